#![doc = include_str!("../README.md")]
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod commit;
pub mod device;
pub mod dtype;
pub mod engine;
pub mod error;
mod fsx;
pub mod io;
pub mod ipc;
pub mod manifest;
pub mod plan;
pub mod recover;
pub mod reference;
pub mod restore;
pub mod staging;
pub mod synthetic;
pub mod tensor;
pub mod util;

pub use dtype::Dtype;
pub use engine::{
    Engine, EngineConfig, SaveHandle, SaveOptions, SaveReport, SaveTimings, StagedReport, StepSel,
};
pub use error::{Error, Result};
pub use io::BackendKind;
pub use manifest::{CheckpointInfo, Manifest, Metadata};
pub use restore::Checkpoint;
pub use tensor::{AlignedBytes, DeviceSlice, LoadedTensor, Source, Tensor};
