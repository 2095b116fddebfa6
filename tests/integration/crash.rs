//! Power loss (docs/crash.md): record every filesystem operation of real saves (1 and 4
//! ranks, with retention, and a recovery), generate the states a power loss at any point
//! could leave (`shmckpt_crashsim::states`), materialize each one and run what a
//! restarted trainer runs: `Engine::open` with recovery, `load(latest)`, `verify`, `gc`.
//!
//! Invariants checked in every state:
//! - every listed step is one that was saved, and loads and verifies with exactly its
//!   bytes, on every rank (nothing else is ever served; recovery never publishes a torn
//!   step);
//! - `latest` is the newest listed step, and loads with exactly its bytes;
//! - every step reported committed before the crash point is listed, unless retention had
//!   already retired it; `latest` is at least the newest reported step;
//! - opening the engine leaves no trash directory, and no partial directory but those
//!   the partial-part rule keeps (a durable part of a step newer than every committed
//!   one), which `gc` removes;
//! - `gc` keeps exactly the newest `KEEP` listed steps (never a valid step newer than the
//!   ones it retains), and they still verify;
//! - (one rank) the trainer's next save commits on top, and is `latest` with its bytes.
//!
//! The number of random states per crash point is `SHMCKPT_CRASH_RANDOM` (default
//! below); the seed is `SHMCKPT_CRASH_SEED` (default fixed), printed with every failure.
//!
//! Sampled by default (the four-rank run's 7,000-odd distinct states took 150 s of the
//! test suite's time on the 2-core CI machine): of the distinct states a run generates,
//! every `Durable` and `Everything` one (two per crash point) is checked, and of the
//! `Random` ones a sample of `SHMCKPT_CRASH_SAMPLE` (default below) drawn with the seed;
//! each run prints how many it checked of how many, and the seed.
//! `SHMCKPT_CRASH_FULL=1` checks every distinct state (docs/crash.md, section 3).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use shmckpt::restore::{self, ReadOptions};
use shmckpt::testing::staging::{Arena, ArenaSpec};
use shmckpt::{BackendKind, Dtype, Engine, EngineConfig, Metadata, StepSel};
use shmckpt_bench::synthetic::LayoutEntry;
use shmckpt_crashsim::states::{self, Variant};
use shmckpt_crashsim::{Log, Op, record::Recording};

use crate::common::{BACKENDS, State, real_dir};

/// Steps whose committed directory retention had renamed to its trash name before
/// `point` of `log` (they may be gone, or still there if the rename was not durable).
pub(crate) fn retired_before(log: &Log, point: usize) -> BTreeSet<u64> {
    log.ops[..point]
        .iter()
        .filter_map(|o| match o {
            Op::Rename { from, to, .. } => {
                let s = shmckpt::manifest::parse_step_dir(from)?;
                (shmckpt::manifest::parse_step_with_suffix(to, ".trash") == Some(s)).then_some(s)
            }
            _ => None,
        })
        .collect()
}

/// Chunk size of every engine here.
const CHUNK: u64 = 64 << 10;
/// Retention of every engine here.
const KEEP: usize = 2;
/// Random states per crash point (besides the durable-only and everything states).
const RANDOM_PER_POINT: usize = 160;
const SEED: u64 = 0x00c0_ffee_2026_1201;

fn random_per_point() -> usize {
    std::env::var("SHMCKPT_CRASH_RANDOM")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(RANDOM_PER_POINT)
}

/// Distinct `Random` states checked per recorded run in the default (sampled) run.
const SAMPLE: usize = 300;

/// `None` with `SHMCKPT_CRASH_FULL=1` (check every distinct state), else how many of the
/// distinct `Random` states to check (`SHMCKPT_CRASH_SAMPLE`, default `SAMPLE`).
fn sample_size() -> Option<usize> {
    if std::env::var("SHMCKPT_CRASH_FULL").is_ok_and(|v| v == "1") {
        return None;
    }
    Some(
        std::env::var("SHMCKPT_CRASH_SAMPLE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(SAMPLE),
    )
}

fn seed() -> u64 {
    std::env::var("SHMCKPT_CRASH_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(SEED)
}

/// ~70 KiB per rank: two 64 KiB chunks (the second partial), 18 file blocks to tear.
fn layout(rank: u32) -> Vec<LayoutEntry> {
    vec![
        LayoutEntry {
            name: "w".into(),
            dtype: Dtype::F32,
            shape: vec![64, 257 + rank as usize],
        },
        LayoutEntry {
            name: "b".into(),
            dtype: Dtype::BF16,
            shape: vec![333],
        },
        LayoutEntry {
            name: "step".into(),
            dtype: Dtype::I64,
            shape: vec![1],
        },
    ]
}

/// What `rank` saves as `step`: different for every step and rank (made once: the checker
/// compares with it thousands of times).
pub(crate) fn state(step: u64, rank: u32) -> Arc<State> {
    static MADE: Mutex<BTreeMap<(u64, u32), Arc<State>>> = Mutex::new(BTreeMap::new());
    let mut made = MADE.lock().unwrap_or_else(|e| e.into_inner());
    Arc::clone(
        made.entry((step, rank))
            .or_insert_with(|| Arc::new(State::new(layout(rank), step * 1000 + u64::from(rank)))),
    )
}

fn config(root: &Path, rank: u32, world: u32, backend: BackendKind) -> EngineConfig {
    EngineConfig::new(root)
        .with_backend(backend)
        .with_staging_capacity(1 << 20)
        .with_chunk_size(CHUNK)
        .with_queue_depth(4)
        .with_writer_threads(2)
        .with_rank(rank, world)
        .with_keep_last(Some(KEEP))
        .with_recover_on_open(true)
}

/// Saves of steps `steps` by `world` ranks (one engine each, saving in parallel), under a
/// recording of the root.
pub(crate) fn record_saves(root: &Path, world: u32, backend: BackendKind, steps: &[u64]) -> Log {
    let rec = Recording::start(root).unwrap();
    let engines: Vec<Engine> = (0..world)
        .map(|r| Engine::open(config(root, r, world, backend)).unwrap())
        .collect();
    for &step in steps {
        std::thread::scope(|s| {
            for (r, e) in engines.iter().enumerate() {
                s.spawn(move || {
                    let st = state(step, r as u32);
                    e.save(step, &st.tensors(), &Metadata::new())
                        .unwrap()
                        .wait()
                        .unwrap_or_else(|e| panic!("step {step} rank {r}: {e}"));
                });
            }
        });
    }
    drop(engines);
    rec.finish()
}

/// Compare a loaded rank file with what `rank` saved as `step`.
pub(crate) fn same(ck: &shmckpt::Checkpoint, step: u64, rank: u32) -> Result<(), String> {
    let want = state(step, rank);
    if ck.tensors.len() != want.layout.len() {
        return Err(format!(
            "step {step} rank {rank}: {} tensors, saved {}",
            ck.tensors.len(),
            want.layout.len()
        ));
    }
    for (e, d) in want.layout.iter().zip(&want.data) {
        let t = ck
            .get(&e.name)
            .ok_or_else(|| format!("step {step} rank {rank}: tensor {} missing", e.name))?;
        if t.dtype != e.dtype || t.shape != e.shape || t.data.as_bytes() != &d[..] {
            return Err(format!(
                "step {step} rank {rank}: tensor {} differs from what was saved",
                e.name
            ));
        }
    }
    Ok(())
}

/// Reads of the checker: buffered `pread` (the bytes are those of the page cache, which is
/// what the materialized state holds; O_DIRECT and io_uring set-up would only slow the
/// thousands of checks down), through one small arena per thread (a private one per read
/// would be 32 MiB made, prefaulted and removed per file).
fn read_options() -> ReadOptions {
    thread_local! {
        static ARENA: Arc<Arena> = Arena::create(&ArenaSpec {
            name: None,
            capacity: 8 * CHUNK,
            chunk_size: CHUNK,
            slots: 1,
            rank: 0,
            world_size: 1,
            root: PathBuf::new(),
        })
        .unwrap();
    }
    ReadOptions {
        backend: BackendKind::Pwrite,
        queue_depth: 2,
        direct_io: false,
        arena: Some(ARENA.with(Arc::clone)),
        any_dir_name: false,
    }
}

/// Every rank of `dir` verifies and holds exactly what was saved as `step`.
pub(crate) fn step_exact(dir: &Path, step: u64, world: u32) -> Result<(), String> {
    let opts = read_options();
    restore::verify_dir(dir, &opts).map_err(|e| format!("verify step {step}: {e}"))?;
    for rank in 0..world {
        let ck = restore::load_owned(dir, rank, &opts)
            .map_err(|e| format!("load step {step} rank {rank}: {e}"))?;
        same(&ck, step, rank)?;
    }
    Ok(())
}

pub(crate) fn listed(root: &Path) -> Result<Vec<u64>, String> {
    shmckpt::manifest::list_committed(root)
        .map(|v| v.into_iter().map(|c| c.step).collect())
        .map_err(|e| format!("list: {e}"))
}

/// Run a restarted trainer on the materialized state `root` and check the invariants.
pub(crate) fn check_state(
    root: &Path,
    world: u32,
    saved: &BTreeSet<u64>,
    reported: &BTreeSet<u64>,
    retired: &BTreeSet<u64>,
) -> Result<(), String> {
    let cfg = config(root, 0, world, BackendKind::Pwrite)
        .with_direct_io(false)
        .with_writer_threads(1);
    let engine = Engine::open(cfg.clone()).map_err(|e| format!("Engine::open: {e}"))?;
    let steps = listed(root)?;
    for &s in &steps {
        if !saved.contains(&s) {
            return Err(format!("step {s} is listed but was never saved"));
        }
        step_exact(&root.join(format!("step-{s}")), s, world)?;
    }
    let latest = engine.latest().map_err(|e| format!("latest: {e}"))?;
    if latest != steps.last().copied() {
        return Err(format!("latest is {latest:?}, listed {steps:?}"));
    }
    for r in reported.difference(retired) {
        if !steps.contains(r) {
            return Err(format!(
                "step {r} was reported committed and is gone (listed {steps:?})"
            ));
        }
    }
    if let Some(&newest) = reported.last()
        && latest.is_none_or(|l| l < newest)
    {
        return Err(format!(
            "latest is {latest:?}, older than step {newest} reported committed"
        ));
    }
    // The partial-part rule: a partial directory left by the open holds a durable part
    // (`manifest.json` or a rank's `rank-K.manifest.json`) of a step newer than every
    // committed one; nothing else is left.
    let leftovers: Vec<String> = std::fs::read_dir(root)
        .map_err(|e| e.to_string())?
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_owned))
        .filter(|n| {
            if n.ends_with(".trash") {
                return true;
            }
            let Some(step) = shmckpt::manifest::parse_step_with_suffix(n, ".partial") else {
                return n.ends_with(".partial");
            };
            let durable = std::fs::read_dir(root.join(n)).is_ok_and(|rd| {
                rd.flatten().any(|e| {
                    let f = e.file_name().to_string_lossy().into_owned();
                    f == "manifest.json"
                        || (f.starts_with("rank-") && f.ends_with(".manifest.json"))
                })
            });
            !durable || latest.is_some_and(|l| l >= step)
        })
        .collect();
    if !leftovers.is_empty() {
        return Err(format!("after open: leftovers {leftovers:?}"));
    }
    // The load, a resume: rank 0's parts of the uncommitted newer steps are withdrawn
    // (another rank's new save must never merge with them).
    if let Some(l) = latest {
        let ck = engine
            .load(StepSel::Latest)
            .map_err(|e| format!("load(latest = {l}): {e}"))?;
        same(&ck, l, 0)?;
    }
    let part0 = shmckpt::manifest::rank_manifest_name(0);
    for e in std::fs::read_dir(root)
        .map_err(|e| e.to_string())?
        .flatten()
    {
        let n = e.file_name().to_string_lossy().into_owned();
        if let Some(step) = shmckpt::manifest::parse_step_with_suffix(&n, ".partial")
            && latest.is_some_and(|l| step > l)
            && root.join(&n).join(&part0).exists()
        {
            return Err(format!(
                "after the load of {latest:?}: rank 0's part of step {step} is left"
            ));
        }
    }
    drop(engine);
    // gc, as `shmckpt gc --keep KEEP` runs it: it removes the partial directories too.
    // gc cleans nothing while another engine holds a rank lock of the root; the engine
    // above has dropped its lock, but a child process that another test is spawning at
    // that moment may still hold a copy of the descriptor until its exec closes it (CI saw
    // two consecutive states left uncleaned), so a sweep that removed nothing is retried
    // for up to 2 s before the leftover counts.
    let leftover = || -> Result<Option<String>, String> {
        Ok(std::fs::read_dir(root)
            .map_err(|e| e.to_string())?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .find(|n| n.ends_with(".partial")))
    };
    for attempt in 0..100 {
        shmckpt::commit::clean_stale_with(root, u32::MAX, shmckpt::commit::Sweep::Gc)
            .map_err(|e| format!("gc clean: {e}"))?;
        match leftover()? {
            None => break,
            Some(p) if attempt == 99 => return Err(format!("after gc: leftover {p}")),
            Some(_) => std::thread::sleep(std::time::Duration::from_millis(20)),
        }
    }
    shmckpt::commit::apply_retention(root, KEEP).map_err(|e| format!("gc retention: {e}"))?;
    let after = listed(root)?;
    let want: Vec<u64> = steps[steps.len().saturating_sub(KEEP)..].to_vec();
    if after != want {
        return Err(format!("gc left {after:?} of {steps:?}, expected {want:?}"));
    }
    for &s in &after {
        step_exact(&root.join(format!("step-{s}")), s, world)?;
    }
    if world == 1 {
        // The trainer goes on: its next save commits on top of what the crash left.
        let next = saved.last().map_or(1, |s| s + 1);
        let engine = Engine::open(cfg).map_err(|e| format!("second Engine::open: {e}"))?;
        let st = state(next, 0);
        engine
            .save(next, &st.tensors(), &Metadata::new())
            .and_then(|h| h.wait())
            .map_err(|e| format!("save of step {next} after the crash: {e}"))?;
        let now = listed(root)?;
        let mut want = after.clone();
        want.push(next);
        let want = want[want.len().saturating_sub(KEEP)..].to_vec();
        if now != want {
            return Err(format!(
                "after saving step {next}: listed {now:?}, expected {want:?}"
            ));
        }
        let ck = engine
            .load(StepSel::Latest)
            .map_err(|e| format!("load(latest) after saving step {next}: {e}"))?;
        if ck.step != next {
            return Err(format!("latest is {} after saving step {next}", ck.step));
        }
        same(&ck, next, 0)?;
    }
    Ok(())
}

/// What one run of the checker covered.
#[derive(Debug, Default)]
struct Tally {
    generated: usize,
    /// Distinct states (the others are built the same way as one of these).
    distinct: usize,
    /// Distinct `Random` states, and how many of them were checked.
    distinct_random: usize,
    checked_random: usize,
    checked: usize,
    violations: Vec<String>,
}

/// The indices into `plan` to check: of the distinct states (`distinct`, indices in plan
/// order), every non-`Random` one, and of the `Random` ones all (`sample` is `None`) or
/// `sample` of them drawn with `seed` (partial Fisher-Yates); in plan order.
fn choose(
    plan: &[(usize, Variant)],
    distinct: &[usize],
    sample: Option<usize>,
    seed: u64,
) -> Vec<usize> {
    let (mut random, mut fixed): (Vec<usize>, Vec<usize>) = distinct
        .iter()
        .partition(|&&n| matches!(plan[n].1, Variant::Random(_)));
    if let Some(k) = sample
        && k < random.len()
    {
        let mut rng = states::Rng::new(seed ^ 0x5a4d_504c_4543_4845);
        for i in 0..k {
            let j = i + rng.below((random.len() - i) as u64) as usize;
            random.swap(i, j);
        }
        random.truncate(k);
    }
    fixed.extend(random);
    fixed.sort_unstable();
    fixed
}

/// Check the crash states of `log` that `plan` names: each distinct one, or the default
/// run's sample of them (`choose`).
fn check_log(
    tag: &str,
    log: &Log,
    world: u32,
    saved: &BTreeSet<u64>,
    plan: &[(usize, Variant)],
) -> Tally {
    // States are checked on tmpfs: the checker's own `fsync`s (cleaning, retention) cost
    // nothing there, where on a busy disk they dominate. What is checked is the bytes.
    let scratch = tempfile::Builder::new()
        .prefix("crashsim-")
        .tempdir_in("/dev/shm")
        .unwrap();
    let mut tally = Tally {
        generated: plan.len(),
        ..Tally::default()
    };
    // Generating a state is cheap next to checking it: the distinct ones are found first,
    // then the chosen ones are generated again and checked.
    let mut seen = HashSet::new();
    let mut distinct = Vec::new();
    for (n, &(point, variant)) in plan.iter().enumerate() {
        let model = states::crash_state(log, point, variant);
        let key = (
            model.digest(),
            log.committed_before(point),
            retired_before(log, point),
        );
        if seen.insert(key) {
            distinct.push(n);
        }
    }
    drop(seen);
    tally.distinct = distinct.len();
    tally.distinct_random = distinct
        .iter()
        .filter(|&&n| matches!(plan[n].1, Variant::Random(_)))
        .count();
    for n in choose(plan, &distinct, sample_size(), seed()) {
        let (point, variant) = plan[n];
        tally.checked += 1;
        if matches!(variant, Variant::Random(_)) {
            tally.checked_random += 1;
        }
        let model = states::crash_state(log, point, variant);
        let reported = log.committed_before(point);
        let retired = retired_before(log, point);
        let root = scratch.path().join(format!("s{n}"));
        std::fs::create_dir(&root).unwrap();
        model.materialize(&root).unwrap();
        if let Err(why) = check_state(&root, world, saved, &reported, &retired) {
            tally.violations.push(format!(
                "{tag}: crash at op {point}/{} ({variant:?}, seed {:#x}): {why}\n  \
                 state: {:?}\n  reported {reported:?}, retired {retired:?}\n  last ops: {:?}",
                log.ops.len(),
                seed(),
                model.listing(),
                &log.ops[point.saturating_sub(4)..point]
                    .iter()
                    .map(short)
                    .collect::<Vec<_>>(),
            ));
        }
        let _ = std::fs::remove_dir_all(&root);
    }
    tally
}

fn short(op: &shmckpt_crashsim::Op) -> String {
    use shmckpt_crashsim::Op;
    match op {
        Op::Write { id, offset, data } => format!("write #{id} @{offset} +{}", data.len()),
        other => format!("{other:?}"),
    }
}

fn report(tag: &str, log: &Log, tally: &Tally) {
    let sample = match sample_size() {
        None => "SHMCKPT_CRASH_FULL=1: every distinct state".to_owned(),
        Some(k) => format!(
            "sampled: every durable-only and everything state, {} of the {} distinct random \
             ones drawn with seed {:#x} (SHMCKPT_CRASH_SAMPLE={k}; SHMCKPT_CRASH_FULL=1 \
             checks every one)",
            tally.checked_random,
            tally.distinct_random,
            seed()
        ),
    };
    // Through `io::stderr()`, not `eprintln!`: the test harness captures the macros'
    // output of a passing test, and what a sampled run checked is shown in every run
    // (scripts/test.sh's log included).
    let line = format!(
        "crash {tag}: {} | {} crash states generated, {} distinct (the others are built \
         the same way as one of them), {} checked ({sample}), {} violations\n",
        log.summary(),
        tally.generated,
        tally.distinct,
        tally.checked,
        tally.violations.len()
    );
    let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
    assert!(
        tally.violations.is_empty(),
        "{} violations, first ones:\n{}",
        tally.violations.len(),
        tally.violations[..tally.violations.len().min(5)].join("\n")
    );
}

#[test]
fn one_rank_saves_with_retention_survive_every_crash_state() {
    for backend in BACKENDS {
        let dir = real_dir("crash-rec1");
        let steps = [1, 2, 3, 4, 5, 6];
        let log = record_saves(dir.path(), 1, backend, &steps);
        let plan = states::plan(&log, seed(), random_per_point());
        let tally = check_log(
            &format!("1 rank {backend:?}"),
            &log,
            1,
            &steps.into(),
            &plan,
        );
        report(&format!("1 rank {backend:?}"), &log, &tally);
    }
}

#[test]
fn four_rank_saves_with_retention_survive_every_crash_state() {
    let dir = real_dir("crash-rec4");
    let steps = [1, 2, 3, 4];
    let log = record_saves(dir.path(), 4, BackendKind::Auto, &steps);
    let plan = states::plan(&log, seed(), random_per_point());
    let tally = check_log("4 ranks", &log, 4, &steps.into(), &plan);
    report("4 ranks", &log, &tally);
}

/// Regression (found by the 4-rank run): a rank whose merge loses the race to rename the
/// partial directory found the step committed by another rank and reported it at once,
/// before that rank had synced the root: a power loss right after the report could undo
/// the rename, losing a step reported committed. The losing rank now syncs the root
/// first. Here the race is set up deterministically: every part is in the partial
/// directory and the step's directory already exists (the other rank's rename, not yet
/// durable), so this rank's rename fails and it reports the other rank's commit.
#[test]
fn a_rank_that_loses_the_commit_race_reports_only_a_durable_commit() {
    use shmckpt::manifest::{FileEntry, rank_manifest_name};
    let dir = real_dir("crash-race");
    let root = dir.path();
    let entry = |rank: u32| FileEntry {
        rank,
        file: shmckpt::manifest::rank_file_name(rank, 2),
        bytes: 4096,
        data_start: 4096,
        header_crc32c: None,
        object: None,
        session: None,
        tensors: Vec::new(),
    };
    let rec = Recording::start(root).unwrap();
    let partial = shmckpt::commit::prepare_partial(root, 7, 0, &entry(0).file, 2).unwrap();
    let part1 = serde_json::to_vec(&entry(1)).unwrap();
    shmckpt::testing::io::file::write_durable(&partial.join(rank_manifest_name(1)), &part1)
        .unwrap();
    // The other rank's committed directory, renamed into place but the root not synced.
    let other = root.join("step-7.other");
    shmckpt::testing::fsops::create_dir(&other).unwrap();
    shmckpt::testing::io::file::write_durable(&other.join("manifest.json"), b"{}").unwrap();
    shmckpt::testing::io::file::fsync_dir(&other).unwrap();
    shmckpt::testing::fsops::rename(&other, &root.join("step-7")).unwrap();
    let done = shmckpt::commit::commit(root, 7, 2, &partial, entry(0), &Metadata::new()).unwrap();
    assert_eq!(done, Some(root.join("step-7")));
    shmckpt_crashsim::record::committed(root, 7);
    let log = rec.finish();
    // Right after the report, with nothing but what was made durable:
    let state = states::crash_state(&log, log.ops.len(), Variant::Durable);
    assert!(
        state
            .listing()
            .contains(&"step-7/manifest.json (2 B)".to_owned()),
        "the reported step is not durable: {:?}\n{}",
        state.listing(),
        log.summary()
    );
}

#[cfg(feature = "fault-injection")]
const ROOT_ENV: &str = "SHMCKPT_CRASH_ROOT";
#[cfg(feature = "fault-injection")]
const SHM_ENV: &str = "SHMCKPT_CRASH_SHM";

/// Reported (as ignored) without fault injection, which the recovery run needs to hold the
/// child's writes back.
#[cfg(not(feature = "fault-injection"))]
#[test]
#[ignore = "the recovery crash states need --features fault-injection"]
fn recovery_crash_states_need_fault_injection() {}

/// Child role (a plain function, never collected as a test): commit steps 1 and 2, stage
/// step 3 with its writes past the first chunk held back, and die by SIGKILL, leaving the
/// arena for recovery.
#[cfg(feature = "fault-injection")]
fn child_dies_with_a_staged_save() {
    use shmckpt::testing::io::fault::{Fault, FaultPlan, Rule};
    let root = PathBuf::from(std::env::var(ROOT_ENV).unwrap());
    let shm = std::env::var(SHM_ENV).unwrap();
    let plan = Arc::new(FaultPlan::new());
    let cfg = config(&root, 0, 1, BackendKind::Auto)
        .with_shm_name(shm)
        .with_faults(Arc::clone(&plan));
    let engine = Engine::open(cfg).unwrap();
    for step in [1, 2] {
        let st = state(step, 0);
        engine
            .save(step, &st.tensors(), &Metadata::new())
            .unwrap()
            .wait()
            .unwrap();
    }
    plan.add(Rule {
        kind: shmckpt::testing::io::OpKind::Write,
        offsets: CHUNK..u64::MAX,
        fault: Fault::Delay(std::time::Duration::from_secs(60)),
        times: None,
    });
    let st = state(3, 0);
    let handle = engine.save(3, &st.tensors(), &Metadata::new()).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    std::hint::black_box(&handle);
    crate::common::sigkill_self();
}

/// A trainer killed with step 3 staged restarts: `Engine::open` recovers step 3 from the
/// arena (recorded: its writes, `fdatasync`, manifest and renames), then saves steps 4
/// and 5 with retention. Every crash state of that run, recovery included, is checked.
#[cfg(feature = "fault-injection")]
const ROLES: &[crate::common::Role] = &[(
    "child_dies_with_a_staged_save",
    child_dies_with_a_staged_save,
)];

#[cfg(feature = "fault-injection")]
#[test]
fn recovery_and_later_saves_survive_every_crash_state() {
    use std::os::unix::process::ExitStatusExt;
    if crate::common::run_role(ROLES) {
        return;
    }
    let dir = real_dir("crash-recover");
    let root = dir.path();
    let shm = crate::common::test_shm_name("crash");
    let _guard = crate::common::ShmGuard(shm.clone());
    let out = crate::common::child_command("child_dies_with_a_staged_save")
        .env(ROOT_ENV, root)
        .env(SHM_ENV, &shm)
        .output()
        .unwrap();
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGKILL),
        "the child should have died by SIGKILL: {:?}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(listed(root).unwrap(), [1, 2]);
    let rec = Recording::start(root).unwrap();
    let engine = Engine::open(config(root, 0, 1, BackendKind::Auto)).unwrap();
    // The recovery's report: open returned with step 3 committed.
    assert_eq!(engine.latest().unwrap(), Some(3));
    shmckpt_crashsim::record::committed(root, 3);
    for step in [4, 5] {
        let st = state(step, 0);
        engine
            .save(step, &st.tensors(), &Metadata::new())
            .unwrap()
            .wait()
            .unwrap();
    }
    drop(engine);
    let log = rec.finish();
    let plan = states::plan(&log, seed(), random_per_point());
    let tally = check_log("recovery", &log, 1, &[1, 2, 3, 4, 5].into(), &plan);
    report("recovery", &log, &tally);
}
