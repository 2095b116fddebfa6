//! The one abstraction an export reads a checkpoint through: a rank file's header
//! metadata, and the byte ranges of chosen tensors of a rank file, every tensor's CRC-32C
//! checked. The trait is `crate::tier::RankFiles` (a bucket, `crate::remote`, implements it
//! too); its implementations here import it from this module; `source.rs` picks one for
//! a source.

/// The prefix of a source read from the kept arenas: `memory:ROOT`.
pub const MEMORY_PREFIX: &str = "memory:";

pub(super) use crate::tier::RankFiles;
