//! The staging arena is allocated in the background after `Engine::open` (issue 24): a
//! save started before that is done takes only allocated chunks and is byte-exact; closing
//! the engine meanwhile stops the allocation at once and leaves nothing behind. The
//! allocation is slowed with the fault-injection pause, so both happen before it ends.

use crate::common;

use std::time::{Duration, Instant};

use common::*;
use shmckpt::{BackendKind, Dtype, Engine, Error, StepSel};
use shmckpt_bench::synthetic::LayoutEntry;

fn big_layout() -> Vec<LayoutEntry> {
    vec![
        LayoutEntry {
            name: "a".into(),
            dtype: Dtype::U8,
            shape: vec![100 << 20],
        },
        LayoutEntry {
            name: "b".into(),
            dtype: Dtype::F32,
            shape: vec![3, 1 << 20],
        },
    ]
}

#[test]
fn a_save_while_the_arena_is_being_allocated_is_exact() {
    for backend in BACKENDS {
        let dir = real_dir("prefault-save");
        // 192 MiB in 1 MiB chunks: 3 batches of 64, the 2 in the background paused 300 ms.
        let cfg = small_config(dir.path(), backend)
            .with_staging_capacity(192 << 20)
            .with_chunk_size(1 << 20)
            .with_prefault_pause(Duration::from_millis(300));
        let engine = Engine::open(cfg).unwrap();
        assert!(!engine.staging_ready());
        // 112 MiB: more than the first batch, so the save waits for background chunks.
        let state = State::new(big_layout(), 24);
        let rep = save_committed(&engine, 1, &state);
        assert_eq!(rep.tensors, 2);
        let ck = engine.load(StepSel::Step(1)).unwrap();
        assert_loaded_equal(&ck, &state);
        engine.wait_staging_ready().unwrap();
        assert!(engine.staging_ready());
        // And once allocated (io_uring: the arena now registered as fixed buffers).
        let state2 = State::new(big_layout(), 25);
        save_committed(&engine, 2, &state2);
        assert_loaded_equal(&engine.load(StepSel::Step(2)).unwrap(), &state2);
        engine.close();
    }
}

#[test]
fn closing_while_the_arena_is_being_allocated_stops_it() {
    let dir = real_dir("prefault-close");
    // 1 GiB in 1 MiB chunks: 16 batches, each background one paused 2 s.
    let cfg = small_config(dir.path(), BackendKind::Auto)
        .with_staging_capacity(1 << 30)
        .with_chunk_size(1 << 20)
        .with_prefault_pause(Duration::from_secs(2));
    let engine = Engine::open(cfg).unwrap();
    let name = engine.shm_name().to_owned();
    assert!(shm_exists(&name));
    assert!(!engine.staging_ready());
    // A save fits in the first batch and completes while the rest is still pending.
    let state = step_state(3);
    save_committed(&engine, 3, &state);
    assert_step_is_exact(dir.path(), 3);
    let t = Instant::now();
    engine.close();
    // Not a speed claim: the allocation would need at least 2 s more; close stopped it.
    assert!(
        t.elapsed() < Duration::from_millis(1500),
        "{:?}",
        t.elapsed()
    );
    assert!(!shm_exists(&name));
    // The root is free for the next engine (lock released, no partial left).
    let engine = Engine::open(small_config(dir.path(), BackendKind::Auto)).unwrap();
    assert_eq!(engine.list().unwrap().len(), 1);
    engine.close();
}

/// Child role (own mount namespace, a 200 MiB `/dev/shm` that another file fills while the
/// arena is still being allocated): a plain function, never collected as a test.
fn child_dev_shm_fills_up_during_prefault() {
    if let Err(e) = run_tool(
        "mount",
        &["-t", "tmpfs", "-o", "size=200m", "tmpfs", "/dev/shm"],
    ) {
        skip(
            REQUIRE_NS,
            &format!("prefault ENOSPC test: cannot mount a tmpfs on /dev/shm: {e}"),
        );
        return;
    }
    let dir = real_dir("prefault-enospc");
    let root = dir.path();
    // 192 MiB in 1 MiB chunks: the first 64 MiB at open, 2 batches in the background, each
    // paused 500 ms: time enough to take the rest of /dev/shm first.
    let cfg = small_config(root, BackendKind::Auto)
        .with_staging_capacity(192 << 20)
        .with_chunk_size(1 << 20)
        .with_prefault_pause(Duration::from_millis(500));
    let engine = Engine::open(cfg).unwrap();
    let name = engine.shm_name().to_owned();
    let filler = std::fs::File::create("/dev/shm/filler").unwrap();
    let free = rustix::fs::statvfs("/dev/shm").unwrap();
    let free = free.f_bavail * free.f_frsize;
    rustix::fs::fallocate(&filler, rustix::fs::FallocateFlags::empty(), 0, free).unwrap();
    // The background allocation fails: a typed error, no SIGBUS, nothing handed out.
    let err = engine.wait_staging_ready().unwrap_err();
    assert!(matches!(err, Error::ShmTooSmall { .. }), "{err}");
    assert!(!engine.staging_ready());
    let err = engine
        .save(1, &step_state(1).tensors(), &shmckpt::Metadata::new())
        .unwrap_err();
    assert!(matches!(err, Error::ShmTooSmall { .. }), "{err}");
    assert!(engine.list().unwrap().is_empty());
    println!("PREFAULTENOSPC: {err}");
    engine.close();
    assert!(!shm_exists(&name));
}

const ROLES: &[Role] = &[(
    "child_dev_shm_fills_up_during_prefault",
    child_dev_shm_fills_up_during_prefault,
)];

#[test]
fn dev_shm_filling_up_during_prefault_is_a_typed_error() {
    if run_role(ROLES) {
        return;
    }
    let Some(mut cmd) = child_command_in_mount_ns("child_dev_shm_fills_up_during_prefault") else {
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
        "prefault ENOSPC child failed ({:?}):\n{text}",
        out.status
    );
    assert!(
        relay_markers(&text, &["SKIPPED", "PREFAULTENOSPC"]),
        "the child neither ran nor skipped:\n{text}"
    );
}
