//! Attaching to an arena that another (usually dead) process created, to inspect its
//! descriptor and copy staged chunks out of it: the staging side of crash recovery.
//!
//! The descriptor of an attached arena is never handed out (a [`Descriptor`] is a raw
//! pointer that must not outlive the mapping); callers get owned views and copies.
#![allow(unsafe_code)]

use super::Segment;
use super::descriptor::{Descriptor, HeaderView, SlotView};
use crate::error::{Error, Result};

/// A mapped arena of another process, with its descriptor checked.
#[derive(Debug)]
pub struct AttachedArena {
    // Field order: `desc` points into `seg`'s mapping and is dropped first.
    desc: Descriptor,
    seg: Segment,
}

impl AttachedArena {
    /// Map `/dev/shm/<name>` and check its descriptor (magic, version, geometry against the
    /// segment size). Nothing in the segment is written.
    ///
    /// Fails with [`Error::Shm`] when the segment cannot be opened or mapped, and with
    /// [`Error::Recovery`] when it is not a shmckpt arena of this layout version.
    pub fn open(name: &str) -> Result<AttachedArena> {
        let seg = Segment::open(name)?;
        // SAFETY: `seg` maps `seg.len()` bytes from a page-aligned address and is owned by the
        // returned value next to `desc`, which is dropped first and never handed out, so the
        // mapping outlives every use of the descriptor.
        let desc = unsafe { Descriptor::attach(seg.as_ptr(), seg.len()) }.map_err(|reason| {
            Error::Recovery {
                arena: name.to_owned(),
                reason,
            }
        })?;
        Ok(AttachedArena { desc, seg })
    }

    /// The segment name.
    pub fn name(&self) -> &str {
        self.seg.name().unwrap_or("")
    }

    /// Bytes of the segment.
    pub fn len(&self) -> usize {
        self.seg.len()
    }

    /// Whether the segment is empty (never: `open` refuses segments without a header).
    pub fn is_empty(&self) -> bool {
        self.seg.is_empty()
    }

    /// The arena header.
    pub fn header(&self) -> HeaderView {
        self.desc.header_view()
    }

    /// Number of save slots.
    pub fn slot_count(&self) -> u32 {
        self.desc.geometry().n_slots
    }

    /// Read slot `slot` (`< slot_count()`).
    pub fn slot(&self, slot: u32) -> SlotView {
        self.desc.slot_view(slot)
    }

    /// Mark slot `slot` free (its save was recovered or found committed), so that a retry
    /// skips it.
    pub fn release_slot(&self, slot: u32) {
        self.desc.free(slot);
    }

    /// Copy `out.len()` bytes of arena chunk `index`, starting `at` bytes into the chunk,
    /// into `out`. Returns `None` (copying nothing) when `index` is not a chunk of this
    /// arena or the range runs past the end of the chunk.
    ///
    /// The copy is only meaningful while nobody writes the chunk, i.e. after its owner
    /// died; bytes changing underneath would only make the copy torn.
    pub fn read_chunk(&self, index: u32, at: u64, out: &mut [u8]) -> Option<()> {
        let geo = self.desc.geometry();
        let end = at.checked_add(out.len() as u64)?;
        if u64::from(index) >= geo.n_chunks || end > geo.chunk_size {
            return None;
        }
        let offset = geo.data_offset + u64::from(index) * geo.chunk_size + at;
        // SAFETY: `attach` checked `geo.total_len() <= seg.len()`; with `index < n_chunks`
        // and `at + out.len() <= chunk_size`, `offset + out.len() <= total_len` lies inside
        // the mapping, which `self` keeps alive. The source is shared memory that no Rust
        // reference points to and `out` is a distinct exclusive borrow, so the ranges do not
        // overlap; every byte value is a valid `u8`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.seg.as_ptr().add(offset as usize),
                out.as_mut_ptr(),
                out.len(),
            );
        }
        Some(())
    }

    /// Remove the name from `/dev/shm` (the mapping stays valid until `self` drops).
    pub fn unlink(&self) -> std::io::Result<()> {
        self.seg.unlink()
    }
}
