//! The engine: plan → stage → write → commit.
//!
//! `save` validates and lays out the tensors, creates the partial directory and file,
//! copies every byte into staging chunks (several threads for host memory) and hands each
//! chunk to the writer pool as soon as it is complete. It returns when the last byte is
//! staged. Writers checksum and write the chunks; the commit thread, taking saves in order,
//! waits for the last write, makes the file durable, writes the manifest and renames the
//! directory.

use std::collections::BTreeSet;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use crate::commit::{self, RootLock};
use crate::device::cuda::{DeviceBuffer, EventRef, StreamRef};
use crate::device::{After, CudaStaging, DeviceSink, Sources, StageJob, host};
use crate::error::{Error, Result};
use crate::io::file::FileTarget;
use crate::io::pool::{ChunkInfo, Outcome, WriteJob, WriteSink, WriterPool};
use crate::io::{BackendKind, BackendOptions, align_up};
use crate::manifest::{self, CheckpointInfo, FileEntry, Manifest, Metadata, TensorEntry};
use crate::plan::{self, PieceSource, Plan, TensorSpec};
use crate::restore::{self, Checkpoint};
use crate::staging::descriptor::SaveRecord;
use crate::staging::{Arena, ArenaSpec, ChunkLease, NAME_PREFIX};
use crate::tensor::{DeviceSlice, Source, Tensor};

/// Default staging capacity: 2 GiB.
pub const DEFAULT_STAGING_CAPACITY: u64 = 2 << 30;
/// Default chunk size: 8 MiB.
pub const DEFAULT_CHUNK_SIZE: u64 = 8 << 20;
/// Default number of writer threads.
pub const DEFAULT_WRITER_THREADS: usize = 2;
/// Default requests in flight per writer.
pub const DEFAULT_QUEUE_DEPTH: u32 = 8;
/// Default number of save slots (saves staged or draining at once).
pub const DEFAULT_MAX_INFLIGHT_SAVES: u32 = 4;
/// Engine settings. Build with [`EngineConfig::new`] and the `with_*` setters; every
/// setter's documentation gives its default.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    root: PathBuf,
    staging_capacity: u64,
    chunk_size: u64,
    writer_threads: usize,
    queue_depth: u32,
    copy_threads: usize,
    direct_io: bool,
    keep_last: Option<usize>,
    rank: u32,
    world_size: u32,
    backend: BackendKind,
    shm_name: Option<String>,
    max_inflight_saves: u32,
    recover_on_open: bool,
    #[cfg(feature = "fault-injection")]
    faults: Option<Arc<crate::io::fault::FaultPlan>>,
}

impl EngineConfig {
    /// Settings for checkpoints under `root` (an existing, writable directory), with all
    /// defaults.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        EngineConfig {
            root: root.into(),
            staging_capacity: DEFAULT_STAGING_CAPACITY,
            chunk_size: DEFAULT_CHUNK_SIZE,
            writer_threads: DEFAULT_WRITER_THREADS,
            queue_depth: DEFAULT_QUEUE_DEPTH,
            copy_threads: std::thread::available_parallelism()
                .map(|n| n.get().min(4))
                .unwrap_or(1),
            direct_io: true,
            keep_last: None,
            rank: 0,
            world_size: 1,
            backend: BackendKind::Auto,
            shm_name: None,
            max_inflight_saves: DEFAULT_MAX_INFLIGHT_SAVES,
            recover_on_open: false,
            #[cfg(feature = "fault-injection")]
            faults: None,
        }
    }

    /// Bytes of shared-memory staging, reserved and pre-faulted when the engine is built
    /// (rounded up to whole chunks). A checkpoint file larger than this is refused. Default
    /// 2 GiB.
    pub fn with_staging_capacity(mut self, bytes: u64) -> Self {
        self.staging_capacity = bytes;
        self
    }

    /// Unit of staging, writing and (for CUDA) copy events. A multiple of 4096 between
    /// 64 KiB and 1 GiB. Default 8 MiB.
    pub fn with_chunk_size(mut self, bytes: u64) -> Self {
        self.chunk_size = bytes;
        self
    }

    /// Writer threads, each with its own io_uring (or `pwrite` loop). Default 2.
    pub fn with_writer_threads(mut self, n: usize) -> Self {
        self.writer_threads = n;
        self
    }

    /// Writes in flight per writer thread (io_uring submission queue depth). Default 8.
    pub fn with_queue_depth(mut self, depth: u32) -> Self {
        self.queue_depth = depth;
        self
    }

    /// Threads copying host tensors into staging (saves under 64 MiB use one). Default: the
    /// number of CPUs, at most 4.
    pub fn with_copy_threads(mut self, n: usize) -> Self {
        self.copy_threads = n;
        self
    }

    /// Open files with `O_DIRECT` (falls back to buffered writes plus `fdatasync`, logged,
    /// when the filesystem refuses it). Default true.
    pub fn with_direct_io(mut self, on: bool) -> Self {
        self.direct_io = on;
        self
    }

    /// Keep only the newest `n` committed checkpoints (`None`: keep all). Older ones are
    /// deleted only after a newer one is committed. Default `None`.
    pub fn with_keep_last(mut self, n: Option<usize>) -> Self {
        self.keep_last = n;
        self
    }

    /// This process's rank and the number of ranks; they name the file
    /// (`rank-00003-of-00008.safetensors`). Default 0 of 1.
    pub fn with_rank(mut self, rank: u32, world_size: u32) -> Self {
        self.rank = rank;
        self.world_size = world_size;
        self
    }

    /// Write backend. Default [`BackendKind::Auto`] (io_uring, else `pwrite` with a
    /// warning).
    pub fn with_backend(mut self, kind: BackendKind) -> Self {
        self.backend = kind;
        self
    }

    /// Name of the staging segment in `/dev/shm` (without slash). Default
    /// `shmckpt.<pid>.r<rank>.<n>`.
    pub fn with_shm_name(mut self, name: impl Into<String>) -> Self {
        self.shm_name = Some(name.into());
        self
    }

    /// Saves that may be staged or draining at once; a further `save` waits. Default 4.
    pub fn with_max_inflight_saves(mut self, n: u32) -> Self {
        self.max_inflight_saves = n;
        self
    }

    /// On open, before stale partial directories are removed, recover the staging arenas
    /// that dead engines of this root and rank left in `/dev/shm`: commit every save they
    /// had fully staged, refuse the others, remove the arenas, and log each step (see
    /// [`crate::recover`]). Arenas of live processes are never touched. Default false:
    /// leftovers are then kept for `shmckpt recover`, but partial files already written
    /// are removed by the open.
    pub fn with_recover_on_open(mut self, on: bool) -> Self {
        self.recover_on_open = on;
        self
    }

    /// Inject I/O faults (tests only).
    #[cfg(feature = "fault-injection")]
    pub fn with_faults(mut self, plan: Arc<crate::io::fault::FaultPlan>) -> Self {
        self.faults = Some(plan);
        self
    }

    /// The checkpoint root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn validate(&self) -> Result<()> {
        let cs = self.chunk_size;
        if !cs.is_multiple_of(4096) || !(64 << 10..=1 << 30).contains(&cs) {
            return Err(Error::Config(format!(
                "chunk_size {cs} must be a multiple of 4096 between 64 KiB and 1 GiB"
            )));
        }
        if self.staging_capacity < cs {
            return Err(Error::Config(format!(
                "staging_capacity {} is smaller than one chunk ({cs})",
                self.staging_capacity
            )));
        }
        if self.world_size == 0 || self.rank >= self.world_size {
            return Err(Error::Config(format!(
                "rank {} is not below world_size {}",
                self.rank, self.world_size
            )));
        }
        if !(1..=256).contains(&self.writer_threads) {
            return Err(Error::Config("writer_threads must be 1..=256".into()));
        }
        if !(1..=4096).contains(&self.queue_depth) {
            return Err(Error::Config("queue_depth must be 1..=4096".into()));
        }
        if !(1..=256).contains(&self.max_inflight_saves) {
            return Err(Error::Config("max_inflight_saves must be 1..=256".into()));
        }
        if let Some(n) = &self.shm_name
            && (n.is_empty() || n.len() > 200 || n.contains('/'))
        {
            return Err(Error::Config(format!(
                "shm name {n:?} must be 1..200 characters without '/'"
            )));
        }
        if self.keep_last == Some(0) {
            return Err(Error::Config(
                "keep_last must be at least 1 (None keeps all)".into(),
            ));
        }
        Ok(())
    }

    /// Build the engine.
    pub fn build(self) -> Result<Engine> {
        Engine::open(self)
    }
}

/// A tensor whose memory is handed to the engine, for [`Engine::save_async_owned`].
#[derive(Debug)]
pub struct OwnedTensor {
    /// Name, unique within a save.
    pub name: String,
    /// Element type.
    pub dtype: crate::Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Its bytes.
    pub data: OwnedData,
}

/// The memory of an [`OwnedTensor`].
#[derive(Debug)]
#[non_exhaustive]
pub enum OwnedData {
    /// Host bytes.
    Host(Vec<u8>),
    /// A whole device buffer.
    Cuda(DeviceBuffer),
}

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

/// Timings of a save, measured from the moment `save` was called.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SaveTimings {
    /// Until `save` returned: every byte staged (the trainer's stall).
    pub staging: Duration,
    /// Part of `staging` spent waiting for free staging chunks or save slots (backpressure
    /// from earlier saves still draining).
    pub backpressure: Duration,
    /// Until the file was written and `fdatasync`ed.
    pub durable: Duration,
    /// Until the checkpoint directory was renamed into place and the root fsynced.
    pub committed: Duration,
}

/// What a finished save did.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq)]
pub struct SaveReport {
    /// Step.
    pub step: u64,
    /// Committed directory (for multi-rank saves, set by whichever rank committed; `None`
    /// while other ranks are still writing).
    pub dir: Option<PathBuf>,
    /// This rank's file (its final path once committed).
    pub file: PathBuf,
    /// Bytes of this rank's file.
    pub bytes: u64,
    /// Tensors saved.
    pub tensors: usize,
    /// Timings.
    pub timings: SaveTimings,
    /// Backend that wrote (`io_uring`, `pwrite`).
    pub backend: &'static str,
    /// Whether the file was written with O_DIRECT.
    pub direct_io: bool,
    /// Steps deleted by retention after this commit.
    pub retired: Vec<u64>,
}

impl SaveReport {
    /// Bytes over time-to-durable, in GB/s.
    pub fn persist_gbps(&self) -> f64 {
        crate::util::gbps(self.bytes, self.timings.durable)
    }
}

/// What is known as soon as `save` returns.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StagedReport {
    /// Step.
    pub step: u64,
    /// File bytes staged.
    pub bytes: u64,
    /// Time in `save` (stall).
    pub staging: Duration,
    /// Part of it spent waiting for staging space.
    pub backpressure: Duration,
    /// Part of it spent registering the staging arena with CUDA (the first device save of
    /// an engine not prepared with [`Engine::prepare_cuda`]).
    pub registration: Duration,
}

struct Shared {
    cfg: EngineConfig,
    arena: Arc<Arena>,
    inflight: Mutex<BTreeSet<u64>>,
    backend: &'static str,
    gate: Gate,
    cuda: OnceLock<Arc<CudaStaging>>,
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

/// Options of [`Engine::save_with`] and [`Engine::save_async`]; borrows the streams and
/// events it names for `'a`.
#[derive(Debug, Clone, Default)]
pub struct SaveOptions<'a> {
    after: Vec<(i32, After)>,
    _handles: PhantomData<&'a ()>,
}

impl<'a> SaveOptions<'a> {
    /// Default options: device copies start after the device is synchronized.
    pub fn new() -> Self {
        Self::default()
    }

    /// Copy the tensors of `stream`'s device after the work queued on `stream` when `save`
    /// is called, instead of synchronizing the whole device. Use the stream the tensors
    /// were produced on ([`Stream::handle`](crate::cuda::Stream::handle), or
    /// [`StreamRef::from_raw`](crate::cuda::StreamRef::from_raw) for a framework's stream).
    pub fn after_stream(mut self, stream: StreamRef<'a>) -> Self {
        let device = stream.device();
        self.after.retain(|(d, _)| *d != device);
        self.after.push((device, After::Stream(stream.raw())));
        self
    }

    /// Copy the tensors of `event`'s device after `event` (recorded by the caller after
    /// producing them) instead of synchronizing the whole device.
    pub fn after_event(mut self, event: EventRef<'a>) -> Self {
        let device = event.device();
        self.after.retain(|(d, _)| *d != device);
        self.after.push((device, After::Event(event.raw())));
        self
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
    _lock: RootLock,
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

impl Engine {
    /// Open an engine: check the root, take the rank lock, remove stale partial
    /// directories, create the staging arena and start the writers.
    pub fn open(cfg: EngineConfig) -> Result<Engine> {
        cfg.validate()?;
        commit::check_root(&cfg.root)?;
        let lock = commit::lock_root(&cfg.root, cfg.rank)?;
        if cfg.recover_on_open {
            crate::recover::recover_on_open(&cfg.root, cfg.rank);
        }
        commit::clean_stale(&cfg.root, cfg.rank)?;
        let name = cfg.shm_name.clone().unwrap_or_else(|| {
            format!(
                "{NAME_PREFIX}{}.r{}.{}",
                std::process::id(),
                cfg.rank,
                ARENA_COUNTER.fetch_add(1, Ordering::Relaxed)
            )
        });
        let root_abs = std::fs::canonicalize(&cfg.root).unwrap_or_else(|_| cfg.root.clone());
        let t = Instant::now();
        let arena = Arena::create(&ArenaSpec {
            name: Some(name),
            capacity: cfg.staging_capacity,
            chunk_size: cfg.chunk_size,
            slots: cfg.max_inflight_saves,
            rank: cfg.rank,
            world_size: cfg.world_size,
            root: root_abs,
        })?;
        tracing::debug!(name = ?arena.name(), bytes = arena.capacity(), elapsed = ?t.elapsed(), "staging arena ready");
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
            inflight: Mutex::new(BTreeSet::new()),
            gate: Gate::default(),
            cuda: OnceLock::new(),
        });
        let (tx, rx) = crossbeam_channel::unbounded::<Arc<SaveState>>();
        let commit_thread = std::thread::Builder::new()
            .name("shmckpt-commit".into())
            .spawn(move || {
                for st in rx {
                    st.wait_settled();
                    let res = finalize(&st);
                    st.complete(res);
                }
            })
            .map_err(|e| Error::Config(format!("cannot spawn commit thread: {e}")))?;
        Ok(Engine {
            shared,
            pool,
            commit_tx: Some(tx),
            commit_thread: Some(commit_thread),
            last_save: Mutex::new(None),
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
    pub fn backend(&self) -> &'static str {
        self.shared.backend
    }

    /// Save `tensors` as checkpoint `step`.
    ///
    /// Returns as soon as every byte is in staging: the caller may then overwrite or free
    /// its tensors (host or device). The returned handle reports when the checkpoint is
    /// durable and committed. If earlier saves still occupy the staging arena, this waits
    /// for space (reported as `backpressure`). Invalid input is rejected before anything is
    /// written.
    ///
    /// Device tensors are copied after all work queued on their device has finished (the
    /// device is synchronized); use [`Engine::save_with`] to wait for one stream or event
    /// instead.
    pub fn save(
        &self,
        step: u64,
        tensors: &[Tensor<'_>],
        metadata: &Metadata,
    ) -> Result<SaveHandle> {
        self.save_with(step, tensors, metadata, &SaveOptions::default())
    }

    /// [`Engine::save`] with options (ordering of device copies after the trainer's work).
    pub fn save_with(
        &self,
        step: u64,
        tensors: &[Tensor<'_>],
        metadata: &Metadata,
        opts: &SaveOptions<'_>,
    ) -> Result<SaveHandle> {
        let sources = Sources::new(tensors);
        let state = self.begin(step, tensors, metadata)?;
        let jobs = self
            .pool
            .sender()
            .ok_or_else(|| Error::Shutdown("engine closed".into()))?;
        match stage_and_finish(&state, &sources, &opts.after, &jobs) {
            Ok(()) => Ok(SaveHandle { state }),
            Err(()) => Err(SaveHandle { state }
                .wait()
                .err()
                .unwrap_or_else(|| Error::Internal("staging failed without an error".into()))),
        }
    }

    /// Start a save and return at once; staging runs on a background thread. The handle
    /// reports staged ([`SaveHandle::wait_staged`]) and durable ([`SaveHandle::wait`])
    /// separately. Validation errors are still returned here.
    ///
    /// # Safety
    /// Every tensor's memory (host slices and device ranges) must stay valid and must not
    /// be modified or freed until [`SaveHandle::wait_staged`] (or `wait`) has returned or
    /// [`SaveHandle::is_staged`] is true. Trainers that order their own work after staging
    /// (e.g. the next optimizer step waits on the handle) use this to overlap the copy
    /// with other work.
    #[allow(unsafe_code)]
    pub unsafe fn save_async(
        &self,
        step: u64,
        tensors: &[Tensor<'_>],
        metadata: &Metadata,
        opts: &SaveOptions<'_>,
    ) -> Result<SaveHandle> {
        // SAFETY: this function's contract: the caller keeps every tensor's memory valid and
        // unmodified until the handle reports the save staged.
        let sources = unsafe { Sources::new(tensors).into_static() };
        let state = self.begin(step, tensors, metadata)?;
        self.spawn_staging(state, sources, opts.after.clone(), Box::new(()))
    }

    /// [`Engine::save_async`] without `unsafe`: the engine takes ownership of the tensors'
    /// memory and frees it once the save is staged (device buffers are dropped then, host
    /// vectors deallocated). Device copies start after the device is synchronized.
    #[allow(unsafe_code)]
    pub fn save_async_owned(
        &self,
        step: u64,
        tensors: Vec<OwnedTensor>,
        metadata: &Metadata,
    ) -> Result<SaveHandle> {
        let views: Vec<Tensor<'_>> = tensors
            .iter()
            .map(|t| match &t.data {
                OwnedData::Host(b) => {
                    Tensor::host(t.name.as_str(), t.dtype, t.shape.clone(), b.as_slice())
                }
                OwnedData::Cuda(b) => b.tensor(t.name.as_str(), t.dtype, t.shape.clone()),
            })
            .collect();
        // SAFETY: every tensor's memory is owned by `tensors`, which moves into the staging
        // thread (moving a `Vec` or a `DeviceBuffer` does not move the memory it owns) and
        // is dropped there only after staging has ended; nobody else can reach it, so it is
        // neither modified nor freed while it is read.
        let sources = unsafe { Sources::new(&views).into_static() };
        let state = self.begin(step, &views, metadata)?;
        drop(views);
        self.spawn_staging(state, sources, Vec::new(), Box::new(tensors))
    }

    /// Stage `state` on a background thread, dropping `sources` and then `keep` (which may
    /// own the memory `sources` points to) once staging ended.
    fn spawn_staging(
        &self,
        state: Arc<SaveState>,
        sources: Sources<'static>,
        after: Vec<(i32, After)>,
        keep: Box<dyn Send>,
    ) -> Result<SaveHandle> {
        let jobs = self
            .pool
            .sender()
            .ok_or_else(|| Error::Shutdown("engine closed".into()))?;
        let st = Arc::clone(&state);
        let spawned = std::thread::Builder::new()
            .name("shmckpt-stage".into())
            .spawn(move || {
                let _ = stage_and_finish(&st, &sources, &after, &jobs);
                drop(sources);
                drop(keep);
            });
        if let Err(e) = spawned {
            let err = Error::Internal(format!("cannot spawn the staging thread: {e}"));
            state.staging_finished(Err(err));
            return Err(SaveHandle { state }
                .wait()
                .err()
                .unwrap_or_else(|| Error::Internal("staging failed without an error".into())));
        }
        Ok(SaveHandle { state })
    }

    /// Set up CUDA for `devices` now (contexts, streams, and the one-time registration of
    /// the staging arena) instead of at the first save that needs it. Returns the
    /// registration time if this call registered.
    pub fn prepare_cuda(&self, devices: &[i32]) -> Result<Option<Duration>> {
        self.shared
            .cuda()
            .prepare(&devices.iter().copied().collect())
    }

    /// How long registering the staging arena with CUDA took, once it is registered.
    pub fn cuda_registration_time(&self) -> Option<Duration> {
        self.shared.cuda.get().and_then(|c| c.registration_time())
    }

    /// Validate, lay out, create the files and the descriptor slot, queue the save for
    /// commit, and take the staging gate (released when staging ends).
    fn begin(
        &self,
        step: u64,
        tensors: &[Tensor<'_>],
        metadata: &Metadata,
    ) -> Result<Arc<SaveState>> {
        let started = Instant::now();
        let cfg = &self.shared.cfg;
        let arena = &self.shared.arena;
        let cs = arena.chunk_size();

        // 1. Validate and lay out: nothing is touched before this succeeds.
        let specs: Vec<TensorSpec> = tensors
            .iter()
            .map(|t| TensorSpec {
                name: t.name.to_string(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                len: t.source.len(),
            })
            .collect();
        let system: Metadata = [
            (plan::META_STEP.to_owned(), step.to_string()),
            (plan::META_RANK.to_owned(), cfg.rank.to_string()),
            (plan::META_WORLD.to_owned(), cfg.world_size.to_string()),
        ]
        .into();
        let plan = Plan::new(&specs, &system, metadata)?;
        let needed = plan.chunk_count(cs) * cs;
        if needed > arena.capacity() {
            return Err(Error::TooLarge {
                needed,
                capacity: arena.capacity(),
            });
        }
        let devices: BTreeSet<i32> = tensors
            .iter()
            .filter_map(|t| match t.source {
                Source::Cuda(d) if !d.is_empty() => Some(d.device()),
                _ => None,
            })
            .collect();
        if !devices.is_empty() {
            crate::device::cuda::init()?;
        }

        // One save stages at a time.
        let gate_wait = self.shared.gate.enter();
        if !lock(&self.shared.inflight).insert(step) {
            self.shared.gate.leave();
            return Err(Error::StepExists {
                step,
                root: cfg.root.clone(),
            });
        }
        let undo = || {
            lock(&self.shared.inflight).remove(&step);
            self.shared.gate.leave();
        };

        // 2. Files: a committed step is refused here; creating the partial directory and
        // the file (metadata operations that can wait behind the filesystem's journal,
        // e.g. discards of a deleted checkpoint) happens off the caller's path, on the
        // opener thread below, while staging proceeds.
        if cfg.root.join(manifest::step_dir_name(step)).exists() {
            undo();
            return Err(Error::StepExists {
                step,
                root: cfg.root.clone(),
            });
        }
        let file_name = manifest::rank_file_name(cfg.rank, cfg.world_size);
        let partial = cfg.root.join(manifest::partial_dir_name(step));

        // 3. A descriptor slot, so a crash from here on is recoverable.
        let t_slot = Instant::now();
        let slot = arena.acquire_slot();
        let slot_wait = t_slot.elapsed() + gate_wait;
        let n_chunks = plan.chunk_count(cs);
        arena.descriptor().begin(
            slot,
            &SaveRecord {
                step,
                file_len: plan.file_len(),
                data_start: plan.data_start(),
                n_file_chunks: n_chunks,
                partial_dir: &manifest::partial_dir_name(step),
                file_name: &file_name,
            },
        );
        let state = Arc::new(SaveState {
            shared: Arc::clone(&self.shared),
            step,
            plan,
            metadata: metadata.clone(),
            file: FileSlot {
                path: partial.join(&file_name),
                ..FileSlot::default()
            },
            partial,
            file_name,
            slot,
            started,
            slot_wait,
            failed: AtomicBool::new(false),
            progress: Mutex::new(Progress::default()),
            changed: Condvar::new(),
            crcs: Mutex::new(vec![Vec::new(); n_chunks as usize]),
        });
        let queued = self
            .commit_tx
            .as_ref()
            .map(|tx| tx.send(Arc::clone(&state)).is_ok())
            .unwrap_or(false);
        if !queued {
            // No commit thread to clean up: do it here.
            arena.release_slot(slot);
            undo();
            return Err(Error::Shutdown("engine closed".into()));
        }
        let st = Arc::clone(&state);
        let opener = std::thread::Builder::new()
            .name("shmckpt-open".into())
            .spawn(move || st.open_file());
        if let Err(e) = opener {
            state.file_opened(Err(Error::Shutdown(format!(
                "cannot spawn the file-opening thread: {e}"
            ))));
        }
        *lock(&self.last_save) = Some(Arc::clone(&state));
        Ok(state)
    }

    /// Committed checkpoints, oldest first.
    pub fn list(&self) -> Result<Vec<CheckpointInfo>> {
        manifest::list_committed(&self.shared.cfg.root)
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
    pub fn load(&self, which: impl Into<StepSel>) -> Result<Checkpoint> {
        let info = self.resolve(which.into())?;
        restore::load_owned(&info.dir, self.shared.cfg.rank, &self.read_options())
    }

    /// Load this rank's tensors into caller buffers, by name, verifying every checksum.
    /// Every tensor of the checkpoint must have a destination of exactly its size. Returns
    /// the step loaded.
    pub fn load_into(
        &self,
        which: impl Into<StepSel>,
        dest: &mut [(&str, &mut [u8])],
    ) -> Result<u64> {
        let info = self.resolve(which.into())?;
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
        let info = self.resolve(which.into())?;
        let (_, entry) = restore::rank_file(&info.dir, self.shared.cfg.rank)?;
        let named: Vec<(&str, u64)> = dest.iter().map(|(n, d)| (*n, d.len() as u64)).collect();
        let order = restore::match_destinations(&entry, &named)?;
        let ordered = order.iter().map(|&i| dest[i].1).collect();
        // SAFETY: forwarded from this function's contract.
        let mut sink = unsafe { DeviceSink::new(self.shared.cuda(), ordered)? };
        restore::read_file(
            &info.dir.join(&entry.file),
            &entry,
            &self.read_options(),
            &mut sink,
        )?;
        Ok(info.step)
    }

    /// Manifest of a committed checkpoint.
    pub fn manifest(&self, which: impl Into<StepSel>) -> Result<Manifest> {
        Manifest::read(&self.resolve(which.into())?.dir)
    }

    pub(crate) fn read_options(&self) -> restore::ReadOptions {
        restore::ReadOptions {
            backend: self.shared.cfg.backend,
            queue_depth: self.shared.cfg.queue_depth.max(2),
            direct_io: self.shared.cfg.direct_io,
            arena: Some(Arc::clone(&self.shared.arena)),
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
        self.shared.arena.close();
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Default)]
struct Progress {
    dispatched: u64,
    finished: u64,
    staging_done: bool,
    staged: Option<std::result::Result<StagedReport, Arc<Error>>>,
    error: Option<Arc<Error>>,
    result: Option<std::result::Result<SaveReport, Arc<Error>>>,
    done: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum FileState {
    #[default]
    Pending,
    Ready,
    Failed,
}

/// The save's file, opened by the opener thread while staging runs.
#[derive(Debug, Default)]
struct FileSlot {
    target: OnceLock<Arc<FileTarget>>,
    state: Mutex<FileState>,
    changed: Condvar,
    /// Where the file is being written (known before it exists, for errors).
    path: PathBuf,
}

/// One save in flight; shared by the caller's handle, the writers and the commit thread.
pub(crate) struct SaveState {
    shared: Arc<Shared>,
    step: u64,
    plan: Plan,
    metadata: Metadata,
    file: FileSlot,
    partial: PathBuf,
    file_name: String,
    slot: u32,
    started: Instant,
    /// Time spent waiting for the staging gate and a descriptor slot.
    slot_wait: Duration,
    failed: AtomicBool,
    progress: Mutex<Progress>,
    changed: Condvar,
    /// Per file chunk: (entry, crc32c, length) of each tensor piece in it.
    crcs: Mutex<Vec<Vec<(u32, u32, u64)>>>,
}

impl SaveState {
    /// The first error of a failed save, for `flush`; `None` if it succeeded.
    fn failure(&self) -> Option<Error> {
        let p = lock(&self.progress);
        match (&p.result, &p.error) {
            (Some(Err(e)), _) | (None, Some(e)) => Some(Error::SaveFailed {
                step: self.step,
                source: Arc::clone(e),
            }),
            _ => None,
        }
    }

    /// Staged chunks are always zero-padded to 4096; the writer writes the padding only
    /// when the file is open with O_DIRECT.
    fn write_len(&self, len: usize) -> usize {
        align_up(len as u64) as usize
    }

    /// Runs on the opener thread: create the partial directory and the file, reserve its
    /// space. Failures fail the save (the handle reports them).
    fn open_file(&self) {
        let cfg = &self.shared.cfg;
        let r = commit::prepare_partial(&cfg.root, self.step, &self.file_name, cfg.world_size)
            .and_then(|partial| {
                let t = FileTarget::create(&partial.join(&self.file_name), cfg.direct_io)?;
                t.preallocate(align_up(self.plan.file_len()))?;
                Ok(t)
            });
        self.file_opened(r);
    }

    fn file_opened(&self, r: Result<FileTarget>) {
        let ok = match r {
            Ok(t) => {
                let _ = self.file.target.set(Arc::new(t));
                true
            }
            Err(e) => {
                self.failed.store(true, Ordering::Release);
                let mut p = lock(&self.progress);
                if p.error.is_none() {
                    p.error = Some(Arc::new(e));
                }
                false
            }
        };
        *lock(&self.file.state) = if ok {
            FileState::Ready
        } else {
            FileState::Failed
        };
        self.file.changed.notify_all();
        self.changed.notify_all();
    }

    /// The open file, waiting for the opener; `None` if opening failed.
    fn file_target(&self) -> Option<&Arc<FileTarget>> {
        let mut s = lock(&self.file.state);
        while *s == FileState::Pending {
            s = self.file.changed.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        drop(s);
        self.file.target.get()
    }

    fn staging_finished(&self, r: std::result::Result<StagedReport, Error>) {
        let mut p = lock(&self.progress);
        match r {
            Ok(rep) => p.staged = Some(Ok(rep)),
            Err(e) => {
                self.failed.store(true, Ordering::Release);
                let e = Arc::new(e);
                // A write error that made staging stop is the root cause: keep it.
                if p.error.is_none() {
                    p.error = Some(Arc::clone(&e));
                }
                p.staged = Some(Err(p.error.clone().unwrap_or(e)));
            }
        }
        p.staging_done = true;
        drop(p);
        self.shared.gate.leave();
        self.changed.notify_all();
    }

    /// Block until staging ended and every dispatched chunk finished.
    fn wait_settled(&self) {
        let mut p = lock(&self.progress);
        while !(p.staging_done && p.finished == p.dispatched) {
            p = self.changed.wait(p).unwrap_or_else(|e| e.into_inner());
        }
        drop(p);
        // The opener must be done too, so a failed save's file can be removed.
        let _ = self.file_target();
    }

    fn wait_done(&self) {
        let mut p = lock(&self.progress);
        while !p.done {
            p = self.changed.wait(p).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn complete(&self, r: std::result::Result<SaveReport, Arc<Error>>) {
        lock(&self.shared.inflight).remove(&self.step);
        let mut p = lock(&self.progress);
        p.result = Some(r);
        p.done = true;
        drop(p);
        self.changed.notify_all();
    }

    fn tensor_crcs(&self) -> Vec<u32> {
        let mut acc: Vec<Option<u32>> = vec![None; self.plan.entries().len()];
        for chunk in lock(&self.crcs).iter() {
            for &(e, crc, len) in chunk {
                let a = &mut acc[e as usize];
                *a = Some(match *a {
                    None => crc,
                    Some(prev) => crc32c::crc32c_combine(prev, crc, len as usize),
                });
            }
        }
        acc.into_iter().map(|c| c.unwrap_or(0)).collect()
    }
}

impl WriteSink for SaveState {
    fn target(&self) -> Option<&Arc<FileTarget>> {
        self.file_target()
    }

    fn path(&self) -> &Path {
        &self.file.path
    }

    fn failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    fn finished(&self, chunk: &ChunkInfo, bytes: Option<&[u8]>, outcome: Outcome) {
        let mut failure = None;
        match (outcome, bytes) {
            (Outcome::Written, Some(bytes)) => {
                // Checksum the staged bytes of each tensor piece, off the caller's path.
                let cs = self.shared.arena.chunk_size();
                let parts: Vec<(u32, u32, u64)> = self
                    .plan
                    .pieces(self.plan.chunk_range(chunk.chunk, cs))
                    .into_iter()
                    .filter_map(|p| match p.source {
                        PieceSource::Tensor { entry, .. } => Some((
                            entry as u32,
                            crc32c::crc32c(&bytes[p.dst..p.dst + p.len]),
                            p.len as u64,
                        )),
                        PieceSource::Header { .. } => None,
                    })
                    .collect();
                lock(&self.crcs)[chunk.chunk as usize] = parts;
                self.shared
                    .arena
                    .descriptor()
                    .chunk_written(self.slot, chunk.chunk);
            }
            (Outcome::Written, None) => {
                failure = Some(Error::Internal("chunk written without its bytes".into()))
            }
            (Outcome::Failed(e), _) => failure = Some(e),
            (Outcome::Skipped, _) => {}
        }
        if failure.is_some() || self.failed() {
            // The lease drops after this returns and its arena chunk may be refilled by
            // another save: the descriptor must not point recovery at it any more.
            self.shared
                .arena
                .descriptor()
                .chunk_lost(self.slot, chunk.chunk);
        }
        let mut p = lock(&self.progress);
        if let Some(e) = failure {
            self.failed.store(true, Ordering::Release);
            if p.error.is_none() {
                p.error = Some(Arc::new(e));
            }
        }
        p.finished += 1;
        drop(p);
        self.changed.notify_all();
    }
}

/// Stage every chunk of `state` (host or device sources) and record the outcome. On
/// failure the save is marked failed (the commit thread cleans up) and `Err` is returned.
fn stage_and_finish(
    state: &Arc<SaveState>,
    sources: &Sources<'_>,
    after: &[(i32, After)],
    jobs: &Sender<WriteJob>,
) -> std::result::Result<(), ()> {
    let step = state.step;
    let dispatch = |lease: ChunkLease, chunk: u64, len: usize, write_len: usize| {
        dispatch(state, jobs, lease, chunk, len, write_len)
    };
    let devices = sources.devices();
    let mut registration = Duration::ZERO;
    let write_len = |len: usize| state.write_len(len);
    let failed = || state.failed();
    let job = StageJob {
        plan: &state.plan,
        sources,
        write_len: &write_len,
        failed: &failed,
        dispatch: &dispatch,
    };
    let staged = if devices.is_empty() {
        host::stage_host(&state.shared.arena, &job, state.shared.cfg.copy_threads)
    } else {
        let cuda = state.shared.cuda();
        match cuda.prepare(&devices) {
            Ok(r) => {
                registration = r.unwrap_or_default();
                cuda.stage(&job, after)
            }
            Err(e) => Err(e),
        }
    };
    match staged {
        Ok(waited) => {
            state.shared.arena.descriptor().staged(state.slot);
            let report = StagedReport {
                step,
                bytes: state.plan.file_len(),
                staging: state.started.elapsed(),
                backpressure: state.slot_wait + waited,
                registration,
            };
            tracing::debug!(step, staging = ?report.staging, backpressure = ?report.backpressure, "save staged");
            state.staging_finished(Ok(report));
            Ok(())
        }
        Err(e) => {
            state.staging_finished(Err(e));
            // Let the commit thread clean up, so a retry of this step can start at once.
            state.wait_done();
            Err(())
        }
    }
}

/// Record file chunk `chunk` as staged and queue its write.
fn dispatch(
    state: &Arc<SaveState>,
    jobs: &Sender<WriteJob>,
    lease: ChunkLease,
    chunk: u64,
    len: usize,
    write_len: usize,
) -> Result<()> {
    let cs = state.shared.arena.chunk_size();
    state
        .shared
        .arena
        .descriptor()
        .chunk_staged(state.slot, chunk, lease.index());
    lock(&state.progress).dispatched += 1;
    let job = WriteJob {
        sink: Arc::clone(state) as Arc<dyn WriteSink>,
        lease,
        info: ChunkInfo {
            chunk,
            offset: chunk * cs,
            len,
            write_len,
        },
    };
    if let Err(e) = jobs.send(job) {
        let job = e.0;
        let err = Error::Shutdown("writer pool is gone".into());
        job.sink.finished(&job.info, None, Outcome::Failed(err));
        return Err(Error::Shutdown("writer pool is gone".into()));
    }
    Ok(())
}

/// Runs on the commit thread once a save has settled.
fn finalize(st: &SaveState) -> std::result::Result<SaveReport, Arc<Error>> {
    let failure = {
        let mut p = lock(&st.progress);
        if st.failed() {
            Some(p.error.take().unwrap_or_else(|| {
                Arc::new(Error::Internal(
                    "staging failed before the save was complete".into(),
                ))
            }))
        } else {
            None
        }
    };
    let result = match failure {
        Some(e) => Err(e),
        None => persist(st).map_err(Arc::new),
    };
    if result.is_err() {
        commit::abort_partial(&st.partial, &st.file_name);
    }
    st.shared.arena.release_slot(st.slot);
    if let Err(e) = &result {
        tracing::error!(step = st.step, error = %e, "save failed; nothing committed");
    }
    result
}

fn persist(st: &SaveState) -> Result<SaveReport> {
    let cfg = &st.shared.cfg;
    let target = st
        .file_target()
        .ok_or_else(|| Error::Internal("the checkpoint file was never opened".into()))?;
    target.finish(st.plan.file_len())?;
    let durable = st.started.elapsed();
    let crcs = st.tensor_crcs();
    let data_start = st.plan.data_start();
    let entry = FileEntry {
        rank: cfg.rank,
        file: st.file_name.clone(),
        bytes: st.plan.file_len(),
        data_start,
        tensors: st
            .plan
            .entries()
            .iter()
            .zip(&crcs)
            .map(|(e, &crc)| TensorEntry {
                name: e.name.clone(),
                dtype: e.dtype,
                shape: e.shape.clone(),
                data_offsets: e.data_offsets(data_start),
                crc32c: crc,
            })
            .collect(),
    };
    let dir = commit::commit(
        &cfg.root,
        st.step,
        cfg.world_size,
        &st.partial,
        entry,
        &st.metadata,
    )?;
    let committed = st.started.elapsed();
    let mut retired = Vec::new();
    if let (Some(keep), Some(_)) = (cfg.keep_last, &dir) {
        match commit::apply_retention(&cfg.root, keep) {
            Ok(r) => retired = r,
            Err(e) => tracing::warn!(error = %e, "retention failed; older checkpoints kept"),
        }
    }
    let (staging, backpressure) = match &lock(&st.progress).staged {
        Some(Ok(s)) => (s.staging, s.backpressure),
        _ => (Duration::ZERO, Duration::ZERO),
    };
    let file = match &dir {
        Some(d) => d.join(&st.file_name),
        None => st.partial.join(&st.file_name),
    };
    Ok(SaveReport {
        step: st.step,
        dir,
        file,
        bytes: st.plan.file_len(),
        tensors: st.plan.entries().len(),
        timings: SaveTimings {
            staging,
            backpressure,
            durable,
            committed,
        },
        backend: st.shared.backend,
        direct_io: target.is_direct(),
        retired,
    })
}

/// A save in flight. Dropping it does not cancel the save.
pub struct SaveHandle {
    state: Arc<SaveState>,
}

impl std::fmt::Debug for SaveHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SaveHandle")
            .field("step", &self.state.step)
            .field("done", &self.is_done())
            .finish()
    }
}

impl SaveHandle {
    /// The step.
    pub fn step(&self) -> u64 {
        self.state.step
    }

    /// Staging facts, once every byte is staged (`save` returns staged); `None` before,
    /// or when staging failed.
    pub fn staged(&self) -> Option<StagedReport> {
        match &lock(&self.state.progress).staged {
            Some(Ok(s)) => Some(*s),
            _ => None,
        }
    }

    /// True once every byte is staged (or staging failed): the caller's tensors are no
    /// longer read.
    pub fn is_staged(&self) -> bool {
        lock(&self.state.progress).staging_done
    }

    /// Block until every byte is staged: from then on the caller may reuse its tensors.
    pub fn wait_staged(&self) -> Result<StagedReport> {
        let mut p = lock(&self.state.progress);
        while !p.staging_done {
            p = self
                .state
                .changed
                .wait(p)
                .unwrap_or_else(|e| e.into_inner());
        }
        match &p.staged {
            Some(Ok(s)) => Ok(*s),
            Some(Err(e)) => Err(Error::SaveFailed {
                step: self.state.step,
                source: Arc::clone(e),
            }),
            None => Err(Error::Internal("staging ended without a report".into())),
        }
    }

    /// True once the save is committed or has failed (`wait` then returns at once).
    pub fn is_done(&self) -> bool {
        lock(&self.state.progress).done
    }

    /// Block until the checkpoint is durable and committed, or failed.
    pub fn wait(self) -> Result<SaveReport> {
        let mut p = lock(&self.state.progress);
        while !p.done {
            p = self
                .state
                .changed
                .wait(p)
                .unwrap_or_else(|e| e.into_inner());
        }
        let step = self.state.step;
        // The handle is consumed: its staging report (which may share the error) is no
        // longer needed, so the caller can get the original error back.
        if matches!(p.staged, Some(Err(_))) {
            p.staged = None;
        }
        match p.result.take() {
            Some(Ok(r)) => Ok(r),
            // The original error, unless `flush` handed out a share of it.
            Some(Err(e)) => {
                Err(Arc::try_unwrap(e).unwrap_or_else(|e| Error::SaveFailed { step, source: e }))
            }
            None => Err(Error::Internal("result already taken".into())),
        }
    }

    /// Like [`SaveHandle::wait`], giving up after `timeout` (returns the handle back).
    pub fn wait_timeout(
        self,
        timeout: Duration,
    ) -> std::result::Result<Result<SaveReport>, SaveHandle> {
        let deadline = Instant::now() + timeout;
        {
            let mut p = lock(&self.state.progress);
            while !p.done {
                let now = Instant::now();
                if now >= deadline {
                    drop(p);
                    return Err(self);
                }
                p = self
                    .state
                    .changed
                    .wait_timeout(p, deadline - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
        Ok(self.wait())
    }
}
