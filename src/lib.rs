//! shmckpt: checkpoints deep-learning training state without stalling the trainer.
//!
//! `save` copies every tensor into pinned staging buffers in POSIX shared memory and
//! returns; io_uring writers drain the staging buffers to disk with O_DIRECT and commit the
//! checkpoint atomically as standard safetensors files plus a manifest.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod commit;
pub mod dtype;
pub mod engine;
pub mod error;
pub mod io;
pub mod manifest;
pub mod plan;
pub mod reference;
pub mod restore;
pub mod staging;
pub mod synthetic;
pub mod tensor;
pub mod util;

pub use dtype::Dtype;
pub use engine::{
    Engine, EngineConfig, SaveHandle, SaveReport, SaveTimings, StagedReport, StepSel,
};
pub use error::{Error, Result};
pub use io::BackendKind;
pub use manifest::{CheckpointInfo, Manifest, Metadata};
pub use restore::Checkpoint;
pub use tensor::{AlignedBytes, DeviceSlice, LoadedTensor, Source, Tensor};
