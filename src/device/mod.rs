//! Copy sources: how bytes get from host or device memory into staging chunks.
//!
//! Host tensors are copied with `memcpy`, by several threads for large saves
//! ([`host`]). Device tensors are copied with `cuMemcpyDtoHAsync` on the engine's own stream
//! per device, straight into each tensor's place in the staged file image; one event per
//! chunk and device marks the chunk complete, and the chunk goes to the writers as soon as
//! its events have fired, so disk writes overlap the rest of the device-to-host copy
//! ([`pipeline`]).
//!
//! `unsafe` is allowed only in the leaf files that need it: `cuda/`, `sources.rs`,
//! `pipeline.rs`.
#![deny(unsafe_code)]

pub mod cuda;
pub mod host;
pub mod pipeline;
pub mod snapshot;
pub mod sources;

use crate::error::Result;
use crate::plan::Plan;
use crate::staging::ChunkLease;

pub(crate) use pipeline::{After, CudaStaging};
pub use snapshot::SnapshotRequest;
pub use sources::Sources;

/// One event per device, recorded after that device's copies of a save.
pub(crate) type Marks = Vec<(i32, cuda::Event)>;
/// Latches by device (`cuda::Latch`).
pub(crate) type Latches = Vec<(i32, cuda::Latch)>;

/// What staging needs from the engine.
pub struct StageJob<'a> {
    /// The file image.
    pub plan: &'a Plan,
    /// The tensors' bytes.
    pub sources: &'a Sources<'a>,
    /// Bytes to write for a chunk holding `len` file bytes (O_DIRECT rounding).
    pub write_len: &'a (dyn Fn(usize) -> usize + Sync),
    /// True once the save failed (stop early).
    pub failed: &'a (dyn Fn() -> bool + Sync),
    /// Hand a complete chunk to the writers.
    pub dispatch: &'a (dyn Fn(ChunkLease, u64, usize, usize) -> Result<()> + Sync),
    /// Make the `After::Stream` streams wait (on the device) for the save's copies, and
    /// call `queued` once every copy is queued and they wait ([`crate::SaveOptions::hold_streams`]).
    pub hold: bool,
    /// Called once every host byte is copied and every device copy is queued (with
    /// `hold`: and the streams wait for them), with one event per device recorded after
    /// that device's copies; for host-only saves when staging ended (no events). Returns
    /// the latches the trainer's streams wait on (`SaveWatch::hold_stream`): the pipeline
    /// opens each on its device's engine stream, behind the copies (dropped unopened: opened
    /// from the host).
    pub queued: &'a (dyn Fn(Marks) -> Latches + Sync),
    /// Snapshot mode ([`crate::SaveOptions::snapshot_on_request`]; not with `hold`):
    /// device copies are queued at most [`snapshot::LOOKAHEAD_BYTES`] ahead, and once the
    /// request is set the bytes not queued yet are copied into a transient device buffer;
    /// `queued` is then called with the events after those copies (the caller's device
    /// memory is no longer read once they complete), and not again at the end.
    pub snapshot: Option<&'a SnapshotRequest>,
}
