//! The recorder (`src/record.rs`) on the library's commit protocol, which reports to it
//! through the filesystem observer hook.

use shmckpt::manifest::{FileEntry, Metadata};
use shmckpt::testing::fsops;
use shmckpt_crashsim::Op;
use shmckpt_crashsim::record::*;

fn shape(op: &Op) -> String {
    match op {
        Op::Mkdir { parent, name, id } => format!("mkdir {parent}/{name}={id}"),
        Op::Create { parent, name, id } => {
            // The manifest's temporary name holds the pid.
            let name = name.split(".tmp-").next().unwrap_or(name);
            format!("create {parent}/{name}={id}")
        }
        Op::Write { id, offset, data } => format!("write {id}@{offset}+{}", data.len()),
        Op::Truncate { id, len } => format!("ftruncate {id} {len}"),
        Op::Fallocate { id, offset, len } => format!("fallocate {id} {offset}+{len}"),
        Op::Rename {
            from_parent,
            from,
            to_parent,
            to,
            id,
        } => {
            let from = from.split(".tmp-").next().unwrap_or(from);
            format!("rename {from_parent}/{from} {to_parent}/{to}={id}")
        }
        Op::Unlink { parent, name, id } => format!("unlink {parent}/{name}={id}"),
        Op::Rmdir { parent, name, id } => format!("rmdir {parent}/{name}={id}"),
        Op::Fsync { id } => format!("fsync {id}"),
        Op::Fdatasync { id } => format!("fdatasync {id}"),
        Op::Committed { step } => format!("committed {step}"),
    }
}

/// The commit protocol of one rank, as the recorder sees it, in order; a root not
/// recorded is not seen.
#[test]
fn records_a_commit_in_issue_order() {
    let dir = tempfile::tempdir().unwrap();
    let other = tempfile::tempdir().unwrap();
    let root = dir.path();
    std::fs::create_dir(root.join("old")).unwrap();
    let rec = Recording::start(root).unwrap();
    // Not recorded: another root.
    fsops::create_dir(&other.path().join("x")).unwrap();
    let partial = shmckpt::commit::prepare_partial(root, 1, 0, "f", 1).unwrap();
    let t = fsops::create_new_file(&partial.join("f")).unwrap();
    fsops::fallocate(std::os::fd::AsFd::as_fd(&t), 8192).unwrap();
    fsops::set_len(&t, 10).unwrap();
    fsops::fdatasync_file(&t).unwrap();
    let entry = FileEntry {
        rank: 0,
        file: "f".into(),
        bytes: 10,
        // A valid entry (`Manifest::from_parts` checks it): no tensors, all header.
        data_start: 10,
        header_crc32c: None,
        object: None,
        session: None,
        tensors: Vec::new(),
    };
    shmckpt::commit::commit(root, 1, 1, &partial, entry, &Metadata::new()).unwrap();
    committed(root, 1);
    let retired = shmckpt::commit::retire_old(root, 1).unwrap();
    assert!(retired.steps.is_empty());
    fsops::remove_dir_all(&root.join("old")).unwrap();
    let log = rec.finish();
    let manifest_len = std::fs::metadata(root.join("step-1/manifest.json"))
        .unwrap()
        .len();
    let got: Vec<String> = log.ops.iter().map(shape).collect();
    // Ids: 0 the root, 1 `old` (in the base), then in order of creation.
    assert_eq!(
        got,
        [
            "mkdir 0/step-1.partial=2".to_owned(),
            "create 2/f=3".into(),
            "fallocate 3 0+8192".into(),
            "ftruncate 3 10".into(),
            "fdatasync 3".into(),
            "create 2/manifest.json=4".into(),
            format!("write 4@0+{manifest_len}"),
            "fsync 4".into(),
            "rename 2/manifest.json 2/manifest.json=4".into(),
            "fsync 2".into(),
            "rename 0/step-1.partial 0/step-1=2".into(),
            "fsync 0".into(),
            "committed 1".into(),
            "rmdir 0/old=1".into(),
        ]
    );
    assert_eq!(log.base.dirs[&0].len(), 1);
}
