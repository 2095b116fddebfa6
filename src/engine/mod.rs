//! The engine: plan → stage → write → commit.
//!
//! `mod.rs` opens the engine and loads; `save` starts saves and stages them; `state`
//! is one save in flight; `finalize` makes it durable and commits it on the commit
//! thread; `handle` is what the caller holds.
//!
//! `save` validates and lays out the tensors, creates the partial directory and file,
//! copies every byte into staging chunks (several threads for host memory) and hands each
//! chunk to the writer pool as soon as it is complete. It returns when the last byte is
//! staged. Writers checksum and write the chunks; the commit thread, taking saves in order,
//! waits for the last write, makes the file durable, writes the manifest and renames the
//! directory.

mod finalize;
mod flash;
mod handle;
mod kept;
mod load;
mod memory;
mod provisional;
mod remote_ops;
mod report;
mod request;
mod save;
mod state;
mod tiers;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use crate::commit::{self, RootLock};
use crate::config::EngineConfig;
use crate::device::CudaStaging;
use crate::error::{Error, Result};
use crate::io::pool::WriterPool;
use crate::io::{Backend, BackendOptions};
use crate::manifest::{self, CheckpointInfo, Manifest};
use crate::restore::sink::{DeviceSink, HostSink};
use crate::restore::{self, Checkpoint};
use crate::slab::SlabPool;
use crate::staging::{Arena, ArenaSpec, NAME_PREFIX, Prefault};
use crate::tensor::DeviceSlice;
use crate::tier::{RemoteTier, TierContext};
pub(crate) use flash::check_slot as check_kept_slot;
pub use kept::{ArenaOwner, KeptArenaInfo, list_kept, remove_kept, remove_kept_forced};

pub use handle::{SaveHandle, SaveWatch};
pub use report::{LoadReport, LoadSource, OpenTimings, SaveReport, SaveTimings, StagedReport};
pub use request::{LoadInto, LoadRequest, Loaded, Sources};
pub use save::{OwnedData, OwnedTensor, SaveOptions};
use state::SaveState;
use tiers::Resolved;
pub use tiers::{StepTiers, Tier, Tiers};

/// Which committed checkpoint to load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum StepSel {
    /// The newest committed step (the default).
    #[default]
    Latest,
    /// A given step.
    Step(u64),
}

impl From<u64> for StepSel {
    fn from(s: u64) -> Self {
        StepSel::Step(s)
    }
}

struct Shared {
    cfg: EngineConfig,
    arena: Arc<Arena>,
    /// A previous engine's kept image, adopted into `arena` at open (flash restore),
    /// until the first save.
    adopted: Mutex<Option<flash::Adopted>>,
    /// Why there is no adopted image to serve from (flash restore on).
    kept_note: Option<String>,
    inflight: Mutex<BTreeSet<u64>>,
    /// The last save's layout, reused by the next save of the same tensors and metadata.
    plans: Mutex<crate::plan::PlanCache>,
    /// Whether this engine began a save: until then every part of this rank in a partial
    /// directory is a dead incarnation's (`Engine::withdraw_stale_parts`).
    began_saving: std::sync::atomic::AtomicBool,
    backend: Backend,
    gate: Gate,
    cuda: OnceLock<Arc<CudaStaging>>,
    setup: Mutex<Setup>,
    /// Committed images held for replication (`EngineConfig::with_replica_hold`), for the
    /// arena's reclaim hook.
    held: Arc<crate::staging::held::HeldImages>,
    /// The tier beyond memory and disk (`EngineConfig::with_remote`), a plug-in
    /// (`crate::tier`): told of the saves it takes, asked for the steps it holds.
    remote: Option<Arc<dyn RemoteTier>>,
    /// Whether saves write a local file (false: the tier beyond the disk holds every
    /// save's only copy, "remote only").
    files: bool,
    /// The newest memory-only saves (`EngineConfig::with_disk_cadence`, `with_memory_steps`).
    memory: Arc<memory::MemoryTier>,
    /// What decides which saves go to disk.
    cadence: Mutex<memory::Cadence>,
    /// Whether the recovery behind the open is still writing (`DiskCadence::WhenIdle`
    /// counts it as a disk save in flight).
    recovering: AtomicBool,
}

impl Shared {
    /// Whether the CUDA side exists and its arena is registered.
    fn cuda_registered(&self) -> bool {
        self.cuda
            .get()
            .is_some_and(|c| c.registration_time().is_some())
    }

    fn cuda(&self) -> &Arc<CudaStaging> {
        self.cuda.get_or_init(|| {
            Arc::new(CudaStaging::new(
                Arc::clone(&self.arena),
                self.cfg.batch_device_copies,
                self.cfg.copy_ahead,
                self.cfg.blocking_sync,
            ))
        })
    }
}

/// Lets one save stage at a time; the holder may be a background staging thread.
#[derive(Debug, Default)]
struct Gate {
    busy: Mutex<bool>,
    freed: Condvar,
}

impl Gate {
    /// Wait until free, take it; returns the time waited.
    fn enter(&self) -> Duration {
        let t = Instant::now();
        let mut b = lock(&self.busy);
        while *b {
            b = self.freed.wait(b).unwrap_or_else(|e| e.into_inner());
        }
        *b = true;
        t.elapsed()
    }

    fn leave(&self) {
        *lock(&self.busy) = false;
        self.freed.notify_all();
    }

    /// Wait until no save is staging.
    fn wait_idle(&self) {
        let mut b = lock(&self.busy);
        while *b {
            b = self.freed.wait(b).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// The checkpoint engine. One per rank; `save` may be called from any thread (saves are
/// serialized).
pub struct Engine {
    shared: Arc<Shared>,
    pool: WriterPool,
    commit_tx: Option<Sender<Arc<SaveState>>>,
    commit_thread: Option<JoinHandle<()>>,
    /// The last disk save started (`flush` waits for it).
    last_save: Mutex<Option<Arc<SaveState>>>,
    /// The recovery the open left behind it ([`Engine::wait_recovery`]).
    behind: Mutex<Behind>,
    /// The allocation of the last loaded checkpoint, given back when its tensors were
    /// dropped, for the next `load`.
    load_buffers: Arc<SlabPool>,
    /// Registered read buffers of device loads from disk (made at the first one).
    device_ring: Mutex<Option<Arc<restore::DeviceRing>>>,
    /// What the open recovered from dead engines' arenas, and what it left unrecovered.
    recovery: crate::recover::OpenRecovery,
    /// Where the open spent its time.
    open_timings: OpenTimings,
    _lock: RootLock,
}

/// The recovery of a dead engine's older saves after the open returned (flash restore with
/// its newest save held: `crate::recover::SlotOutcome::Behind`).
#[derive(Default)]
struct Behind {
    /// The thread, until joined; it returns each step's outcome and the staged chunks of
    /// the saves whose recovery failed (held out of the pool while the descriptor names
    /// them, so the next open can retry).
    thread: Option<JoinHandle<BehindDone>>,
    /// Once joined: each step's outcome.
    outcomes: Vec<(u64, crate::recover::SlotOutcome)>,
    /// Once joined: the chunks of the saves whose recovery failed.
    stuck: Vec<crate::staging::ChunkLease>,
}

type BehindDone = (
    Vec<(u64, crate::recover::SlotOutcome)>,
    Vec<crate::staging::ChunkLease>,
);

/// Recover `b`'s saves into `shared`'s root, oldest first: each staged chunk recorded
/// `WRITTEN` and given back to the pool once it is on the device (as a drain gives its
/// chunks back: a restart's first saves need the room), each slot freed (before its
/// remaining chunks return to the pool) once its recovery ended, except after an I/O error
/// (`Failed`: the slot stays `STAGED` and its chunks not yet written are returned, held,
/// for the next open to retry, the others read from the file then); each step out of
/// `inflight` then.
fn recover_behind(shared: &Shared, b: flash::Behind) -> BehindDone {
    /// Clears `Shared::recovering` when the recovery ends, however it ends (a panic
    /// included: the cadence must not wait for it forever).
    struct Ended<'a>(&'a AtomicBool);
    impl Drop for Ended<'_> {
        fn drop(&mut self) {
            self.0.store(false, Ordering::Release);
        }
    }
    let _ended = Ended(&shared.recovering);
    let flash::Behind { att, saves } = b;
    let header = att.header();
    let mut outcomes = Vec::new();
    let mut stuck = Vec::new();
    for s in saves {
        let slot = s.view.slot;
        let leases: std::collections::BTreeMap<u32, Mutex<Option<crate::staging::ChunkLease>>> = s
            .leases
            .into_iter()
            .map(|l| (l.index(), Mutex::new(Some(l))))
            .collect();
        let written = |k: u64, index: u32| {
            if let Some(held) = leases.get(&index) {
                // `WRITTEN` before the chunk can be reused (the descriptor's rule 2).
                shared.arena.descriptor().chunk_written(slot, k);
                drop(lock(held).take());
            }
        };
        let outcome = crate::recover::recover_behind(
            &att,
            &header,
            &shared.cfg.root,
            &s.view,
            Some(&written),
        );
        let rest = leases
            .into_values()
            .filter_map(|m| m.into_inner().unwrap_or_else(|p| p.into_inner()));
        if matches!(outcome, crate::recover::SlotOutcome::Failed { .. }) {
            stuck.extend(rest);
        } else {
            shared.arena.release_slot(slot);
            rest.for_each(drop);
        }
        lock(&shared.inflight).remove(&s.view.step);
        outcomes.push((s.view.step, outcome));
    }
    (outcomes, stuck)
}

/// Set-up running in the background after `Engine::open`.
#[derive(Debug, Default)]
struct Setup {
    /// The threads allocating the arena's pages, until they are done (stopped at close).
    prefault: Prefault,
    /// Registration threads ([`Engine::prepare_cuda_background`]) and the removal of stale
    /// directories (`commit::clean_stale_behind`), joined at close.
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("root", &self.shared.cfg.root)
            .field("arena", &self.shared.arena.name())
            .field("backend", &self.shared.backend)
            .finish()
    }
}

static ARENA_COUNTER: AtomicU64 = AtomicU64::new(0);

impl EngineConfig {
    /// Build the engine ([`Engine::open`]).
    pub fn build(self) -> Result<Engine> {
        Engine::open(self)
    }
}

impl Engine {
    /// Open an engine: check the root (creating it first with
    /// [`EngineConfig::with_create_root`]), take the rank lock, move stale partial
    /// directories out of the way (removed behind the open), create the staging arena and
    /// start the writers.
    pub fn open(cfg: EngineConfig) -> Result<Engine> {
        let t_open = Instant::now();
        cfg.validate()?;
        if cfg.create_root {
            commit::create_root(&cfg.root)?;
        }
        commit::check_root(&cfg.root)?;
        let lock = commit::lock_root(&cfg.root, cfg.rank)?;
        // The bucket is checked before anything else is set up: a missing bucket or
        // refused credentials fail the open.
        let remote = match &cfg.remote {
            Some(spec) => spec.open(&TierContext {
                world_size: cfg.world_size,
                root: cfg.root.clone(),
                session: cfg.session.clone(),
            })?,
            None => None,
        };
        let files = remote.as_ref().is_none_or(|t| !t.replaces_disk());
        // Recovery first: the partial files of the saves it recovers must still be there,
        // and `clean_stale` keeps those of the arenas left unrecovered.
        let mut timings = OpenTimings::default();
        let root_abs = std::fs::canonicalize(&cfg.root).unwrap_or_else(|_| cfg.root.clone());
        let mut spec = ArenaSpec {
            name: None,
            capacity: cfg.staging_capacity,
            chunk_size: cfg.chunk_size,
            slots: cfg.arena_slots(),
            rank: cfg.rank,
            world_size: cfg.world_size,
            root: root_abs.clone(),
        };
        // With flash restore, the newest save of the dead engine's kept arena may be held in
        // memory by this engine (taken over in place below) instead of written to disk
        // before the open returns.
        let adopt = if cfg.keep_in_memory && cfg.recover_on_open {
            Some(crate::recover::AdoptSpec {
                name: crate::staging::kept_name(&root_abs, cfg.rank),
                geometry: Arena::geometry(&spec)?,
                world_size: cfg.world_size,
                session: cfg.session.clone(),
            })
        } else {
            None
        };
        let t = Instant::now();
        let mut recovery =
            crate::recover::on_open(&cfg.root, cfg.rank, cfg.recover_on_open, adopt.as_ref());
        timings.recovery = t.elapsed();
        let t = Instant::now();
        // Stale directories leave the step namespace here; their files are removed behind
        // the open (joined at close).
        let cleaning = commit::clean_stale_behind(&cfg.root, cfg.rank)?;
        timings.clean = t.elapsed();
        let t_arena = Instant::now();
        let private_name = || {
            format!(
                "{NAME_PREFIX}{}.r{}.{}",
                std::process::id(),
                cfg.rank,
                ARENA_COUNTER.fetch_add(1, Ordering::Relaxed)
            )
        };
        // Flash restore: take over what a previous engine of this root and rank kept.
        let mut keep = false;
        let mut kept_image = None;
        let mut kept_note = None;
        let mut taken_over = None;
        let mut held_step = None;
        let mut behind = None;
        let name = if cfg.keep_in_memory {
            let stable = crate::staging::kept_name(&root_abs, cfg.rank);
            let mut taken =
                flash::take_kept(&stable, &root_abs, cfg.rank, recovery.deferred.as_ref());
            if recovery.deferred.is_some() {
                // The save recovery left staged is taken over now, in place, or committed
                // as recovery would have (then the arena is looked at again).
                let over = match taken.image.take() {
                    Some(image) if image.is_staged() => {
                        let mut named = spec.clone();
                        named.name = Some(stable.clone());
                        match flash::take_over(image, &named, &root_abs, cfg.rank) {
                            Ok(t) => Some(t),
                            Err(not) => {
                                tracing::warn!(reason = %not.why, "the dead engine's arena cannot be taken over: its staged save is recovered to disk");
                                None
                            }
                        }
                    }
                    _ => None,
                };
                match over {
                    Some(t) => {
                        taken_over = Some(t.arena);
                        held_step = t.held;
                        behind = t.behind;
                        recovery.deferred = None;
                    }
                    None => {
                        recovery.recover_deferred(&cfg.root);
                        taken = flash::take_kept(&stable, &root_abs, cfg.rank, None);
                    }
                }
            }
            kept_image = taken.image;
            kept_note = taken.reason;
            if taken.name_free {
                keep = true;
                stable
            } else {
                tracing::warn!(arena = %stable, "the kept arena's name is taken: this engine keeps nothing in memory");
                private_name()
            }
        } else {
            cfg.shm_name.clone().unwrap_or_else(private_name)
        };
        let t = Instant::now();
        spec.name = Some(name);
        // A kept arena of this engine's layout becomes this engine's arena, image in place;
        // otherwise its image is copied into a new arena below.
        let mut adoption = None;
        if let Some(image) = kept_image.take() {
            match flash::take_over(image, &spec, &root_abs, cfg.rank) {
                Ok(t) => {
                    taken_over = Some(t.arena);
                    adoption = Some(t.adopted);
                }
                Err(not) => {
                    let flash::NotTaken { image, why } = *not;
                    tracing::info!(reason = %why, "the kept arena is not taken over: its image is copied into a new arena");
                    if image.release_name() {
                        kept_image = Some(image);
                    } else {
                        keep = false;
                        spec.name = Some(private_name());
                        kept_note = Some("the kept arena's name could not be freed".into());
                    }
                }
            }
        }
        // A new arena's pages are allocated in the background (`prefault`); a save takes
        // only chunks already backed.
        let pause = cfg.prefault_pause();
        // The dead arenas recovery removed are freed in the background: a new arena that
        // does not fit in `/dev/shm` waits for the room they take and is tried again.
        let mut create = |spec: &ArenaSpec| {
            let make =
                || Arena::create_prefaulting(spec, crate::staging::prefault_threads(), pause);
            match make() {
                Err(Error::ShmTooSmall { .. }) if recovery.is_freeing() => {
                    recovery.wait_freed();
                    make()
                }
                r => r,
            }
        };
        let made = match taken_over {
            Some(a) => Ok((a, Prefault::default())),
            None => create(&spec),
        };
        let (arena, prefault) = match made {
            Err(Error::ShmTooSmall { .. }) if kept_image.is_some() => {
                // Room for both the previous image and the new arena is missing: the new
                // arena comes first.
                tracing::warn!(
                    "no room in /dev/shm for the kept image and a new arena: dropping the image"
                );
                kept_image = None;
                kept_note = Some("dropped: /dev/shm has no room for it and a new arena".into());
                create(&spec)?
            }
            r => r?,
        };
        if keep {
            arena.enable_keep();
        } else if cfg.replica_hold {
            // A save must not reuse its own chunks, or its image is not whole (not held).
            arena.take_oldest_first();
        }
        // Chunks held beyond their write (for uploads, for replication) are given back
        // when staging runs out (read from the local file instead): the local tier never
        // waits on the bucket or on a partner beyond the chunks in flight. One hook for both.
        let held = Arc::new(crate::staging::held::HeldImages::default());
        let memory = Arc::new(memory::MemoryTier::new(cfg.memory_steps));
        match held_step {
            Some(Ok(step)) => {
                recovery.held = Some(step.step);
                memory.hold_adopted(&arena, step);
            }
            Some(Err(why)) => kept_note = Some(why),
            None => {}
        }
        {
            let held = Arc::downgrade(&held);
            let mem = Arc::downgrade(&memory);
            let arena_ref = Arc::downgrade(&arena);
            let tier = remote.as_ref().map(Arc::downgrade);
            arena.set_reclaim(crate::staging::Reclaim(Box::new(move |empty| {
                if let Some(h) = held.upgrade() {
                    h.spill_all();
                }
                // The memory tier's oldest step is given up rather than waited for when a
                // newer one is held (the newest never: it stays recoverable until a newer
                // step is, and the save path made room for it, `make_room_for`).
                if empty
                    && let (Some(m), Some(a)) = (mem.upgrade(), arena_ref.upgrade())
                    && let Some(step) = m.give_up_superseded(&a)
                {
                    tracing::warn!(step, "staging ran out of chunks: an older memory-only step is given up (staging_capacity holds fewer saves than the disk cadence and memory_steps need)");
                }
                // Uploads give theirs back only when nothing is free (a save reusing its
                // own chunk costs the remote tier nothing).
                if empty && let Some(t) = tier.as_ref().and_then(std::sync::Weak::upgrade) {
                    t.reclaim();
                }
            })));
        }
        tracing::debug!(name = ?arena.name(), bytes = arena.capacity(), elapsed = ?t.elapsed(), "staging arena ready");
        // Otherwise adopt the kept image into the new arena by copying (a kept image is
        // left only when its name was freed for this arena, so keeping is on; the previous
        // segment is freed when `image` drops, in `adopt`).
        if let Some(image) = kept_image {
            // The image goes into chunks of the new arena: all of it backed first.
            arena.wait_filled()?;
            adoption = Some(flash::adopt(image, &arena, &root_abs, cfg.rank));
        }
        let adopted = match adoption {
            Some(Ok(a)) => Some(a),
            Some(Err(why)) => {
                tracing::warn!(reason = %why, "kept image not adopted; loads read the disk");
                kept_note = Some(why);
                None
            }
            None => None,
        };
        if let Some(a) = &adopted {
            // The cheap check of the disk copy, once at open (again before every load the
            // image serves, where the report carries it).
            let dir = cfg.root.join(manifest::step_dir_name(a.step()));
            if let Err(why) = a.check_disk_copy(&dir) {
                tracing::error!(step = a.step(), problem = %why, "the disk copy of the kept image's step is damaged: a load from disk would fail (`shmckpt verify` checks every byte)");
            }
        }
        timings.arena = t_arena.elapsed();
        let t = Instant::now();
        let opts = BackendOptions {
            kind: cfg.backend,
            queue_depth: cfg.queue_depth,
            fixed: Some(Arc::clone(&arena)),
            #[cfg(feature = "fault-injection")]
            faults: cfg.faults.clone(),
        };
        let pool = WriterPool::start(cfg.writer_threads, &opts)?;
        timings.writers = t.elapsed();
        let shared = Arc::new(Shared {
            backend: pool.backend(),
            cfg,
            arena,
            adopted: Mutex::new(adopted),
            kept_note,
            inflight: Mutex::new(BTreeSet::new()),
            plans: Mutex::default(),
            began_saving: std::sync::atomic::AtomicBool::new(false),
            gate: Gate::default(),
            cuda: OnceLock::new(),
            setup: Mutex::new(Setup {
                prefault,
                threads: cleaning.into_iter().collect(),
            }),
            held,
            remote,
            files,
            memory,
            cadence: Mutex::new(memory::Cadence::default()),
            recovering: AtomicBool::new(behind.is_some()),
        });
        // The dead engine's older saves left staged: recovered on a thread, a save of their
        // step refused meanwhile (`StepExists`).
        let behind = match behind {
            Some(b) => {
                crate::util::lock(&shared.inflight).extend(b.saves.iter().map(|s| s.view.step));
                let sh = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name("shmckpt-recover".into())
                    .spawn(move || recover_behind(&sh, b))
                    .map_err(|e| Error::Config(format!("cannot spawn the recovery thread: {e}")))
                    .map(Some)?
            }
            None => None,
        };
        let (tx, rx) = crossbeam_channel::unbounded::<Arc<SaveState>>();
        let commit_thread = std::thread::Builder::new()
            .name("shmckpt-commit".into())
            .spawn(move || {
                for st in rx {
                    st.wait_settled();
                    let (res, retired) = finalize::finalize(&st);
                    // The filesystem observer: the report's place among the operations.
                    #[cfg(feature = "fs-observer")]
                    if let Ok(r) = &res
                        && r.dir.is_some()
                        && let Some(o) = crate::observe::observer()
                    {
                        o.committed(&st.shared.cfg.root, st.step);
                    }
                    st.complete(res);
                    // The save is reported committed first: deleting the retired
                    // checkpoints' files can take seconds and delays nothing but the
                    // next commit on this thread.
                    if let Err(e) = retired.remove() {
                        tracing::warn!(error = %e, "could not delete a retired checkpoint; the next engine removes it at open");
                    }
                }
            })
            .map_err(|e| Error::Config(format!("cannot spawn commit thread: {e}")))?;
        Ok(Engine {
            shared,
            pool,
            commit_tx: Some(tx),
            commit_thread: Some(commit_thread),
            last_save: Mutex::new(None),
            behind: Mutex::new(Behind {
                thread: behind,
                ..Behind::default()
            }),
            load_buffers: SlabPool::new(),
            device_ring: Mutex::new(None),
            recovery,
            open_timings: OpenTimings {
                total: t_open.elapsed(),
                ..timings
            },
            _lock: lock,
        })
    }

    /// What recovery did at open (`EngineConfig::with_recover_on_open`, on by default):
    /// one report per staging arena of a dead engine of this root and rank that it
    /// handled. [`Engine::recovered_steps`] is the short form.
    pub fn recovered(&self) -> &[crate::recover::RecoveryReport] {
        &self.recovery.reports
    }

    /// Where [`Engine::open`] spent its time.
    pub fn open_timings(&self) -> &OpenTimings {
        &self.open_timings
    }

    /// The steps that recovery at open committed from dead engines' staging arenas (the
    /// crashed trainer's saves that had returned from `save`), and the one this engine took
    /// over in memory instead (flash restore, [`crate::recover::SlotOutcome::Adopted`]:
    /// held as its memory-only step, on disk with its next disk save or at close), oldest
    /// first.
    pub fn recovered_steps(&self) -> Vec<u64> {
        let mut steps: Vec<u64> = self
            .recovery
            .reports
            .iter()
            .flat_map(crate::recover::RecoveryReport::committed_steps)
            .chain(self.recovery.held)
            .collect();
        steps.sort_unstable();
        steps.dedup();
        steps
    }

    /// Staging arenas of dead engines of this root and rank that still hold saves to
    /// recover after the open: recovery at open was off (the arenas and their partial
    /// directories are then kept for `shmckpt recover`), or it failed for them (the
    /// arena is kept for a retry). Logged as a warning at open.
    pub fn unrecovered(&self) -> &[String] {
        &self.recovery.unrecovered
    }

    /// The settings.
    pub fn config(&self) -> &EngineConfig {
        &self.shared.cfg
    }

    /// Name of the staging segment in `/dev/shm`.
    pub fn shm_name(&self) -> &str {
        self.shared.arena.name().unwrap_or("")
    }

    /// Staging bytes available to one save.
    pub fn staging_capacity(&self) -> u64 {
        self.shared.arena.capacity()
    }

    /// Write backend in use (`io_uring` or `pwrite`).
    pub fn backend(&self) -> Backend {
        self.shared.backend
    }

    /// Set up CUDA for `devices` now (contexts, streams, and the one-time registration of
    /// the staging arena) instead of at the first save that needs it. Returns the
    /// registration time if this call registered. The registration needs the whole arena
    /// allocated: this waits for the background prefault first
    /// ([`Engine::wait_staging_ready`]).
    pub fn prepare_cuda(&self, devices: &[i32]) -> Result<Option<Duration>> {
        self.shared
            .cuda()
            .prepare(&devices.iter().copied().collect())
    }

    /// [`Engine::prepare_cuda`] without waiting: contexts and streams are set up now (their
    /// errors returned), the registration of the staging arena runs on a background thread
    /// once the arena is allocated. A device save started before it is done waits for it;
    /// [`Engine::wait_staging_ready`] waits for it too. A failed registration is logged
    /// and tried again by the next device save (which then reports its error).
    pub fn prepare_cuda_background(&self, devices: &[i32]) -> Result<()> {
        let set: BTreeSet<i32> = devices.iter().copied().collect();
        let cuda = Arc::clone(self.shared.cuda());
        cuda.prepare_devices(&set)?;
        // Registered already, or being registered (a device save or an earlier call): that
        // one does it (and a device save retries if it fails).
        if set.is_empty() || cuda.registered_or_busy() {
            return Ok(());
        }
        let h = std::thread::Builder::new()
            .name("shmckpt-cuda-register".into())
            .spawn(move || {
                if let Err(e) = cuda.prepare(&set) {
                    tracing::warn!(error = %e, "background CUDA registration of the staging arena failed");
                }
            })
            .map_err(|e| Error::Config(format!("cannot spawn a registration thread: {e}")))?;
        lock(&self.shared.setup).threads.push(h);
        Ok(())
    }

    /// Whether the staging arena is wholly allocated (the background prefault of
    /// [`Engine::open`] is done) and no background registration is still running.
    pub fn staging_ready(&self) -> bool {
        self.shared.arena.is_filled()
            && lock(&self.shared.setup)
                .threads
                .iter()
                .all(|h| h.is_finished())
    }

    /// Wait until the staging arena is wholly allocated and every background set-up
    /// ([`Engine::prepare_cuda_background`]) has ended. From then on a save's stall has no
    /// one-time cost left. Fails when the allocation failed (`/dev/shm` filled up:
    /// `ShmTooSmall`).
    pub fn wait_staging_ready(&self) -> Result<()> {
        self.shared.arena.wait_filled()?;
        let done = std::mem::take(&mut lock(&self.shared.setup).threads);
        for h in done {
            if h.join().is_err() {
                tracing::error!("a background set-up thread panicked");
            }
        }
        Ok(())
    }

    /// How long registering the staging arena with CUDA took, once it is registered.
    pub fn cuda_registration_time(&self) -> Option<Duration> {
        self.shared.cuda.get().and_then(|c| c.registration_time())
    }

    /// Committed checkpoints, oldest first.
    pub fn list(&self) -> Result<Vec<CheckpointInfo>> {
        manifest::list_committed(&self.shared.cfg.root)
    }

    /// Delete committed checkpoint `step` (`commit::remove_step`: renamed out of the
    /// listing durably, then its files deleted). A step this engine is still saving is
    /// refused ([`Error::NotFound`], nothing touched); wait for its handle first.
    pub fn remove(&self, step: u64) -> Result<()> {
        let root = &self.shared.cfg.root;
        // A memory-only step (`EngineConfig::with_disk_cadence`) is given up.
        if self.shared.memory.holds(step) {
            self.shared.gate.enter();
            let gone = self.shared.memory.give_up(&self.shared.arena, step);
            self.shared.gate.leave();
            if gone {
                return Ok(());
            }
        }
        if lock(&self.shared.inflight).contains(&step) {
            return Err(Error::NotFound {
                what: format!("step {step} (its save is still in flight)"),
                step: Some(step),
                root: root.clone(),
            });
        }
        commit::remove_step(root, step)
    }

    /// The newest step a local load of "latest" reads, if any: the memory-only step of
    /// this engine when it is newer than the disk's newest committed step
    /// ([`EngineConfig::with_disk_cadence`]), else the disk's newest committed step (with
    /// the default cadence, always the latter). [`Engine::latest_in`] with
    /// [`Tiers::Local`]; [`Engine::list_in`] says which tiers hold each step.
    pub fn latest(&self) -> Result<Option<u64>> {
        let disk = self.disk_latest()?;
        Ok(match (self.memory_step(), disk) {
            (Some(m), d) if d.is_none_or(|d| m > d) => Some(m),
            (_, d) => d,
        })
    }

    /// The disk's newest committed step, if any.
    pub(crate) fn disk_latest(&self) -> Result<Option<u64>> {
        Ok(self.list()?.last().map(|c| c.step))
    }

    fn resolve(&self, which: StepSel) -> Result<CheckpointInfo> {
        let all = self.list()?;
        let root = self.shared.cfg.root.clone();
        match which {
            StepSel::Latest => all.last().cloned().ok_or(Error::NotFound {
                what: "(latest)".into(),
                step: None,
                root,
            }),
            StepSel::Step(s) => {
                all.into_iter()
                    .find(|c| c.step == s)
                    .ok_or_else(|| Error::NotFound {
                        what: format!("step {s}"),
                        step: Some(s),
                        root,
                    })
            }
        }
    }

    /// Wait for every save in flight to be committed (or to fail). Returns the error of
    /// the last save started if it failed (earlier saves report through their handles).
    pub fn flush(&self) -> Result<()> {
        self.shared.gate.wait_idle();
        // The commit thread finishes saves in order: the last one done means all are.
        if let Some(last) = lock(&self.last_save).clone() {
            last.wait_done();
            if let Some(e) = last.failure() {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Finish every save in flight, stop the threads, and remove the staging segment.
    /// Dropping the engine does the same.
    pub fn close(mut self) {
        self.shutdown();
    }

    /// Wait until the recovery this engine's open left behind it has ended (flash restore
    /// that held the dead engine's newest save in memory recovers its older saves, e.g. a
    /// disk save that was in flight, on a thread: `crate::recover::SlotOutcome::Behind`),
    /// and return each such step's outcome, oldest first, to the first call after it ended
    /// (later calls, and an engine that had none, get an empty list). `close` waits for it
    /// too.
    pub fn wait_recovery(&self) -> Vec<(u64, crate::recover::SlotOutcome)> {
        let mut b = lock(&self.behind);
        if let Some(h) = b.thread.take() {
            match h.join() {
                Ok((outcomes, stuck)) => {
                    b.outcomes = outcomes;
                    b.stuck = stuck;
                }
                Err(_) => tracing::error!("the recovery thread panicked"),
            }
        }
        std::mem::take(&mut b.outcomes)
    }

    fn shutdown(&mut self) {
        self.wait_recovery();
        self.shared.gate.wait_idle();
        // Nothing saved is lost on a clean exit: the held memory-only steps go to disk.
        if self.commit_tx.is_some()
            && let Err(e) = self.persist_memory()
        {
            tracing::error!(error = %e, "could not write the held memory-only steps to disk at close");
        }
        self.commit_tx = None;
        if let Some(h) = self.commit_thread.take()
            && h.join().is_err()
        {
            tracing::error!("commit thread panicked");
        }
        self.pool.shutdown();
        // Saves are done: stop allocating (a registration waiting for it then gives up).
        let (mut prefault, threads) = {
            let mut s = lock(&self.shared.setup);
            (
                std::mem::take(&mut s.prefault),
                std::mem::take(&mut s.threads),
            )
        };
        prefault.stop();
        for h in threads {
            if h.join().is_err() {
                tracing::error!("a background set-up thread panicked");
            }
        }
        // Uploads hold arena chunks (leases keep the mapping alive) or read committed
        // files: finished after the writers, before the arena is marked closed.
        if let Some(r) = &self.shared.remote {
            r.close();
        }
        self.shared.arena.close();
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

use crate::util::lock;
