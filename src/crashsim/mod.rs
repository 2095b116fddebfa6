//! Power-loss simulation for tests (feature `crash-record`; docs/crash.md).
//!
//! 1. [`record`]: while a [`record::Recording`] of a root is active, every filesystem
//!    mutation and sync the engine issues on that root (through `crate::fsops` and the
//!    write backends) is appended to one log, in issue order: data writes (io_uring and
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

pub mod model;
pub mod record;
#[cfg(test)]
mod record_tests;
pub mod states;

use std::sync::Arc;

/// The engine's filesystem funnel (recorded operations), for tests that stage a scene the
/// recorder must see.
pub mod fsops {
    pub use crate::fsops::{create_dir, remove_dir_all, rename};
}

/// A file or directory of a recorded root (an inode, as first seen by the recorder).
pub type Id = u32;

/// One recorded operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// `mkdir parent/name`, making directory `id`.
    Mkdir {
        /// Directory the entry is made in.
        parent: Id,
        /// Entry name.
        name: String,
        /// The new directory.
        id: Id,
    },
    /// A new regular file `parent/name` (`O_CREAT` that created it).
    Create {
        /// Directory the entry is made in.
        parent: Id,
        /// Entry name.
        name: String,
        /// The new file.
        id: Id,
    },
    /// Bytes written to file `id` at `offset` (a completed write, as many bytes as it
    /// transferred).
    Write {
        /// The file.
        id: Id,
        /// File offset.
        offset: u64,
        /// The bytes.
        data: Arc<[u8]>,
    },
    /// `ftruncate(id, len)`.
    Truncate {
        /// The file.
        id: Id,
        /// New length.
        len: u64,
    },
    /// `fallocate(id, 0, offset, len)` (mode 0: the size grows to `offset + len`).
    Fallocate {
        /// The file.
        id: Id,
        /// Start.
        offset: u64,
        /// Length.
        len: u64,
    },
    /// `rename(from_parent/from, to_parent/to)` of entry `id` (replacing what `to` named).
    Rename {
        /// Source directory.
        from_parent: Id,
        /// Source name.
        from: String,
        /// Destination directory.
        to_parent: Id,
        /// Destination name.
        to: String,
        /// What was moved.
        id: Id,
    },
    /// `unlink(parent/name)` of file `id`.
    Unlink {
        /// Directory.
        parent: Id,
        /// Entry name.
        name: String,
        /// The file.
        id: Id,
    },
    /// `rmdir(parent/name)` of directory `id`.
    Rmdir {
        /// Directory.
        parent: Id,
        /// Entry name.
        name: String,
        /// The directory removed.
        id: Id,
    },
    /// `fsync` of `id`: its data and size; for a directory, its entries.
    Fsync {
        /// File or directory.
        id: Id,
    },
    /// `fdatasync` of file `id`: its data and size.
    Fdatasync {
        /// The file.
        id: Id,
    },
    /// The engine reported `step` committed to its caller (a `SaveHandle` completing with
    /// a committed directory), or a test says a recovery reported it.
    Committed {
        /// The step.
        step: u64,
    },
}

impl Op {
    /// The directory whose `fsync` makes this directory operation durable (the
    /// destination's, for a rename), or `None` for operations that are not directory
    /// operations.
    pub fn dir_parent(&self) -> Option<Id> {
        match self {
            Op::Mkdir { parent, .. }
            | Op::Create { parent, .. }
            | Op::Unlink { parent, .. }
            | Op::Rmdir { parent, .. } => Some(*parent),
            Op::Rename { to_parent, .. } => Some(*to_parent),
            _ => None,
        }
    }

    /// The file whose data or size this operation changes.
    pub fn data_target(&self) -> Option<Id> {
        match self {
            Op::Write { id, .. } | Op::Truncate { id, .. } | Op::Fallocate { id, .. } => Some(*id),
            _ => None,
        }
    }

    /// The file or directory this operation makes durable.
    pub fn synced(&self) -> Option<Id> {
        match self {
            Op::Fsync { id } | Op::Fdatasync { id } => Some(*id),
            _ => None,
        }
    }
}

/// A recorded run: the root as it was when recording started (taken as durable), and
/// every operation since, in issue order.
#[derive(Debug, Clone)]
pub struct Log {
    /// The state at the start.
    pub base: model::Model,
    /// The operations.
    pub ops: Vec<Op>,
}

impl Log {
    /// Steps reported committed by operations before `point`.
    pub fn committed_before(&self, point: usize) -> std::collections::BTreeSet<u64> {
        self.ops[..point]
            .iter()
            .filter_map(|o| match o {
                Op::Committed { step } => Some(*step),
                _ => None,
            })
            .collect()
    }

    /// Steps whose committed directory retention had renamed to its trash name before
    /// `point` (they may be gone, or still there if the rename was not durable).
    pub fn retired_before(&self, point: usize) -> std::collections::BTreeSet<u64> {
        self.ops[..point]
            .iter()
            .filter_map(|o| match o {
                Op::Rename { from, to, .. } => {
                    let s = crate::manifest::parse_step_dir(from)?;
                    (crate::manifest::parse_step_with_suffix(to, ".trash") == Some(s)).then_some(s)
                }
                _ => None,
            })
            .collect()
    }

    /// How many operations of each kind the log holds, for reports.
    pub fn summary(&self) -> String {
        let mut counts = std::collections::BTreeMap::<&str, usize>::new();
        for o in &self.ops {
            let k = match o {
                Op::Mkdir { .. } => "mkdir",
                Op::Create { .. } => "create",
                Op::Write { .. } => "write",
                Op::Truncate { .. } => "ftruncate",
                Op::Fallocate { .. } => "fallocate",
                Op::Rename { .. } => "rename",
                Op::Unlink { .. } => "unlink",
                Op::Rmdir { .. } => "rmdir",
                Op::Fsync { .. } => "fsync",
                Op::Fdatasync { .. } => "fdatasync",
                Op::Committed { .. } => "committed",
            };
            *counts.entry(k).or_default() += 1;
        }
        format!("{} ops {counts:?}", self.ops.len())
    }
}
