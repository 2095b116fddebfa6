//! Where everything lies in an arena, computed with checked arithmetic, and the parsing of
//! a descriptor read from a segment that nobody vouches for.
//!
//! ```text
//! [page 0: ArenaHeader][root region: 0 or more pages][slot 0][slot 1]...[data chunks]
//! ```
//!
//! A root of at most [`MAX_ROOT_INLINE`] bytes is kept inside the header page; a longer one
//! (up to [`MAX_ROOT_LEN`]) in a page-rounded region right after it, whose size follows
//! from `root_len` alone (so arenas with short roots keep the original layout).
//!
//! Everything here is pure: byte slices in, typed values or a reason out. No value read from
//! a segment is used before it is checked against the segment's real size, and no
//! arithmetic on such a value can overflow.
#![forbid(unsafe_code)]

use std::mem::offset_of;
use std::sync::atomic::{AtomicU32, AtomicU64};

/// Size of the header page and of each slot header.
pub const PAGE: usize = 4096;
/// Longest checkpoint-root path kept inside the header page.
pub const MAX_ROOT_INLINE: usize = 3072;
/// Longest checkpoint-root path recorded at all (far beyond any path the OS resolves).
pub const MAX_ROOT_LEN: usize = 1 << 20;
/// Longest file name recorded in a slot.
pub const MAX_NAME: usize = 1024;
/// Most slots an arena may have.
pub const MAX_SLOTS: u32 = 4096;
/// Most data chunks an arena may have (chunk-map entries hold a 30-bit index).
pub const MAX_CHUNKS: u64 = (1 << 30) - 1;

const PAGE_U64: u64 = PAGE as u64;

/// Magic at the start of every arena.
pub const MAGIC: [u8; 8] = *b"SHMCKPT1";
/// Layout version of the descriptor.
pub const VERSION: u32 = 1;

/// Header page of an arena.
#[repr(C)]
pub struct ArenaHeader {
    /// [`MAGIC`]'s bytes (`u64::from_ne_bytes(MAGIC)`, so the segment holds exactly
    /// `MAGIC`), stored last with `Release` by `Descriptor::init` to publish the fields
    /// written before it.
    pub magic: AtomicU64,
    /// [`VERSION`].
    pub version: u32,
    /// Number of slots.
    pub n_slots: u32,
    /// Offset of the first data chunk.
    pub data_offset: u64,
    /// Bytes per chunk.
    pub chunk_size: u64,
    /// Number of data chunks.
    pub n_chunks: u64,
    /// Bytes of one slot (header page + chunk map, page rounded).
    pub slot_bytes: u64,
    /// Process that created the arena.
    pub owner_pid: AtomicU32,
    /// Rank of the engine.
    pub rank: u32,
    /// World size of the engine.
    pub world_size: u32,
    /// Length of the root: inline in `root` when at most [`MAX_ROOT_INLINE`] bytes, else in the
    /// root region after this page (see the module's documentation).
    pub root_len: u32,
    /// Creation time, ms since the epoch.
    pub created_unix_ms: u64,
    /// Set to 1 on clean shutdown (before unlink), so a leftover is known not to be a crash.
    pub closed: AtomicU32,
    _pad: u32,
    /// Checkpoint root (UTF-8 or raw bytes of the OS path).
    pub root: [u8; MAX_ROOT_INLINE],
}

/// Header of one slot; followed by its chunk map (`u32` per file chunk).
#[repr(C)]
pub struct SlotHeader {
    /// [`slot_state`](super::descriptor::slot_state).
    pub state: AtomicU32,
    /// Number of file chunks (chunk-map entries in use).
    pub n_file_chunks: u32,
    /// Step of the save.
    pub step: u64,
    /// Exact file length.
    pub file_len: u64,
    /// Offset of the data section in the file.
    pub data_start: u64,
    /// Incremented for every save using the slot.
    pub generation: u64,
    /// Length of `partial_dir`.
    pub partial_len: u32,
    /// Length of `file_name`.
    pub file_name_len: u32,
    /// Name of the partial directory (relative to the root).
    pub partial_dir: [u8; MAX_NAME],
    /// File name inside the partial directory.
    pub file_name: [u8; MAX_NAME],
}

/// Geometry of an arena: where everything is. Only [`Geometry::new`] makes one, so every
/// value is consistent and `total_len` did not overflow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Slots.
    pub n_slots: u32,
    /// Data chunks.
    pub n_chunks: u64,
    /// Bytes per chunk.
    pub chunk_size: u64,
    /// Bytes of one slot (header page + chunk map, page rounded).
    pub slot_bytes: u64,
    /// Length of the recorded root.
    pub root_len: u64,
    /// Bytes of the root region after the header page (0 when the root is inline).
    pub root_bytes: u64,
    /// Offset of slot 0.
    pub slots_offset: u64,
    /// First data byte.
    pub data_offset: u64,
    /// Total segment length.
    pub total_len: u64,
}

impl Geometry {
    /// Layout for `n_chunks` chunks of `chunk_size` bytes, `n_slots` slots and a root of
    /// `root_len` bytes; `None` when a count is out of range or a size overflows.
    pub fn new(n_chunks: u64, chunk_size: u64, n_slots: u32, root_len: u64) -> Option<Geometry> {
        if n_chunks == 0
            || n_chunks > MAX_CHUNKS
            || chunk_size == 0
            || !chunk_size.is_multiple_of(PAGE_U64)
            || n_slots == 0
            || n_slots > MAX_SLOTS
            || root_len > MAX_ROOT_LEN as u64
        {
            return None;
        }
        let slot_bytes = n_chunks
            .checked_mul(4)?
            .checked_add(PAGE_U64)?
            .div_ceil(PAGE_U64)
            .checked_mul(PAGE_U64)?;
        let root_bytes = root_region_bytes(root_len)?;
        let slots_offset = PAGE_U64.checked_add(root_bytes)?;
        let data_offset = slot_bytes
            .checked_mul(u64::from(n_slots))?
            .checked_add(slots_offset)?;
        let total_len = n_chunks.checked_mul(chunk_size)?.checked_add(data_offset)?;
        // The mapping length and every offset must also fit the address space.
        usize::try_from(total_len).ok()?;
        Some(Geometry {
            n_slots,
            n_chunks,
            chunk_size,
            slot_bytes,
            root_len,
            root_bytes,
            slots_offset,
            data_offset,
            total_len,
        })
    }

    /// Offset of slot `slot`'s header; `None` past the last slot.
    pub fn slot_offset(&self, slot: u32) -> Option<u64> {
        if slot >= self.n_slots {
            return None;
        }
        // Cannot overflow: bounded by `data_offset`, computed checked in `new`.
        Some(self.slots_offset + u64::from(slot) * self.slot_bytes)
    }

    /// Offset of chunk-map entry `k` of slot `slot`; `None` when either is out of range.
    pub fn entry_offset(&self, slot: u32, k: u64) -> Option<u64> {
        if k >= self.n_chunks {
            return None;
        }
        Some(self.slot_offset(slot)? + PAGE_U64 + 4 * k)
    }

    /// Offset of byte `at` of arena chunk `index`, for a range of `len` bytes that must lie
    /// inside the chunk; `None` otherwise.
    pub fn chunk_range(&self, index: u64, at: u64, len: u64) -> Option<u64> {
        if index >= self.n_chunks || at.checked_add(len)? > self.chunk_size {
            return None;
        }
        // Bounded by `total_len`, computed checked in `new`.
        Some(self.data_offset + index * self.chunk_size + at)
    }

    /// Data capacity in bytes (cannot overflow: part of `total_len`).
    pub fn capacity(&self) -> u64 {
        self.n_chunks * self.chunk_size
    }
}

/// Bytes of the root region for a root of `root_len` bytes (0 when it fits inline).
pub fn root_region_bytes(root_len: u64) -> Option<u64> {
    if root_len <= MAX_ROOT_INLINE as u64 {
        Some(0)
    } else if root_len <= MAX_ROOT_LEN as u64 {
        root_len.div_ceil(PAGE_U64).checked_mul(PAGE_U64)
    } else {
        None
    }
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[off..off + 4]);
    u32::from_ne_bytes(a)
}

fn u64_at(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_ne_bytes(a)
}

/// The arena header page, parsed and checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedHeader {
    /// The checked geometry.
    pub geometry: Geometry,
    /// Creating process.
    pub owner_pid: u32,
    /// Rank.
    pub rank: u32,
    /// World size.
    pub world_size: u32,
    /// Creation time.
    pub created_unix_ms: u64,
    /// Closed flag.
    pub closed: bool,
    /// The root, when it is inline (else read it from `geometry.slots_offset - root_bytes`).
    pub inline_root: Option<Vec<u8>>,
}

/// Parse the header page `page` of a segment of `seg_len` bytes: magic, version, and a
/// geometry that fits the segment.
pub fn parse_header(page: &[u8], seg_len: u64) -> Result<ParsedHeader, String> {
    if page.len() < PAGE || seg_len < PAGE_U64 {
        return Err(format!(
            "segment of {seg_len} bytes is smaller than a header"
        ));
    }
    if page[offset_of!(ArenaHeader, magic)..][..8] != MAGIC {
        return Err("not a shmckpt arena (bad magic)".to_owned());
    }
    let version = u32_at(page, offset_of!(ArenaHeader, version));
    if version != VERSION {
        return Err(format!("arena layout version {version} is not {VERSION}"));
    }
    let n_slots = u32_at(page, offset_of!(ArenaHeader, n_slots));
    let data_offset = u64_at(page, offset_of!(ArenaHeader, data_offset));
    let chunk_size = u64_at(page, offset_of!(ArenaHeader, chunk_size));
    let n_chunks = u64_at(page, offset_of!(ArenaHeader, n_chunks));
    let slot_bytes = u64_at(page, offset_of!(ArenaHeader, slot_bytes));
    let root_len = u32_at(page, offset_of!(ArenaHeader, root_len));
    let Some(geo) = Geometry::new(n_chunks, chunk_size, n_slots, u64::from(root_len)) else {
        return Err(format!(
            "arena header is inconsistent ({n_chunks} chunks of {chunk_size} bytes, \
             {n_slots} slots, root of {root_len} bytes)"
        ));
    };
    if geo.data_offset != data_offset || geo.slot_bytes != slot_bytes {
        return Err(format!(
            "arena header is inconsistent (data at {data_offset}, slots of {slot_bytes} \
             bytes; the counts give {} and {})",
            geo.data_offset, geo.slot_bytes
        ));
    }
    if geo.total_len > seg_len {
        return Err(format!(
            "arena geometry needs {} bytes; the segment has {seg_len}",
            geo.total_len
        ));
    }
    let inline_root = (geo.root_bytes == 0).then(|| {
        let at = offset_of!(ArenaHeader, root);
        page[at..at + root_len as usize].to_vec()
    });
    Ok(ParsedHeader {
        geometry: geo,
        owner_pid: u32_at(page, offset_of!(ArenaHeader, owner_pid)),
        rank: u32_at(page, offset_of!(ArenaHeader, rank)),
        world_size: u32_at(page, offset_of!(ArenaHeader, world_size)),
        created_unix_ms: u64_at(page, offset_of!(ArenaHeader, created_unix_ms)),
        closed: u32_at(page, offset_of!(ArenaHeader, closed)) != 0,
        inline_root,
    })
}

/// A slot header page, parsed (names cut to [`MAX_NAME`], chunk count to the arena's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedSlot {
    /// Raw state.
    pub state: u32,
    /// Chunk-map entries in use (at most the arena's chunk count).
    pub n_file_chunks: u64,
    /// Step.
    pub step: u64,
    /// File length.
    pub file_len: u64,
    /// Data section offset.
    pub data_start: u64,
    /// Partial directory name (raw bytes).
    pub partial_dir: Vec<u8>,
    /// File name (raw bytes).
    pub file_name: Vec<u8>,
}

/// Offset of the state word inside a slot header.
pub const SLOT_STATE_OFFSET: u64 = offset_of!(SlotHeader, state) as u64;

/// Parse slot header page `page` of an arena of geometry `geo`.
pub fn parse_slot(page: &[u8], geo: &Geometry) -> Result<ParsedSlot, String> {
    if page.len() < PAGE {
        return Err("slot header is truncated".to_owned());
    }
    let pl = (u32_at(page, offset_of!(SlotHeader, partial_len)) as usize).min(MAX_NAME);
    let fl = (u32_at(page, offset_of!(SlotHeader, file_name_len)) as usize).min(MAX_NAME);
    let pd = offset_of!(SlotHeader, partial_dir);
    let fname = offset_of!(SlotHeader, file_name);
    Ok(ParsedSlot {
        state: u32_at(page, offset_of!(SlotHeader, state)),
        n_file_chunks: u64::from(u32_at(page, offset_of!(SlotHeader, n_file_chunks)))
            .min(geo.n_chunks),
        step: u64_at(page, offset_of!(SlotHeader, step)),
        file_len: u64_at(page, offset_of!(SlotHeader, file_len)),
        data_start: u64_at(page, offset_of!(SlotHeader, data_start)),
        partial_dir: page[pd..pd + pl].to_vec(),
        file_name: page[fname..fname + fl].to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_layout_is_the_segment_format() {
        // The magic is an `AtomicU64` in memory and the 8 bytes `MAGIC` in the segment:
        // same offset, size and neighbours as the `[u8; 8]` it replaced.
        assert_eq!(
            (
                offset_of!(ArenaHeader, magic),
                offset_of!(ArenaHeader, version),
                offset_of!(ArenaHeader, owner_pid),
                offset_of!(ArenaHeader, created_unix_ms),
                offset_of!(ArenaHeader, closed),
                offset_of!(ArenaHeader, root),
                size_of::<ArenaHeader>(),
            ),
            (0, 8, 48, 64, 72, 80, 80 + MAX_ROOT_INLINE)
        );
    }

    #[test]
    fn geometry_refuses_overflow_and_absurd_counts() {
        assert!(Geometry::new(1 << 62, 4096, 1, 0).is_none());
        assert!(Geometry::new(1 << 32, 4096, 1, 0).is_none());
        assert!(Geometry::new(4, 4096 * 3 + 1, 1, 0).is_none());
        assert!(Geometry::new(4, u64::MAX - 4095, 1, 0).is_none());
        assert!(Geometry::new(MAX_CHUNKS, 1 << 40, 1, 0).is_none());
        assert!(Geometry::new(4, 4096, 0, 0).is_none());
        assert!(Geometry::new(4, 4096, MAX_SLOTS + 1, 0).is_none());
        assert!(Geometry::new(4, 4096, 1, MAX_ROOT_LEN as u64 + 1).is_none());
        let g = Geometry::new(4, 65536, 2, 0).unwrap();
        assert_eq!(
            (g.slot_bytes, g.slots_offset, g.data_offset, g.total_len),
            (8192, 4096, 4096 + 2 * 8192, 4096 + 2 * 8192 + 4 * 65536)
        );
        let long = Geometry::new(4, 65536, 2, 5000).unwrap();
        assert_eq!((long.root_bytes, long.slots_offset), (8192, 12288));
        assert_eq!(long.data_offset, g.data_offset + 8192);
        assert_eq!(g.slot_offset(2), None);
        assert_eq!(g.entry_offset(1, 4), None);
        assert_eq!(g.chunk_range(3, 65535, 2), None);
        assert_eq!(
            g.chunk_range(3, 65535, 1),
            Some(g.data_offset + 3 * 65536 + 65535)
        );
    }
}
