//! Reading checkpoints back through the same I/O backend (O_DIRECT where possible),
//! checking the safetensors header against the manifest and every tensor's CRC-32C:
//! `header.rs` (file and header checks), `reader.rs` (the read loops: into one slab whose
//! ranges become the loaded tensors, or chunk by chunk to a [`ReadSink`]), `extents.rs`
//! (the chunk-by-chunk loop, over the whole data section or chosen extents), `ranged.rs`
//! (only the requested tensors: [`load_ranges`]), `sink.rs` (caller host buffers, device
//! memory).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::io::BackendKind;
use crate::manifest::{FileEntry, Manifest, Metadata};
use crate::slab::SlabPool;
use crate::staging::Arena;
use crate::tensor::LoadedTensor;

mod completion;
pub(crate) mod device;
mod extents;
pub(crate) mod header;
mod ranged;
mod reader;
pub(crate) mod sink;

pub(crate) use completion::{CrcPiece, combine_crcs, file_crc_pieces, for_pieces};
pub(crate) use device::check_device_read;
pub use device::{DeviceRing, SplitLoad, load_split_host};
pub use header::{check_header, read_file_metadata};
pub(crate) use ranged::read_wanted;
pub use ranged::{
    DEFAULT_GAP, RangeDest, RangeRequest, RangedLoad, RangedOptions, RangedStats, coalesce,
    load_ranges, read_ranges,
};
pub use reader::read_file;
use sink::HostSink;

/// How to read.
#[derive(Debug, Clone)]
pub struct ReadOptions {
    /// Backend (io_uring or pread).
    pub backend: BackendKind,
    /// Reads in flight.
    pub queue_depth: u32,
    /// Try O_DIRECT.
    pub direct_io: bool,
    /// Staging arena to borrow buffers from; `None` allocates private buffers.
    pub arena: Option<Arc<Arena>>,
    /// Read a checkpoint directory whatever its name ([`Manifest::read_any_name`]): a
    /// directory its user named, like a DCP checkpoint's. `false` (the default): a
    /// directory named `step-N` must hold a manifest of step N ([`Manifest::read`]).
    pub any_dir_name: bool,
}

impl ReadOptions {
    /// The manifest of `dir`, read as [`ReadOptions::any_dir_name`] says.
    pub fn read_manifest(&self, dir: &Path) -> Result<Manifest> {
        if self.any_dir_name {
            Manifest::read_any_name(dir)
        } else {
            Manifest::read(dir)
        }
    }
}

impl Default for ReadOptions {
    fn default() -> Self {
        ReadOptions {
            backend: BackendKind::Auto,
            queue_depth: 4,
            direct_io: true,
            arena: None,
            any_dir_name: false,
        }
    }
}

/// A loaded checkpoint (one rank's file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    /// Step.
    pub step: u64,
    /// Directory it was read from.
    pub dir: PathBuf,
    /// User metadata.
    pub metadata: Metadata,
    /// Tensors, in file order.
    pub tensors: Vec<LoadedTensor>,
}

impl Checkpoint {
    /// The tensor called `name`.
    pub fn get(&self, name: &str) -> Option<&LoadedTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// Receives the bytes of a file as they are read, in file order.
pub trait ReadSink {
    /// `bytes` are the bytes of tensor `tensor` (index in the manifest's file entry)
    /// starting at offset `at` inside the tensor.
    fn piece(&mut self, tensor: usize, at: u64, bytes: &[u8]) -> Result<()>;
    /// The staging buffers that held the pieces given so far are about to be reused:
    /// finish any asynchronous use of them. Called after every few chunks, at the end, and
    /// before an error returns; buffers are reused only after it returned `Ok`.
    fn chunk_end(&mut self) -> Result<()> {
        Ok(())
    }
}

/// Discards the bytes (checksums are still verified).
#[derive(Debug, Default)]
pub struct Discard;

impl ReadSink for Discard {
    fn piece(&mut self, _: usize, _: u64, _: &[u8]) -> Result<()> {
        Ok(())
    }
}

/// What `read_file` measured.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadStats {
    /// Bytes read from the data section.
    pub bytes: u64,
    /// Whether O_DIRECT was used.
    pub direct_io: bool,
}

/// Load `rank`'s file of the checkpoint in `dir` into owned tensors: the data section is
/// read with O_DIRECT straight into one allocation whose ranges become the tensors' bytes.
pub fn load_owned(dir: &Path, rank: u32, opts: &ReadOptions) -> Result<Checkpoint> {
    load_owned_pooled(dir, rank, opts, None)
}

/// [`load_owned`] reusing the allocation `pool` holds (an engine's, given back when the
/// tensors of its previous load were dropped).
pub(crate) fn load_owned_pooled(
    dir: &Path,
    rank: u32,
    opts: &ReadOptions,
    pool: Option<&Arc<SlabPool>>,
) -> Result<Checkpoint> {
    let manifest = Manifest::read(dir)?;
    let entry = rank_entry(&manifest, dir, rank)?;
    // The file's size and header are checked before allocating what the manifest claims:
    // a lying manifest must be an error, not an allocation failure (the parser ties the
    // tensors' sizes to `bytes`).
    let (data, _) = reader::read_to_slab(&dir.join(&entry.file), entry, opts, pool)?;
    let tensors = entry
        .tensors
        .iter()
        .zip(data)
        .map(|(t, data)| LoadedTensor {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            data,
        })
        .collect();
    Ok(Checkpoint {
        step: manifest.step,
        dir: dir.to_owned(),
        metadata: manifest.metadata.clone(),
        tensors,
    })
}

/// Load `rank`'s file into caller buffers matched by name. Every tensor needs a buffer of
/// exactly its size.
pub fn load_into(
    dir: &Path,
    rank: u32,
    dest: &mut [(&str, &mut [u8])],
    opts: &ReadOptions,
) -> Result<()> {
    let manifest = Manifest::read(dir)?;
    let entry = rank_entry(&manifest, dir, rank)?;
    let named: Vec<(&str, u64)> = dest.iter().map(|(n, b)| (*n, b.len() as u64)).collect();
    let order = match_destinations(entry, &named)?;
    // Reorder the caller's buffers into file order.
    let mut slots: Vec<Option<&mut [u8]>> = dest.iter_mut().map(|(_, b)| Some(&mut **b)).collect();
    let ordered: Vec<&mut [u8]> = order
        .iter()
        .map(|&i| slots[i].take().expect("each destination used once"))
        .collect();
    let mut sink = HostSink { dest: ordered };
    read_file(&dir.join(&entry.file), entry, opts, &mut sink)?;
    Ok(())
}

/// Match caller destinations `(name, byte length)` with the tensors of `entry`: returns,
/// for each tensor in file order, the index of its destination. Every tensor needs exactly
/// one destination of exactly its size, and every destination a tensor.
pub fn match_destinations(entry: &FileEntry, dest: &[(&str, u64)]) -> Result<Vec<usize>> {
    let mut by_name: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, (name, _)) in dest.iter().enumerate() {
        if by_name.insert(*name, i).is_some() {
            return Err(Error::Destination {
                name: (*name).to_owned(),
                reason: "given twice".into(),
            });
        }
    }
    let mut order = Vec::with_capacity(entry.tensors.len());
    for t in &entry.tensors {
        let i = *by_name
            .get(t.name.as_str())
            .ok_or_else(|| Error::Destination {
                name: t.name.clone(),
                reason: "no destination buffer given".into(),
            })?;
        if dest[i].1 != t.len() {
            return Err(Error::Destination {
                name: t.name.clone(),
                reason: format!(
                    "buffer holds {} bytes, the tensor has {}",
                    dest[i].1,
                    t.len()
                ),
            });
        }
        order.push(i);
    }
    if order.len() != dest.len() {
        let known: std::collections::HashSet<&str> =
            entry.tensors.iter().map(|t| t.name.as_str()).collect();
        let extra = dest
            .iter()
            .find(|(n, _)| !known.contains(n))
            .map(|(n, _)| n.to_string())
            .unwrap_or_default();
        return Err(Error::Destination {
            name: extra,
            reason: "not in the checkpoint".into(),
        });
    }
    Ok(order)
}

/// Read and parse the manifest of `dir` and return `rank`'s file entry with it.
pub fn rank_file(dir: &Path, rank: u32) -> Result<(Manifest, FileEntry)> {
    let manifest = Manifest::read(dir)?;
    let entry = rank_entry(&manifest, dir, rank)?.clone();
    Ok((manifest, entry))
}

/// Verify every file of the checkpoint in `dir`: header against manifest, sizes, checksums.
/// Returns the bytes read.
pub fn verify_dir(dir: &Path, opts: &ReadOptions) -> Result<u64> {
    let manifest = Manifest::read(dir)?;
    let mut total = 0;
    for f in &manifest.files {
        total += read_file(&dir.join(&f.file), f, opts, &mut Discard)?.bytes;
    }
    Ok(total)
}

pub(crate) fn rank_entry<'m>(m: &'m Manifest, dir: &Path, rank: u32) -> Result<&'m FileEntry> {
    m.file_of_rank(rank).ok_or_else(|| {
        Error::corrupt(
            dir.join(crate::manifest::MANIFEST),
            None,
            format!("no file for rank {rank}"),
        )
    })
}
