//! shmckpt's engine saving into a crashfs mount (through the kernel: FUSE, io_uring and
//! `pwrite`, O_DIRECT, real `fsync`s), the power cut at seeded random points; the durable
//! state is then mounted again and a restarted trainer runs on it (docs/crash.md).
//!
//! Per configuration, one uncrashed run counts the mutating requests `M`; then each
//! iteration cuts the power at a random request `n < M` (seed `SHMCKPT_CRASHFS_SEED`,
//! `SHMCKPT_CRASHFS_ITERS` iterations), drops the trainer, clears its arenas (a power loss
//! clears `/dev/shm`), mounts what was durable and checks, as the simulated harness does:
//! every listed step loads and verifies with exactly its bytes on every rank; `latest` is
//! the newest listed step; every step reported committed before the cut is listed unless
//! `keep` newer steps are; no partial directory survives the open; `gc` keeps the newest
//! `keep`; the trainer's next save commits on top.
//!
//! Needs `/dev/fuse` and root: skips visibly otherwise, fails under
//! `SHMCKPT_REQUIRE_FUSE=1` (as `.ci/run` sets).

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Mutex;
use std::time::Instant;

use crashfs::{Image, Mounted};
use shmckpt::restore::{self, ReadOptions};
use shmckpt::{BackendKind, Dtype, Engine, EngineConfig, Metadata, StepSel, Tensor};

const KEEP: usize = 2;

/// The tests of this binary share its pid, hence its arena names: one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The tensors rank `rank` saves as `step`: ~150 KiB over several 64 KiB chunks.
fn tensors(step: u64, rank: u32) -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (step << 8) ^ u64::from(rank);
    let mut bytes = |n: usize| -> Vec<u8> {
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    };
    vec![
        ("w".into(), Dtype::F32, vec![100, 257], bytes(100 * 257 * 4)),
        ("b".into(), Dtype::BF16, vec![1000], bytes(2000)),
        ("rng".into(), Dtype::U8, vec![40_001], bytes(40_001)),
    ]
}

fn save(e: &Engine, step: u64, rank: u32) -> shmckpt::Result<shmckpt::SaveReport> {
    let t = tensors(step, rank);
    let views: Vec<Tensor<'_>> = t
        .iter()
        .map(|(n, d, s, b)| Tensor::host(n.as_str(), *d, s.clone(), b))
        .collect();
    e.save(step, &views, &Metadata::new())?.wait()
}

fn same(ck: &shmckpt::Checkpoint, step: u64, rank: u32) -> Result<(), String> {
    let want = tensors(step, rank);
    if ck.tensors.len() != want.len() {
        return Err(format!(
            "step {step} rank {rank}: {} tensors",
            ck.tensors.len()
        ));
    }
    for (n, d, s, b) in &want {
        let t = ck
            .get(n)
            .ok_or_else(|| format!("step {step} rank {rank}: {n} missing"))?;
        if t.dtype != *d || &t.shape != s || t.data.as_bytes() != &b[..] {
            return Err(format!(
                "step {step} rank {rank}: {n} differs from what was saved"
            ));
        }
    }
    Ok(())
}

fn config(root: &Path, rank: u32, world: u32, backend: BackendKind) -> EngineConfig {
    EngineConfig::new(root)
        .with_backend(backend)
        .with_staging_capacity(1 << 20)
        .with_chunk_size(64 << 10)
        .with_queue_depth(4)
        .with_writer_threads(2)
        .with_rank(rank, world)
        .with_keep_last(Some(KEEP))
        .with_recover_on_open(true)
}

/// xorshift64*, seeded.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n.max(1)
    }
}

fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v.parse().unwrap_or_else(|e| panic!("{name}={v:?}: {e}")),
        Err(_) => default,
    }
}

/// What a trainer did before the power went off.
struct Run {
    reported: BTreeSet<u64>,
    mutations: u64,
    cut: bool,
}

/// `world` engines on `root` save steps `1..=steps` in parallel, until the power goes off.
fn train(m: &Mounted, world: u32, backend: BackendKind, steps: u64) -> Run {
    let root = m.path();
    let mut reported = BTreeSet::new();
    let engines: Vec<Engine> = (0..world)
        .map_while(|r| Engine::open(config(root, r, world, backend)).ok())
        .collect();
    if engines.len() == world as usize {
        for step in 1..=steps {
            let ok: Vec<Option<shmckpt::SaveReport>> = std::thread::scope(|s| {
                let hs: Vec<_> = engines
                    .iter()
                    .enumerate()
                    .map(|(r, e)| s.spawn(move || save(e, step, r as u32).ok()))
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for rep in ok.iter().flatten() {
                if rep.dir.is_some() {
                    reported.insert(step);
                }
            }
            if ok.iter().any(Option::is_none) {
                assert!(m.power().is_cut(), "step {step} failed with the power on");
                break;
            }
        }
    } else {
        assert!(m.power().is_cut(), "Engine::open failed with the power on");
    }
    drop(engines);
    clear_own_arenas();
    Run {
        reported,
        mutations: m.power().mutations(),
        cut: m.power().is_cut(),
    }
}

/// A power loss clears `/dev/shm`: remove this process's arenas (the trainer's; the tests
/// of this binary run one at a time).
fn clear_own_arenas() {
    let prefix = format!("shmckpt.{}.", std::process::id());
    for e in std::fs::read_dir("/dev/shm").unwrap().flatten() {
        if e.file_name().to_string_lossy().starts_with(&prefix) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

fn listed(root: &Path) -> Result<Vec<u64>, String> {
    shmckpt::manifest::list_committed(root)
        .map(|v| v.into_iter().map(|c| c.step).collect())
        .map_err(|e| format!("list: {e}"))
}

fn step_exact(root: &Path, step: u64, world: u32) -> Result<(), String> {
    let dir = root.join(format!("step-{step}"));
    let opts = ReadOptions {
        backend: BackendKind::Pwrite,
        direct_io: false,
        ..ReadOptions::default()
    };
    restore::verify_dir(&dir, &opts).map_err(|e| format!("verify step {step}: {e}"))?;
    for rank in 0..world {
        let ck = restore::load_owned(&dir, rank, &opts)
            .map_err(|e| format!("load step {step} rank {rank}: {e}"))?;
        same(&ck, step, rank)?;
    }
    Ok(())
}

/// The restarted trainer, on the remounted durable state.
fn check(root: &Path, world: u32, steps: u64, run: &Run) -> Result<(), String> {
    let cfg = config(root, 0, world, BackendKind::Pwrite);
    let engine = Engine::open(cfg.clone()).map_err(|e| format!("Engine::open: {e}"))?;
    let list = listed(root)?;
    for &s in &list {
        if !(1..=steps).contains(&s) {
            return Err(format!("step {s} listed, never saved"));
        }
        step_exact(root, s, world)?;
    }
    let latest = engine.latest().map_err(|e| format!("latest: {e}"))?;
    if latest != list.last().copied() {
        return Err(format!("latest {latest:?}, listed {list:?}"));
    }
    if let Some(l) = latest {
        let ck = engine
            .load(StepSel::Latest)
            .map_err(|e| format!("load(latest = {l}): {e}"))?;
        same(&ck, l, 0)?;
    }
    for &r in &run.reported {
        if !list.contains(&r) && list.iter().filter(|&&l| l > r).count() < KEEP {
            return Err(format!(
                "step {r} was reported committed and is gone (listed {list:?})"
            ));
        }
    }
    let leftovers: Vec<String> = std::fs::read_dir(root)
        .map_err(|e| e.to_string())?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".partial") || n.ends_with(".trash"))
        .collect();
    if !leftovers.is_empty() {
        return Err(format!("after Engine::open: {leftovers:?}"));
    }
    drop(engine);
    // gc, as `shmckpt gc --keep KEEP` runs it.
    shmckpt::commit::clean_stale(root, u32::MAX).map_err(|e| format!("gc clean: {e}"))?;
    shmckpt::commit::apply_retention(root, KEEP).map_err(|e| format!("gc retention: {e}"))?;
    let after = listed(root)?;
    let want = list[list.len().saturating_sub(KEEP)..].to_vec();
    if after != want {
        return Err(format!("gc left {after:?} of {list:?}, expected {want:?}"));
    }
    for &s in &after {
        step_exact(root, s, world)?;
    }
    // The trainer goes on: its next save commits on top.
    let next = steps + 1;
    let engines: Vec<Engine> = (0..world)
        .map(|r| Engine::open(config(root, r, world, BackendKind::Pwrite)))
        .collect::<shmckpt::Result<_>>()
        .map_err(|e| format!("Engine::open for the next save: {e}"))?;
    std::thread::scope(|s| {
        let hs: Vec<_> = engines
            .iter()
            .enumerate()
            .map(|(r, e)| s.spawn(move || save(e, next, r as u32)))
            .collect();
        hs.into_iter()
            .try_for_each(|h| h.join().unwrap().map(|_| ()))
    })
    .map_err(|e| format!("save of step {next} after the crash: {e}"))?;
    drop(engines);
    if listed(root)?.last() != Some(&next) {
        return Err(format!(
            "step {next} saved after the crash is not the latest"
        ));
    }
    step_exact(root, next, world)
}

/// Run `iters` power cuts on saves of `steps` steps by `world` ranks.
fn power_cuts(tag: &str, world: u32, backend: BackendKind, steps: u64) {
    if let Err(why) = crashfs::can_mount() {
        assert!(
            std::env::var("SHMCKPT_REQUIRE_FUSE").as_deref() != Ok("1"),
            "SHMCKPT_REQUIRE_FUSE=1 but no FUSE mount can be made: {why}"
        );
        eprintln!(
            "SKIPPED: {tag}: no FUSE mount ({why}); set SHMCKPT_REQUIRE_FUSE=1 to make this a failure"
        );
        return;
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let t = Instant::now();
    let seed = env_u64("SHMCKPT_CRASHFS_SEED", 0x28_2026);
    let iters = env_u64("SHMCKPT_CRASHFS_ITERS", 40);
    let mut rng = Rng(seed ^ u64::from(world) << 32 | 1);
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();

    // The uncrashed run: how many requests a run makes.
    let m = Mounted::mount(Image::empty(), &mnt).unwrap();
    let full = train(&m, world, backend, steps);
    assert!(!full.cut);
    assert_eq!(full.reported, (1..=steps).collect::<BTreeSet<_>>());
    let total = full.mutations;
    let img = m.crash();
    let m = Mounted::mount(img, &mnt).unwrap();
    check(&mnt, world, steps, &full).unwrap_or_else(|e| panic!("{tag}, uncrashed: {e}"));
    drop(m);

    let (mut cuts, mut reported) = (0, 0);
    for i in 0..iters {
        let n = rng.below(total);
        let m = Mounted::mount(Image::empty(), &mnt).unwrap();
        m.power().cut_at_mutation(n);
        let run = train(&m, world, backend, steps);
        let img = m.crash();
        cuts += usize::from(run.cut);
        reported += run.reported.len();
        let m = Mounted::mount(img, &mnt).unwrap();
        let res = check(&mnt, world, steps, &run);
        drop(m);
        if let Err(e) = res {
            panic!(
                "{tag}: iteration {i} (seed {seed:#x}), power cut at request {n} of {total}, after {} requests, steps reported {:?}: {e}",
                run.mutations, run.reported
            );
        }
    }
    eprintln!(
        "crashfs {tag}: {iters} power cuts at random requests of {total} ({cuts} before the end; {reported} commits reported before them), 0 violations, {:.1?}",
        t.elapsed()
    );
}

#[test]
fn one_rank_survives_power_cuts_through_fuse() {
    power_cuts("1 rank, io_uring", 1, BackendKind::IoUring, 5);
}

#[test]
fn two_ranks_survive_power_cuts_through_fuse() {
    power_cuts("2 ranks, pwrite", 2, BackendKind::Pwrite, 4);
}
