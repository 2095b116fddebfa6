//! Flash restore (issue 12, item 2): an arena kept in `/dev/shm` after the engine's
//! process died serves the next engine's `load`, checked against the disk's manifest;
//! stale, damaged or foreign arenas fall back to the disk (with the reason), and nothing
//! in shared memory is looked at with the option off.

use crate::common;

use std::os::unix::fs::{FileExt, MetadataExt};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};

use common::*;
use shmckpt::{BackendKind, Engine, LoadSource, Metadata};

const ROOT_ENV: &str = "SHMCKPT_TEST_FLASH_ROOT";

fn kept_name(root: &Path) -> String {
    let canon = std::fs::canonicalize(root).unwrap();
    shmckpt::testing::staging::kept_name(&canon, 0)
}

pub(crate) fn keep_config(root: &Path) -> shmckpt::EngineConfig {
    small_config(root, BackendKind::Auto).with_keep_in_memory(true)
}

/// Child: commit steps 1 and 2 with flash restore on, then die by SIGKILL.
fn child_keeper() {
    let root = PathBuf::from(std::env::var(ROOT_ENV).unwrap());
    let engine = Engine::open(keep_config(&root)).unwrap();
    for s in [1, 2] {
        let st = step_state(s);
        save_committed(&engine, s, &st);
    }
    std::hint::black_box(&engine);
    sigkill_self();
}

/// Load `step` from `engine`: it must come from `source` and equal `state` byte for byte.
/// Returns the report (for the fallback reason).
pub(crate) fn load_exact(
    engine: &Engine,
    step: u64,
    state: &State,
    source: LoadSource,
) -> shmckpt::LoadReport {
    let (ck, report) = load_with_report(engine, step).unwrap();
    assert_eq!(report.source, source, "{report:?}");
    assert_loaded_equal(&ck, state);
    report
}

/// The kept arena `name`, opened for reading and writing (to damage it).
fn kept_file(name: &str) -> std::fs::File {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(Path::new("/dev/shm").join(name))
        .unwrap()
}

/// Offset in the kept arena `name` of byte `at` of file chunk `k` of its kept image.
fn kept_chunk_offset(name: &str, k: usize, at: u64) -> u64 {
    let att = shmckpt::testing::staging::AttachedArena::open(name).unwrap();
    let slot = (0..att.slot_count())
        .map(|s| att.slot(s))
        .find(|v| v.state == shmckpt::testing::staging::descriptor::slot_state::KEPT)
        .expect("a kept slot");
    assert_eq!(slot.step, 2);
    let geo = att.header().geometry;
    let (_, index) = slot.chunks[k];
    geo.data_offset + u64::from(index) * geo.chunk_size + at
}

/// Run [`child_keeper`] on `root` and check it died by SIGKILL leaving its arena.
pub(crate) fn killed_keeper(root: &Path) -> ShmGuard {
    let out = child_command("child_keeper")
        .env(ROOT_ENV, root)
        .output()
        .unwrap();
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGKILL),
        "child: {:?}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let name = kept_name(root);
    assert!(shm_exists(&name), "the kept arena {name} did not survive");
    ShmGuard(name)
}

/// The child roles of this module's tests.
pub(crate) const ROLES: &[Role] = &[
    ("child_keeper", child_keeper),
    ("child_adopter", child_adopter),
];

#[test]
fn kept_arena_survives_sigkill_and_serves_the_next_load_exactly() {
    if run_role(ROLES) {
        return;
    }
    let dir = real_dir("flash-kill");
    let root = dir.path();
    let guard = killed_keeper(root);
    let engine = Engine::open(keep_config(root)).unwrap();
    let (ck, report) = load_with_report(&engine, 2).unwrap();
    assert_eq!(report.source, LoadSource::Memory, "{report:?}");
    assert_eq!(report.fallback_reason, None);
    assert_eq!(ck.step, 2);
    assert_loaded_equal(&ck, &step_state(2));
    // Step 1 is not in memory: the disk serves it, and says why.
    let (ck1, r1) = load_with_report(&engine, 1).unwrap();
    assert_eq!(r1.source, LoadSource::Disk);
    assert!(r1.fallback_reason.unwrap().contains("holds step 2"));
    assert_loaded_equal(&ck1, &step_state(1));
    // The new engine keeps its own arena under the same name; after a save and a clean
    // close, the next engine serves that save from memory.
    let s3 = step_state(3);
    save_committed(&engine, 3, &s3);
    engine.close();
    assert!(shm_exists(&guard.0));
    let engine = Engine::open(keep_config(root)).unwrap();
    load_exact(&engine, 3, &s3, LoadSource::Memory);
    // The kept arena is listed with its step, root and owner, and `remove_kept` removes it
    // (after this engine replaced it with its own under the same name).
    let listed = shmckpt::flash::list_kept();
    let mine = listed.iter().find(|k| k.name == guard.0).unwrap();
    assert_eq!(mine.owner_uid, rustix::process::geteuid().as_raw());
    assert_eq!(mine.owner, shmckpt::flash::ArenaOwner::Alive);
    assert_eq!(
        mine.root.as_deref(),
        Some(std::fs::canonicalize(root).unwrap().as_path())
    );
    engine.close();
    remove_kept_after_close(&guard.0);
    assert!(!shm_exists(&guard.0));
}

/// `remove_kept` of the arena of an engine this process just closed. The closed engine's
/// rank lock is released at `close` (the engine owns the lock's only file), but a child
/// forked in that instant by another test's thread holds a copy of that file until it
/// execs, and the lock belongs to the open file, which the fork shares: `remove_kept` then
/// rightly sees the lock held. A clean-clone CI run (2 busy cores) failed here once with
/// "its engine ... is running", most likely so. Retried for up to 10 s while that is the
/// reason.
fn remove_kept_after_close(name: &str) {
    let start = std::time::Instant::now();
    loop {
        match shmckpt::flash::remove_kept(name) {
            Ok(()) => return,
            Err(shmckpt::Error::ArenaInUse { reason, .. })
                if reason.contains("is running")
                    && start.elapsed() < std::time::Duration::from_secs(10) =>
            {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(e) => panic!("remove_kept({name}): {e}"),
        }
    }
}

#[test]
fn stale_kept_arena_falls_back_to_disk_with_the_reason() {
    if run_role(ROLES) {
        return;
    }
    let dir = real_dir("flash-stale");
    let root = dir.path();
    let _guard = killed_keeper(root);
    // An engine without flash restore commits step 3: the kept step 2 is now stale.
    let e = Engine::open(small_config(root, BackendKind::Auto)).unwrap();
    let s3 = step_state(3);
    save_committed(&e, 3, &s3);
    e.close();
    let engine = Engine::open(keep_config(root)).unwrap();
    // Even asked for step 2 exactly, a stale image is never used.
    let (ck, report) = load_with_report(&engine, 2).unwrap();
    assert_eq!(report.source, LoadSource::Disk);
    let why = report.fallback_reason.unwrap();
    assert!(why.contains("stale"), "{why}");
    assert_loaded_equal(&ck, &step_state(2));
    let (ck, report) = load_with_report(&engine, 3).unwrap();
    assert_eq!(report.source, LoadSource::Disk);
    assert!(report.fallback_reason.unwrap().contains("holds step 2"));
    assert_loaded_equal(&ck, &s3);
}

#[test]
fn damaged_kept_arena_falls_back_to_disk_with_the_reason() {
    if run_role(ROLES) {
        return;
    }
    let dir = real_dir("flash-flip");
    let root = dir.path();
    let guard = killed_keeper(root);
    // Flip one byte of the first data chunk of the kept image.
    let at = kept_chunk_offset(&guard.0, 1, 100);
    let f = kept_file(&guard.0);
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0xFF], at).unwrap();
    drop(f);
    let engine = Engine::open(keep_config(root)).unwrap();
    let why = load_exact(&engine, 2, &step_state(2), LoadSource::Disk)
        .fallback_reason
        .unwrap();
    assert!(why.contains("CRC-32C"), "{why}");
}

/// This rank's file of `step` under `root`.
#[test]
fn foreign_kept_arena_is_refused_and_left_alone() {
    if run_role(ROLES) {
        return;
    }
    if !is_root() {
        skip(REQUIRE_ROOT, "chown to another user needs root");
        return;
    }
    let dir = real_dir("flash-foreign");
    let root = dir.path();
    let guard = killed_keeper(root);
    let path = Path::new("/dev/shm").join(&guard.0);
    std::os::unix::fs::chown(&path, Some(65534), Some(65534)).unwrap();
    let before = std::fs::read(&path).unwrap();
    let engine = Engine::open(keep_config(root)).unwrap();
    let why = load_exact(&engine, 2, &step_state(2), LoadSource::Disk)
        .fallback_reason
        .unwrap();
    assert!(why.contains("refused"), "{why}");
    // Saves still work (in a private arena), and the foreign segment is untouched.
    let s3 = step_state(3);
    save_committed(&engine, 3, &s3);
    engine.close();
    let m = std::fs::symlink_metadata(&path).unwrap();
    assert_eq!((m.uid(), m.gid()), (65534, 65534));
    assert!(
        std::fs::read(&path).unwrap() == before,
        "the foreign arena was modified"
    );
}

#[test]
fn with_the_option_off_shared_memory_is_never_looked_at() {
    let dir = real_dir("flash-off");
    let root = dir.path();
    // A segment under the kept name holding garbage: an engine without the option must
    // neither read it nor remove it nor replace it, and keeps nothing after closing.
    let name = kept_name(root);
    let _guard = ShmGuard(name.clone());
    let path = Path::new("/dev/shm").join(&name);
    std::fs::write(&path, b"not an arena").unwrap();
    let atime = std::fs::metadata(&path).unwrap().atime_nsec();
    let e = Engine::open(small_config(root, BackendKind::Auto)).unwrap();
    let s1 = step_state(1);
    save_committed(&e, 1, &s1);
    let (ck, report) = load_with_report(&e, 1).unwrap();
    assert_eq!(report.source, LoadSource::Disk);
    assert_eq!(report.fallback_reason, None);
    assert_loaded_equal(&ck, &s1);
    let shm_name = e.shm_name().to_owned();
    assert_ne!(shm_name, name);
    e.close();
    assert_eq!(
        std::fs::metadata(&path).unwrap().atime_nsec(),
        atime,
        "read"
    );
    assert_eq!(std::fs::read(&path).unwrap(), b"not an arena");
    assert!(!shm_exists(&shm_name), "nothing kept with the option off");
}

#[test]
fn shm_cli_lists_and_removes_kept_arenas() {
    if run_role(ROLES) {
        return;
    }
    let dir = real_dir("flash-cli");
    let root = dir.path();
    let guard = killed_keeper(root);
    let run = |args: &[&str]| {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_shmckpt"))
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap()
    };
    let list: serde_json::Value = serde_json::from_str(&run(&["shm", "list", "--json"])).unwrap();
    let mine = list
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["name"] == guard.0.as_str())
        .unwrap_or_else(|| panic!("{} not listed: {list}", guard.0));
    assert_eq!(mine["step"], 2);
    assert_eq!(mine["rank"], 0);
    assert_eq!(
        mine["root"],
        std::fs::canonicalize(root).unwrap().to_str().unwrap()
    );
    assert_eq!(mine["owner_uid"], rustix::process::geteuid().as_raw());
    assert_eq!(mine["owner"], "gone", "its engine was killed");
    assert!(mine["bytes"].as_u64().unwrap() >= 16 << 20);
    run(&["shm", "rm", &guard.0]);
    assert!(!shm_exists(&guard.0));
    // Names that are not kept arenas are refused.
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_shmckpt"))
        .args(["shm", "rm", "shmckpt.1.r0.0"])
        .output()
        .unwrap();
    assert!(!o.status.success());
}

#[test]
fn clean_close_keeps_the_image_and_every_dtype_loads_from_memory_exactly() {
    let dir = real_dir("flash-close");
    let root = dir.path();
    let _guard = ShmGuard(kept_name(root));
    let state = State::new(every_dtype(), 9);
    let e = Engine::open(keep_config(root)).unwrap();
    save_committed(&e, 4, &state);
    // In the same process, the disk serves (only a previous engine's image is served).
    let (_, r) = load_with_report(&e, 4).unwrap();
    assert_eq!(r.source, LoadSource::Disk);
    e.close();
    let e = Engine::open(keep_config(root)).unwrap();
    let (ck, r) = load_with_report(&e, 4).unwrap();
    assert_eq!(r.source, LoadSource::Memory, "{r:?}");
    assert_loaded_equal(&ck, &state);
    // Served again (the image stays until the first save), then dropped by a save.
    let (ck2, r) = load_with_report(&e, 4).unwrap();
    assert_eq!(r.source, LoadSource::Memory);
    assert_eq!(ck2, ck);
    let s5 = step_state(5);
    save_committed(&e, 5, &s5);
    let (_, r) = load_with_report(&e, 5).unwrap();
    assert_eq!(r.source, LoadSource::Disk);
    assert!(r.fallback_reason.unwrap().contains("a save started since"));
}

/// The owner pid recorded in the kept arena `name`.
fn kept_owner(name: &str) -> u32 {
    shmckpt::testing::staging::AttachedArena::open(name)
        .unwrap()
        .header()
        .owner_pid
}

/// Descriptors of this process that still name `/dev/shm/<name>` after it was unlinked.
fn deleted_segments_open(name: &str) -> usize {
    let gone = format!("/dev/shm/{name} (deleted)");
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|l| l.as_os_str() == gone.as_str())
        .count()
}

#[test]
fn adoption_frees_the_previous_segment_and_records_the_image_in_the_new_arena() {
    if run_role(ROLES) {
        return;
    }
    let dir = real_dir("flash-adopt");
    let root = dir.path();
    let guard = killed_keeper(root);
    let old_owner = kept_owner(&guard.0);
    assert_ne!(old_owner, std::process::id());
    let engine = Engine::open(keep_config(root)).unwrap();
    // The previous segment is closed at open (its memory freed), not at the first save:
    // nothing of this process names the unlinked segment any more.
    assert_eq!(deleted_segments_open(&guard.0), 0);
    assert_eq!(engine.shm_name(), guard.0);
    // /dev/shm holds one kept arena for this root and rank: the new engine's own, which
    // records the adopted step 2 as its kept image before any save.
    let canon = std::fs::canonicalize(root).unwrap();
    let mine: Vec<_> = shmckpt::flash::list_kept()
        .into_iter()
        .filter(|k| k.root.as_deref() == Some(canon.as_path()))
        .collect();
    assert_eq!(mine.len(), 1, "{mine:?}");
    assert_eq!(mine[0].name, guard.0);
    assert_eq!(mine[0].rank, Some(0));
    assert_eq!(mine[0].step, Some(2));
    assert_eq!(kept_owner(&guard.0), std::process::id());
    let (ck, report) = load_with_report(&engine, 2).unwrap();
    assert_eq!(report.source, LoadSource::Memory, "{report:?}");
    assert_loaded_equal(&ck, &step_state(2));
    // Loaded twice from the adopted image, byte-exact both times.
    let (ck2, report) = load_with_report(&engine, shmckpt::StepSel::Latest).unwrap();
    assert_eq!(report.source, LoadSource::Memory, "{report:?}");
    assert_eq!(ck2, ck);
}

/// Child: adopt the image [`child_keeper`] left (and serve a load from it), then die by
/// SIGKILL before any save.
fn child_adopter() {
    let root = PathBuf::from(std::env::var(ROOT_ENV).unwrap());
    let engine = Engine::open(keep_config(&root)).unwrap();
    load_exact(&engine, 2, &step_state(2), LoadSource::Memory);
    std::hint::black_box(&engine);
    sigkill_self();
}

#[test]
fn an_adopted_image_survives_a_second_crash_before_any_save() {
    if run_role(ROLES) {
        return;
    }
    let dir = real_dir("flash-twice");
    let root = dir.path();
    let guard = killed_keeper(root);
    let keeper = kept_owner(&guard.0);
    let child = child_command("child_adopter")
        .env(ROOT_ENV, root)
        .spawn()
        .unwrap();
    let adopter = child.id();
    let out = child.wait_with_output().unwrap();
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGKILL),
        "child: {:?}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    // The arena now under the name is the adopter's own, not the keeper's.
    assert!(shm_exists(&guard.0));
    assert_ne!(keeper, adopter);
    assert_eq!(kept_owner(&guard.0), adopter);
    let engine = Engine::open(keep_config(root)).unwrap();
    let (ck, report) = load_with_report(&engine, 2).unwrap();
    assert_eq!(report.source, LoadSource::Memory, "{report:?}");
    assert_eq!(report.fallback_reason, None);
    assert_loaded_equal(&ck, &step_state(2));
}

#[test]
fn a_save_after_adoption_reuses_the_image_chunks_and_is_kept_in_turn() {
    if run_role(ROLES) {
        return;
    }
    let dir = real_dir("flash-save");
    let root = dir.path();
    let guard = killed_keeper(root);
    // Six chunks: the adopted image holds four and the next save needs four distinct ones
    // to be kept whole; with only two free it would have to recycle its own chunks (or
    // wait), and nothing would be kept. So step 3 is served from memory below only if the
    // save got the image's chunks back when it began.
    let cfg = || keep_config(root).with_staging_capacity(6 * (64 << 10));
    let engine = std::sync::Arc::new(Engine::open(cfg()).unwrap());
    let (ck, report) = load_with_report(&engine, 2).unwrap();
    assert_eq!(report.source, LoadSource::Memory, "{report:?}");
    assert_loaded_equal(&ck, &step_state(2));
    drop(ck);
    let (tx, rx) = std::sync::mpsc::channel();
    let e = std::sync::Arc::clone(&engine);
    std::thread::spawn(move || {
        let s3 = step_state(3);
        let r = e
            .save(3, &s3.tensors(), &Metadata::new())
            .and_then(|h| h.wait().map(|_| ()));
        let _ = tx.send(r);
    });
    rx.recv_timeout(std::time::Duration::from_secs(60))
        .expect("the save after adoption is stuck")
        .unwrap();
    assert_step_is_exact(root, 3);
    // The image was given up by the save.
    let (_, r) = load_with_report(&engine, 2).unwrap();
    assert_eq!(r.source, LoadSource::Disk);
    assert!(r.fallback_reason.unwrap().contains("a save started since"));
    std::sync::Arc::into_inner(engine).unwrap().close();
    assert!(shm_exists(&guard.0));
    let engine = Engine::open(cfg()).unwrap();
    load_exact(&engine, 3, &step_state(3), LoadSource::Memory);
}

#[test]
fn an_arena_smaller_than_the_kept_image_falls_back_to_disk_with_the_reason() {
    if run_role(ROLES) {
        return;
    }
    let dir = real_dir("flash-small");
    let root = dir.path();
    let guard = killed_keeper(root);
    // Two chunks of 64 KiB; the kept file needs four.
    let engine = Engine::open(keep_config(root).with_staging_capacity(2 * (64 << 10))).unwrap();
    assert_eq!(deleted_segments_open(&guard.0), 0);
    let why = load_exact(&engine, 2, &step_state(2), LoadSource::Disk)
        .fallback_reason
        .unwrap();
    assert!(why.contains("smaller than the kept image"), "{why}");
}

#[test]
fn load_into_host_buffers_is_served_from_the_adopted_image() {
    if run_role(ROLES) {
        return;
    }
    let dir = real_dir("flash-into");
    let root = dir.path();
    let _guard = killed_keeper(root);
    let engine = Engine::open(keep_config(root)).unwrap();
    // Damage the file on disk after adoption: a disk read of step 2 now fails its
    // checksum, so a correct result can only come from memory.
    let step_dir = root.join(shmckpt::manifest::step_dir_name(2));
    let file = step_dir.join(shmckpt::manifest::rank_file_name(0, 1));
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&file)
        .unwrap();
    let at = f.metadata().unwrap().len() - 1000;
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0xFF], at).unwrap();
    f.sync_all().unwrap();
    drop(f);
    assert!(
        shmckpt::restore::load_owned(&step_dir, 0, &shmckpt::restore::ReadOptions::default())
            .is_err(),
        "the damaged file still loads from disk"
    );
    let state = step_state(2);
    let mut bufs: Vec<Vec<u8>> = state.data.iter().map(|d| vec![0u8; d.len()]).collect();
    // Destinations in reverse order: matched by name, not position.
    let mut dest: Vec<(&str, &mut [u8])> = state
        .layout
        .iter()
        .zip(bufs.iter_mut())
        .map(|(e, b)| (e.name.as_str(), b.as_mut_slice()))
        .rev()
        .collect();
    assert_eq!(load_into(&engine, 2, &mut dest).unwrap(), 2);
    drop(dest);
    for ((e, got), want) in state.layout.iter().zip(&bufs).zip(&state.data) {
        assert!(got == want, "tensor {} differs", e.name);
    }
    // A destination of the wrong size is refused, as from disk.
    let mut short = vec![0u8; 3];
    let mut dest: Vec<(&str, &mut [u8])> = vec![(state.layout[0].name.as_str(), &mut short)];
    assert!(load_into(&engine, 2, &mut dest).is_err());
}

/// (device, inode) of a segment in `/dev/shm`.
fn shm_inode(name: &str) -> (u64, u64) {
    let m = std::fs::symlink_metadata(Path::new("/dev/shm").join(name)).unwrap();
    (m.dev(), m.ino())
}

#[test]
fn a_kept_arena_of_the_same_layout_is_taken_over_in_place() {
    if run_role(ROLES) {
        return;
    }
    let dir = real_dir("flash-inplace");
    let root = dir.path();
    let guard = killed_keeper(root);
    let before = shm_inode(&guard.0);
    let engine = Engine::open(keep_config(root)).unwrap();
    // The very same segment is this engine's arena now: no second segment, no copy.
    assert_eq!(engine.shm_name(), guard.0);
    assert_eq!(shm_inode(&guard.0), before);
    assert_eq!(deleted_segments_open(&guard.0), 0);
    assert_eq!(kept_owner(&guard.0), std::process::id());
    let (ck, report) = load_with_report(&engine, 2).unwrap();
    assert_eq!(report.source, LoadSource::Memory, "{report:?}");
    assert_loaded_equal(&ck, &step_state(2));
    // It works as a staging arena: a save gives the image up, commits, and is kept.
    let s3 = step_state(3);
    save_committed(&engine, 3, &s3);
    drop(engine);
    let engine = Engine::open(keep_config(root)).unwrap();
    assert_eq!(shm_inode(&guard.0), before);
    load_exact(&engine, 3, &s3, LoadSource::Memory);
}

#[test]
fn a_kept_arena_of_another_layout_is_copied_into_a_new_arena() {
    if run_role(ROLES) {
        return;
    }
    let dir = real_dir("flash-layout");
    let root = dir.path();
    let guard = killed_keeper(root);
    let before = shm_inode(&guard.0);
    // Twice the staging: another layout, so the image is copied into a new segment of
    // the same name and the old one is freed.
    let engine = Engine::open(keep_config(root).with_staging_capacity(2 * (4 << 20))).unwrap();
    assert_eq!(engine.shm_name(), guard.0);
    assert_ne!(shm_inode(&guard.0), before);
    assert_eq!(deleted_segments_open(&guard.0), 0);
    load_exact(&engine, 2, &step_state(2), LoadSource::Memory);
}

#[test]
fn a_sparse_kept_arena_is_never_mapped_and_falls_back_to_disk() {
    if run_role(ROLES) {
        return;
    }
    let dir = real_dir("flash-hole");
    let root = dir.path();
    let guard = killed_keeper(root);
    // Punch a hole into a data chunk of the kept image: a segment that is not wholly
    // allocated could leave mapped pages unbacked (SIGBUS on a full tmpfs).
    let at = kept_chunk_offset(&guard.0, 1, 0);
    let f = kept_file(&guard.0);
    // SAFETY: `fallocate` on an open descriptor of our own file, with plain integers; no
    // memory is passed.
    let rc = unsafe {
        libc::fallocate(
            std::os::fd::AsRawFd::as_raw_fd(&f),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            at as libc::off_t,
            4096,
        )
    };
    assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
    assert!(f.metadata().unwrap().blocks() * 512 < f.metadata().unwrap().len());
    drop(f);
    let before = shm_inode(&guard.0);
    let engine = Engine::open(keep_config(root)).unwrap();
    // Not taken over (a new segment); the copy read the hole as zeros, which the checksums
    // caught: the load comes from the disk, saying why.
    assert_ne!(shm_inode(&guard.0), before);
    let why = load_exact(&engine, 2, &step_state(2), LoadSource::Disk)
        .fallback_reason
        .unwrap();
    assert!(why.contains("CRC-32C"), "{why}");
}

/// Issue 37: one `Engine::load_with(request, destination)`. Each source restricted
/// serves alone or says why not, the fallback order is memory then disk, and a caller
/// buffer of the wrong length is a typed error with nothing written, from every source.
#[test]
fn load_request_restricts_the_sources_and_keeps_one_fallback_order() {
    use shmckpt::{Error, LoadInto, LoadRequest, Sources};
    if run_role(ROLES) {
        return;
    }
    let dir = real_dir("flash-request");
    let root = dir.path();
    let _guard = killed_keeper(root);
    let engine = Engine::open(keep_config(root)).unwrap();
    let owned = |req: LoadRequest| engine.load_with(&req, LoadInto::owned());

    // Memory only: the kept image serves step 2; step 1 it does not hold (NotFound, with
    // the reason); memory never falls back to the disk.
    let got = owned(LoadRequest::new(2).with_sources(Sources::MEMORY)).unwrap();
    assert_eq!(got.report.source, LoadSource::Memory, "{:?}", got.report);
    assert_loaded_equal(got.checkpoint.as_ref().unwrap(), &step_state(2));
    match owned(LoadRequest::new(1).with_sources(Sources::MEMORY)) {
        Err(Error::NotFound { what, step, .. }) => {
            assert_eq!(step, Some(1));
            assert!(what.contains("holds step 2"), "{what}");
        }
        other => panic!("a memory-only load of step 1: {other:?}"),
    }
    // Disk only: the disk serves step 2 although memory holds it, with no reason to give.
    let got = owned(LoadRequest::new(2).with_sources(Sources::DISK)).unwrap();
    assert_eq!(
        (got.report.source, got.report.fallback_reason.as_deref()),
        (LoadSource::Disk, None)
    );
    assert_loaded_equal(got.checkpoint.as_ref().unwrap(), &step_state(2));
    // The default order: memory first (step 2, also "latest"), then the disk (step 1,
    // with why memory could not).
    let got = owned(LoadRequest::latest()).unwrap();
    assert_eq!(
        (got.report.step, got.report.source),
        (2, LoadSource::Memory)
    );
    let got = owned(LoadRequest::new(1)).unwrap();
    assert_eq!(got.report.source, LoadSource::Disk);
    assert!(got.report.fallback_reason.unwrap().contains("holds step 2"));
    assert_loaded_equal(got.checkpoint.as_ref().unwrap(), &step_state(1));
    // No source, or the bucket of an engine without a remote tier: configuration errors.
    let none = Sources::LOCAL.with_memory(false).with_disk(false);
    assert!(matches!(
        owned(LoadRequest::new(2).with_sources(none)),
        Err(Error::Config(_))
    ));
    assert!(matches!(
        owned(LoadRequest::new(2).with_sources(Sources::BUCKET)),
        Err(Error::Config(_))
    ));

    // Caller host buffers, from memory and from the disk: exact bytes; one buffer a byte
    // short is `Error::Destination` naming the tensor, and nothing is written.
    let state = step_state(2);
    for sources in [Sources::MEMORY, Sources::DISK] {
        let mut bufs: Vec<Vec<u8>> = state.data.iter().map(|d| vec![0u8; d.len()]).collect();
        bufs[0].pop();
        let mut dest: Vec<(&str, &mut [u8])> = state
            .layout
            .iter()
            .zip(bufs.iter_mut())
            .map(|(e, b)| (e.name.as_str(), b.as_mut_slice()))
            .collect();
        let req = LoadRequest::new(2).with_sources(sources);
        match engine.load_with(&req, LoadInto::host(&mut dest)) {
            Err(Error::Destination { name, .. }) => assert_eq!(name, state.layout[0].name),
            other => panic!("{sources:?}: a short buffer gave {other:?}"),
        }
        drop(dest);
        assert!(
            bufs.iter().all(|b| b.iter().all(|&x| x == 0)),
            "{sources:?} wrote"
        );
        bufs[0].push(0);
        let mut dest: Vec<(&str, &mut [u8])> = state
            .layout
            .iter()
            .zip(bufs.iter_mut())
            .map(|(e, b)| (e.name.as_str(), b.as_mut_slice()))
            .collect();
        let got = engine.load_with(&req, LoadInto::host(&mut dest)).unwrap();
        assert!(got.checkpoint.is_none());
        let want = if sources == Sources::MEMORY {
            LoadSource::Memory
        } else {
            LoadSource::Disk
        };
        assert_eq!((got.report.step, got.report.source), (2, want));
        drop(dest);
        assert!(bufs == state.data, "{sources:?}: the bytes differ");
    }
}
