//! Support for the bundled CLI, the benchmarks and the integration tests (feature
//! `testing`, hidden from the documentation): synthetic tensors, the raw-write reference,
//! and the crate's internals under their own names. Not part of the stable API.
#![allow(missing_docs)]

pub mod reference;
pub mod synthetic;

/// The CUDA staging pipeline.
pub mod device {
    pub use crate::device::*;
}
/// Disk I/O.
pub mod io {
    pub use crate::io::*;
}
/// File layout.
pub mod plan {
    pub use crate::plan::*;
}
/// The shared-memory staging arena.
pub mod staging {
    pub use crate::staging::*;
}
/// Small helpers.
pub mod util {
    pub use crate::util::*;
}
