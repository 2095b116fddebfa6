//! The recorded operations, and the ids the recorder gives to the inodes they act on.

use std::sync::Arc;

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
