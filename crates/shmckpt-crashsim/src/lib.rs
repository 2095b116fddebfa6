//! Power-loss simulation for shmckpt's tests (docs/crash.md).
//!
//! A tool beside the library, not part of it: it sees the engine through the library's
//! filesystem observer hook ([`shmckpt::observe`], feature `fs-observer`) and its public
//! API only.
//!
//! 1. [`record`]: while a [`record::Recording`] of a root is active, every filesystem
//!    mutation and sync the engine issues on that root (through the library's funnel and
//!    its write backends) is appended to one log, in issue order: data writes (io_uring and
//!    `pwrite` alike, with their bytes), `fdatasync`/`fsync` of files and directories,
//!    `mkdir`, file creation, `rename`, `unlink`, `rmdir`, `fallocate`, `ftruncate`, and a
//!    marker each time a save is reported committed to its caller.
//! 2. [`states`]: from a [`Log`], the states a power loss at any point of it could leave on a
//!    POSIX filesystem with ext4/xfs-like semantics ([`states::crash_state`]).
//! 3. [`model::Model::materialize`] writes such a state into a directory, where the test
//!    runs what a restarted trainer runs and checks the invariants
//!    (`tests/integration/crash.rs`).
//!
//! Files and directories are identified by [`Id`]s that the recorder gives to inodes
//! (a reused inode number gets a new id), so renames and unlinks are followed exactly.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod model;
mod ops;
pub mod record;
pub mod states;

pub use model::Log;
pub use ops::{Id, Op};
