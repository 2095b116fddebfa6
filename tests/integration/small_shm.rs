//! A too small `/dev/shm`: a child process in a private mount namespace mounts a 1 MiB tmpfs
//! on `/dev/shm`. Creating an engine whose arena does not fit fails at once with a clear
//! error (no SIGBUS later, no segment left behind); an arena that fits works, byte-exact.
//! Skips visibly when mount namespaces are not available (a failure under
//! `SHMCKPT_REQUIRE_NS=1`, which `.ci/run` sets).

use crate::common;

use std::path::Path;

use common::*;
use shmckpt::{BackendKind, Engine, Error};

fn shm_entries() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// Child role (own mount namespace, 1 MiB `/dev/shm`).
fn child_small_shm() {
    if let Err(e) = run_tool(
        "mount",
        &["-t", "tmpfs", "-o", "size=1m", "tmpfs", "/dev/shm"],
    ) {
        skip(
            REQUIRE_NS,
            &format!("small /dev/shm test: cannot mount a tmpfs on /dev/shm: {e}"),
        );
        return;
    }
    assert!(shm_entries().is_empty(), "a fresh /dev/shm");
    let dir = real_dir("smallshm");
    let root = dir.path();

    // Too big: refused at creation, with the numbers, and nothing left in /dev/shm.
    let err = Engine::open(small_config(root, BackendKind::Auto).with_staging_capacity(16 << 20))
        .unwrap_err();
    match &err {
        Error::ShmTooSmall {
            name,
            requested,
            available,
            mount,
        } => {
            assert!(name.starts_with(shmckpt::testing::staging::NAME_PREFIX));
            assert!(*requested >= 16 << 20);
            assert!(*available <= 1 << 20, "{available}");
            assert_eq!(mount, "/dev/shm");
        }
        other => panic!("expected ShmTooSmall, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("enlarge /dev/shm") && msg.contains("staging_capacity"),
        "{msg}"
    );
    assert!(shm_entries().is_empty(), "left behind: {:?}", shm_entries());
    println!("SMALLSHM: {msg}");

    // Fits: every page is reserved up front, so using it cannot fault.
    let engine =
        Engine::open(small_config(root, BackendKind::Auto).with_staging_capacity(512 << 10))
            .unwrap();
    // The space is taken: a second arena does not fit any more, and says so.
    let second = Engine::open(
        small_config(root, BackendKind::Auto)
            .with_rank(1, 2)
            .with_staging_capacity(512 << 10),
    )
    .unwrap_err();
    assert!(matches!(second, Error::ShmTooSmall { .. }), "{second}");
    for step in 1..=3 {
        let s = step_state(step);
        save_committed(&engine, step, &s);
        assert_loaded_equal(&engine.load(step).unwrap(), &s);
    }
    drop(engine);
    assert!(shm_entries().is_empty(), "clean shutdown removes the arena");
    assert!(Path::new("/dev/shm").is_dir());
}

#[test]
fn too_small_dev_shm_is_a_clear_error_at_engine_creation() {
    if run_role(&[("child_small_shm", child_small_shm)]) {
        return;
    }
    let Some(mut cmd) = child_command_in_mount_ns("child_small_shm") else {
        return;
    };
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // A SIGBUS would show as a signal here, not as a failed assertion.
    assert!(
        out.status.success(),
        "small-/dev/shm child failed ({:?}):\n{text}",
        out.status
    );
    assert!(
        relay_markers(&text, &["SKIPPED", "SMALLSHM"]),
        "the child neither ran nor skipped:\n{text}"
    );
}
