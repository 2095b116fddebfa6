#![doc = include_str!("../README.md")]
#![deny(unsafe_code)]
#![warn(missing_docs)]

//! # Features
//! No feature is on by default: a plain dependency gets the public API below and nothing
//! else.
//! - `testing` (hidden, for the tests only): the few internals the tests inspect, each
//!   named (the staging arena, its descriptor's records, the file layout).
//! - `s3`: the object-storage tier (module `remote`, `EngineConfig::with_remote`) on the
//!   `object_store` crate (on in the command line and the Python extension).
//! - `fault-injection` (tests only): I/O fault injection in the write backend.
//! - `fs-observer`: every filesystem mutation the engine makes in a root, shown to an
//!   observer (module `observe`; the power-loss recorder of crate `shmckpt-crashsim`).
//!
//! `testing` never re-exports a whole module: the segment mapping, the CUDA staging
//! pipeline and the I/O queues stay unreachable with every feature on:
//!
//! ```compile_fail,E0432
//! // The shared-memory segment (the one place that maps staging memory).
//! use shmckpt::testing::staging::Segment;
//! ```
//! ```compile_fail,E0432
//! // Opening an arena's segment for writing, to map it a second time.
//! use shmckpt::testing::staging::shm::open_existing;
//! ```
//! ```compile_fail,E0432
//! // The staging pipeline that takes raw device pointers and stream handles.
//! use shmckpt::testing::device::CudaStaging;
//! ```
//! ```compile_fail,E0432
//! // The I/O request queue that hands raw buffers to the kernel.
//! use shmckpt::testing::io::queue::LeaseQueue;
//! ```

pub mod commit;
mod config;
pub(crate) mod device;
pub mod divergence;
mod dtype;
mod engine;
mod error;
pub mod export;
mod fsops;
mod fsx;
pub(crate) mod io;
pub mod links;
pub mod manifest;
#[cfg(feature = "fs-observer")]
pub mod observe;
pub(crate) mod plan;
pub mod recover;
pub mod remote;
pub mod replica;
pub mod restore;
pub(crate) mod slab;
pub(crate) mod staging;
mod tensor;
#[cfg(feature = "testing")]
#[doc(hidden)]
pub mod testing;
pub(crate) mod tier;
pub(crate) mod util;

/// The CUDA façade: device memory, streams and events as typed values.
///
/// Streams and events reach a save only as borrowed [`StreamRef`](crate::cuda::StreamRef)/[`EventRef`](crate::cuda::EventRef)
/// values
/// (or through their `unsafe` `from_raw`): the staging pipeline that takes raw handles is
/// not reachable from outside the crate.
///
/// ```compile_fail,E0603
/// use shmckpt::device::CudaStaging;
/// ```
pub mod cuda {
    pub use crate::device::cuda::{
        Context, DeviceBuffer, Event, EventRef, PinnedHost, Stream, StreamRef,
        batch_copies_supported, device_count, driver_present, driver_version, init,
    };
    pub use crate::tensor::DeviceSlice;
}

pub use config::{
    AUTO_STAGING_INITIAL, DEFAULT_CHUNK_SIZE, DEFAULT_COPY_AHEAD, DEFAULT_DEVICE_READ,
    DEFAULT_DEVICE_READ_DEPTH, DEFAULT_MAX_INFLIGHT_SAVES, DEFAULT_QUEUE_DEPTH,
    DEFAULT_STAGING_CAPACITY, DEFAULT_WRITER_THREADS, DiskCadence, EngineConfig,
    auto_staging_capacity,
};
pub use dtype::Dtype;
/// Flash restore's arenas kept in `/dev/shm` (`EngineConfig::with_keep_in_memory`):
/// listing and removal, as `shmckpt shm list|rm` does.
pub mod flash {
    pub use crate::engine::{
        ArenaOwner, KeptArenaInfo, list_kept, remove_kept, remove_kept_forced,
    };
    pub use crate::staging::is_kept_name;
}

pub use engine::{
    Engine, LoadInto, LoadReport, LoadRequest, LoadSource, Loaded, OpenTimings, OwnedData,
    OwnedTensor, SaveHandle, SaveOptions, SaveReport, SaveTimings, SaveWatch, Sources,
    StagedReport, StepSel, StepTiers, Tier, Tiers,
};
pub use error::{Error, Result};
pub use io::{Backend, BackendKind};
pub use manifest::{CheckpointInfo, Manifest, Metadata};
pub use plan::MAX_NAME_LEN;
pub use restore::Checkpoint;
pub use tensor::{AlignedBytes, DeviceSlice, LoadedTensor, Source, Tensor};
