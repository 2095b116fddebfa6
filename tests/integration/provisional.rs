//! Provisional saves (`SaveOptions::provisional`): staged and written like any save, taken
//! by their tier (the memory tier, the disk) only once the caller confirms them; refused,
//! nothing of them is visible; undecided at a crash, recovery drops them. The Python
//! package starts a deferred save this way before it has checked what it saves.

use std::path::Path;
use std::time::Duration;

use crate::common::*;
use shmckpt::manifest::partial_dir_name;
use shmckpt::{
    BackendKind, DiskCadence, Engine, EngineConfig, Error, LoadSource, Metadata, SaveOptions,
    StepSel, Tiers,
};

fn config(root: &Path, every: u64) -> EngineConfig {
    small_config(root, BackendKind::Auto)
        .with_direct_io(false)
        .with_disk_cadence(DiskCadence::Every(every))
}

/// `(step, memory, disk)` of every step `list_in(All)` lists.
fn tiers(e: &Engine) -> Vec<(u64, bool, bool)> {
    e.list_in(Tiers::All)
        .unwrap()
        .into_iter()
        .map(|t| (t.step, t.memory, t.disk))
        .collect()
}

fn provisional(e: &Engine, step: u64) -> shmckpt::SaveHandle {
    e.save_with(
        step,
        &step_state(step).tensors(),
        &Metadata::new(),
        &SaveOptions::new().provisional(),
    )
    .unwrap()
}

fn assert_refused(h: shmckpt::SaveHandle, step: u64, why: &str) {
    match h.wait() {
        Err(Error::CommitRefused { step: s, reason }) => {
            assert_eq!(s, step);
            assert_eq!(reason, why);
        }
        other => panic!("expected CommitRefused for step {step}, got {other:?}"),
    }
}

fn assert_loads_from(e: &Engine, step: u64, source: LoadSource) {
    let (ck, report) = load_with_report(e, StepSel::Step(step)).unwrap();
    assert_eq!((report.step, report.source), (step, source));
    assert_loaded_equal(&ck, &step_state(step));
}

/// A memory-only provisional save is staged at once but neither listed nor loadable until
/// confirmed; confirmed, it is the memory tier's newest step, byte-exact; refused or
/// dropped undecided, it fails with `CommitRefused`, the memory tier keeps its step, and
/// the step can be saved again.
#[test]
fn a_memory_only_provisional_save_is_held_only_once_confirmed() {
    let dir = real_dir("provisional-memory");
    let root = dir.path();
    let e = Engine::open(config(root, 10)).unwrap();
    e.save(1, &step_state(1).tensors(), &Metadata::new())
        .unwrap()
        .wait()
        .unwrap();

    let h = provisional(&e, 2);
    assert!(h.is_staged(), "save_with returns once staged");
    let h = h
        .wait_timeout(Duration::from_millis(100))
        .expect_err("undecided: not done");
    assert_eq!(tiers(&e), [(1, false, true)]);
    assert_eq!(e.latest_in(Tiers::All).unwrap(), Some(1));
    assert!(matches!(
        load_with_report(&e, StepSel::Step(2)),
        Err(Error::NotFound { step: Some(2), .. })
    ));
    h.confirm_commit(Ok(()));
    let r = h.wait().unwrap();
    assert!(r.memory_only, "{r:?}");
    assert_eq!(tiers(&e), [(1, false, true), (2, true, false)]);
    assert_loads_from(&e, 2, LoadSource::Memory);

    let h = provisional(&e, 3);
    h.confirm_commit(Err("metadata changed".into()));
    assert_refused(h, 3, "metadata changed");
    assert_eq!(tiers(&e), [(1, false, true), (2, true, false)]);
    assert_loads_from(&e, 2, LoadSource::Memory);
    // Dropped undecided: refused.
    drop(provisional(&e, 3));
    assert_eq!(tiers(&e), [(1, false, true), (2, true, false)]);
    // The refused step saved again, as any save: the memory tier's newest.
    let r = e
        .save(3, &step_state(3).tensors(), &Metadata::new())
        .unwrap()
        .wait()
        .unwrap();
    assert!(r.memory_only, "{r:?}");
    assert_eq!(tiers(&e), [(1, false, true), (3, true, false)]);
    assert_loads_from(&e, 3, LoadSource::Memory);
    e.close();
    assert_eq!(committed(root), [1, 3], "close wrote the held step");
    assert_step_is_exact(root, 3);
}

/// A decision given while the save is still staging (a background save confirmed or
/// refused at once) is applied once staging ends.
#[test]
fn a_decision_before_staging_ends_is_applied_after_it() {
    let dir = real_dir("provisional-early");
    let root = dir.path();
    let e = Engine::open(config(root, 10).with_memory_steps(2)).unwrap();
    e.save(1, &step_state(1).tensors(), &Metadata::new())
        .unwrap()
        .wait()
        .unwrap();
    for (step, decision) in [(2, Ok(())), (3, Err("no".to_owned())), (4, Ok(()))] {
        let state = step_state(step);
        let tensors = state.tensors();
        #[allow(unsafe_code)]
        // SAFETY: `state` owns the tensors' bytes; it is neither changed nor dropped
        // before the handle reports the save staged (`wait` below, or its drop).
        let h = unsafe {
            e.save_async(
                step,
                &tensors,
                &Metadata::new(),
                &SaveOptions::new().provisional(),
            )
        }
        .unwrap();
        let refused = decision.is_err();
        h.confirm_commit(decision);
        if refused {
            assert_refused(h, step, "no");
        } else {
            assert!(h.wait().unwrap().memory_only);
        }
        drop(state);
    }
    assert_eq!(
        tiers(&e),
        [(1, false, true), (2, true, false), (4, true, false)]
    );
    assert_loads_from(&e, 2, LoadSource::Memory);
    assert_loads_from(&e, 4, LoadSource::Memory);
    e.close();
}

/// A disk provisional save is written, but its commit waits for the decision: confirmed,
/// committed byte-exact; refused, no directory of it is left and the step can be saved
/// again.
#[test]
fn a_disk_provisional_save_commits_only_once_confirmed() {
    let dir = real_dir("provisional-disk");
    let root = dir.path();
    let e = Engine::open(config(root, 1)).unwrap();
    let h = provisional(&e, 5);
    let h = h
        .wait_timeout(Duration::from_millis(200))
        .expect_err("undecided: not committed");
    assert!(committed(root).is_empty());
    assert_eq!(e.latest().unwrap(), None);
    h.confirm_commit(Ok(()));
    let r = h.wait().unwrap();
    assert!(!r.memory_only && r.dir.is_some(), "{r:?}");
    assert_step_is_exact(root, 5);

    let h = provisional(&e, 6);
    h.confirm_commit(Err("re-captured".into()));
    assert_refused(h, 6, "re-captured");
    assert_eq!(committed(root), [5]);
    assert!(!root.join(partial_dir_name(6)).exists());
    e.save(6, &step_state(6).tensors(), &Metadata::new())
        .unwrap()
        .wait()
        .unwrap();
    e.close();
    assert_eq!(committed(root), [5, 6]);
    assert_step_is_exact(root, 6);
}

/// Child: every second save to disk: step 1 to disk, step 2 memory-only provisional and
/// confirmed, step 3 to disk provisional and undecided (written, its commit waiting),
/// step 4 memory-only provisional undecided (staged, parked), then death by SIGKILL.
fn child_provisional() {
    let root = env_path(ROOT_ENV);
    let shm = std::env::var(SHM_ENV).unwrap();
    let e = Engine::open(
        config(&root, 2)
            .with_memory_steps(2)
            .with_staging_capacity(1 << 20)
            .with_shm_name(shm),
    )
    .unwrap();
    e.save(1, &step_state(1).tensors(), &Metadata::new())
        .unwrap()
        .wait()
        .unwrap();
    let h2 = provisional(&e, 2);
    h2.confirm_commit(Ok(()));
    assert!(h2.wait().unwrap().memory_only);
    let h3 = provisional(&e, 3);
    let h3 = h3
        .wait_timeout(Duration::from_millis(300))
        .expect_err("undecided");
    let h4 = provisional(&e, 4);
    assert!(h4.is_staged());
    assert_eq!(committed(&root), [1]);
    std::hint::black_box((&e, &h3, &h4));
    sigkill_self();
}

const ROLES: &[Role] = &[("child_provisional", child_provisional)];

/// After a SIGKILL, recovery commits the confirmed memory-only step and neither undecided
/// save (the disk save whose commit waited, the memory-only save parked): no step the
/// caller had not confirmed becomes visible.
#[test]
fn recovery_drops_undecided_provisional_saves() {
    if run_role(ROLES) {
        return;
    }
    let dir = real_dir("provisional-kill");
    let root = dir.path();
    let shm = test_shm_name("provisional");
    let _g = ShmGuard(shm.clone());
    run_child("child_provisional", root, &shm);
    assert_eq!(committed(root), [1]);
    let e = Engine::open(config(root, 2)).unwrap();
    assert_eq!(e.recovered_steps(), [2]);
    assert_eq!(committed(root), [1, 2]);
    assert!(partial_dirs(root).is_empty(), "{:?}", partial_dirs(root));
    assert_eq!(e.latest().unwrap(), Some(2));
    assert_step_is_exact(root, 2);
    e.close();
}
