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
#[cfg(feature = "s3")]
mod remote_ops;
mod report;
mod save;
mod state;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use crate::commit::{self, RootLock};
use crate::config::EngineConfig;
use crate::device::CudaStaging;
use crate::device::cuda::DeviceBuffer;
use crate::error::{Error, Result};
use crate::io::pool::WriterPool;
use crate::io::{Backend, BackendOptions};
use crate::manifest::{self, CheckpointInfo, Manifest};
use crate::restore::sink::{DeviceSink, HostSink};
use crate::restore::{self, Checkpoint};
use crate::slab::SlabPool;
use crate::staging::{Arena, ArenaSpec, NAME_PREFIX, Prefault};
use crate::tensor::DeviceSlice;
pub use flash::{
    ArenaOwner, KeptArenaInfo, LoadReport, LoadSource, list_kept, remove_kept, remove_kept_forced,
};

pub use handle::SaveHandle;
pub use report::{SaveReport, SaveTimings, StagedReport};
pub use save::{OwnedData, OwnedTensor, SaveOptions};
use state::SaveState;

/// Which committed checkpoint to load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepSel {
    /// The newest committed step.
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
    backend: Backend,
    gate: Gate,
    cuda: OnceLock<Arc<CudaStaging>>,
    setup: Mutex<Setup>,
    /// The remote tier's uploader (`EngineConfig::with_remote`).
    #[cfg(feature = "s3")]
    remote: Option<Arc<crate::remote::tier::RemoteTier>>,
}

impl Shared {
    fn cuda(&self) -> &Arc<CudaStaging> {
        self.cuda
            .get_or_init(|| Arc::new(CudaStaging::new(Arc::clone(&self.arena))))
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
    last_save: Mutex<Option<Arc<SaveState>>>,
    /// The allocation of the last loaded checkpoint, given back when its tensors were
    /// dropped, for the next `load`.
    load_buffers: Arc<SlabPool>,
    /// Registered read buffers of device loads from disk (made at the first one).
    device_ring: Mutex<Option<Arc<restore::DeviceRing>>>,
    _lock: RootLock,
}

/// Set-up running in the background after `Engine::open`.
#[derive(Debug, Default)]
struct Setup {
    /// The threads allocating the arena's pages, until they are done (stopped at close).
    prefault: Prefault,
    /// Registration threads ([`Engine::prepare_cuda_background`]), joined at close.
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
    /// [`EngineConfig::with_create_root`]), take the rank lock, remove stale partial
    /// directories, create the staging arena and start the writers.
    pub fn open(cfg: EngineConfig) -> Result<Engine> {
        cfg.validate()?;
        if cfg.create_root {
            commit::create_root(&cfg.root)?;
        }
        commit::check_root(&cfg.root)?;
        let lock = commit::lock_root(&cfg.root, cfg.rank)?;
        // The bucket is checked before anything else is set up: a missing bucket or
        // refused credentials fail the open.
        #[cfg(feature = "s3")]
        let remote = match &cfg.remote {
            Some(target) => {
                let r = Arc::new(target.open(cfg.remote_options.clone())?);
                Some(Arc::new(crate::remote::tier::RemoteTier::start(
                    r,
                    cfg.world_size,
                    cfg.remote_keep_last,
                    cfg.remote_max_pending,
                    cfg.remote_session.clone(),
                )?))
            }
            None => None,
        };
        if cfg.recover_on_open {
            crate::recover::recover_on_open(&cfg.root, cfg.rank);
        }
        commit::clean_stale(&cfg.root, cfg.rank)?;
        let private_name = || {
            format!(
                "{NAME_PREFIX}{}.r{}.{}",
                std::process::id(),
                cfg.rank,
                ARENA_COUNTER.fetch_add(1, Ordering::Relaxed)
            )
        };
        let root_abs = std::fs::canonicalize(&cfg.root).unwrap_or_else(|_| cfg.root.clone());
        // Flash restore: take over what a previous engine of this root and rank kept.
        let mut keep = false;
        let mut kept_image = None;
        let mut kept_note = None;
        let name = if cfg.keep_in_memory {
            let stable = crate::staging::kept_name(&root_abs, cfg.rank);
            let taken = flash::take_kept(&stable, &root_abs, cfg.rank);
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
        let mut spec = ArenaSpec {
            name: Some(name),
            capacity: cfg.staging_capacity,
            chunk_size: cfg.chunk_size,
            slots: cfg.max_inflight_saves,
            rank: cfg.rank,
            world_size: cfg.world_size,
            root: root_abs.clone(),
        };
        // A kept arena of this engine's layout becomes this engine's arena, image in place;
        // otherwise its image is copied into a new arena below.
        let mut adoption = None;
        let mut taken_over = None;
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
        let create = |spec: &ArenaSpec| {
            Arena::create_prefaulting(spec, crate::staging::prefault_threads(), pause)
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
        let opts = BackendOptions {
            kind: cfg.backend,
            queue_depth: cfg.queue_depth,
            fixed: Some(Arc::clone(&arena)),
            #[cfg(feature = "fault-injection")]
            faults: cfg.faults.clone(),
        };
        let pool = WriterPool::start(cfg.writer_threads, &opts)?;
        let shared = Arc::new(Shared {
            backend: pool.backend(),
            cfg,
            arena,
            adopted: Mutex::new(adopted),
            kept_note,
            inflight: Mutex::new(BTreeSet::new()),
            gate: Gate::default(),
            cuda: OnceLock::new(),
            setup: Mutex::new(Setup {
                prefault,
                threads: Vec::new(),
            }),
            #[cfg(feature = "s3")]
            remote,
        });
        let (tx, rx) = crossbeam_channel::unbounded::<Arc<SaveState>>();
        let commit_thread = std::thread::Builder::new()
            .name("shmckpt-commit".into())
            .spawn(move || {
                for st in rx {
                    st.wait_settled();
                    let (res, retired) = finalize::finalize(&st);
                    // Power-loss tests: the report's place among the recorded operations.
                    #[cfg(feature = "crash-record")]
                    if let Ok(r) = &res
                        && r.dir.is_some()
                    {
                        crate::crashsim::record::committed(&st.shared.cfg.root, st.step);
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
            load_buffers: SlabPool::new(),
            device_ring: Mutex::new(None),
            _lock: lock,
        })
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

    /// Delete committed checkpoint `step` ([`commit::remove_step`]: renamed out of the
    /// listing durably, then its files deleted). A step this engine is still saving is
    /// refused ([`Error::NotFound`], nothing touched); wait for its handle first.
    pub fn remove(&self, step: u64) -> Result<()> {
        let root = &self.shared.cfg.root;
        if lock(&self.shared.inflight).contains(&step) {
            return Err(Error::NotFound {
                what: format!("step {step} (its save is still in flight)"),
                root: root.clone(),
            });
        }
        commit::remove_step(root, step)
    }

    /// The newest committed step, if any.
    pub fn latest(&self) -> Result<Option<u64>> {
        Ok(self.list()?.last().map(|c| c.step))
    }

    fn resolve(&self, which: StepSel) -> Result<CheckpointInfo> {
        let all = self.list()?;
        let root = self.shared.cfg.root.clone();
        match which {
            StepSel::Latest => all.last().cloned().ok_or(Error::NotFound {
                what: "(latest)".into(),
                root,
            }),
            StepSel::Step(s) => {
                all.into_iter()
                    .find(|c| c.step == s)
                    .ok_or_else(|| Error::NotFound {
                        what: format!("step {s}"),
                        root,
                    })
            }
        }
    }

    /// Load this rank's tensors of a committed checkpoint, verifying every checksum.
    ///
    /// The file's data section is read with O_DIRECT (`max(queue_depth, 16)` reads of
    /// 4 MiB in flight) straight into one allocation, and the tensors' bytes are views of
    /// it (no copy; checksums computed on a second thread as the reads complete). When all
    /// tensors of a loaded checkpoint are dropped, the engine keeps that allocation (one
    /// file's size) for its next `load`, so repeated loads do not pay the first touch of
    /// fresh memory again; [`Engine::release_load_buffers`] frees it.
    ///
    /// With [`EngineConfig::with_keep_in_memory`], the step that a previous engine kept in
    /// shared memory, adopted (copied and checked) at open, is served from this engine's
    /// arena; [`Engine::load_with_report`] says which path served the load.
    pub fn load(&self, which: impl Into<StepSel>) -> Result<Checkpoint> {
        self.load_with_report(which).map(|(ck, _)| ck)
    }

    /// [`Engine::load`], also reporting which path served the load and, when flash restore
    /// is on but the disk served it, why.
    ///
    /// With a remote tier ([`EngineConfig::with_remote`]), a step the disk does not hold
    /// (or "latest" with no step on disk) is loaded from the bucket
    /// ([`LoadSource::Remote`]).
    pub fn load_with_report(&self, which: impl Into<StepSel>) -> Result<(Checkpoint, LoadReport)> {
        let which = which.into();
        let info = match self.resolve(which) {
            Ok(info) => info,
            #[cfg(feature = "s3")]
            Err(e @ Error::NotFound { .. }) => return self.load_fallback_remote(which, e),
            Err(e) => return Err(e),
        };
        let fallback_reason = match self.try_memory(&info)? {
            Memory::Served(ck, disk_problem) => {
                let report = LoadReport {
                    step: info.step,
                    source: LoadSource::Memory,
                    fallback_reason: None,
                    disk_problem,
                };
                return Ok((ck, report));
            }
            Memory::Not(why) => why,
        };
        let ck = restore::load_owned_pooled(
            &info.dir,
            self.shared.cfg.rank,
            &self.read_options(),
            Some(&self.load_buffers),
        )?;
        let report = LoadReport {
            step: info.step,
            source: LoadSource::Disk,
            fallback_reason,
            disk_problem: None,
        };
        Ok((ck, report))
    }

    /// Flash restore: `info`'s step from the adopted image, if it can serve it, with what
    /// the cheap check of the disk copy found; else why not (`None` with the option off).
    fn try_memory(&self, info: &CheckpointInfo) -> Result<Memory> {
        let (image, manifest, _, disk_problem) = match self.memory_image(info)? {
            Ok(found) => found,
            Err(why) => return Ok(Memory::Not(why)),
        };
        let a = image.as_ref().expect("memory_image returns a held image");
        match a.to_checkpoint(&info.dir, &manifest, &self.load_buffers) {
            Ok(ck) => {
                tracing::info!(
                    step = info.step,
                    "load served from the kept image (flash restore)"
                );
                Ok(Memory::Served(ck, disk_problem))
            }
            Err(why) => {
                tracing::warn!(step = info.step, reason = %why, "flash restore not possible; loading from disk");
                Ok(Memory::Not(Some(why)))
            }
        }
    }

    /// Flash restore: the adopted image, locked (a save waits to give it up until the
    /// caller is done with its chunks), with `info`'s manifest, this rank's entry and what
    /// the cheap check of the disk copy found wrong (logged as an error), if it can serve
    /// `info`'s step: else why not (`None` with the option off). The guard always holds an
    /// image when `Ok(Ok)`.
    #[allow(clippy::type_complexity)]
    fn memory_image(
        &self,
        info: &CheckpointInfo,
    ) -> Result<
        std::result::Result<
            (
                std::sync::MutexGuard<'_, Option<flash::Adopted>>,
                Manifest,
                manifest::FileEntry,
                Option<String>,
            ),
            Option<String>,
        >,
    > {
        if !self.shared.cfg.keep_in_memory {
            return Ok(Err(None));
        }
        let image = lock(&self.shared.adopted);
        let Some(a) = image.as_ref() else {
            let why = self
                .shared
                .kept_note
                .clone()
                .unwrap_or_else(|| "no kept image (a save started since)".into());
            return Ok(Err(Some(why)));
        };
        let (manifest, entry) = restore::rank_file(&info.dir, self.shared.cfg.rank)?;
        let latest = self.latest()?;
        if let Err(why) = a.check(info.step, &entry, latest) {
            tracing::warn!(step = info.step, reason = %why, "flash restore not possible; loading from disk");
            return Ok(Err(Some(why)));
        }
        let disk_problem = a.check_disk_copy(&info.dir).err();
        if let Some(why) = &disk_problem {
            tracing::error!(step = info.step, problem = %why, "the disk copy of the step served from memory is damaged: a load from disk would fail (`shmckpt verify` checks every byte)");
        }
        Ok(Ok((image, manifest, entry, disk_problem)))
    }

    /// Bytes the engine holds for its next [`Engine::load`] (the allocation of a loaded
    /// checkpoint whose tensors were all dropped).
    pub fn load_buffer_bytes(&self) -> usize {
        self.load_buffers.held_bytes()
    }

    /// Free the memory kept for the next [`Engine::load`].
    pub fn release_load_buffers(&self) {
        self.load_buffers.clear();
        lock(&self.device_ring).take();
    }

    /// Load this rank's tensors into caller buffers, by name, verifying every checksum.
    /// Every tensor of the checkpoint must have a destination of exactly its size. Returns
    /// the step loaded.
    ///
    /// With [`EngineConfig::with_keep_in_memory`], a step held by the image adopted at open
    /// is copied from memory (verified at adoption), like [`Engine::load`]; with a remote
    /// tier, a step not on disk is read from the bucket.
    pub fn load_into(
        &self,
        which: impl Into<StepSel>,
        dest: &mut [(&str, &mut [u8])],
    ) -> Result<u64> {
        let which = which.into();
        let info = match self.resolve(which) {
            Ok(info) => info,
            // Not on disk: from the bucket, with a remote tier.
            #[cfg(feature = "s3")]
            Err(Error::NotFound { .. }) if self.remote().is_some() => {
                return self.load_into_remote(which, dest).map(|r| r.step);
            }
            Err(e) => return Err(e),
        };
        if let Ok((image, _, entry, _)) = self.memory_image(&info)? {
            let named: Vec<(&str, u64)> = dest.iter().map(|(n, b)| (*n, b.len() as u64)).collect();
            let order = restore::match_destinations(&entry, &named)?;
            let mut slots: Vec<Option<&mut [u8]>> =
                dest.iter_mut().map(|(_, b)| Some(&mut **b)).collect();
            let ordered = order
                .iter()
                .map(|&i| slots[i].take().expect("each destination used once"))
                .collect();
            let a = image.as_ref().expect("memory_image returns a held image");
            a.send(&mut HostSink { dest: ordered })?;
            tracing::info!(
                step = info.step,
                "load_into served from the kept image (flash restore)"
            );
            return Ok(info.step);
        }
        restore::load_into(&info.dir, self.shared.cfg.rank, dest, &self.read_options())?;
        Ok(info.step)
    }

    /// Load this rank's tensors into device buffers, by name, verifying every checksum on
    /// the host before the bytes go to the device. Every tensor needs a buffer of exactly
    /// its size. Returns the step loaded.
    #[allow(unsafe_code)]
    pub fn load_into_device(
        &self,
        which: impl Into<StepSel>,
        dest: &mut [(&str, &mut DeviceBuffer)],
    ) -> Result<u64> {
        let slices: Vec<(&str, DeviceSlice<'_>)> =
            dest.iter().map(|(n, b)| (*n, b.slice())).collect();
        // SAFETY: each slice is a whole `DeviceBuffer` borrowed mutably for this call, so it
        // is valid for writes and nobody else uses it until we return.
        unsafe { self.load_into_device_raw(which, &slices) }
    }

    /// [`Engine::load_into_device`] with raw device ranges.
    ///
    /// # Safety
    /// Every range must be device memory of its device, valid for writes of its length and
    /// not accessed by anyone else until this call returns.
    #[allow(unsafe_code)]
    pub unsafe fn load_into_device_raw(
        &self,
        which: impl Into<StepSel>,
        dest: &[(&str, DeviceSlice<'_>)],
    ) -> Result<u64> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.load_into_device_raw_with_report(which, dest) }.map(|r| r.step)
    }

    /// [`Engine::load_into_device`], also reporting which path served the load (flash
    /// restore: the image adopted at open, checked completely then, is copied to the
    /// device straight from the engine's CUDA-registered arena).
    #[allow(unsafe_code)]
    pub fn load_into_device_with_report(
        &self,
        which: impl Into<StepSel>,
        dest: &mut [(&str, &mut DeviceBuffer)],
    ) -> Result<LoadReport> {
        let slices: Vec<(&str, DeviceSlice<'_>)> =
            dest.iter().map(|(n, b)| (*n, b.slice())).collect();
        // SAFETY: each slice is a whole `DeviceBuffer` borrowed mutably for this call, so it
        // is valid for writes and nobody else uses it until we return.
        unsafe { self.load_into_device_raw_with_report(which, &slices) }
    }

    /// [`Engine::load_into_device_raw`] with the report of
    /// [`Engine::load_into_device_with_report`].
    ///
    /// # Safety
    /// As [`Engine::load_into_device_raw`].
    #[allow(unsafe_code)]
    pub unsafe fn load_into_device_raw_with_report(
        &self,
        which: impl Into<StepSel>,
        dest: &[(&str, DeviceSlice<'_>)],
    ) -> Result<LoadReport> {
        let info = self.resolve(which.into())?;
        let (_, entry) = restore::rank_file(&info.dir, self.shared.cfg.rank)?;
        let named: Vec<(&str, u64)> = dest.iter().map(|(n, d)| (*n, d.len() as u64)).collect();
        let order = restore::match_destinations(&entry, &named)?;
        let ordered: Vec<Option<DeviceSlice<'_>>> =
            order.iter().map(|&i| Some(dest[i].1)).collect();
        let fallback_reason = match self.memory_image(&info)? {
            Ok((image, _, mem_entry, disk_problem)) if mem_entry == entry => {
                // SAFETY: forwarded from this function's contract.
                let mut sink = unsafe { DeviceSink::new(self.shared.cuda(), ordered)? };
                // Every checksum was verified when the image was adopted: straight from the
                // engine's own (CUDA-registered) arena chunks to the device, in file order;
                // the image stays locked (its chunks untouched) until the copies finished.
                let a = image.as_ref().expect("memory_image returns a held image");
                a.send(&mut sink)?;
                tracing::info!(
                    step = info.step,
                    "device load served from the kept image (flash restore)"
                );
                return Ok(LoadReport {
                    step: info.step,
                    source: LoadSource::Memory,
                    fallback_reason: None,
                    disk_problem,
                });
            }
            Ok(_) => Some(format!(
                "the manifest of step {} changed during the load",
                info.step
            )),
            Err(why) => why,
        };
        // From disk: O_DIRECT reads into a small ring of registered buffers of their own
        // (`EngineConfig::with_device_read`), each copied to the device as soon as it is
        // read and checksummed (the staging arena is not used: it may hold a kept image,
        // and its chunks are sized for writes).
        let ring = self.device_ring()?;
        // SAFETY: forwarded from this function's contract.
        unsafe {
            ring.read_to_device(
                &info.dir.join(&entry.file),
                &entry,
                ordered,
                &self.read_options(),
                None,
            )?
        };
        Ok(LoadReport {
            step: info.step,
            source: LoadSource::Disk,
            fallback_reason,
            disk_problem: None,
        })
    }

    /// Flash restore: check the disk copy of the step the adopted image holds completely,
    /// as `shmckpt verify` does for this rank's file (every byte read, header against the
    /// manifest, every tensor's CRC-32C). Loads served from memory only check the disk
    /// copy's size and header ([`LoadReport::disk_problem`]); call this (on a thread of
    /// your own: it reads the whole file, with the engine's read settings) to learn of
    /// damage inside the data section too. Returns the step checked, `None` when no image
    /// is adopted (none was, or a save dropped it); the error names the file and tensor.
    pub fn verify_disk_copy(&self) -> Result<Option<u64>> {
        let step = lock(&self.shared.adopted).as_ref().map(|a| a.step());
        let Some(step) = step else {
            return Ok(None);
        };
        let info = self.resolve(StepSel::Step(step))?;
        let (_, entry) = restore::rank_file(&info.dir, self.shared.cfg.rank)?;
        restore::read_file(
            &info.dir.join(&entry.file),
            &entry,
            &self.read_options(),
            &mut restore::Discard,
        )?;
        Ok(Some(step))
    }

    /// Manifest of a committed checkpoint.
    pub fn manifest(&self, which: impl Into<StepSel>) -> Result<Manifest> {
        Manifest::read(&self.resolve(which.into())?.dir)
    }

    /// The `__metadata__` of this rank's file of a committed checkpoint, read from the
    /// file's header after the header is checked against the manifest (its tensors, and
    /// its CRC-32C where the manifest records one): each rank's own metadata, which the
    /// manifest (the committing rank's) does not hold for the other ranks.
    pub fn file_metadata(&self, which: impl Into<StepSel>) -> Result<manifest::Metadata> {
        let dir = self.resolve(which.into())?.dir;
        let m = Manifest::read(&dir)?;
        let rank = self.shared.cfg.rank;
        let entry = m.files.iter().find(|f| f.rank == rank).ok_or_else(|| {
            Error::corrupt(
                dir.join(manifest::MANIFEST),
                None,
                format!("the manifest has no file of rank {rank}"),
            )
        })?;
        restore::read_file_metadata(&dir.join(&entry.file), entry)
    }

    /// The registered read buffers of device loads from disk, made at the first one.
    fn device_ring(&self) -> Result<Arc<restore::DeviceRing>> {
        let mut ring = lock(&self.device_ring);
        if let Some(r) = &*ring {
            return Ok(Arc::clone(r));
        }
        let cfg = &self.shared.cfg;
        let r = Arc::new(restore::DeviceRing::new(
            cfg.device_read,
            cfg.device_read_depth,
        )?);
        *ring = Some(Arc::clone(&r));
        Ok(r)
    }

    pub(crate) fn read_options(&self) -> restore::ReadOptions {
        restore::ReadOptions {
            backend: self.shared.cfg.backend,
            queue_depth: self.shared.cfg.queue_depth.max(2),
            direct_io: self.shared.cfg.direct_io,
            // A kept image lives in the arena's chunks: loads must not overwrite it.
            arena: (!self.shared.arena.keeps()).then(|| Arc::clone(&self.shared.arena)),
            any_dir_name: false,
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

    fn shutdown(&mut self) {
        self.shared.gate.wait_idle();
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
        // Uploads read committed files, not the arena: finished after the writers.
        #[cfg(feature = "s3")]
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

/// What flash restore did for a load.
enum Memory {
    /// Served it, with what the cheap check of the disk copy found wrong.
    Served(Checkpoint, Option<String>),
    /// Did not: why (`None` with the option off).
    Not(Option<String>),
}

use crate::util::lock;
