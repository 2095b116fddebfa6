#![doc = include_str!("../README.md")]
#![deny(unsafe_code)]
#![warn(missing_docs)]

//! # Features
//! - `ipc` (off by default): the CUDA IPC writer process, the `--mode ipc`
//!   baseline.
//! - `testing` (off by default, hidden): synthetic data, the raw-write reference and the
//!   crate's internals for the CLI, benchmarks and tests.
//! - `cli` (on by default): what the `shmckpt` binary needs (`ipc` + `testing`). Library
//!   users build with `default-features = false`.
//! - `fault-injection` (tests only): I/O fault injection in the write backend.

pub mod commit;
mod config;
pub(crate) mod device;
mod dtype;
mod engine;
mod error;
mod fsx;
pub(crate) mod io;
#[cfg(feature = "ipc")]
pub mod ipc;
pub mod manifest;
pub(crate) mod plan;
pub mod recover;
pub mod replica;
pub mod restore;
pub(crate) mod slab;
pub(crate) mod staging;
mod tensor;
#[cfg(feature = "testing")]
#[doc(hidden)]
pub mod testing;
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
        Context, DeviceBuffer, Event, EventRef, PinnedHost, Stream, StreamRef, device_count,
        driver_present, driver_version, init,
    };
    #[cfg(feature = "ipc")]
    pub use crate::device::cuda::{
        IpcMapping, IpcMemHandle, allocation_range, device_uuid, ipc_export, ordinal_of_uuid,
    };
    pub use crate::tensor::DeviceSlice;
}

pub use config::{
    DEFAULT_CHUNK_SIZE, DEFAULT_DEVICE_READ, DEFAULT_DEVICE_READ_DEPTH, DEFAULT_MAX_INFLIGHT_SAVES,
    DEFAULT_QUEUE_DEPTH, DEFAULT_STAGING_CAPACITY, DEFAULT_WRITER_THREADS, EngineConfig,
};
pub use dtype::Dtype;
/// Flash restore's arenas kept in `/dev/shm` (`EngineConfig::with_keep_in_memory`):
/// listing and removal, as `shmckpt shm list|rm` does.
pub mod flash {
    pub use crate::engine::{
        ArenaOwner, KeptArenaInfo, list_kept, remove_kept, remove_kept_forced,
    };
}

pub use engine::{
    Engine, LoadReport, LoadSource, OwnedData, OwnedTensor, SaveHandle, SaveOptions, SaveReport,
    SaveTimings, StagedReport, StepSel,
};
pub use error::{Error, Result};
pub use io::{Backend, BackendKind};
pub use manifest::{CheckpointInfo, Manifest, Metadata};
pub use plan::MAX_NAME_LEN;
pub use restore::Checkpoint;
pub use tensor::{AlignedBytes, DeviceSlice, LoadedTensor, Source, Tensor};
