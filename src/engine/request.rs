//! What a load asks for and where its bytes go: [`LoadRequest`] (which step, from which
//! sources), [`LoadInto`] (owned buffers, caller host buffers or device memory) and
//! [`Loaded`] (what [`Engine::load_with`](super::Engine::load_with) did).

use super::{LoadReport, StepSel, Tiers};
use crate::device::cuda::DeviceBuffer;
use crate::restore::Checkpoint;
use crate::tensor::DeviceSlice;

/// The sources a load may read from. Whatever the set, they are tried in the one order of
/// [`Engine::load_with`](super::Engine::load_with): the image kept in shared memory
/// (flash restore), then the local disk, then the bucket (the remote tier). Default:
/// [`Sources::ALL`].
///
/// Peer images (replicas) are not a source of their own here: the replica wire is driven
/// by `torch.distributed` in the Python package, which puts a partner's file on the local
/// disk; the load then reads it as the disk's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Sources {
    memory: bool,
    disk: bool,
    bucket: bool,
}

impl Sources {
    /// Memory, disk and bucket: what a load reads by default.
    pub const ALL: Sources = Sources {
        memory: true,
        disk: true,
        bucket: true,
    };
    /// Memory or the local disk, never the bucket ([`Tiers::Local`]).
    pub const LOCAL: Sources = Sources {
        memory: true,
        disk: true,
        bucket: false,
    };
    /// The kept image in shared memory only: a step it cannot serve is
    /// [`Error::NotFound`](crate::Error::NotFound), with the reason.
    pub const MEMORY: Sources = Sources {
        memory: true,
        disk: false,
        bucket: false,
    };
    /// The local disk only (the kept image is not used even when it holds the step).
    pub const DISK: Sources = Sources {
        memory: false,
        disk: true,
        bucket: false,
    };
    /// The bucket only ([`Tiers::Remote`]), whatever the local disk holds.
    pub const BUCKET: Sources = Sources {
        memory: false,
        disk: false,
        bucket: true,
    };

    /// With or without the kept image in memory.
    pub const fn with_memory(mut self, on: bool) -> Self {
        self.memory = on;
        self
    }

    /// With or without the local disk.
    pub const fn with_disk(mut self, on: bool) -> Self {
        self.disk = on;
        self
    }

    /// With or without the bucket.
    pub const fn with_bucket(mut self, on: bool) -> Self {
        self.bucket = on;
        self
    }

    /// Whether the kept image in memory may serve the load.
    pub const fn memory(self) -> bool {
        self.memory
    }

    /// Whether the local disk may serve the load.
    pub const fn disk(self) -> bool {
        self.disk
    }

    /// Whether the bucket may serve the load.
    pub const fn bucket(self) -> bool {
        self.bucket
    }

    /// The tiers that decide which step "latest" is (and whether a step exists): the
    /// disk's listing when memory or the disk may serve (the kept image only serves a step
    /// the disk lists), the bucket's otherwise. `None` for the empty set.
    pub(super) fn tiers(self) -> Option<Tiers> {
        match (self.memory || self.disk, self.bucket) {
            (true, true) => Some(Tiers::All),
            (true, false) => Some(Tiers::Local),
            (false, true) => Some(Tiers::Remote),
            (false, false) => None,
        }
    }
}

impl Default for Sources {
    fn default() -> Self {
        Sources::ALL
    }
}

impl From<Tiers> for Sources {
    fn from(t: Tiers) -> Self {
        match t {
            Tiers::All => Sources::ALL,
            Tiers::Local => Sources::LOCAL,
            Tiers::Remote => Sources::BUCKET,
        }
    }
}

/// Which step a load reads and from which sources. Defaults: the latest step
/// ([`StepSel::Latest`], resolved as [`Engine::latest_in`](super::Engine::latest_in) does
/// for the sources' tiers) from [`Sources::ALL`].
///
/// ```
/// use shmckpt::{LoadRequest, Sources, StepSel};
/// let r = LoadRequest::new(7).with_sources(Sources::LOCAL);
/// assert_eq!((r.step, r.sources), (StepSel::Step(7), Sources::LOCAL));
/// assert_eq!(LoadRequest::latest(), LoadRequest::default());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub struct LoadRequest {
    /// The step (default: the latest).
    pub step: StepSel,
    /// Where it may be read from (default: [`Sources::ALL`]).
    pub sources: Sources,
}

impl LoadRequest {
    /// `which` (a step number or [`StepSel`]) from every source.
    pub fn new(which: impl Into<StepSel>) -> Self {
        LoadRequest {
            step: which.into(),
            sources: Sources::ALL,
        }
    }

    /// The latest step from every source.
    pub fn latest() -> Self {
        Self::default()
    }

    /// Read only from `sources` (tried in the one fallback order).
    pub fn with_sources(mut self, sources: Sources) -> Self {
        self.sources = sources;
        self
    }

    /// Read only from `tiers` ([`Tiers::Local`]: memory or disk; [`Tiers::Remote`]: the
    /// bucket).
    pub fn with_tiers(self, tiers: Tiers) -> Self {
        self.with_sources(tiers.into())
    }
}

impl From<u64> for LoadRequest {
    fn from(step: u64) -> Self {
        LoadRequest::new(step)
    }
}

impl From<StepSel> for LoadRequest {
    fn from(which: StepSel) -> Self {
        LoadRequest::new(which)
    }
}

/// Where a load puts the bytes. Caller destinations are matched by name: every tensor of
/// this rank's file needs exactly one destination of exactly its size (else
/// [`Error::Destination`](crate::Error::Destination), before any byte is written).
#[derive(Debug)]
pub struct LoadInto<'a>(pub(super) Target<'a>);

pub(super) use crate::tier::Target;

impl<'a> LoadInto<'a> {
    /// New buffers owned by the returned [`Checkpoint`] ([`Loaded::checkpoint`]).
    pub fn owned() -> Self {
        LoadInto(Target::Owned)
    }

    /// The caller's host buffers, by name.
    pub fn host<'s: 'a, 'b: 'a>(dest: &'a mut [(&'s str, &'b mut [u8])]) -> Self {
        LoadInto(Target::Host(
            dest.iter_mut().map(|(n, b)| (*n, &mut **b)).collect(),
        ))
    }

    /// The caller's device buffers, by name (checksums verified on the host before the
    /// bytes go to the device).
    pub fn device<'s: 'a, 'b: 'a>(dest: &'a mut [(&'s str, &'b mut DeviceBuffer)]) -> Self {
        LoadInto(Target::Device(
            dest.iter_mut().map(|(n, b)| (*n, b.slice())).collect(),
        ))
    }

    /// Device ranges by name.
    ///
    /// # Safety
    /// Every range must be device memory of its device, valid for writes of its length,
    /// and not accessed by anyone else (host or queued device work) from this call until
    /// the load it is given to returns.
    #[allow(unsafe_code)]
    pub unsafe fn device_raw(dest: &[(&'a str, DeviceSlice<'a>)]) -> Self {
        LoadInto(Target::Device(dest.to_vec()))
    }
}

/// What [`Engine::load_with`](super::Engine::load_with) did.
#[derive(Debug)]
#[non_exhaustive]
pub struct Loaded {
    /// The step, the source that served it and why the earlier sources could not.
    pub report: LoadReport,
    /// The checkpoint, for [`LoadInto::owned`]; `None` for caller destinations.
    pub checkpoint: Option<Checkpoint>,
    /// What the read from the bucket did, when the bucket served the load (always `None`
    /// without the `s3` feature).
    pub remote: Option<crate::tier::RemoteLoad>,
}
