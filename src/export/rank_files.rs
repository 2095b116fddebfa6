//! The one abstraction an export reads a checkpoint through: a rank file's header
//! metadata, and the byte ranges of chosen tensors of a rank file, every tensor's CRC-32C
//! checked. Its implementations (a local directory, the kept arenas, a bucket) import it
//! from here; `source.rs` picks one for a source.

use std::path::{Path, PathBuf};

use crate::error::Result;
use crate::manifest::{FileEntry, Metadata};
use crate::restore::ReadSink;

/// The prefix of a source read from the kept arenas: `memory:ROOT`.
pub const MEMORY_PREFIX: &str = "memory:";

/// A checkpoint's rank files, as the export reads them.
pub(super) trait RankFiles {
    /// The checkpoint, as the report and messages name it.
    fn source(&self) -> PathBuf;
    /// Rank file `f`, as messages name it.
    fn path_of(&self, f: &FileEntry) -> PathBuf;
    /// The local directory holding the rank files (the destination may not be inside it).
    fn local_dir(&self) -> Option<&Path> {
        None
    }
    /// The `__metadata__` of `f`'s header (its size and header checked against `f`).
    fn metadata(&self, f: &FileEntry) -> Result<Metadata>;
    /// Send the pieces of the tensors of `f` flagged in `wanted` to `sink` (file order),
    /// reading only their byte ranges, each one's CRC-32C checked against `f`. Returns the
    /// bytes read.
    fn read_wanted(&self, f: &FileEntry, wanted: &[bool], sink: &mut dyn ReadSink) -> Result<u64>;
}
