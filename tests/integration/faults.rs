//! Injected write faults (feature `fault-injection`), on both write backends: ENOSPC and EIO
//! at chosen offsets, short writes, slow writes. A failure reaches the `SaveHandle` with the
//! file path and offset, nothing is committed, the staging space is released and the next
//! save succeeds; short and slow writes still commit exact bytes.

use crate::common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use shmckpt::testing::io::OpKind;
use shmckpt::testing::io::fault::{Fault, FaultPlan, Rule};
use shmckpt::{BackendKind, Dtype, Engine, Error, Metadata};
use shmckpt_bench::synthetic::LayoutEntry;

const CS: u64 = 64 << 10;
/// Staging chunks of the engines here.
const ARENA_CHUNKS: u64 = 8;

fn engine(root: &Path, backend: BackendKind, plan: &Arc<FaultPlan>) -> Engine {
    Engine::open(
        small_config(root, backend)
            .with_staging_capacity(ARENA_CHUNKS * CS)
            .with_faults(Arc::clone(plan)),
    )
    .unwrap()
}

fn save_exact(e: &Engine, step: u64) {
    let s = step_state(step);
    let r = e.save(step, &s.tensors(), &Metadata::new()).unwrap().wait();
    let r = r.unwrap_or_else(|err| panic!("step {step}: {err}"));
    assert_eq!(
        r.dir.as_deref(),
        Some(e.config().root().join(format!("step-{step}")).as_path())
    );
    assert_loaded_equal(&e.load(step).unwrap(), &s);
}

/// A state whose file fills every staging chunk: it can only be staged if no chunk leaked.
fn arena_filling_state(seed: u64) -> State {
    State::new(
        vec![LayoutEntry {
            name: "all".into(),
            dtype: Dtype::U8,
            shape: vec![(ARENA_CHUNKS * CS - 4096 - 100) as usize],
        }],
        seed,
    )
}

/// Every staging chunk and slot is free again: a save that needs the whole arena goes
/// through (bounded wait instead of a hang if a chunk leaked).
fn assert_staging_released(e: &Engine, step: u64) {
    let info = shmckpt::recover::inspect_arena(e.shm_name());
    assert!(
        info.details.unwrap().slots.is_empty(),
        "a descriptor slot is still in use"
    );
    let s = arena_filling_state(step);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|sc| {
        sc.spawn(|| {
            let r = e
                .save(step, &s.tensors(), &Metadata::new())
                .and_then(|h| h.wait());
            tx.send(r.map(|r| r.bytes)).unwrap();
        });
        let r = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("staging space was not released: a full-arena save cannot start");
        assert!(r.unwrap() > (ARENA_CHUNKS - 1) * CS);
    });
    assert_loaded_equal(&e.load(step).unwrap(), &s);
}

/// One failure case: rules added after step 1 committed; step 2 must fail with `errno` at
/// `offset`.
fn failing_case(backend: BackendKind, rules: &[Rule], errno: i32, offset: u64) {
    let dir = real_dir("fault");
    let root = dir.path();
    let plan = Arc::new(FaultPlan::new());
    let e = engine(root, backend, &plan);
    save_exact(&e, 1);
    for r in rules {
        plan.add(r.clone());
    }
    let s2 = step_state(2);
    // A write that fails while the save is still staging is returned by `save` itself,
    // later ones by the handle: the same error either way.
    let err = e
        .save(2, &s2.tensors(), &Metadata::new())
        .and_then(|h| h.wait())
        .expect_err("the save must fail");
    let file = root.join("step-2.partial/rank-00000-of-00001.safetensors");
    match &err {
        Error::Io {
            op,
            path,
            offset: Some(at),
            source,
        } => {
            assert_eq!(*op, "write");
            assert_eq!(path, &file);
            assert_eq!(*at, offset, "{err}");
            assert_eq!(source.raw_os_error(), Some(errno));
        }
        other => panic!("{backend:?}: expected a write error, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains(&file.display().to_string()) && msg.contains(&format!("at offset {offset}")),
        "{msg}"
    );
    assert!(plan.fired() >= 1);
    // Nothing committed, nothing left behind, no descriptor of the removed file kept.
    assert_eq!(descriptors_under(root), Vec::<String>::new());
    assert_eq!(committed(root), [1]);
    assert!(partial_dirs(root).is_empty(), "{:?}", partial_dirs(root));
    assert_eq!(e.latest().unwrap(), Some(1));
    assert_step_is_exact(root, 1);
    // Staging released; the next saves succeed (the same step again, too).
    plan.clear();
    assert_staging_released(&e, 3);
    save_exact(&e, 2);
    assert_eq!(committed(root), [1, 2, 3]);
}

fn errno_at(offset: u64, errno: i32) -> Rule {
    Rule {
        kind: OpKind::Write,
        offsets: offset..offset + 1,
        fault: Fault::Errno(errno),
        times: Some(1),
    }
}

/// A dead incarnation's durable part is never merged with a re-save of its rank (the chaos
/// soak, seed 2, found it: a listed step whose rank-0 file was gone). Rank 0 of 2 saves
/// step 1 (its file and part, kept by the partial-part rule) and is gone; its next
/// incarnation's save of step 1 fails (EIO), which removes the file; rank 1's save must
/// then commit nothing, where it used to merge the old part and commit a step without rank
/// 0's file. Rank 0's next save commits both ranks' exact bytes.
#[test]
fn a_failed_resave_leaves_no_part_for_the_other_ranks_to_commit() {
    use shmckpt::manifest::{partial_dir_name, rank_manifest_name};
    for b in BACKENDS {
        let dir = real_dir("faults-stale-part");
        let root = dir.path();
        let plan = Arc::new(FaultPlan::new());
        let open = |rank: u32| {
            Engine::open(
                small_config(root, b)
                    .with_rank(rank, 2)
                    .with_faults(Arc::clone(&plan)),
            )
            .unwrap()
        };
        let state = |rank: u32| step_state(10 + u64::from(rank));
        let save = |e: &Engine, rank: u32| {
            e.save(1, &state(rank).tensors(), &Metadata::new())
                .unwrap()
                .wait()
        };
        let r0 = open(0);
        assert_eq!(save(&r0, 0).unwrap().dir, None);
        r0.close();
        let part = root.join(partial_dir_name(1)).join(rank_manifest_name(0));
        assert!(part.is_file());

        let r0 = open(0);
        plan.add(errno_at(CS, libc::EIO));
        let err = save(&r0, 0).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EIO), "{b:?}: {err}");
        plan.clear();
        assert!(
            !part.exists(),
            "{b:?}: the dead incarnation's part is removed"
        );
        r0.close();

        let r1 = open(1);
        let rep = save(&r1, 1).unwrap();
        assert_eq!(rep.dir, None, "{b:?}: rank 0 has no part of step 1");
        assert!(committed(root).is_empty(), "{b:?}: {:?}", committed(root));
        let r0 = open(0);
        assert_commits_step_1_of_both(&save(&r0, 0).unwrap(), root, state);
        r0.close();
        r1.close();
    }
}

/// `rep`, the last rank's save of step 1, committed it, the root's only step, with both
/// ranks' exact bytes (`state(rank)`).
fn assert_commits_step_1_of_both(
    rep: &shmckpt::SaveReport,
    root: &std::path::Path,
    state: impl Fn(u32) -> State,
) {
    use shmckpt::manifest::{rank_file_name, step_dir_name};
    assert_eq!(rep.dir.as_deref(), Some(&*root.join(step_dir_name(1))));
    assert_eq!(committed(root), [1]);
    for rank in 0..2 {
        assert_safetensors_equal(
            &root.join(step_dir_name(1)).join(rank_file_name(rank, 2)),
            &state(rank),
        );
    }
}

/// Two ranks on one root: rank 1's save of step 1 writes its file and durable part, then
/// fails in the merge (rank 0's part there is damaged). The failed save must take its part
/// out with its file: rank 0's next save of step 1 then commits nothing, where it used to
/// merge rank 1's leftover part and commit a step whose file for rank 1 was gone. Rank 1's
/// next save commits both ranks' exact bytes.
#[test]
fn a_save_that_fails_after_its_part_takes_the_part_out() {
    use shmckpt::manifest::{partial_dir_name, rank_file_name, rank_manifest_name};
    let dir = real_dir("faults-part-after");
    let root = dir.path();
    let open = |rank: u32| {
        Engine::open(small_config(root, BackendKind::Pwrite).with_rank(rank, 2)).unwrap()
    };
    let state = |rank: u32| step_state(20 + u64::from(rank));
    let save = |e: &Engine, rank: u32| {
        e.save(1, &state(rank).tensors(), &Metadata::new())
            .unwrap()
            .wait()
    };
    let partial = root.join(partial_dir_name(1));
    std::fs::create_dir(&partial).unwrap();
    std::fs::write(
        partial.join(rank_manifest_name(0)),
        b"{ not a manifest part",
    )
    .unwrap();

    let r1 = open(1);
    let err = save(&r1, 1).unwrap_err();
    assert!(
        matches!(err, Error::SaveFailed { .. } | Error::Corrupt { .. }),
        "{err:?}"
    );
    assert!(
        !partial.join(rank_manifest_name(1)).exists(),
        "the failed save's part is taken out"
    );
    assert!(!partial.join(rank_file_name(1, 2)).exists());
    r1.close();

    let r0 = open(0);
    let rep = save(&r0, 0).unwrap();
    assert_eq!(rep.dir, None, "rank 1 has no part of step 1");
    assert!(committed(root).is_empty(), "{:?}", committed(root));
    r0.close();

    let r1 = open(1);
    assert_commits_step_1_of_both(&save(&r1, 1).unwrap(), root, state);
    r1.close();
}

#[test]
fn enospc_on_the_first_chunk() {
    for b in BACKENDS {
        failing_case(b, &[errno_at(0, libc::ENOSPC)], libc::ENOSPC, 0);
    }
}

#[test]
fn eio_on_a_middle_chunk() {
    for b in BACKENDS {
        failing_case(b, &[errno_at(2 * CS, libc::EIO)], libc::EIO, 2 * CS);
    }
}

#[test]
fn eio_on_the_last_partial_chunk() {
    for b in BACKENDS {
        failing_case(b, &[errno_at(3 * CS, libc::EIO)], libc::EIO, 3 * CS);
    }
}

#[test]
fn enospc_inside_a_chunk_after_a_short_write() {
    // The first write of chunk 1 stops after 8 KiB; the rest of it fails with ENOSPC at the
    // exact offset where it resumes.
    let short = Rule {
        kind: OpKind::Write,
        offsets: CS..CS + 1,
        fault: Fault::Short(8192),
        times: Some(1),
    };
    for b in BACKENDS {
        failing_case(
            b,
            &[short.clone(), errno_at(CS + 8192, libc::ENOSPC)],
            libc::ENOSPC,
            CS + 8192,
        );
    }
}

#[test]
fn short_writes_are_resubmitted_until_complete() {
    for b in BACKENDS {
        for n in [4096u32, 3 * 4096 + 17] {
            let dir = real_dir("short");
            let plan = Arc::new(FaultPlan::new());
            plan.add(Rule {
                kind: OpKind::Write,
                offsets: 0..u64::MAX,
                fault: Fault::Short(n),
                times: None,
            });
            let e = engine(dir.path(), b, &plan);
            save_exact(&e, 1);
            // 4 chunks of up to 64 KiB in pieces of at most 12 KiB: many resubmissions.
            assert!(
                plan.fired() >= 4 * 5,
                "{b:?} {n}: only {} short writes",
                plan.fired()
            );
            assert_safetensors_equal(
                &dir.path().join("step-1/rank-00000-of-00001.safetensors"),
                &step_state(1),
            );
        }
    }
}

#[test]
fn slow_writes_still_commit_exact_bytes() {
    for b in BACKENDS {
        let dir = real_dir("slow");
        let plan = Arc::new(FaultPlan::new());
        plan.add(Rule {
            kind: OpKind::Write,
            offsets: 0..u64::MAX,
            fault: Fault::Delay(Duration::from_millis(20)),
            times: None,
        });
        let e = engine(dir.path(), b, &plan);
        // Overwrite the caller's buffers as soon as `save` returns: the slow writers must
        // still write what was staged.
        let mut s = step_state(1);
        let h = e.save(1, &s.tensors(), &Metadata::new()).unwrap();
        for d in &mut s.data {
            d.fill(0xAB);
        }
        h.wait().unwrap();
        assert!(plan.fired() >= 4);
        assert_loaded_equal(&e.load(1).unwrap(), &step_state(1));
    }
}

#[test]
fn flush_reports_a_failed_save_with_its_root_cause() {
    let dir = real_dir("flushfail");
    let root = dir.path();
    let plan = Arc::new(FaultPlan::new());
    let e = engine(root, BackendKind::Pwrite, &plan);
    save_exact(&e, 1);
    e.flush().unwrap();
    plan.add(errno_at(8192, libc::EIO));
    let s2 = step_state(2);
    let h = e.save(2, &s2.tensors(), &Metadata::new());
    let h = match h {
        // The write error can land while `save` is still staging: `save` itself reports it
        // (documented), and there is then no accepted save left for `flush` to report.
        Err(err) => {
            assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
            e.flush().expect("nothing accepted is left to fail");
            None
        }
        Ok(h) => Some(h),
    };
    if let Some(h) = h {
        let err = e.flush().expect_err("flush must report the failed save");
        match &err {
            Error::SaveFailed { step, source } => {
                assert_eq!(*step, 2);
                assert_eq!(source.raw_os_error(), Some(libc::EIO), "{err}");
            }
            other => panic!("expected SaveFailed, got {other:?}"),
        }
        assert_eq!(err.raw_os_error(), Some(libc::EIO));
        drop(err);
        // The handle still hands out the original write error.
        match h.wait() {
            Err(Error::Io { op: "write", .. }) => {}
            other => panic!("expected the write error, got {other:?}"),
        }
    }
    plan.clear();
    save_exact(&e, 3);
    e.flush().unwrap();
}
