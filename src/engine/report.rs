//! What a save reports: once staged, and once committed.

use std::path::PathBuf;
use std::time::Duration;

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
    /// Until the checkpoint directory was renamed into place and the root fsynced; `None`
    /// when this save committed nothing (other ranks still missing, a part-only save, a
    /// bucket-only save): a report whose `dir` is `None` carries no commit time.
    pub committed: Option<Duration>,
}

/// Where [`crate::Engine::open`] spent its time, phase by phase, to tell a slow restart's
/// cause (recovering a crashed predecessor's saves, setting up the arena, the writers).
#[non_exhaustive]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OpenTimings {
    /// Recovering dead engines' staging arenas of this root and rank: rebuilding, writing
    /// (`fdatasync` included) and committing their staged saves, and removing what they
    /// left (`EngineConfig::with_recover_on_open`).
    pub recovery: Duration,
    /// Removing stale partial directories.
    pub clean: Duration,
    /// Setting up this engine's staging arena: taking the kept arena over and checking its
    /// image (flash restore), or creating a new one (its pages are allocated in the
    /// background), and adopting a kept image into it by copying.
    pub arena: Duration,
    /// Starting the writers (io_uring rings and their registered buffers).
    pub writers: Duration,
    /// The whole open.
    pub total: Duration,
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
    pub backend: crate::io::Backend,
    /// Whether the file was written with O_DIRECT.
    pub direct_io: bool,
    /// A memory-only save (`EngineConfig::with_disk_cadence`): staged in the shared-memory
    /// arena and recoverable after a crash of the process, **not durable**: nothing was
    /// written to disk, `dir` is `None`, `file` is empty and the timings' `durable` is
    /// zero. Loads of this engine read it from memory; `Engine::close` writes the newest
    /// such step to disk.
    pub memory_only: bool,
    /// Steps retired by this commit's retention (`keep_last`): no longer listed or
    /// loadable when the save is reported committed; their files are deleted right after
    /// (by the time [`crate::Engine::close`] returns).
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
    /// an engine not prepared with [`Engine::prepare_cuda`](crate::Engine::prepare_cuda)).
    pub registration: Duration,
    /// Device bytes of the save's snapshot (its peak; 0 when none was taken:
    /// [`SaveOptions::snapshot_on_request`](crate::SaveOptions::snapshot_on_request)).
    pub snapshot_bytes: u64,
    /// Whether that snapshot queued its device-to-device copies in one driver call per
    /// device (`cuMemcpyBatchAsync`, CUDA 12.8+; see
    /// [`cuda::batch_copies_supported`](crate::cuda::batch_copies_supported)) rather than
    /// one per tensor; `false` when none was taken.
    pub snapshot_batched: bool,
}

/// Which path served a load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LoadSource {
    /// The checkpoint files on disk.
    Disk,
    /// Shared memory: the arena a previous engine kept (flash restore), or a memory-only
    /// save of this engine (`EngineConfig::with_disk_cadence`).
    Memory,
    /// The bucket of the remote tier (a step not on the local disk).
    Remote,
}

/// What a load did ([`Loaded::report`](crate::Loaded::report) of [`crate::Engine::load_with`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LoadReport {
    /// Step loaded.
    pub step: u64,
    /// Which path served it.
    pub source: LoadSource,
    /// With flash restore on and the disk serving: why memory could not.
    pub fallback_reason: Option<String>,
    /// With memory serving: what the cheap check of this rank's file on disk found wrong
    /// (its size, or its header bytes against the kept image's), also logged as an error.
    /// The bytes served are the manifest's all the same (checked by CRC-32C at adoption),
    /// but the disk copy is damaged: a load from disk would fail. `None` when the check
    /// passed or memory did not serve. Damage inside the data section is not seen by this
    /// check: `shmckpt verify` reads every byte.
    pub disk_problem: Option<String>,
}
