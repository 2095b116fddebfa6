//! Engine settings: [`EngineConfig`] and its defaults.

use std::path::{Path, PathBuf};
#[cfg(feature = "fault-injection")]
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::io::BackendKind;

/// Default staging capacity: 2 GiB.
pub const DEFAULT_STAGING_CAPACITY: u64 = 2 << 30;
/// First staging capacity of an engine whose capacity is sized from its saves (the Python
/// `Checkpointer` without `staging_capacity`): 64 MiB, grown with
/// [`auto_staging_capacity`] by the first save that needs more.
pub const AUTO_STAGING_INITIAL: u64 = 64 << 20;

/// The staging capacity that fits a save needing `needed` bytes of staging (what
/// [`Error::TooLarge`] reports): `needed` plus 1/16 of headroom, so that a state that
/// grows a little does not resize again, rounded up to whole chunks of `chunk_size`
/// bytes; only `needed` (rounded up to chunks) when `/dev/shm` cannot hold the headroom.
/// `reclaimable`: bytes of `/dev/shm` that are freed before the new arena is made (the
/// arena being replaced, unless it is kept in memory).
///
/// [`Error::ShmTooSmall`], naming `staging_capacity`, when `/dev/shm` (its free bytes plus
/// `reclaimable`) cannot hold `needed`. No memory is allocated here.
pub fn auto_staging_capacity(needed: u64, chunk_size: u64, reclaimable: u64) -> Result<u64> {
    auto_capacity_within(
        needed,
        chunk_size,
        crate::staging::shm::shm_available().saturating_add(reclaimable),
    )
}

/// [`auto_staging_capacity`] against `room` bytes of `/dev/shm`.
pub(crate) fn auto_capacity_within(needed: u64, chunk_size: u64, room: u64) -> Result<u64> {
    let chunk = chunk_size.max(1);
    let round = |b: u64| b.div_ceil(chunk).checked_mul(chunk);
    let overflow = || Error::SizeOverflow {
        what: "staging capacity",
    };
    let base = needed.max(chunk);
    let exact = round(base).ok_or_else(overflow)?;
    let roomy = base
        .checked_add(needed / 16)
        .and_then(round)
        .ok_or_else(overflow)?;
    if roomy <= room {
        Ok(roomy)
    } else if exact <= room {
        Ok(exact)
    } else {
        Err(Error::ShmTooSmall {
            name: "(staging_capacity unset: sized from the save)".into(),
            requested: exact,
            available: room,
            mount: crate::staging::shm::SHM_MOUNT.to_owned(),
        })
    }
}

/// Default chunk size: 8 MiB.
pub const DEFAULT_CHUNK_SIZE: u64 = 8 << 20;
/// Default bytes of device-to-host copies a save keeps queued ahead of their completion:
/// 256 MiB (about 5 ms of copies at 55 GB/s; `EngineConfig::with_copy_ahead`).
pub const DEFAULT_COPY_AHEAD: u64 = 256 << 20;
/// Default number of writer threads.
pub const DEFAULT_WRITER_THREADS: usize = 2;
/// Default requests in flight per writer.
pub const DEFAULT_QUEUE_DEPTH: u32 = 8;
/// Default number of save slots (saves staged or draining at once).
pub const DEFAULT_MAX_INFLIGHT_SAVES: u32 = 4;
/// Default size of each O_DIRECT read of a device load from disk: 32 MiB. On the H200
/// machine, 8 GiB disk-to-GPU loads with 32 MiB × 8 were the fastest of the settings
/// swept against raw reads of the same runs (16 MiB × 4 and × 8, 4 MiB × 16, 32 MiB × 8;
/// `benches/gpu/load_sweep.sh`, docs/benchmarks.md).
pub const DEFAULT_DEVICE_READ: u64 = 32 << 20;
/// Default reads in flight of a device load from disk: 8 (with the ring's 4 spare
/// buffers, 12 × 32 MiB = 384 MiB of registered host memory).
pub const DEFAULT_DEVICE_READ_DEPTH: u32 = 8;
/// Which saves go to the local disk ([`EngineConfig::with_disk_cadence`]); the others stay
/// in the memory tier only (staged in the shared-memory arena, recoverable after a crash
/// of the process, written to disk by no one while the process lives).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DiskCadence {
    /// Every `n`-th save goes to disk, counted in saves since the last disk save: the
    /// engine's first save, then every `n`-th after the previous disk save. `Every(1)` (the
    /// default) sends every save to disk, as without this setting.
    Every(u64),
    /// A save goes to disk when the previous disk save has finished (committed or failed),
    /// else it stays in memory only: the disk takes every save it can sustain. A dead
    /// engine's saves this engine recovers behind its open (flash restore) count as such a
    /// save until their recovery ends: they write to the same disk.
    WhenIdle,
}

impl Default for DiskCadence {
    fn default() -> Self {
        DiskCadence::Every(1)
    }
}

impl DiskCadence {
    /// Whether every save goes to disk (the default, no memory-only save ever).
    pub fn is_every_save(self) -> bool {
        self == DiskCadence::Every(1)
    }
}

/// Engine settings. Build with [`EngineConfig::new`] and the `with_*` setters; every
/// setter's documentation gives its default.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub(crate) root: PathBuf,
    pub(crate) staging_capacity: u64,
    pub(crate) chunk_size: u64,
    pub(crate) writer_threads: usize,
    pub(crate) queue_depth: u32,
    pub(crate) copy_threads: usize,
    pub(crate) direct_io: bool,
    pub(crate) batch_device_copies: bool,
    pub(crate) copy_ahead: u64,
    pub(crate) stream_latches: bool,
    pub(crate) blocking_sync: bool,
    pub(crate) keep_last: Option<usize>,
    pub(crate) rank: u32,
    pub(crate) world_size: u32,
    pub(crate) backend: BackendKind,
    pub(crate) shm_name: Option<String>,
    pub(crate) max_inflight_saves: u32,
    pub(crate) recover_on_open: bool,
    pub(crate) keep_in_memory: bool,
    pub(crate) replica_hold: bool,
    pub(crate) device_read: u64,
    pub(crate) device_read_depth: u32,
    pub(crate) create_root: bool,
    pub(crate) disk_cadence: DiskCadence,
    pub(crate) disk_interval: Option<std::time::Duration>,
    pub(crate) remote_every: u64,
    pub(crate) memory_steps: usize,
    pub(crate) session: Option<String>,
    /// The tier beyond memory and disk (the object-storage tier: `EngineConfig::with_remote`
    /// and its setters, feature `s3`), a plug-in (`crate::tier`).
    pub(crate) remote: Option<Box<dyn crate::tier::TierSpec>>,
    #[cfg(feature = "fault-injection")]
    pub(crate) faults: Option<Arc<crate::io::fault::FaultPlan>>,
    #[cfg(feature = "fault-injection")]
    pub(crate) prefault_pause: std::time::Duration,
}

impl EngineConfig {
    /// Settings for checkpoints under `root` (an existing, writable directory unless
    /// [`EngineConfig::with_create_root`] is on), with all defaults.
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
            batch_device_copies: std::env::var_os("SHMCKPT_BATCH_COPIES").is_none_or(|v| v != "0"),
            copy_ahead: DEFAULT_COPY_AHEAD,
            stream_latches: false,
            blocking_sync: false,
            keep_last: None,
            rank: 0,
            world_size: 1,
            backend: BackendKind::Auto,
            shm_name: None,
            max_inflight_saves: DEFAULT_MAX_INFLIGHT_SAVES,
            recover_on_open: true,
            keep_in_memory: false,
            replica_hold: false,
            device_read: DEFAULT_DEVICE_READ,
            device_read_depth: DEFAULT_DEVICE_READ_DEPTH,
            create_root: false,
            disk_cadence: DiskCadence::Every(1),
            disk_interval: None,
            remote_every: 1,
            memory_steps: 1,
            session: None,
            remote: None,
            #[cfg(feature = "fault-injection")]
            faults: None,
            #[cfg(feature = "fault-injection")]
            prefault_pause: std::time::Duration::ZERO,
        }
    }

    /// Bytes of shared-memory staging (rounded up to whole chunks). A checkpoint file
    /// larger than this is refused. Default 2 GiB. Building the engine checks that
    /// `/dev/shm` has this much free and allocates the first 64 MiB; the rest is allocated
    /// (pre-faulted) by background threads, a save taking only chunks already allocated
    /// ([`Engine::wait_staging_ready`](crate::Engine::wait_staging_ready)).
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

    /// Queue a device snapshot's copies ([`SaveOptions::snapshot_on_request`](crate::SaveOptions::snapshot_on_request))
    /// in one driver call per device where the driver can (`cuMemcpyBatchAsync`, CUDA
    /// 12.8+: [`cuda::batch_copies_supported`](crate::cuda::batch_copies_supported)), not
    /// one call per tensor. Default true, unless the environment variable
    /// `SHMCKPT_BATCH_COPIES` is `0` when the configuration is made (a switch for
    /// comparisons and for ruling the batch API out).
    pub fn with_batch_device_copies(mut self, on: bool) -> Self {
        self.batch_device_copies = on;
        self
    }

    /// Bytes of a save's device-to-host copies queued ahead of their completion; 0 queues
    /// every copy at once. Default [`DEFAULT_COPY_AHEAD`] (256 MiB).
    ///
    /// The copies go to the driver in the order of the checkpoint file, one per tensor
    /// piece of each staging chunk, and each chunk's copies are queued once the copies
    /// this many bytes before it have completed. Queueing all of them at once (thousands
    /// for a state of thousands of tensors) fills the driver's queue, where the trainer's
    /// own kernel launches then wait behind the engine's calls while the copy runs
    /// (docs/benchmarks.md, "Memory tier at the PCIe limit"). A save that holds the
    /// trainer's streams ([`SaveOptions::hold_streams`](crate::SaveOptions::hold_streams))
    /// queues every copy before it returns, whatever this is; a snapshot-mode save keeps
    /// its copies at most this far ahead (at most [`DEFAULT_COPY_AHEAD`] when this is 0), so
    /// that a snapshot finds most bytes not queued yet.
    pub fn with_copy_ahead(mut self, bytes: u64) -> Self {
        self.copy_ahead = bytes;
        self
    }

    /// Whether [`SaveWatch::hold_stream`](crate::SaveWatch::hold_stream) returns at once
    /// while a save's copies are still being queued, the stream waiting on the device for a
    /// latch the engine opens behind the last copies; default off: it blocks its thread
    /// until every copy is queued, then makes the stream wait for an event. Off by default
    /// because on an H100 a save of 8.18 GiB every ~184 ms step of the decoder bench cost
    /// more with latches (+5.05 % against +3.91 %, 5 alternated rounds,
    /// docs/benchmarks.md): that trainer's thread has nothing to launch while it waits.
    ///
    /// A latch is a 32-bit cell in pinned host memory: `cuStreamWaitValue32` on the
    /// caller's stream, `cuStreamWriteValue32` on the engine's stream behind the copies, or
    /// a store from the host when staging ends without (a latch is never left shut). It is
    /// used only for a device whose copies are ordered after an event recorded at the call
    /// ([`SaveOptions::after_event`](crate::SaveOptions::after_event), as the Python
    /// package's non-blocking saves do): ordered after a stream, the engine would record
    /// on it when staging starts, behind the latch, and wait for itself. Where the driver
    /// refuses stream memory operations, the blocking wait is used. Without latches the
    /// optimizer step's hook blocks its thread until about 5 ms before the copy's end
    /// (`with_copy_ahead`), time a trainer whose thread launches kernels all step long
    /// loses.
    pub fn with_stream_latches(mut self, on: bool) -> Self {
        self.stream_latches = on;
        self
    }

    /// Whether the engine's staging thread sleeps while it waits for its device-to-host
    /// copies (`CU_EVENT_BLOCKING_SYNC` events) instead of spinning on a core until they
    /// complete (the driver's default for a process with fewer contexts than cores).
    /// Default off.
    ///
    /// A save keeps its copies [`with_copy_ahead`](Self::with_copy_ahead) bytes ahead of
    /// their completion, so the staging thread waits for a chunk's copies about once per
    /// chunk (~1,000 waits for 8 GiB in 8 MiB chunks) for as long as the copy runs. Sleeping
    /// frees that core for the trainer's threads, at the cost of a wake-up (tens of
    /// microseconds) per wait.
    pub fn with_blocking_sync(mut self, on: bool) -> Self {
        self.blocking_sync = on;
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

    /// An id every rank of one run shares, new for each run (e.g. a random id that rank 0
    /// broadcasts; the Python `Checkpointer` does this under `torch.distributed`): 1 to
    /// 128 ASCII letters, digits, `-`, `_` or `.`. It is recorded in the header of each
    /// file this engine saves and in its manifest part (on disk and in a bucket), and a
    /// part of another session does not count toward a commit
    /// (`crate::commit::store::commit_parts`): after a crash, a rank's part of a step
    /// the dead run never committed is never merged with another rank's save of the same
    /// step number by the new run (a step whose files would come from two runs). A
    /// recovery commits a crashed save under the session that saved it. Default `None`:
    /// any part without a session counts, as before sessions existed; every multi-rank
    /// run should set one.
    pub fn with_session(mut self, session: Option<String>) -> Self {
        self.session = session;
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
    /// [`crate::recover`]; [`crate::Engine::recovered`] reports it). Arenas of live
    /// processes are never touched. Default true: a save that returned from `save`
    /// survives a crash of its trainer. Off, the open recovers nothing and deletes nothing
    /// recoverable: the dead engines' arenas that hold saves to recover, and their partial
    /// directories, are kept for `shmckpt recover` (logged as a warning;
    /// [`crate::Engine::unrecovered`] names them).
    pub fn with_recover_on_open(mut self, on: bool) -> Self {
        self.recover_on_open = on;
        self
    }

    /// Flash restore (default off). The staging arena is named after the root and rank
    /// (`shmckpt.keep-<hash of the canonical root>.r<rank>`, owner-only) and stays in
    /// `/dev/shm` when the engine closes or its process dies, holding the last committed
    /// step's bytes. A later engine of the same root and rank with this option attaches to
    /// it at open (same owner only) and adopts its image: with the same staging settings
    /// (chunk size, capacity, `max_inflight_saves`) it takes the segment over as its own
    /// arena, image in place (no copy, no second arena); otherwise it copies the image into
    /// a new arena and frees the previous segment. Either way it checks the image (a
    /// committed step, equal to the disk's latest, every tensor's CRC-32C against the
    /// manifest) and records it as the arena's kept image, so it survives a second crash
    /// before any save.
    /// `load`, `load_into` and `load_into_device` then serve that step from the engine's own
    /// arena (not checked again: it is this process's memory from then on; device loads
    /// copy from it directly, it being registered with CUDA), as long as it is the disk's
    /// latest; otherwise they read the disk and log why. The disk copy's size and header
    /// are checked before each load the image serves (a mismatch is logged and returned in
    /// `LoadReport::disk_problem`); `Engine::verify_disk_copy` checks every byte.
    /// [`EngineConfig::with_shm_name`] is ignored then (the name must be stable).
    ///
    /// Memory cost: the arena (`staging_capacity`) stays in `/dev/shm` after the process
    /// exits, until `shmckpt shm rm` (which refuses it while this engine runs, unless
    /// `--force`) or the next engine takes it over or replaces it; when
    /// the settings differ, both arenas exist during the new engine's open (the previous
    /// one is freed before `open` returns). Disk reads
    /// of `load_into` and `load_into_device` go through private buffers, so that they never
    /// overwrite the kept image. A save gives the kept image up when it starts; a crash
    /// during a disk save leaves nothing to restore from memory (the disk still has the
    /// last committed step).
    ///
    /// With a disk cadence ([`EngineConfig::with_disk_cadence`]) the memory-only steps
    /// live in this arena too: after a crash, recovery at open commits them from it and
    /// makes the newest its kept image (its bytes are all there), so the next engine
    /// serves that step from memory instead of reading back the file recovery wrote; a
    /// clean [`Engine::close`](crate::Engine::close) writes the held steps to disk and
    /// keeps the newest. With recovery at open off, a kept arena holding a staged save is
    /// left untouched for `shmckpt recover` (this engine then keeps nothing).
    pub fn with_keep_in_memory(mut self, on: bool) -> Self {
        self.keep_in_memory = on;
        self
    }

    /// Hold each committed save's image in its staging chunks for the replication of its
    /// step (peer replicas, `docs/replicas.md`): when the image is whole in the arena at
    /// commit, its chunks stay out of the free pool ([`crate::SaveHandle::held_image`]
    /// takes them) until the replication gives them back, or staging runs short (then
    /// every chunk not in a piece in flight comes back at once). Loads from disk then read
    /// through private buffers (never the arena's chunks). Default off.
    pub fn with_replica_hold(mut self, on: bool) -> Self {
        self.replica_hold = on;
        self
    }

    /// How device loads from disk ([`crate::Engine::load_with`] into device memory) read: O_DIRECT
    /// reads of `bytes` each (a multiple of 4096 between 1 MiB and 1 GiB), `depth` of them
    /// in flight (1..=64), into a ring of CUDA-registered buffers of their own (`depth` + 4
    /// buffers, made and registered at the first device load; the staging arena is not
    /// used). Each buffer is checksummed and copied to the device as soon as its read
    /// completes. Disks differ in which pattern they serve fastest (`shmckpt bench --load
    /// --source cuda --device-read SIZE --device-read-depth N` measures one against the raw
    /// read). Default 32 MiB × 8 (384 MiB of buffers).
    pub fn with_device_read(mut self, bytes: u64, depth: u32) -> Self {
        self.device_read = bytes;
        self.device_read_depth = depth;
        self
    }

    /// Create the root (and its missing parents, like `mkdir -p`: mode 0o777 less the
    /// umask) when it does not exist; a failure is [`Error::RootCreateFailed`] with the OS
    /// error. Default false: the Rust API and the command line refuse a missing root
    /// ([`Error::RootMissing`]), so a mistyped path is an error rather than a new
    /// directory. The Python `Checkpointer` turns it on (as PyTorch DCP's
    /// `FileSystemWriter` creates its directory).
    pub fn with_create_root(mut self, on: bool) -> Self {
        self.create_root = on;
        self
    }

    /// Whether saves write a local file: false when the tier beyond the disk holds every
    /// save's only copy (remote only, `EngineConfig::with_remote_only`).
    pub(crate) fn has_disk_tier(&self) -> bool {
        !self.remote.as_ref().is_some_and(|t| t.replaces_disk())
    }

    /// Which saves go to the local disk; the others are **memory-only**: staged into the
    /// shared-memory arena and marked complete in its descriptor (so recovery after a crash
    /// of the process commits them, as it commits any staged save), served to loads of this
    /// engine from the arena, but not written to disk while the process lives. The newest
    /// memory-only step is held until a newer save is loadable (a newer memory-only save
    /// staged, or a newer disk save committed); [`EngineConfig::with_memory_steps`] holds
    /// the `n` newest instead. [`Engine::close`](crate::Engine::close) writes the held
    /// steps to disk. Default [`DiskCadence::Every(1)`](DiskCadence::Every): every save
    /// goes to disk. Memory-only saves are never uploaded to the bucket: only disk saves
    /// are ([`EngineConfig::with_remote_every`]). [`DiskCadence::WhenIdle`] and
    /// [`EngineConfig::with_disk_interval`] decide per rank, so they are refused with
    /// several ranks (ranks that disagree would never commit a step); so is any cadence
    /// but `Every(1)` for a remote-only engine (it has no disk) or a kept arena
    /// ([`EngineConfig::with_keep_in_memory`]). With
    /// [`EngineConfig::with_replica_hold`], disk saves hold their images for replication as
    /// always; a memory-only save holds none (replicas take disk saves only).
    ///
    /// Host memory: the arena must hold the staging of the disk save draining, the held
    /// memory-only steps and the save being staged ((2 + `memory_steps`) × a save's file
    /// per rank, for a trainer whose disk saves drain while it saves again); when staging
    /// runs out, an older held memory-only step is given up (logged), never the newest:
    /// when the arena cannot hold it and the next save, it goes to disk first (logged) and
    /// the save waits for its chunks.
    pub fn with_disk_cadence(mut self, cadence: DiskCadence) -> Self {
        self.disk_cadence = cadence;
        self
    }

    /// A save also goes to disk when at least `interval` has passed since the last disk
    /// save began (whatever [`EngineConfig::with_disk_cadence`] says): a bound on how old
    /// the newest durable step can get. Default `None`.
    pub fn with_disk_interval(mut self, interval: Option<std::time::Duration>) -> Self {
        self.disk_interval = interval;
        self
    }

    /// With a remote tier: every `k`-th disk save is also uploaded to the bucket, counted
    /// in disk saves (the engine's first disk save, then every `k`-th after the last
    /// upload); the other disk saves stay local. Memory-only saves are never uploaded, so a
    /// save the bucket takes is always a disk save too. Default 1: every disk save.
    pub fn with_remote_every(mut self, k: u64) -> Self {
        self.remote_every = k;
        self
    }

    /// With a disk cadence: how many memory-only steps the memory tier holds at most, the
    /// newest ones saved since the last disk save committed (a committed disk save gives
    /// up the older ones: a newer step is durable). Each is served to loads of this engine,
    /// listed by [`Engine::list_in`](crate::Engine::list_in), committed by recovery after a
    /// crash of the process (every one held: each keeps its descriptor slot), and written
    /// to disk, oldest first, by [`Engine::close`](crate::Engine::close). A newer
    /// memory-only save beyond `n` gives the oldest held step up; so does staging when it
    /// runs out of chunks (saves never wait on the memory tier), oldest first, one step per
    /// time it runs out. The arena gets `n` descriptor slots beyond
    /// [`EngineConfig::with_max_inflight_saves`]. Default 1; at least 1, at most 256.
    ///
    /// Host memory per rank: staging must hold the disk save draining, the `n` held steps
    /// and the save being staged, `(n + 2) ×` a save's file, for none to be given up.
    pub fn with_memory_steps(mut self, n: usize) -> Self {
        self.memory_steps = n;
        self
    }

    /// Memory-only steps held at most ([`EngineConfig::with_memory_steps`]).
    pub fn memory_steps(&self) -> usize {
        self.memory_steps
    }

    /// Descriptor slots of the staging arena: the saves in flight, and with a disk cadence
    /// the memory-only steps held ([`EngineConfig::with_memory_steps`]).
    pub(crate) fn arena_slots(&self) -> u32 {
        if self.every_save_to_disk() {
            self.max_inflight_saves
        } else {
            self.max_inflight_saves + self.memory_steps as u32
        }
    }

    /// The disk cadence ([`EngineConfig::with_disk_cadence`]).
    pub fn disk_cadence(&self) -> DiskCadence {
        self.disk_cadence
    }

    /// Whether every save goes to disk (the default cadence and no interval).
    pub(crate) fn every_save_to_disk(&self) -> bool {
        self.disk_cadence.is_every_save() && self.disk_interval.is_none()
    }

    /// Whether committed images are held for replication ([`EngineConfig::with_replica_hold`]).
    pub fn replica_hold(&self) -> bool {
        self.replica_hold
    }

    /// Bytes of device copies queued ahead ([`EngineConfig::with_copy_ahead`]).
    pub fn copy_ahead(&self) -> u64 {
        self.copy_ahead
    }

    /// Whether held streams wait on latches ([`EngineConfig::with_stream_latches`]).
    pub fn stream_latches(&self) -> bool {
        self.stream_latches
    }

    /// Whether waits for device copies sleep ([`EngineConfig::with_blocking_sync`]).
    pub fn blocking_sync(&self) -> bool {
        self.blocking_sync
    }

    /// Bytes per staging chunk ([`EngineConfig::with_chunk_size`]).
    pub fn chunk_size(&self) -> u64 {
        self.chunk_size
    }

    /// Staging arena bytes ([`EngineConfig::with_staging_capacity`]).
    pub fn staging_capacity(&self) -> u64 {
        self.staging_capacity
    }

    /// Writer threads ([`EngineConfig::with_writer_threads`]).
    pub fn writer_threads(&self) -> usize {
        self.writer_threads
    }

    /// I/O queue depth per writer thread ([`EngineConfig::with_queue_depth`]).
    pub fn queue_depth(&self) -> u32 {
        self.queue_depth
    }

    /// Host-copy threads ([`EngineConfig::with_copy_threads`]).
    pub fn copy_threads(&self) -> usize {
        self.copy_threads
    }

    /// Whether files are written with O_DIRECT ([`EngineConfig::with_direct_io`]).
    pub fn direct_io(&self) -> bool {
        self.direct_io
    }

    /// Committed steps kept, `None` for all ([`EngineConfig::with_keep_last`]).
    pub fn keep_last(&self) -> Option<usize> {
        self.keep_last
    }

    /// This process's rank and the world size ([`EngineConfig::with_rank`]).
    pub fn rank(&self) -> (u32, u32) {
        (self.rank, self.world_size)
    }

    /// The write backend asked for ([`EngineConfig::with_backend`]).
    pub fn backend(&self) -> BackendKind {
        self.backend
    }

    /// Saves in flight at most ([`EngineConfig::with_max_inflight_saves`]).
    pub fn max_inflight_saves(&self) -> u32 {
        self.max_inflight_saves
    }

    /// Whether flash restore is on ([`EngineConfig::with_keep_in_memory`]).
    pub fn keep_in_memory(&self) -> bool {
        self.keep_in_memory
    }

    /// Inject I/O faults (tests only).
    #[cfg(feature = "fault-injection")]
    pub fn with_faults(mut self, plan: Arc<crate::io::fault::FaultPlan>) -> Self {
        self.faults = Some(plan);
        self
    }

    /// Delay every background prefault batch of the staging arena by `pause` (tests
    /// only: a slow prefault).
    #[cfg(feature = "fault-injection")]
    pub fn with_prefault_pause(mut self, pause: std::time::Duration) -> Self {
        self.prefault_pause = pause;
        self
    }

    /// The delay of every background prefault batch (zero unless a test set one).
    pub(crate) fn prefault_pause(&self) -> std::time::Duration {
        #[cfg(feature = "fault-injection")]
        return self.prefault_pause;
        #[cfg(not(feature = "fault-injection"))]
        std::time::Duration::ZERO
    }

    /// The checkpoint root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    pub(crate) fn validate(&self) -> Result<()> {
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
        if let Some(id) = self
            .session
            .as_deref()
            .filter(|id| !crate::manifest::is_session_id(id))
        {
            return Err(Error::Config(format!(
                "session {id:?} must be 1 to {} ASCII letters, digits, '-', '_' or '.'",
                crate::manifest::MAX_SESSION_LEN
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
        crate::restore::check_device_read(self.device_read, self.device_read_depth)?;
        if let Some(t) = &self.remote {
            t.validate()?;
        }
        if self.keep_last == Some(0) {
            return Err(Error::Config(
                "keep_last must be at least 1 (None keeps all)".into(),
            ));
        }
        self.validate_cadence()?;
        Ok(())
    }
}

impl EngineConfig {
    /// The disk cadence's checks ([`EngineConfig::with_disk_cadence`]).
    fn validate_cadence(&self) -> Result<()> {
        if self.disk_cadence == DiskCadence::Every(0) {
            return Err(Error::Config(
                "disk_every must be at least 1 (1: every save goes to disk)".into(),
            ));
        }
        if self.disk_interval == Some(std::time::Duration::ZERO) {
            return Err(Error::Config(
                "disk_interval must be positive (None: no interval)".into(),
            ));
        }
        if !(1..=256).contains(&self.memory_steps) {
            return Err(Error::Config(
                "memory_steps must be 1..=256 (1: the newest memory-only step)".into(),
            ));
        }
        if self.remote_every == 0 {
            return Err(Error::Config(
                "remote_every must be at least 1 (1: every disk save is uploaded)".into(),
            ));
        }
        if self.remote_every > 1 && !self.has_disk_tier() {
            return Err(Error::Config(
                "a remote-only engine uploads every save: remote_every must be 1".into(),
            ));
        }
        let per_rank = self.disk_cadence == DiskCadence::WhenIdle || self.disk_interval.is_some();
        if per_rank && self.world_size > 1 {
            return Err(Error::Config(
                "disk_every=\"auto\" and disk_interval decide per rank: with several ranks a \
                 step could go to disk on one rank and stay in memory on another, and never \
                 commit; use disk_every=N"
                    .into(),
            ));
        }
        if !self.every_save_to_disk() && !self.has_disk_tier() {
            return Err(Error::Config(
                "a remote-only engine has no disk: disk_every must be 1".into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn auto_capacity_adds_a_sixteenth_in_whole_chunks() {
        // 100 MiB + 6.25 MiB = 106.25 MiB, rounded up to 8 MiB chunks: 112 MiB.
        assert_eq!(
            auto_capacity_within(100 * MIB, 8 * MIB, 1 << 40).unwrap(),
            112 * MIB
        );
        // A save smaller than one chunk still gets one chunk (and its sixteenth).
        assert_eq!(auto_capacity_within(1, 8 * MIB, 1 << 40).unwrap(), 8 * MIB);
        assert_eq!(
            auto_capacity_within(0, 64 << 10, 1 << 40).unwrap(),
            64 << 10
        );
    }

    #[test]
    fn auto_capacity_is_bounded_by_shared_memory() {
        // Room for the save but not the headroom: exactly the save, in whole chunks.
        assert_eq!(
            auto_capacity_within(100 * MIB, 8 * MIB, 105 * MIB).unwrap(),
            104 * MIB
        );
        // No room: ShmTooSmall with the numbers, naming the setting and the remedy.
        let e = auto_capacity_within(100 * MIB, 8 * MIB, 103 * MIB).unwrap_err();
        match &e {
            Error::ShmTooSmall {
                requested,
                available,
                mount,
                ..
            } => {
                assert_eq!(*requested, 104 * MIB);
                assert_eq!(*available, 103 * MIB);
                assert_eq!(mount, "/dev/shm");
            }
            other => panic!("expected ShmTooSmall, got {other:?}"),
        }
        let msg = e.to_string();
        assert!(
            msg.contains("staging_capacity") && msg.contains("enlarge /dev/shm"),
            "{msg}"
        );
        // Sizes near u64::MAX are an error, not a wrap.
        assert!(matches!(
            auto_capacity_within(u64::MAX - 1, 8 * MIB, u64::MAX),
            Err(Error::SizeOverflow { .. })
        ));
    }
}
