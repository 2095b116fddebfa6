//! The tier plug-in interface: what the engine asks of a tier beyond its own memory and
//! disk, and what such a tier is told. One implementation today, the object-storage tier
//! (`crate::remote`, feature `s3`); the engine names none of its types and has no branch
//! on whether it is compiled in.
//!
//! * [`TierSpec`]: a tier's settings in an [`EngineConfig`](crate::EngineConfig), checked
//!   with the configuration and opened with the engine ([`TierSpec::open`]).
//! * [`RemoteTier`]: an opened tier. Saves: [`RemoteTier::begin_save`] gives each save
//!   the tier takes a [`TierSave`], which is offered the save's staged chunks as they are
//!   written and told how the save ended locally ([`LocalOutcome`]). Loads: a restore
//!   source of committed steps ([`RemoteTier::list`], [`RemoteTier::read`], ...), the
//!   fallback of the engine's one load order.
//! * [`RemoteTier::replaces_disk`]: a tier that holds every save's only copy (a root of
//!   `s3://...`, "remote only"): the engine then writes no local file.

use std::any::Any;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::manifest::{FileEntry, Manifest, Metadata};
use crate::restore::{Checkpoint, DeviceRing, ReadSink};
use crate::staging::ChunkLease;
use crate::tensor::DeviceSlice;

/// What a read from the bucket did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteLoad {
    /// Step read.
    pub step: u64,
    /// Bytes read (header and data).
    pub bytes: u64,
    /// Time taken.
    pub elapsed: Duration,
    /// Data bytes sent to the device through registered staging buffers (loads into
    /// device memory; 0 for loads into host memory).
    pub staged: u64,
    /// Registered staging memory the load held (its two buffers; 0 for loads into host
    /// memory): with `concurrency` ranged GETs of `part_size` in flight, the most host
    /// memory a device load holds for data, never a copy of the whole object.
    pub staging: u64,
}

/// Where a load puts the tensors it reads (the destination of
/// [`LoadInto`](crate::LoadInto)).
#[derive(Debug)]
pub(crate) enum Target<'a> {
    /// New buffers owned by the returned checkpoint.
    Owned,
    /// The caller's host buffers, by name.
    Host(Vec<(&'a str, &'a mut [u8])>),
    /// Device ranges valid for writes, used by nobody else while the load runs (the
    /// contract of [`LoadInto::device_raw`](crate::LoadInto::device_raw);
    /// [`LoadInto::device`](crate::LoadInto::device) borrows whole buffers).
    Device(Vec<(&'a str, DeviceSlice<'a>)>),
}

/// What a tier needs of its engine when it opens.
#[derive(Debug, Clone)]
#[allow(
    dead_code,
    reason = "read by the tiers that implement the interface: none in a build without `s3`"
)]
pub(crate) struct TierContext {
    /// Ranks of the run (a step is committed once every rank's part is there).
    pub(crate) world_size: u32,
    /// The engine's root (the local checkpoint tier, or with a tier that replaces the
    /// disk, the rank's private directory).
    pub(crate) root: PathBuf,
    /// The run's session ([`crate::EngineConfig::with_session`]): a part of another
    /// session does not count toward a commit.
    pub(crate) session: Option<String>,
}

/// A tier's settings, held by [`EngineConfig`](crate::EngineConfig) (set through the
/// tier's own `with_*` setters, e.g. `EngineConfig::with_remote`).
pub(crate) trait TierSpec: std::fmt::Debug + Send + Sync {
    /// Check the settings ([`Error::Config`]); run by the configuration's own check.
    fn validate(&self) -> Result<()>;

    /// Whether the tier holds every save's only copy: the engine writes no local file
    /// (remote only).
    fn replaces_disk(&self) -> bool;

    /// Open the tier for an engine (checking what it needs, e.g. that the bucket can be
    /// listed). `None`: the settings name no tier (setters called without a target).
    fn open(&self, ctx: &TierContext) -> Result<Option<Arc<dyn RemoteTier>>>;

    /// A boxed copy (the configuration is `Clone`).
    fn clone_box(&self) -> Box<dyn TierSpec>;

    /// The settings as their own type, for the tier's setters.
    #[allow(
        dead_code,
        reason = "called by the tiers that implement the interface: none in a build without `s3`"
    )]
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

impl Clone for Box<dyn TierSpec> {
    fn clone(&self) -> Self {
        self.clone_box()
    }
}

/// An opened tier of an engine: it takes saves and serves loads.
pub(crate) trait RemoteTier: std::fmt::Debug + Send + Sync {
    /// Whether the tier holds every save's only copy (no local file is written).
    fn replaces_disk(&self) -> bool;

    /// A save the tier takes: `n_chunks` staging chunks of `chunk_size` bytes will be
    /// offered to it ([`TierSave::offer`]). Nothing is sent before [`TierSave::start`].
    fn begin_save(&self, step: u64, n_chunks: u64, chunk_size: u64) -> Arc<dyn TierSave>;

    /// Staging ran out of free chunks: give back every chunk the tier holds that it can
    /// read again elsewhere (the local file).
    fn reclaim(&self);

    /// Finish what is queued and stop; called once, when the engine closes, after its
    /// writers stopped.
    fn close(&self);

    /// Where the tier is, for messages.
    fn url(&self) -> &str;

    /// Committed steps, oldest first.
    fn list(&self) -> Result<Vec<u64>>;

    /// The newest committed step.
    fn latest(&self) -> Result<Option<u64>>;

    /// The manifest of committed step `step` ([`Error::NotFound`] when it is not).
    fn manifest(&self, step: u64) -> Result<Manifest>;

    /// The `__metadata__` of `rank`'s file of committed step `step`, from its header
    /// (checked against the manifest).
    fn file_metadata(&self, step: u64, rank: u32) -> Result<Metadata>;

    /// Read `rank`'s tensors of committed step `step` into `target`, every checksum
    /// verified; `ring`: the engine's CUDA-registered read buffers, for device targets.
    fn read(
        &self,
        step: u64,
        rank: u32,
        target: &mut Target<'_>,
        ring: &dyn Fn() -> Result<Arc<DeviceRing>>,
    ) -> Result<(Option<Checkpoint>, RemoteLoad)>;

    /// The tier as its own type (its public API on the engine, e.g. `Engine::remote`).
    #[allow(
        dead_code,
        reason = "called by the tiers that implement the interface: none in a build without `s3`"
    )]
    fn as_any(&self) -> &dyn Any;
}

/// How a save the tier takes ended locally.
#[derive(Debug)]
#[allow(
    dead_code,
    reason = "read by the tiers that implement the interface: none in a build without `s3`"
)]
pub(crate) enum LocalOutcome {
    /// Committed (or its part written): this rank's entry, and where its file may be
    /// (the partial directory's path, then the committed one's: another rank may rename
    /// the directory at any time), `None` when the save wrote no file (remote only).
    Committed {
        entry: FileEntry,
        file: Option<[PathBuf; 2]>,
    },
    /// Failed, or never started: nothing of it may reach the tier.
    Failed(Arc<Error>),
}

/// One save's copy to a tier.
pub(crate) trait TierSave: Send + Sync {
    /// Send the save (in the background): its chunks as they are offered, its completion
    /// once [`TierSave::local_outcome`] reports the local commit.
    fn start(&self, metadata: &Metadata, rank: u32, file_name: &str, file_len: u64);

    /// File chunk `chunk` (`len` bytes of `lease`) is written locally (or, remote only,
    /// staged and checksummed): the tier may hold it until it sent it.
    fn offer(&self, chunk: u64, lease: ChunkLease, len: usize);

    /// The save's local outcome (called once, on the commit thread).
    fn local_outcome(&self, outcome: LocalOutcome);

    /// The save's copy as its own type (its public API on the handle).
    #[allow(
        dead_code,
        reason = "called by the tiers that implement the interface: none in a build without `s3`"
    )]
    fn as_any(&self) -> &dyn Any;
}

/// A checkpoint's rank files, as the export (`crate::export`) reads them: a local
/// directory, the kept arenas, or a bucket's step (`crate::remote`).
pub(crate) trait RankFiles {
    /// The checkpoint, as the report and messages name it.
    fn source(&self) -> PathBuf;
    /// Rank file `f`, as messages name it.
    fn path_of(&self, f: &FileEntry) -> PathBuf;
    /// The local directory holding the rank files (the destination may not be inside it).
    fn local_dir(&self) -> Option<&Path> {
        None
    }
    /// The `__metadata__` of `f`'s header (its size and header checked against `f`).
    fn metadata(&self, f: &FileEntry) -> Result<Metadata>;
    /// Send the pieces of the tensors of `f` flagged in `wanted` to `sink` (file order),
    /// reading only their byte ranges, each one's CRC-32C checked against `f`. Returns the
    /// bytes read.
    fn read_wanted(&self, f: &FileEntry, wanted: &[bool], sink: &mut dyn ReadSink) -> Result<u64>;
}

#[cfg(test)]
mod tests;
