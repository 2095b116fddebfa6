//! A cadence per tier (`EngineConfig::with_disk_cadence`): which saves go to disk, the
//! memory-only saves served from the arena in the same process, recovered after a SIGKILL,
//! listed with their tiers and written to disk by `close`.

use crate::common;

use std::path::Path;
use std::time::Duration;

use common::*;
use shmckpt::{
    BackendKind, DiskCadence, Engine, EngineConfig, Error, LoadSource, Metadata, StepSel, Tiers,
};

const CS: u64 = 64 << 10;

fn cadence_config(root: &Path, cadence: DiskCadence) -> EngineConfig {
    small_config(root, BackendKind::Auto)
        .with_direct_io(false)
        .with_disk_cadence(cadence)
}

/// `(step, memory, disk, bucket)` of every step `list_in(All)` lists.
/// Flash restore with a disk cadence of every `every`-th save and `staging` bytes of
/// staging: a child and the engine opened after it share this layout (the take-over in
/// place needs the same one).
fn flash_config(root: &Path, every: u64, staging: u64) -> EngineConfig {
    cadence_config(root, DiskCadence::Every(every))
        .with_staging_capacity(staging)
        .with_keep_in_memory(true)
}

fn tiers(e: &Engine) -> Vec<(u64, bool, bool, bool)> {
    e.list_in(Tiers::All)
        .unwrap()
        .into_iter()
        .map(|t| (t.step, t.memory, t.disk, t.bucket))
        .collect()
}

/// Save `step` (its [`step_state`]), overwrite the caller's buffers at once, and return
/// whether the save was memory-only (after waiting for its handle).
fn save_step(e: &Engine, step: u64) -> shmckpt::SaveReport {
    let mut s = step_state(step);
    let h = e.save(step, &s.tensors(), &Metadata::new()).unwrap();
    // The engine holds its own copy from here on.
    for d in &mut s.data {
        d.fill(0xA5);
    }
    h.wait().unwrap()
}

/// Each slot recovery reported at `e`'s open: its step and outcome (as `Debug` prints it).
fn slot_outcomes(e: &Engine) -> Vec<(u64, String)> {
    e.recovered()
        .iter()
        .flat_map(|r| r.slots.iter())
        .map(|s| (s.step, format!("{:?}", s.outcome)))
        .collect()
}

fn assert_latest_from(e: &Engine, step: u64, source: LoadSource) {
    assert_eq!(e.latest_in(Tiers::All).unwrap(), Some(step));
    assert_eq!(e.latest().unwrap(), Some(step));
    let (ck, report) = load_with_report(e, StepSel::Latest).unwrap();
    assert_eq!((report.step, report.source), (step, source));
    assert_eq!(ck.step, step);
    assert_loaded_equal(&ck, &step_state(step));
}

#[test]
fn every_third_save_goes_to_disk_and_the_others_are_served_from_memory() {
    let dir = real_dir("cadence-every");
    let root = dir.path();
    let e = Engine::open(cadence_config(root, DiskCadence::Every(3))).unwrap();

    // The first save goes to disk.
    let r1 = save_step(&e, 1);
    assert!(!r1.memory_only && r1.dir.is_some(), "{r1:?}");
    assert_eq!(tiers(&e), [(1, false, true, false)]);

    // Memory-only: staged, never durable, loadable here with its exact bytes.
    let r2 = save_step(&e, 2);
    assert!(r2.memory_only, "{r2:?}");
    assert_eq!(r2.dir, None);
    assert_eq!(r2.file, Path::new(""));
    assert_eq!(r2.timings.committed, None);
    assert_eq!(committed(root), [1]);
    assert!(partial_dirs(root).is_empty(), "{:?}", partial_dirs(root));
    assert_eq!(
        tiers(&e),
        [(1, false, true, false), (2, true, false, false)]
    );
    assert_latest_from(&e, 2, LoadSource::Memory);
    // The disk's own step is still read from the disk.
    let (ck, report) = load_with_report(&e, 1).unwrap();
    assert_eq!(report.source, LoadSource::Disk);
    assert_loaded_equal(&ck, &step_state(1));
    // A step that is in memory is not saved twice.
    assert!(matches!(
        e.save(2, &step_state(2).tensors(), &Metadata::new()),
        Err(Error::StepExists { step: 2, .. })
    ));

    // The next memory-only save replaces it.
    assert!(save_step(&e, 3).memory_only);
    assert_eq!(
        tiers(&e),
        [(1, false, true, false), (3, true, false, false)]
    );
    assert!(matches!(
        load_with_report(&e, 2),
        Err(Error::NotFound { step: Some(2), .. })
    ));
    assert_latest_from(&e, 3, LoadSource::Memory);
    // Into caller buffers too, and its manifest and file metadata as a load reads them.
    let want = step_state(3);
    let mut bufs: Vec<Vec<u8>> = want.data.iter().map(|d| vec![0u8; d.len()]).collect();
    let mut dest: Vec<(&str, &mut [u8])> = want
        .layout
        .iter()
        .zip(bufs.iter_mut())
        .map(|(l, b)| (l.name.as_str(), b.as_mut_slice()))
        .collect();
    assert_eq!(load_into(&e, StepSel::Latest, &mut dest).unwrap(), 3);
    assert!(bufs == want.data, "caller buffers differ from step 3");
    let m = e.manifest(StepSel::Latest).unwrap();
    assert_eq!((m.step, m.files.len()), (3, 1));
    assert_eq!(
        e.file_metadata(3)
            .unwrap()
            .get("shmckpt.step")
            .map(String::as_str),
        Some("3")
    );
    // Memory only: a load from the disk alone does not see it.
    let disk_only = shmckpt::LoadRequest::new(StepSel::Latest).with_sources(shmckpt::Sources::DISK);
    assert_eq!(load_with_report(&e, disk_only).unwrap().1.step, 1);

    // The third save after the disk's goes to disk; once committed, memory gives its step up.
    let r4 = save_step(&e, 4);
    assert!(!r4.memory_only && r4.dir.is_some(), "{r4:?}");
    assert_eq!(committed(root), [1, 4]);
    assert_eq!(
        tiers(&e),
        [(1, false, true, false), (4, false, true, false)]
    );
    assert_latest_from(&e, 4, LoadSource::Disk);

    // Close writes the newest memory-only step to disk: nothing saved is lost.
    assert!(save_step(&e, 5).memory_only);
    assert_eq!(committed(root), [1, 4]);
    e.close();
    assert_eq!(committed(root), [1, 4, 5]);
    for s in [1, 4, 5] {
        assert_step_is_exact(root, s);
    }
}

#[test]
fn persist_memory_writes_the_newest_memory_only_step() {
    let dir = real_dir("cadence-persist");
    let root = dir.path();
    let e =
        Engine::open(cadence_config(root, DiskCadence::Every(10)).with_keep_last(Some(2))).unwrap();
    save_step(&e, 1);
    assert_eq!(e.persist_memory().unwrap(), [], "nothing in memory yet");
    assert!(save_step(&e, 2).memory_only);
    let r = e.persist_memory().unwrap();
    assert_eq!(r.len(), 1, "step 2 was in memory: {r:?}");
    let r = &r[0];
    assert_eq!(r.step, 2);
    assert!(!r.memory_only && r.dir.is_some(), "{r:?}");
    assert_eq!(committed(root), [1, 2]);
    assert_eq!(
        tiers(&e),
        [(1, false, true, false), (2, false, true, false)]
    );
    assert_step_is_exact(root, 2);
    // Removing a memory-only step gives it up.
    assert!(save_step(&e, 3).memory_only);
    e.remove(3).unwrap();
    assert_eq!(e.latest_in(Tiers::All).unwrap(), Some(2));
    e.close();
    assert_eq!(committed(root), [1, 2]);
}

/// `memory_steps(3)`: the three newest memory-only steps are held, each loadable with its
/// exact bytes; a fourth gives the oldest up, a committed disk save all older ones, and
/// close writes the held ones to disk, oldest first.
#[test]
fn memory_steps_holds_the_n_newest_memory_only_steps() {
    let dir = real_dir("cadence-steps");
    let root = dir.path();
    let cfg = cadence_config(root, DiskCadence::Every(6)).with_memory_steps(3);
    assert_eq!(cfg.memory_steps(), 3);
    let e = Engine::open(cfg).unwrap();
    assert!(!save_step(&e, 1).memory_only);
    for s in 2..=4 {
        assert!(save_step(&e, s).memory_only);
    }
    assert_eq!(
        tiers(&e),
        [
            (1, false, true, false),
            (2, true, false, false),
            (3, true, false, false),
            (4, true, false, false)
        ]
    );
    assert_latest_from(&e, 4, LoadSource::Memory);
    for s in [2, 3] {
        let (ck, report) = load_with_report(&e, s).unwrap();
        assert_eq!((report.step, report.source), (s, LoadSource::Memory));
        assert_loaded_equal(&ck, &step_state(s));
        assert_eq!(e.manifest(s).unwrap().step, s);
    }
    // A held step is not saved twice, whichever it is.
    assert!(matches!(
        e.save(2, &step_state(2).tensors(), &Metadata::new()),
        Err(Error::StepExists { step: 2, .. })
    ));
    // A fourth memory-only step: the oldest held one is given up.
    assert!(save_step(&e, 5).memory_only);
    assert_eq!(
        tiers(&e),
        [
            (1, false, true, false),
            (3, true, false, false),
            (4, true, false, false),
            (5, true, false, false)
        ]
    );
    assert!(matches!(
        load_with_report(&e, 2),
        Err(Error::NotFound { step: Some(2), .. })
    ));
    // Removing a held step in the middle gives that one up only.
    e.remove(4).unwrap();
    assert_eq!(
        tiers(&e),
        [
            (1, false, true, false),
            (3, true, false, false),
            (5, true, false, false)
        ]
    );
    assert_latest_from(&e, 5, LoadSource::Memory);
    // The sixth save after the disk's goes to disk: once committed, every older held step
    // is given up.
    assert!(save_step(&e, 6).memory_only);
    let r7 = save_step(&e, 7);
    assert!(!r7.memory_only && r7.dir.is_some(), "{r7:?}");
    assert_eq!(
        tiers(&e),
        [(1, false, true, false), (7, false, true, false)]
    );
    // Close writes every held step to disk, oldest first.
    for s in 8..=9 {
        assert!(save_step(&e, s).memory_only);
    }
    let reports = e.persist_memory().unwrap();
    let written: Vec<u64> = reports.iter().map(|r| r.step).collect();
    assert_eq!(written, [8, 9]);
    assert!(reports.iter().all(|r| !r.memory_only && r.dir.is_some()));
    assert!(save_step(&e, 10).memory_only);
    e.close();
    assert_eq!(committed(root), [1, 7, 8, 9, 10]);
    for s in [1, 7, 8, 9, 10] {
        assert_step_is_exact(root, s);
    }
}

/// Staging with room for three saves and `memory_steps(3)`: two memory-only steps fit
/// beside the save being staged; the third one staged gives the oldest up instead of
/// waiting, and so on, oldest first.
#[test]
fn staging_runs_out_and_gives_the_oldest_memory_step_up() {
    let dir = real_dir("cadence-steps-small");
    let root = dir.path();
    // Room for exactly three saves (four chunks each).
    let cfg = cadence_config(root, DiskCadence::Every(100))
        .with_memory_steps(3)
        .with_staging_capacity(12 * CS);
    let e = Engine::open(cfg).unwrap();
    assert!(!save_step(&e, 1).memory_only);
    for s in 2..=4 {
        assert!(save_step(&e, s).memory_only);
    }
    assert_eq!(e.list_in(Tiers::Local).unwrap().len(), 4);
    // Steps 2, 3 and 4 hold every chunk: step 5 takes step 2's.
    assert!(save_step(&e, 5).memory_only);
    assert_eq!(
        tiers(&e),
        [
            (1, false, true, false),
            (3, true, false, false),
            (4, true, false, false),
            (5, true, false, false)
        ]
    );
    assert!(save_step(&e, 6).memory_only);
    assert_eq!(
        tiers(&e),
        [
            (1, false, true, false),
            (4, true, false, false),
            (5, true, false, false),
            (6, true, false, false)
        ]
    );
    for s in 4..=6 {
        let (ck, report) = load_with_report(&e, s).unwrap();
        assert_eq!((report.step, report.source), (s, LoadSource::Memory));
        assert_loaded_equal(&ck, &step_state(s));
    }
    e.close();
    assert_eq!(committed(root), [1, 4, 5, 6]);
    for s in [4, 5, 6] {
        assert_step_is_exact(root, s);
    }
}

/// A disk cadence with replicas (`with_replica_hold`): each disk save holds its committed
/// image for replication, a memory-only save holds none (replicas take disk saves only)
/// and is still served from memory.
#[test]
fn with_replica_hold_only_disk_saves_hold_an_image() {
    let dir = real_dir("cadence-held");
    let root = dir.path();
    let e = Engine::open(
        cadence_config(root, DiskCadence::Every(2))
            .with_replica_hold(true)
            .with_memory_steps(2),
    )
    .unwrap();
    for step in 1..=4 {
        let st = step_state(step);
        let h = e.save(step, &st.tensors(), &Metadata::new()).unwrap();
        let cell = h.held_image();
        let r = h.wait().unwrap();
        let image = cell.take();
        if step % 2 == 1 {
            assert!(!r.memory_only, "step {step}: {r:?}");
            let image = image.expect("a disk save's committed image is held");
            let file = std::fs::read(&r.file).unwrap();
            assert_eq!((image.step(), image.len()), (step, file.len() as u64));
        } else {
            assert!(r.memory_only, "step {step}: {r:?}");
            assert!(
                image.is_none(),
                "step {step}: a memory-only save holds no image"
            );
        }
    }
    assert_eq!(
        tiers(&e),
        [
            (1, false, true, false),
            (3, false, true, false),
            (4, true, false, false)
        ]
    );
    assert_latest_from(&e, 4, LoadSource::Memory);
    e.close();
    assert_eq!(committed(root), [1, 3, 4]);
    for s in [1, 3, 4] {
        assert_step_is_exact(root, s);
    }
}

#[test]
fn the_default_cadence_sends_every_save_to_disk() {
    let dir = real_dir("cadence-default");
    let root = dir.path();
    let cfg = small_config(root, BackendKind::Auto).with_direct_io(false);
    assert_eq!(cfg.disk_cadence(), DiskCadence::Every(1));
    let e = Engine::open(cfg).unwrap();
    for s in 1..=3 {
        let r = save_step(&e, s);
        assert!(!r.memory_only && r.dir.is_some(), "{r:?}");
    }
    assert_eq!(committed(root), [1, 2, 3]);
    assert_eq!(
        tiers(&e),
        [
            (1, false, true, false),
            (2, false, true, false),
            (3, false, true, false)
        ]
    );
    e.close();
}

#[test]
fn staging_too_small_for_two_saves_writes_the_memory_step_to_disk_before_the_next() {
    let dir = real_dir("cadence-small");
    let root = dir.path();
    // Room for exactly one save (four chunks).
    let cfg = cadence_config(root, DiskCadence::Every(5)).with_staging_capacity(4 * CS);
    let e = Engine::open(cfg).unwrap();
    save_step(&e, 1);
    assert!(save_step(&e, 2).memory_only);
    // Step 3 cannot be staged beside step 2: step 2, reported staged, is never given up
    // (a crash while step 3 stages would leave nothing newer than step 1): it goes to
    // disk first, and step 3 stages in its chunks once they are written.
    assert!(save_step(&e, 3).memory_only);
    e.flush().unwrap();
    assert_eq!(committed(root), [1, 2]);
    assert_step_is_exact(root, 2);
    assert_eq!(
        tiers(&e),
        [
            (1, false, true, false),
            (2, false, true, false),
            (3, true, false, false)
        ]
    );
    assert_latest_from(&e, 3, LoadSource::Memory);
    e.close();
    assert_eq!(committed(root), [1, 2, 3]);
    assert_step_is_exact(root, 3);
}

#[test]
fn a_disk_interval_sends_a_save_to_disk_once_the_last_disk_save_is_that_old() {
    let dir = real_dir("cadence-interval");
    let root = dir.path();
    let cfg = cadence_config(root, DiskCadence::Every(1000))
        .with_disk_interval(Some(Duration::from_millis(1500)));
    let e = Engine::open(cfg).unwrap();
    assert!(!save_step(&e, 1).memory_only);
    assert!(save_step(&e, 2).memory_only);
    std::thread::sleep(Duration::from_millis(1600));
    let r3 = save_step(&e, 3);
    assert!(!r3.memory_only && r3.dir.is_some(), "{r3:?}");
    assert!(save_step(&e, 4).memory_only);
    assert_eq!(committed(root), [1, 3]);
    e.close();
    assert_eq!(committed(root), [1, 3, 4]);
}

#[test]
fn cadences_that_decide_per_rank_are_refused_with_several_ranks() {
    let dir = real_dir("cadence-config");
    let root = dir.path();
    let open = |cfg: EngineConfig| Engine::open(cfg).map(drop);
    assert!(matches!(
        open(cadence_config(root, DiskCadence::Every(0))),
        Err(Error::Config(_))
    ));
    assert!(matches!(
        open(cadence_config(root, DiskCadence::WhenIdle).with_rank(0, 2)),
        Err(Error::Config(_))
    ));
    assert!(matches!(
        open(
            cadence_config(root, DiskCadence::Every(1))
                .with_disk_interval(Some(Duration::from_secs(1)))
                .with_rank(0, 2)
        ),
        Err(Error::Config(_))
    ));
    assert!(matches!(
        open(cadence_config(root, DiskCadence::Every(2)).with_memory_steps(0)),
        Err(Error::Config(_))
    ));

    // Every N decides alike on every rank.
    open(cadence_config(root, DiskCadence::Every(2)).with_rank(0, 2)).unwrap();
}

/// With a writer slowed down, "auto" sends a save to disk only when the previous disk save
/// has finished.
#[cfg(feature = "fault-injection")]
#[test]
fn when_idle_skips_the_disk_while_a_save_drains() {
    use shmckpt::testing::io::OpKind;
    use shmckpt::testing::io::fault::{Fault, FaultPlan, Rule};
    use std::sync::Arc;

    let dir = real_dir("cadence-idle");
    let root = dir.path();
    let plan = Arc::new(FaultPlan::new());
    plan.add(Rule {
        kind: OpKind::Write,
        offsets: 0..u64::MAX,
        fault: Fault::Delay(Duration::from_millis(300)),
        times: None,
    });
    let e =
        Engine::open(cadence_config(root, DiskCadence::WhenIdle).with_faults(Arc::clone(&plan)))
            .unwrap();
    let s1 = step_state(1);
    let h1 = e.save(1, &s1.tensors(), &Metadata::new()).unwrap();
    // Step 1 drains (four chunks at 300 ms each): 2 and 3 stay in memory.
    for s in [2, 3] {
        let st = step_state(s);
        let r = e
            .save(s, &st.tensors(), &Metadata::new())
            .unwrap()
            .wait()
            .unwrap();
        assert!(
            r.memory_only,
            "step {s} went to disk while step 1 drained: {r:?}"
        );
    }
    assert!(
        !h1.is_done(),
        "the slow writer finished step 1 early: nothing was tested"
    );
    assert_latest_from(&e, 3, LoadSource::Memory);
    let r1 = h1.wait().unwrap();
    assert!(!r1.memory_only && r1.dir.is_some());
    // Step 3 is newer than the disk's step 1: still the latest, from memory.
    assert_latest_from(&e, 3, LoadSource::Memory);
    plan.clear();
    // The disk is idle again: the next save goes to disk, and memory gives step 3 up.
    let r4 = save_step(&e, 4);
    assert!(!r4.memory_only && r4.dir.is_some(), "{r4:?}");
    assert_eq!(
        tiers(&e),
        [(1, false, true, false), (4, false, true, false)]
    );
    e.close();
    assert_eq!(committed(root), [1, 4]);
    assert_step_is_exact(root, 4);
}

/// Child: step 1 to disk, step 2 memory-only, then death by SIGKILL.
fn child_memory_only() {
    let root = env_path(ROOT_ENV);
    let shm = std::env::var(SHM_ENV).unwrap();
    let e = Engine::open(
        cadence_config(&root, DiskCadence::Every(2))
            .with_staging_capacity(1 << 20)
            .with_shm_name(shm),
    )
    .unwrap();
    assert!(!save_step(&e, 1).memory_only);
    let s2 = step_state(2);
    let r = e
        .save(2, &s2.tensors(), &Metadata::new())
        .unwrap()
        .wait()
        .unwrap();
    assert!(r.memory_only);
    assert_eq!(committed(&root), [1]);
    std::hint::black_box(&e);
    sigkill_self();
}

/// Child: step 1 to disk, steps 2, 3 and 4 memory-only with `memory_steps(2)` (step 2 given
/// up), then death by SIGKILL.
fn child_memory_steps() {
    let root = env_path(ROOT_ENV);
    let shm = std::env::var(SHM_ENV).unwrap();
    let e = Engine::open(
        cadence_config(&root, DiskCadence::Every(10))
            .with_memory_steps(2)
            .with_staging_capacity(1 << 20)
            .with_shm_name(shm),
    )
    .unwrap();
    assert!(!save_step(&e, 1).memory_only);
    for s in 2..=4 {
        assert!(save_step(&e, s).memory_only);
    }
    assert_eq!(
        tiers(&e),
        [
            (1, false, true, false),
            (3, true, false, false),
            (4, true, false, false)
        ]
    );
    assert_eq!(committed(&root), [1]);
    std::hint::black_box(&e);
    sigkill_self();
}

/// Child: flash restore on, step 1 to disk, steps 2 and 3 memory-only (3 held), then death
/// by SIGKILL. Its arena is the root's kept arena (stable name).
fn child_keep_memory_only() {
    let root = env_path(ROOT_ENV);
    let e = Engine::open(flash_config(&root, 10, 1 << 20)).unwrap();
    assert!(!save_step(&e, 1).memory_only);
    assert!(save_step(&e, 2).memory_only);
    assert!(save_step(&e, 3).memory_only);
    assert_eq!(committed(&root), [1]);
    std::hint::black_box(&e);
    sigkill_self();
}

/// Child: flash restore on, after `child_keep_memory_only` died: the open takes the dead
/// engine's memory-only step 3 over (held in memory, not written), then death by SIGKILL
/// before anything else.
fn child_adopt_then_die() {
    let root = env_path(ROOT_ENV);
    let e = Engine::open(flash_config(&root, 10, 1 << 20)).unwrap();
    assert_eq!(e.recovered_steps(), [3]);
    assert_eq!(committed(&root), [1]);
    std::hint::black_box(&e);
    sigkill_self();
}

/// Flash restore on, every second save to disk: step 1 to disk, 2 memory-only, then step 3
/// (to disk) staged with the write of its last chunk held back (10 s). Returns the engine
/// and step 3's handle and state, kept alive by the caller until it dies.
fn disk_save_3_draining(root: &Path) -> (Engine, shmckpt::SaveHandle, State) {
    use shmckpt::testing::io::OpKind;
    use shmckpt::testing::io::fault::{Fault, FaultPlan, Rule};
    let plan = std::sync::Arc::new(FaultPlan::new());
    // One write in flight per writer thread: a write is never pushed in the same batch as
    // the held-back one (whose delay runs before the batch is submitted).
    let config = flash_config(root, 2, 1 << 20)
        .with_queue_depth(1)
        .with_faults(std::sync::Arc::clone(&plan));
    let e = Engine::open(config).unwrap();
    assert!(!save_step(&e, 1).memory_only);
    assert!(save_step(&e, 2).memory_only);
    // The last chunk's write (from 192 KiB: the file has 4 chunks of 64 KiB) is held back.
    plan.add(Rule {
        kind: OpKind::Write,
        offsets: (192 << 10)..u64::MAX,
        fault: Fault::Delay(Duration::from_secs(10)),
        times: None,
    });
    let s3 = step_state(3);
    let h3 = e.save(3, &s3.tensors(), &Metadata::new()).unwrap();
    h3.wait_staged().unwrap();
    (e, h3, s3)
}

/// Child: `disk_save_3_draining`, 4 memory-only (held), then death by SIGKILL while step 3
/// drains (its first chunks written, the last one staged).
fn child_keep_disk_save_in_flight() {
    let root = env_path(ROOT_ENV);
    let (e, h3, s3) = disk_save_3_draining(&root);
    assert!(save_step(&e, 4).memory_only);
    let _ = wait_first_chunk_written(&root, 3);
    assert_eq!(committed(&root), [1]);
    std::hint::black_box((&e, &h3, &s3));
    sigkill_self();
}

/// Child: `disk_save_3_draining`, then death by SIGKILL while step 3 drains (its first
/// chunks written): the newest staged save is a disk save partly written.
fn child_keep_newest_disk_save_in_flight() {
    let root = env_path(ROOT_ENV);
    let (e, h3, s3) = disk_save_3_draining(&root);
    if !wait_first_chunk_written(&root, 3) {
        // The first chunk's write did not end within 1 s: the parent tries again.
        std::process::exit(3);
    }
    assert_eq!(committed(&root), [1]);
    std::hint::black_box((&e, &h3, &s3));
    sigkill_self();
}

/// Until the first chunk of staged step `step` of `root`'s kept arena is written (its
/// descriptor says so: `true`), or for 1 s.
fn wait_first_chunk_written(root: &Path, step: u64) -> bool {
    use shmckpt::testing::staging::descriptor::{chunk_state, slot_state};
    let deadline = std::time::Instant::now() + Duration::from_secs(1);
    loop {
        let att = shmckpt::testing::staging::AttachedArena::open(&kept_arena_name(root)).unwrap();
        let first_written = (0..att.slot_count()).any(|s| {
            let v = att.slot(s);
            v.step == step
                && v.state == slot_state::STAGED
                && v.chunks
                    .first()
                    .is_some_and(|c| c.0 == chunk_state::WRITTEN)
        });
        if first_written || std::time::Instant::now() >= deadline {
            return first_written;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A root (and the guard of its kept arena) left by `child_keep_newest_disk_save_in_flight`
/// killed with step 3's first chunks written (tried up to 8 times, in a new root each).
fn killed_with_step_3_partly_written(tag: &str) -> (tempfile::TempDir, ShmGuard) {
    use std::os::unix::process::ExitStatusExt;
    for _ in 0..8 {
        let dir = real_dir(tag);
        let kept = ShmGuard(kept_arena_name(dir.path()));
        let out = child_command("child_keep_newest_disk_save_in_flight")
            .env(ROOT_ENV, dir.path())
            .env(SHM_ENV, "unused")
            .output()
            .unwrap();
        if out.status.signal() == Some(9) {
            return (dir, kept);
        }
        assert_eq!(out.status.code(), Some(3), "{out:?}");
    }
    panic!("no child was killed with step 3 partly written");
}

/// The `fdatasync` of a rank file under `step-3.partial` blocks until [`RELEASE`] is set
/// (for at most 20 s), with [`BLOCKED`] set meanwhile.
struct BlockStep3Sync;
static BLOCKED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
static RELEASE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

impl shmckpt::observe::FsObserver for BlockStep3Sync {
    fn around(&self, op: &shmckpt::observe::FsOp<'_>, run: &mut dyn FnMut() -> bool) {
        use std::os::fd::AsRawFd;
        use std::sync::atomic::Ordering;
        if let shmckpt::observe::FsOp::Sync {
            fd,
            data_only: true,
        } = op
        {
            let target = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()));
            if target.is_ok_and(|t| t.to_string_lossy().contains("step-3.partial/")) {
                BLOCKED.store(true, Ordering::SeqCst);
                let until = std::time::Instant::now() + Duration::from_secs(20);
                while !RELEASE.load(Ordering::SeqCst) && std::time::Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(5));
                }
                BLOCKED.store(false, Ordering::SeqCst);
            }
        }
        run();
    }

    fn tracking_writes(&self) -> bool {
        false
    }

    fn written(&self, _: std::os::fd::BorrowedFd<'_>, _: u64, _: &[u8]) {}

    fn committed(&self, _: &Path, _: u64) {}
}

/// Child, after `child_keep_disk_save_in_flight` died, with `disk_every="auto"`
/// (`WhenIdle`): the open holds step 4 and recovers step 3 behind it, whose final
/// `fdatasync` is held back; meanwhile every chunk of step 3 is recorded `WRITTEN` in the
/// arena's descriptor (given back to the pool), before its recovery ended, and a save
/// stays in memory (the recovery takes the disk, as a disk save in flight would). Then the
/// recovery ends and commits step 3 byte-exact, and the next save goes to disk.
fn child_behind_gives_chunks_back() {
    use shmckpt::testing::staging::descriptor::{chunk_state, slot_state};
    use std::sync::atomic::Ordering;
    assert!(shmckpt::observe::install(&BlockStep3Sync));
    let root = env_path(ROOT_ENV);
    let auto = cadence_config(&root, DiskCadence::WhenIdle)
        .with_staging_capacity(1 << 20)
        .with_keep_in_memory(true);
    let e = Engine::open(auto).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !BLOCKED.load(Ordering::SeqCst) {
        assert!(
            std::time::Instant::now() < deadline,
            "the recovery behind the open never reached its fdatasync"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let att = shmckpt::testing::staging::AttachedArena::open(&kept_arena_name(&root)).unwrap();
    let step3: Vec<_> = (0..att.slot_count())
        .map(|s| att.slot(s))
        .filter(|v| v.step == 3 && v.state == slot_state::STAGED)
        .collect();
    assert_eq!(step3.len(), 1, "{step3:?}");
    assert!(
        step3[0].chunks.iter().all(|c| c.0 == chunk_state::WRITTEN),
        "step 3's chunks while its recovery waits for fdatasync: {:?}",
        step3[0].chunks
    );
    assert!(
        save_step(&e, 5).memory_only,
        "the disk is not idle while the recovery writes"
    );
    assert!(BLOCKED.load(Ordering::SeqCst), "still in its fdatasync");
    RELEASE.store(true, Ordering::SeqCst);
    let behind = e.wait_recovery();
    assert!(
        matches!(
            behind.as_slice(),
            [(3, shmckpt::recover::SlotOutcome::Committed { .. })]
        ),
        "{behind:?}"
    );
    assert_step_is_exact(&root, 3);
    assert_latest_from(&e, 5, LoadSource::Memory);
    assert!(!save_step(&e, 6).memory_only, "the disk is idle again");
    assert_eq!(committed(&root), [1, 3, 6]);
    std::hint::black_box(&e);
    sigkill_self();
}

/// Child: flash restore on, 64 MiB of staging: step 1 to disk, 2 and 3 memory-only (3
/// held), then death by SIGKILL while step 4 (48 MiB) is being staged (its descriptor slot
/// `STAGING`: a trainer that saves every step dies inside the next save most of the time).
fn child_keep_killed_while_staging() {
    use shmckpt::testing::staging::descriptor::slot_state;
    use shmckpt_bench::synthetic::LayoutEntry;
    let root = env_path(ROOT_ENV);
    let e = Engine::open(flash_config(&root, 10, 64 << 20)).unwrap();
    e.wait_staging_ready().unwrap();
    assert!(!save_step(&e, 1).memory_only);
    assert!(save_step(&e, 2).memory_only);
    assert!(save_step(&e, 3).memory_only);
    let big = State::new(
        vec![LayoutEntry {
            name: "big".into(),
            dtype: shmckpt::Dtype::U8,
            shape: vec![48 << 20],
        }],
        4,
    );
    let name = kept_arena_name(&root);
    std::thread::spawn(move || {
        let att = shmckpt::testing::staging::AttachedArena::open(&name).unwrap();
        loop {
            let staging = (0..att.slot_count()).any(|s| {
                let v = att.slot(s);
                v.step == 4 && v.state == slot_state::STAGING
            });
            if staging {
                sigkill_self();
            }
        }
    });
    for _ in 0..50 {
        let _ = e
            .save(4, &big.tensors(), &Metadata::new())
            .and_then(|h| h.wait());
        let _ = e.remove(4);
    }
    // Every attempt staged before the watcher saw it: the parent tries again.
    std::process::exit(3);
}

const ROLES: &[Role] = &[
    ("child_memory_only", child_memory_only),
    ("child_memory_steps", child_memory_steps),
    ("child_keep_memory_only", child_keep_memory_only),
    ("child_adopt_then_die", child_adopt_then_die),
    (
        "child_keep_disk_save_in_flight",
        child_keep_disk_save_in_flight,
    ),
    (
        "child_keep_killed_while_staging",
        child_keep_killed_while_staging,
    ),
    (
        "child_keep_newest_disk_save_in_flight",
        child_keep_newest_disk_save_in_flight,
    ),
    (
        "child_behind_gives_chunks_back",
        child_behind_gives_chunks_back,
    ),
];

/// Flash restore with a disk cadence, killed while the next save was being staged: that
/// save (`STAGING`, never returned) is refused as recovery refuses it, and the newest staged
/// one, memory-only step 3, is still held in memory by the next open, byte-exact.
#[test]
fn flash_restore_holds_the_newest_staged_step_when_killed_inside_the_next_save() {
    if run_role(ROLES) {
        return;
    }
    let dir = real_dir("cadence-keep-staging");
    let root = dir.path();
    let _kept = ShmGuard(kept_arena_name(root));
    let killed = (0..5).any(|_| {
        use std::os::unix::process::ExitStatusExt;
        let out = child_command("child_keep_killed_while_staging")
            .env(ROOT_ENV, root)
            .env(SHM_ENV, "unused")
            .output()
            .unwrap();
        out.status.signal() == Some(9)
    });
    assert!(killed, "no child was killed while staging step 4");
    let e = Engine::open(flash_config(root, 10, 64 << 20)).unwrap();
    let outcomes: Vec<(u64, bool)> = e
        .recovered()
        .iter()
        .flat_map(|r| r.slots.iter())
        .map(|s| {
            (
                s.step,
                matches!(s.outcome, shmckpt::recover::SlotOutcome::Adopted),
            )
        })
        .collect();
    assert_eq!(outcomes, [(3, true), (4, false)], "{:?}", e.recovered());
    assert_eq!(committed(root), [1], "nothing written at open");
    assert_latest_from(&e, 3, LoadSource::Memory);
    e.close();
    assert_eq!(committed(root), [1, 3]);
    assert_step_is_exact(root, 3);
}

/// Flash restore with a disk cadence, a disk save in flight at the crash: the open holds
/// the newest (memory-only) step in memory and recovers the older disk save on a thread
/// behind it (the chunks written before the crash from the partial file, the rest from
/// the arena), which commits it byte-exact; `wait_recovery` reports it.
#[test]
fn flash_restore_recovers_an_older_disk_save_in_flight_behind_the_open() {
    if run_role(ROLES) {
        return;
    }
    let dir = real_dir("cadence-keep-behind");
    let root = dir.path();
    let _kept = ShmGuard(kept_arena_name(root));
    run_child("child_keep_disk_save_in_flight", root, "unused");
    assert_eq!(committed(root), [1]);
    let e = Engine::open(flash_config(root, 2, 1 << 20)).unwrap();
    assert_eq!(
        slot_outcomes(&e),
        [(3, "Behind".to_owned()), (4, "Adopted".to_owned())],
        "{:?}",
        e.recovered()
    );
    let behind = e.wait_recovery();
    assert_eq!(behind.len(), 1, "{behind:?}");
    match &behind[0] {
        (
            3,
            shmckpt::recover::SlotOutcome::Committed {
                from_staging,
                from_file,
                ..
            },
        ) => assert!(
            *from_staging >= 1 && from_file + from_staging == 4,
            "4 chunks, the last from the arena: {from_file} from the file, {from_staging} from the arena"
        ),
        other => panic!("step 3: {other:?}"),
    }
    assert!(e.wait_recovery().is_empty(), "reported once");
    assert_eq!(committed(root), [1, 3]);
    assert_step_is_exact(root, 3);
    assert_eq!(
        tiers(&e),
        [
            (1, false, true, false),
            (3, false, true, false),
            (4, true, false, false)
        ]
    );
    assert_latest_from(&e, 4, LoadSource::Memory);
    e.close();
    assert_eq!(committed(root), [1, 3, 4]);
    assert_step_is_exact(root, 4);
}

/// The chunks of step 3 of `root` that the dead engine's kept arena records `WRITTEN`.
fn written_chunks(root: &Path, step: u64) -> usize {
    use shmckpt::testing::staging::descriptor::chunk_state;
    let att = shmckpt::testing::staging::AttachedArena::open(&kept_arena_name(root)).unwrap();
    (0..att.slot_count())
        .map(|s| att.slot(s))
        .filter(|v| v.step == step)
        .map(|v| {
            v.chunks
                .iter()
                .filter(|c| c.0 == chunk_state::WRITTEN)
                .count()
        })
        .sum()
}

/// Overwrite the arena chunks of `root`'s kept arena that step `step` records `WRITTEN`
/// with 0xEE, as a later save reusing them would.
fn scribble_written_chunks(root: &Path, step: u64) {
    use shmckpt::testing::staging::descriptor::chunk_state;
    use std::os::unix::fs::FileExt;
    let name = kept_arena_name(root);
    let att = shmckpt::testing::staging::AttachedArena::open(&name).unwrap();
    let geo = att.header().geometry;
    let seg = std::fs::OpenOptions::new()
        .write(true)
        .open(Path::new("/dev/shm").join(&name))
        .unwrap();
    let junk = vec![0xEE; geo.chunk_size as usize];
    for v in (0..att.slot_count())
        .map(|s| att.slot(s))
        .filter(|v| v.step == step)
    {
        for &(_, index) in v.chunks.iter().filter(|c| c.0 == chunk_state::WRITTEN) {
            let at = geo.data_offset + u64::from(index) * geo.chunk_size;
            seg.write_all_at(&junk, at).unwrap();
        }
    }
}

/// Flash restore with a disk cadence, killed while the newest save, a disk save, drained:
/// the open reads the chunks already written back from its partial file into the arena and
/// holds the step in memory (nothing written before the open returns), byte-exact, and
/// recovers the older memory-only step behind the open.
#[test]
fn flash_restore_holds_a_disk_save_killed_while_draining_in_memory() {
    if run_role(ROLES) {
        return;
    }
    let (dir, _kept) = killed_with_step_3_partly_written("cadence-keep-restage");
    let root = dir.path();
    assert_eq!(committed(root), [1]);
    let written = written_chunks(root, 3);
    assert!((1..4).contains(&written), "{written} of 4 chunks written");
    // The arena chunks those were written from may hold other bytes by now (a chunk goes
    // back to the pool once written): here, all of them.
    scribble_written_chunks(root, 3);
    let e = Engine::open(flash_config(root, 2, 1 << 20)).unwrap();
    assert_eq!(
        slot_outcomes(&e),
        [(2, "Behind".to_owned()), (3, "Adopted".to_owned())],
        "{:?}",
        e.recovered()
    );
    assert_eq!(e.recovered_steps(), [3]);
    assert_eq!(committed(root), [1], "nothing written at open");
    assert_latest_from(&e, 3, LoadSource::Memory);
    let behind = e.wait_recovery();
    assert!(
        matches!(
            behind.as_slice(),
            [(
                2,
                shmckpt::recover::SlotOutcome::Committed {
                    from_staging: 4,
                    from_file: 0,
                    ..
                }
            )]
        ),
        "{behind:?}"
    );
    assert_eq!(committed(root), [1, 2]);
    assert_step_is_exact(root, 2);
    assert_latest_from(&e, 3, LoadSource::Memory);
    e.close();
    assert_eq!(committed(root), [1, 2, 3]);
    assert_step_is_exact(root, 3);
}

/// The rank file in `root`'s partial directory of step 3.
fn partial_file_of_step_3(root: &Path) -> std::path::PathBuf {
    std::fs::read_dir(root.join("step-3.partial"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .unwrap()
}

/// Open after `child_keep_newest_disk_save_in_flight` died, with `spoil` applied to step 3's
/// partial file first: step 3 is never held (its outcome must match `step_3`), the older
/// memory-only step 2 is recovered at once, and `latest` is step 2, byte-exact, from disk
/// (the slot left in the arena for `shmckpt recover` keeps the arena from being taken over).
fn open_with_partial_file_spoiled(
    tag: &str,
    spoil: impl FnOnce(&Path),
    step_3: fn(&shmckpt::recover::SlotOutcome) -> bool,
) {
    let (dir, _kept) = killed_with_step_3_partly_written(tag);
    let root = dir.path();
    assert!(written_chunks(root, 3) >= 1);
    spoil(&partial_file_of_step_3(root));
    let e = Engine::open(flash_config(root, 2, 1 << 20)).unwrap();
    let outcomes: Vec<(u64, bool)> = e
        .recovered()
        .iter()
        .flat_map(|r| r.slots.iter())
        .map(|s| {
            let ok = match s.step {
                2 => matches!(s.outcome, shmckpt::recover::SlotOutcome::Committed { .. }),
                _ => step_3(&s.outcome),
            };
            (s.step, ok)
        })
        .collect();
    assert_eq!(outcomes, [(2, true), (3, true)], "{:?}", e.recovered());
    assert_eq!(e.recovered_steps(), [2]);
    assert_eq!(committed(root), [1, 2]);
    assert_latest_from(&e, 2, LoadSource::Disk);
    e.close();
    assert_step_is_exact(root, 2);
}

/// The same crash, with the partial file of the disk save in flight cut short before the
/// open: nothing is read back from it (the chunks it lacks are nowhere), and the step is
/// refused as recovery refuses it.
#[test]
fn a_disk_save_whose_written_chunks_are_gone_is_never_held() {
    if run_role(ROLES) {
        return;
    }
    open_with_partial_file_spoiled(
        "cadence-keep-restage-short",
        |file| {
            std::fs::OpenOptions::new()
                .write(true)
                .open(file)
                .unwrap()
                .set_len(4096)
                .unwrap();
        },
        |o| matches!(o, shmckpt::recover::SlotOutcome::Refused { .. }),
    );
}

/// The same crash, with the partial file replaced by a link to a copy of it: the link is
/// never followed (nothing is read back through it, nothing written through it), and the
/// step's recovery fails as recovery fails on a link (the arena kept for a retry).
#[test]
fn a_link_in_place_of_the_partial_file_is_never_read_back() {
    if run_role(ROLES) {
        return;
    }
    open_with_partial_file_spoiled(
        "cadence-keep-restage-link",
        |file| {
            let copy = file.with_extension("copy");
            std::fs::copy(file, &copy).unwrap();
            std::fs::remove_file(file).unwrap();
            std::os::unix::fs::symlink(&copy, file).unwrap();
        },
        |o| {
            matches!(
                o,
                shmckpt::recover::SlotOutcome::Failed {
                    error: Error::UnsafePath { .. }
                }
            )
        },
    );
}

/// The recovery behind the open gives each chunk back once it is on the device, as a
/// drain does, not at its end: a restart's first saves get the room at the disk's pace;
/// and `disk_every="auto"` keeps saves in memory while it writes.
#[test]
fn the_recovery_behind_the_open_gives_chunks_back_as_it_writes_them() {
    if run_role(ROLES) {
        return;
    }
    let dir = real_dir("cadence-keep-behind-gives");
    let root = dir.path();
    let _kept = ShmGuard(kept_arena_name(root));
    run_child("child_keep_disk_save_in_flight", root, "unused");
    run_child("child_behind_gives_chunks_back", root, "unused");
    assert_eq!(committed(root), [1, 3, 6]);
    assert_step_is_exact(root, 3);
    assert_step_is_exact(root, 6);
}

/// Flash restore with a disk cadence, of the same layout: the open takes the dead engine's
/// kept arena over with its memory-only step in place and holds it as its own memory-only
/// step (nothing written before the open returns), served from memory byte-exact; a
/// SIGKILL right after that open leaves it staged for the next one, which takes it over
/// again; `close` writes it to disk.
#[test]
fn flash_restore_holds_the_memory_only_step_of_a_sigkilled_engine_in_memory() {
    if run_role(ROLES) {
        return;
    }
    let dir = real_dir("cadence-keep-kill");
    let root = dir.path();
    let kept = ShmGuard(kept_arena_name(root));
    run_child("child_keep_memory_only", root, "unused");
    assert_eq!(
        committed(root),
        [1],
        "nothing wrote step 3 before the crash"
    );
    assert!(shm_exists(&kept.0), "the kept arena survives the crash");
    // Killed again right after an open that took step 3 over.
    run_child("child_adopt_then_die", root, "unused");
    let open = || Engine::open(flash_config(root, 10, 1 << 20)).unwrap();
    let e = open();
    assert_eq!(e.recovered_steps(), [3]);
    let t = e.open_timings();
    assert!(
        t.recovery > std::time::Duration::ZERO
            && t.recovery + t.clean + t.arena + t.writers <= t.total,
        "the open's phases are parts of it, recovery among them: {t:?}"
    );
    assert_eq!(committed(root), [1], "step 3 stays in memory");
    assert_eq!(
        tiers(&e),
        [(1, false, true, false), (3, true, false, false)]
    );
    assert_latest_from(&e, 3, LoadSource::Memory);
    let (ck, report) = load_with_report(&e, StepSel::Step(1)).unwrap();
    assert_eq!((report.step, report.source), (1, LoadSource::Disk));
    assert_loaded_equal(&ck, &step_state(1));
    e.close();
    assert_eq!(committed(root), [1, 3], "close wrote the held step");
    assert_step_is_exact(root, 3);
    // The next engine serves step 3 from the kept arena (the committed image now).
    let e = open();
    assert!(e.recovered_steps().is_empty());
    assert_latest_from(&e, 3, LoadSource::Memory);
    // The next save goes to disk (the first of an engine) and supersedes it.
    let r4 = save_step(&e, 4);
    assert!(!r4.memory_only, "{r4:?}");
    e.close();
    assert_eq!(committed(root), [1, 3, 4]);
    assert_step_is_exact(root, 4);
}

/// Flash restore with a disk cadence, an engine of another layout (a larger arena): the
/// dead engine's arena cannot be taken over in place, so recovery at open commits its
/// memory-only step and keeps it as the kept arena's image, which the new engine copies
/// into its own arena (checked against the manifest recovery wrote), byte-exact.
#[test]
fn flash_restore_of_another_layout_commits_the_memory_only_step_and_serves_it() {
    if run_role(ROLES) {
        return;
    }
    let dir = real_dir("cadence-keep-kill-layout");
    let root = dir.path();
    let _kept = ShmGuard(kept_arena_name(root));
    run_child("child_keep_memory_only", root, "unused");
    assert_eq!(committed(root), [1]);
    let e = Engine::open(flash_config(root, 10, 2 << 20)).unwrap();
    assert_eq!(e.recovered_steps(), [3]);
    assert_eq!(committed(root), [1, 3], "recovery made step 3 durable");
    assert_latest_from(&e, 3, LoadSource::Memory);
    e.close();
    assert_step_is_exact(root, 3);
}

/// Flash restore with a disk cadence, clean exit: `close` writes the held memory-only step
/// to disk and keeps it as the arena's image; the next engine serves it from memory.
#[test]
fn close_keeps_the_memory_only_step_it_writes_for_flash_restore() {
    let dir = real_dir("cadence-keep-close");
    let root = dir.path();
    let _kept = ShmGuard(kept_arena_name(root));
    let config = || flash_config(root, 10, 1 << 20);
    let e = Engine::open(config()).unwrap();
    assert!(!save_step(&e, 1).memory_only);
    assert!(save_step(&e, 2).memory_only);
    e.close();
    assert_eq!(committed(root), [1, 2]);
    let e = Engine::open(config()).unwrap();
    assert!(e.recovered_steps().is_empty());
    assert_latest_from(&e, 2, LoadSource::Memory);
    e.close();
}

/// With recovery at open off, a kept arena holding a staged memory-only step is left as it
/// is (taking it over would wipe its descriptor): the engine keeps nothing, serves the
/// disk, and `recover_root` commits the step afterwards, byte-exact.
#[test]
fn recovery_off_leaves_the_kept_arena_and_its_staged_step_for_recover() {
    if run_role(ROLES) {
        return;
    }
    let dir = real_dir("cadence-keep-norecover");
    let root = dir.path();
    let kept = ShmGuard(kept_arena_name(root));
    run_child("child_keep_memory_only", root, "unused");
    let e = Engine::open(flash_config(root, 10, 1 << 20).with_recover_on_open(false)).unwrap();
    assert!(e.recovered_steps().is_empty());
    assert_latest_from(&e, 1, LoadSource::Disk);
    e.close();
    assert!(shm_exists(&kept.0), "the kept arena is left for recovery");
    let report = shmckpt::recover::recover_arena(&kept.0, None).unwrap();
    assert_eq!(report.committed_steps(), [3]);
    assert_eq!(committed(root), [1, 3]);
    assert_step_is_exact(root, 3);
}

#[test]
fn a_memory_only_step_is_recovered_after_sigkill() {
    if run_role(ROLES) {
        return;
    }
    let dir = real_dir("cadence-kill");
    let root = dir.path();
    let shm = test_shm_name("cadence");
    let _g = ShmGuard(shm.clone());
    run_child("child_memory_only", root, &shm);
    assert_eq!(
        committed(root),
        [1],
        "nothing wrote step 2 before the crash"
    );
    assert!(shm_exists(&shm), "the arena survives the crash");
    // The next open recovers step 2 from the dead engine's arena and commits it.
    let e = Engine::open(cadence_config(root, DiskCadence::Every(2))).unwrap();
    assert_eq!(e.recovered_steps(), [2]);
    assert!(!shm_exists(&shm), "recovery removes the arena");
    assert_latest_from(&e, 2, LoadSource::Disk);
    e.close();
    assert_eq!(committed(root), [1, 2]);
    assert_step_is_exact(root, 2);
}

/// Every held memory-only step is recovered after a SIGKILL (each keeps its descriptor
/// slot), not only the newest; the one given up before the crash is not.
#[test]
fn every_held_memory_only_step_is_recovered_after_sigkill() {
    if run_role(ROLES) {
        return;
    }
    let dir = real_dir("cadence-kill-steps");
    let root = dir.path();
    let shm = test_shm_name("cadence-steps");
    let _g = ShmGuard(shm.clone());
    run_child("child_memory_steps", root, &shm);
    assert_eq!(
        committed(root),
        [1],
        "nothing wrote steps 3, 4 before the crash"
    );
    let e = Engine::open(cadence_config(root, DiskCadence::Every(10))).unwrap();
    assert_eq!(e.recovered_steps(), [3, 4]);
    assert!(!shm_exists(&shm), "recovery removes the arena");
    assert_latest_from(&e, 4, LoadSource::Disk);
    e.close();
    assert_eq!(committed(root), [1, 3, 4]);
    for s in [1, 3, 4] {
        assert_step_is_exact(root, s);
    }
}

/// A held memory-only step as a replica source (`Outgoing::memory_step`): its bytes copied
/// out of staging and its checksums computed then are exactly the file and the manifest
/// entry the writers make when the step goes to disk; a peer's replica arena takes them
/// (`Incoming::replica_of_memory_step`) and refuses them with one byte changed; once the
/// step is given up (written to disk here), it is no source any more (nothing copied).
#[test]
fn a_memory_only_step_is_a_replica_source_with_the_checksums_of_its_disk_copy() {
    use shmckpt::replica::{self, Incoming, IncomingState, Outgoing};
    let dir = real_dir("cadence-replica-source");
    let root = dir.path();
    let e = Engine::open(cadence_config(root, DiskCadence::Every(2))).unwrap();
    assert!(!save_step(&e, 1).memory_only);
    assert!(save_step(&e, 2).memory_only);

    let out = Outgoing::memory_step(&e, 2).unwrap();
    // SAFETY: the source's memory, `len()` bytes, read-only from here, alive below.
    #[allow(unsafe_code)]
    let bytes = unsafe { std::slice::from_raw_parts(out.as_ptr(), out.len()) }.to_vec();
    let entry = out.entry().expect("a memory-only step's entry").clone();
    assert_eq!(entry.bytes, bytes.len() as u64);
    assert_eq!(out.read(), out.len(), "copied whole");

    // A peer stores it, checked against that entry.
    let receive = |image: &[u8]| {
        let mut inc = Incoming::replica_of_memory_step(root, 2, 0, entry.clone(), None).unwrap();
        assert_eq!(inc.len(), image.len());
        // SAFETY: the arena is `len()` bytes, writable while open.
        #[allow(unsafe_code)]
        unsafe {
            std::ptr::copy_nonoverlapping(image.as_ptr(), inc.as_mut_ptr(), image.len())
        };
        let r = inc.seal();
        (r, inc.state())
    };
    let mut bad = bytes.clone();
    let last = bad.len() - 1;
    bad[last] ^= 0x40;
    let (r, state) = receive(&bad);
    assert!(matches!(r, Err(Error::Checksum { .. })), "{r:?}");
    assert_eq!(state, IncomingState::Refused);
    let (r, state) = receive(&bytes);
    let stored = r.unwrap();
    assert_eq!(state, IncomingState::Sealed);
    assert_eq!(std::fs::read(&stored).unwrap(), bytes);

    // Written to disk: the writers' file and checksums are the ones sent.
    let held_entry = e.memory_entry(2).unwrap();
    assert_eq!(e.persist_memory().unwrap().len(), 1);
    let m: shmckpt::manifest::Manifest =
        serde_json::from_slice(&std::fs::read(root.join("step-2").join("manifest.json")).unwrap())
            .unwrap();
    assert_eq!(m.files, std::slice::from_ref(&entry));
    assert!(entry.tensors.iter().any(|t| t.crc32c != 0));
    assert_eq!(
        std::fs::read(root.join("step-2").join(&entry.file)).unwrap(),
        bytes
    );
    // Committed now: the replica stored is served like any, checked against the manifest.
    assert_eq!(replica::load(root, 2, 0).unwrap().as_bytes(), &bytes[..]);

    // Given up (no longer held): nothing is copied.
    assert!(e.memory_entry(2).is_none());
    assert!(matches!(
        Outgoing::memory_step(&e, 2),
        Err(Error::NotFound { .. })
    ));
    let mut buf = vec![0u8; bytes.len()];
    assert!(matches!(
        e.copy_memory_image(2, &held_entry, &mut buf),
        Err(Error::NotFound { .. })
    ));
    assert!(buf.iter().all(|&b| b == 0));
    replica::remove(&replica::replica_name(root, 0, 2).unwrap()).unwrap();
    drop(out);
    e.close();
}

/// Issue 38: a memory-only step whose rank 1 was lost before any disk held it. Rank 1's
/// image went to a partner as a replica of the memory-only step, its sender's entry kept
/// beside it (`replica::memory_entry`); rank 0's part is in the step's partial directory.
/// A tampered entry, a tampered replica, a link, an entry of another rank or that is not
/// an entry are refused (nothing served); an image for the wrong file name or damaged is
/// never written; the good image is written as rank 1's file in the partial directory,
/// and its part completes the commit with the one protocol: step 2 committed with exactly
/// both ranks' entries and bytes. Then the replica is served only as a committed one.
#[test]
fn a_lost_ranks_memory_only_step_is_committed_from_its_replica_and_entry() {
    use shmckpt::replica::{self, Incoming, IncomingState, Outgoing};
    let dir = real_dir("cadence-pending");
    let root = dir.path();
    let shm = Path::new("/dev/shm");
    let e0 = Engine::open(cadence_config(root, DiskCadence::Every(2)).with_rank(0, 2)).unwrap();
    let e1 = Engine::open(cadence_config(root, DiskCadence::Every(2)).with_rank(1, 2)).unwrap();
    for e in [&e0, &e1] {
        assert!(!save_step(e, 1).memory_only);
    }
    for e in [&e0, &e1] {
        assert!(save_step(e, 2).memory_only);
    }
    assert_eq!(committed(root), [1]);

    // Rank 1's image and entry, as its partner stores them.
    let out = Outgoing::memory_step(&e1, 2).unwrap();
    // SAFETY: the source's memory, `len()` bytes, read-only from here, alive below.
    #[allow(unsafe_code)]
    let bytes = unsafe { std::slice::from_raw_parts(out.as_ptr(), out.len()) }.to_vec();
    let entry = out.entry().unwrap().clone();
    drop(out);
    let mut inc = Incoming::replica_of_memory_step(root, 2, 1, entry.clone(), None).unwrap();
    // SAFETY: the arena is `len()` bytes, writable while open.
    #[allow(unsafe_code)]
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), inc.as_mut_ptr(), bytes.len())
    };
    let stored = inc.seal().unwrap();
    drop(inc);
    let name = replica::replica_name(root, 1, 2).unwrap();
    let ename = replica::entry_name(&name);
    assert_eq!(replica::memory_entry(root, 2, 1).unwrap(), entry);
    assert!(
        replica::list().iter().all(|r| r.name != ename),
        "an entry is no replica"
    );

    // Rank 1 is lost (its step given up, never written); rank 0's goes to the partial
    // directory (as recovery from its arena writes it).
    e1.remove(2).unwrap();
    drop(e1);
    assert_eq!(e0.persist_memory().unwrap().len(), 1);
    assert_eq!(committed(root), [1]);
    let partial = root.join("step-2.partial");
    assert!(partial.join("rank-00000.manifest.json").is_file());
    assert!(!partial.join(&entry.file).exists());

    // A tampered entry (one CRC-32C changed) is refused: the replica does not match it.
    let good = std::fs::read(shm.join(&ename)).unwrap();
    let mut t = entry.clone();
    t.tensors[0].crc32c ^= 1;
    std::fs::write(shm.join(&ename), serde_json::to_vec(&t).unwrap()).unwrap();
    let r = Incoming::serve_memory(root, 2, 1);
    assert!(matches!(r, Err(Error::Checksum { .. })), "{r:?}");
    // Another rank's entry, or not an entry, or a link: refused before the image is read.
    let mut other = entry.clone();
    other.rank = 0;
    std::fs::write(shm.join(&ename), serde_json::to_vec(&other).unwrap()).unwrap();
    assert!(matches!(
        replica::memory_entry(root, 2, 1),
        Err(Error::Corrupt { .. })
    ));
    std::fs::write(shm.join(&ename), b"{\"rank\": 1, \"file\": ").unwrap();
    assert!(matches!(
        replica::memory_entry(root, 2, 1),
        Err(Error::Corrupt { .. })
    ));
    std::fs::remove_file(shm.join(&ename)).unwrap();
    assert!(
        Incoming::serve_memory(root, 2, 1).is_err(),
        "no entry, nothing served"
    );
    std::os::unix::fs::symlink(&stored, shm.join(&ename)).unwrap();
    assert!(matches!(
        replica::memory_entry(root, 2, 1),
        Err(Error::UnsafePath { .. })
    ));
    std::fs::remove_file(shm.join(&ename)).unwrap();
    std::fs::write(shm.join(&ename), &good).unwrap();
    // A tampered replica (one data byte flipped) is refused.
    let mut bad = bytes.clone();
    let last = bad.len() - 1;
    bad[last] ^= 0x10;
    std::fs::write(&stored, &bad).unwrap();
    let r = Incoming::serve_memory(root, 2, 1);
    assert!(matches!(r, Err(Error::Checksum { .. })), "{r:?}");
    std::fs::write(&stored, &bytes).unwrap();

    let served = Incoming::serve_memory(root, 2, 1).unwrap();
    assert_eq!(served.entry(), &entry);
    drop(served);
    let receive = |image: &[u8], entry: &shmckpt::manifest::FileEntry| {
        let mut inc = Incoming::restore_pending(root, 2, 1, 2, entry.clone())?;
        // SAFETY: the memory is `len()` bytes, writable while open.
        #[allow(unsafe_code)]
        unsafe {
            std::ptr::copy_nonoverlapping(image.as_ptr(), inc.as_mut_ptr(), image.len())
        };
        inc.seal().map(|_| inc)
    };
    // An entry naming rank 0's file is refused before anything is received.
    let mut renamed = entry.clone();
    renamed.file = "rank-00000-of-00002.safetensors".into();
    assert!(matches!(
        receive(&bytes, &renamed),
        Err(Error::Corrupt { .. })
    ));
    // A damaged image is never written.
    assert!(matches!(receive(&bad, &entry), Err(Error::Checksum { .. })));
    assert!(!partial.join(&entry.file).exists());
    assert_eq!(committed(root), [1]);

    let inc = receive(&bytes, &entry).unwrap();
    assert_eq!(inc.state(), IncomingState::Sealed);
    assert_eq!(std::fs::read(partial.join(&entry.file)).unwrap(), bytes);
    assert_eq!(committed(root), [1], "no part yet: not committed");
    let dir2 = inc.commit_pending().unwrap().expect("every part is there");
    assert_eq!(dir2, root.join("step-2"));
    assert_eq!(committed(root), [1, 2]);
    let m: shmckpt::manifest::Manifest =
        serde_json::from_slice(&std::fs::read(dir2.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(m.files[1], entry);
    assert_eq!(m.files[0].rank, 0);
    assert_eq!(std::fs::read(dir2.join(&entry.file)).unwrap(), bytes);
    drop(inc);
    // Committed: served as any replica, against the manifest; not as a pending one.
    assert!(matches!(
        Incoming::serve_memory(root, 2, 1),
        Err(Error::StepExists { .. })
    ));
    assert_eq!(replica::load(root, 2, 1).unwrap().as_bytes(), &bytes[..]);
    let e1 = Engine::open(cadence_config(root, DiskCadence::Every(2)).with_rank(1, 2)).unwrap();
    let (ck, report) = load_with_report(&e1, StepSel::Latest).unwrap();
    assert_eq!((report.step, report.source), (2, LoadSource::Disk));
    assert_loaded_equal(&ck, &step_state(2));
    // Removing the replica removes its entry.
    replica::remove(&name).unwrap();
    assert!(!shm.join(&ename).exists());
    e1.close();
    e0.close();
}
