//! A real full disk: a small ext4 filesystem on a loop device (else a size-limited tmpfs),
//! mounted in a private mount namespace by a child process. A save that does not fit fails
//! with ENOSPC, commits nothing, leaves no partial directory, and earlier checkpoints stay
//! intact; a save hitting ENOSPC while committing (the manifest) does the same. Skips
//! visibly (SKIPPED on stderr) when neither filesystem can be mounted; `SHMCKPT_REQUIRE_NS=1`
//! makes that a failure, and `SHMCKPT_REQUIRE_LOOP=1` the fallback to tmpfs (`.ci/run` sets
//! both).

use crate::common;

use std::path::Path;

use common::*;
use shmckpt::{BackendKind, Dtype, Engine, Metadata};
use shmckpt_bench::synthetic::LayoutEntry;

const MIB: u64 = 1 << 20;

fn free_bytes(p: &Path) -> u64 {
    let s = rustix::fs::statvfs(p).unwrap();
    s.f_bavail * s.f_frsize
}

fn blob(bytes: u64, seed: u64) -> State {
    State::new(
        vec![LayoutEntry {
            name: "blob".into(),
            dtype: Dtype::U8,
            shape: vec![bytes as usize],
        }],
        seed,
    )
}

fn mount_ext4(img: &Path, mnt: &Path) -> Result<(), String> {
    if !have_tool("mkfs.ext4") {
        return Err("mkfs.ext4 not found (Debian package e2fsprogs)".into());
    }
    std::fs::File::create(img)
        .and_then(|f| f.set_len(32 * MIB))
        .map_err(|e| e.to_string())?;
    let img = img.to_str().unwrap();
    run_tool("mkfs.ext4", &["-q", "-F", "-m", "0", "-b", "4096", img])?;
    run_tool("mount", &["-o", "loop", img, mnt.to_str().unwrap()])
}

fn mount_tmpfs(mnt: &Path) -> Result<(), String> {
    run_tool(
        "mount",
        &[
            "-t",
            "tmpfs",
            "-o",
            "size=16m",
            "tmpfs",
            mnt.to_str().unwrap(),
        ],
    )
}

fn is_enospc(e: &shmckpt::Error) -> bool {
    e.raw_os_error() == Some(libc::ENOSPC)
}

/// The scenario, on the mounted filesystem `root`.
fn fill_the_disk(root: &Path) {
    let free = free_bytes(root);
    let big = free + 4 * MIB;
    let engine =
        Engine::open(small_config(root, BackendKind::Auto).with_staging_capacity(big + 2 * MIB))
            .unwrap();
    let s1 = step_state(1);
    save_committed(&engine, 1, &s1);
    assert_step_is_exact(root, 1);

    // 1. A checkpoint larger than the free space.
    let s2 = blob(big, 2);
    let err = engine
        .save(2, &s2.tensors(), &Metadata::new())
        .and_then(|h| h.wait())
        .expect_err("a checkpoint larger than the disk must fail");
    assert!(is_enospc(&err), "{err}");
    assert!(err.to_string().contains("step-2.partial"), "{err}");
    assert_eq!(committed(root), [1]);
    assert!(partial_dirs(root).is_empty(), "{:?}", partial_dirs(root));
    assert_step_is_exact(root, 1);
    assert!(
        free_bytes(root) + MIB > free,
        "the failed save's space was given back"
    );

    // 2. ENOSPC while committing: fill the disk so that the data file still fits but the
    // manifest does not. The exact slack depends on the filesystem's metadata, so walk it
    // up a block at a time until the failure moves from the data file to the commit.
    let s3 = blob(256 << 10, 3);
    let filler = root.join("filler");
    let mut hit_commit = false;
    for slack_blocks in 0..64u64 {
        let _ = std::fs::remove_file(&filler);
        let want_free = align(s3.bytes() + 4096) + slack_blocks * 4096;
        let now = free_bytes(root);
        if now <= want_free {
            break;
        }
        let f = std::fs::File::create(&filler).unwrap();
        rustix::fs::fallocate(&f, rustix::fs::FallocateFlags::empty(), 0, now - want_free).unwrap();
        f.sync_all().unwrap();
        match engine
            .save(3, &s3.tensors(), &Metadata::new())
            .and_then(|h| h.wait())
        {
            // Enough room for everything: the commit case was stepped over.
            Ok(_) => break,
            Err(e) => {
                eprintln!("slack {slack_blocks}: {e}");
                assert!(is_enospc(&e), "slack {slack_blocks}: {e}");
                assert_eq!(committed(root), [1], "slack {slack_blocks}: {e}");
                assert!(
                    partial_dirs(root).is_empty(),
                    "slack {slack_blocks}: {e}: left {:?}",
                    partial_dirs(root)
                );
                if e.to_string().contains("manifest") {
                    eprintln!("ENOSPC at commit with {slack_blocks} spare block(s): {e}");
                    hit_commit = true;
                    break;
                }
            }
        }
    }
    let _ = std::fs::remove_file(&filler);
    if !hit_commit {
        eprintln!(
            "note: this filesystem never failed at the manifest; only data-file ENOSPC was tested"
        );
    }
    if hit_commit {
        assert!(!committed(root).contains(&3));
    }
    assert_step_is_exact(root, 1);

    // With space again, the same engine saves; a new engine finds a clean root.
    let s4 = step_state(4);
    save_committed(&engine, 4, &s4);
    drop(engine);
    let e = Engine::open(small_config(root, BackendKind::Auto).with_staging_capacity(MIB)).unwrap();
    assert!(partial_dirs(root).is_empty());
    let last = committed(root);
    assert_eq!(last.first(), Some(&1));
    assert_eq!(last.last(), Some(&4));
    assert_loaded_equal(&e.load(4).unwrap(), &s4);
    assert_loaded_equal(&e.load(1).unwrap(), &s1);
}

fn align(n: u64) -> u64 {
    n.div_ceil(4096) * 4096
}

/// Child role (in its own mount namespace): mount a small filesystem and fill it.
fn child_fulldisk() {
    let work = tempfile::Builder::new()
        .prefix("fulldisk-")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .unwrap();
    let mnt = work.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let kind = match mount_ext4(&work.path().join("disk.img"), &mnt) {
        Ok(()) => "ext4 on a loop device",
        Err(e) => {
            assert!(
                std::env::var(REQUIRE_LOOP).as_deref() != Ok("1"),
                "{REQUIRE_LOOP}=1 but an ext4 image cannot be mounted on a loop device: {e}"
            );
            eprintln!(
                "cannot mount an ext4 image ({e}); trying tmpfs (set {REQUIRE_LOOP}=1 to make this a failure)"
            );
            match mount_tmpfs(&mnt) {
                Ok(()) => "size-limited tmpfs",
                Err(e2) => {
                    skip(
                        REQUIRE_NS,
                        &format!("full-disk test: cannot mount ext4 ({e}) nor tmpfs ({e2})"),
                    );
                    return;
                }
            }
        }
    };
    eprintln!("FULLDISK: testing on {kind}");
    fill_the_disk(&mnt);
    run_tool("umount", &[mnt.to_str().unwrap()]).unwrap();
}

#[test]
fn a_full_disk_fails_the_save_and_keeps_earlier_checkpoints() {
    if run_role(&[("child_fulldisk", child_fulldisk)]) {
        return;
    }
    let Some(mut cmd) = child_command_in_mount_ns("child_fulldisk") else {
        return;
    };
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "full-disk child failed: {:?}\n{}\n{err}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
    relay_markers(&err, &["ENOSPC at commit", "note:"]);
    assert!(
        relay_markers(&err, &["SKIPPED", "FULLDISK"]),
        "the child neither ran nor skipped:\n{err}"
    );
}
