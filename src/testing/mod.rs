//! Support for the crate's own tests (feature `testing`, hidden from the documentation):
//! the few internals the tests inspect, each named (no glob re-exports: nothing reaches
//! the internals but these items). Not part of the stable API. The synthetic workloads
//! the tests save are the crate `shmckpt-bench`'s.

/// The write backend's operation kinds, the durable-write helpers the crash tests stage
/// files with and, with `fault-injection`, its fault plans.
pub mod io {
    pub use crate::io::OpKind;
    /// Durable writes (`fdatasync` of the file, `fsync` of its directory).
    pub mod file {
        pub use crate::io::file::{fsync_dir, write_durable};
    }
    /// Fault injection into the write backend.
    #[cfg(feature = "fault-injection")]
    pub mod fault {
        pub use crate::io::fault::{Fault, FaultPlan, Rule};
    }
}

/// The engine's filesystem funnel (with `fs-observer`, the operations the observer sees),
/// for tests that stage a scene the power-loss recorder must see.
pub mod fsops {
    pub use crate::fsops::{
        create_dir, create_new_file, fallocate, fdatasync_file, remove_dir_all, rename, set_len,
    };
}

/// The file layout, to build the exact image a save writes.
pub mod plan {
    pub use crate::plan::{META_RANK, META_STEP, META_WORLD, Plan, TensorSpec};
}

/// The shared-memory staging arena, its names and its crash descriptor.
pub mod staging {
    pub use crate::staging::{Arena, ArenaSpec, AttachedArena, ChunkLease, NAME_PREFIX, kept_name};
    /// The crash-recovery descriptor's records and states.
    pub mod descriptor {
        pub use crate::staging::descriptor::{SaveRecord, chunk_state, slot_state};
    }
}
