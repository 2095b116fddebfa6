//! The arena's self-description, kept in the first pages of the shared-memory segment so
//! that another process can find out what a dead trainer had staged.
//!
//! ```text
//! [page 0: ArenaHeader][slot 0: SlotHeader page + chunk map][slot 1 ...] ... [data chunks]
//! ```
//!
//! Crash consistency rests on three rules, each a single aligned atomic store with
//! `Release` ordering, read back with `Acquire`:
//! 1. a slot's plain fields (step, sizes, names) are written while its `state` is `FREE`
//!    and only then is `state` set to `STAGING`;
//! 2. a chunk-map entry becomes `STAGED` only after the chunk's bytes are complete, and
//!    `WRITTEN` only after the write to the file completed (and before the chunk is reused);
//!    a chunk whose write failed or was skipped goes back to `EMPTY`, also before the chunk
//!    is reused, so no entry ever points at an arena chunk that holds other bytes;
//! 3. `state` becomes `STAGED` only after every chunk-map entry is `STAGED` or `WRITTEN`.
//!
//! A `SIGKILL` can stop the process between any two stores, never inside one, so a reader
//! sees a prefix of this sequence: a consistent picture.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicU32, Ordering};

pub use super::layout::{ArenaHeader, Geometry, MAGIC, MAX_NAME, PAGE, SlotHeader, VERSION};

/// Slot states.
pub mod slot_state {
    /// Unused.
    pub const FREE: u32 = 0;
    /// A save is copying into staging.
    pub const STAGING: u32 = 1;
    /// Every byte of the save is staged (or already written): `save` returned.
    pub const STAGED: u32 = 2;
    /// Committed, and every chunk of its chunk map still holds the file's bytes (flash
    /// restore keeps it until the next save starts).
    pub const KEPT: u32 = 3;
}

/// Chunk-map entry states (top two bits of the entry; the low 30 bits hold the arena
/// chunk index).
pub mod chunk_state {
    /// Not staged yet.
    pub const EMPTY: u32 = 0;
    /// Bytes complete in the arena chunk.
    pub const STAGED: u32 = 1;
    /// Bytes written to the file; the arena chunk may hold other data now.
    pub const WRITTEN: u32 = 2;
}

const INDEX_MASK: u32 = (1 << 30) - 1;

const _: () = assert!(size_of::<ArenaHeader>() <= PAGE);
const _: () = assert!(size_of::<SlotHeader>() <= PAGE);

/// Access to the descriptor of an arena this process created and maps, borrowed from the
/// mapping (`'a`): it cannot outlive the arena, and it is neither `Clone` nor `Copy`.
///
/// ```compile_fail,E0505
/// use shmckpt::testing::staging::{Arena, ArenaSpec};
/// let arena = Arena::create(&ArenaSpec {
///     name: None, capacity: 4096, chunk_size: 4096, slots: 1, rank: 0, world_size: 1,
///     root: "/tmp".into(),
/// }).unwrap();
/// let d = arena.descriptor();
/// drop(arena); // the mapping goes while the descriptor borrows it: refused
/// d.free(0);
/// ```
///
/// Arenas of other processes are never accessed through it: [`super::attach`] reads them
/// with `pread` and [`super::layout`]'s checked parsing.
#[derive(Debug)]
pub struct Descriptor<'a> {
    base: *mut u8,
    geo: Geometry,
    _mapping: std::marker::PhantomData<&'a [u8]>,
}

// SAFETY: every field that can change after creation is an atomic or is written only by the
// thread that owns the slot (rule 1 above); the pointer is valid for `'a` (the mapping).
unsafe impl Send for Descriptor<'_> {}
// SAFETY: as above.
unsafe impl Sync for Descriptor<'_> {}

/// What `begin` records about a save.
#[derive(Debug, Clone, Copy)]
pub struct SaveRecord<'a> {
    /// Step.
    pub step: u64,
    /// Exact file length.
    pub file_len: u64,
    /// Offset of the data section.
    pub data_start: u64,
    /// Number of file chunks.
    pub n_file_chunks: u64,
    /// Partial directory name, relative to the root.
    pub partial_dir: &'a str,
    /// File name inside it.
    pub file_name: &'a str,
}

/// What a slot holds, read from shared memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotView {
    /// Slot number.
    pub slot: u32,
    /// [`slot_state`].
    pub state: u32,
    /// Step.
    pub step: u64,
    /// File length.
    pub file_len: u64,
    /// Data section offset.
    pub data_start: u64,
    /// Partial directory name.
    pub partial_dir: String,
    /// File name.
    pub file_name: String,
    /// Per file chunk: (state, arena chunk index).
    pub chunks: Vec<(u32, u32)>,
}

/// The arena header, read from shared memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderView {
    /// Creating process.
    pub owner_pid: u32,
    /// Rank.
    pub rank: u32,
    /// World size.
    pub world_size: u32,
    /// Checkpoint root.
    pub root: std::path::PathBuf,
    /// Creation time.
    pub created_unix_ms: u64,
    /// Whether the owner shut down cleanly.
    pub closed: bool,
    /// Geometry.
    pub geometry: Geometry,
}

impl<'a> Descriptor<'a> {
    /// The descriptor of a mapping that [`Descriptor::init`] initialised.
    ///
    /// # Safety
    /// `base` is the start of a writable, page-aligned mapping of at least
    /// `geo.total_len` bytes, initialised by [`Descriptor::init`] with `geo`, that stays
    /// mapped for `'a`.
    pub unsafe fn from_mapping(base: *mut u8, geo: Geometry) -> Descriptor<'a> {
        Descriptor {
            base,
            geo,
            _mapping: std::marker::PhantomData,
        }
    }

    /// Initialise the descriptor of a freshly created, zero-filled arena.
    ///
    /// # Safety
    /// - `base` is the start of a writable, page-aligned mapping of at least
    ///   `geo.total_len` bytes that stays mapped for `'a`;
    /// - `geo` was made for `root.len()` (`geo.root_len == root.len()`);
    /// - no other thread or process accesses the first `geo.data_offset` bytes during this
    ///   call.
    pub unsafe fn init(
        base: *mut u8,
        geo: Geometry,
        pid: u32,
        rank: u32,
        world_size: u32,
        root: &[u8],
    ) -> Descriptor<'a> {
        assert_eq!(
            geo.root_len,
            root.len() as u64,
            "geometry made for another root"
        );
        let root_len = root.len();
        // SAFETY: the caller guarantees `base` is valid, aligned and exclusively ours;
        // `ArenaHeader` fits in the first page (checked at compile time) and all-zero bytes
        // are a valid value for it.
        let h = unsafe { &mut *base.cast::<ArenaHeader>() };
        h.version = VERSION;
        h.n_slots = geo.n_slots;
        h.data_offset = geo.data_offset;
        h.chunk_size = geo.chunk_size;
        h.n_chunks = geo.n_chunks;
        h.slot_bytes = geo.slot_bytes;
        h.owner_pid.store(pid, Ordering::Relaxed);
        h.rank = rank;
        h.world_size = world_size;
        h.root_len = root_len as u32;
        if geo.root_bytes == 0 {
            h.root[..root_len].copy_from_slice(root);
        } else {
            // SAFETY: the root region (`root_bytes >= root_len` bytes from offset PAGE) lies
            // inside the mapping (`slots_offset = PAGE + root_bytes <= total_len`), does not
            // overlap the header page, and is ours exclusively (caller's contract).
            unsafe {
                std::ptr::copy_nonoverlapping(root.as_ptr(), base.add(PAGE), root_len);
            }
        }
        h.created_unix_ms = crate::util::unix_ms();
        // The magic goes last, with `Release`: a reader that loads it with `Acquire` (or
        // reads the page after it, as `attach` does with `pread`, then checks every field)
        // sees the fields above. Native-endian, so the segment holds the bytes `MAGIC`.
        h.magic.store(u64::from_ne_bytes(MAGIC), Ordering::Release);
        // SAFETY: initialised just above; the mapping stays for `'a` (caller's contract).
        unsafe { Descriptor::from_mapping(base, geo) }
    }

    /// The geometry.
    pub fn geometry(&self) -> Geometry {
        self.geo
    }

    fn header(&self) -> &ArenaHeader {
        // SAFETY: established by `init`/`attach`: the first page holds an `ArenaHeader`.
        unsafe { &*self.base.cast::<ArenaHeader>() }
    }

    fn slot_ptr(&self, slot: u32) -> *mut u8 {
        let off = self
            .geo
            .slot_offset(slot)
            .unwrap_or_else(|| panic!("slot {slot} out of range"));
        // SAFETY: `slot_offset` is `Some` only for slot < n_slots, so the offset lies inside
        // the descriptor region of the mapping (`Geometry::data_offset` counts all slots).
        unsafe { self.base.add(off as usize) }
    }

    fn slot_header(&self, slot: u32) -> &SlotHeader {
        // SAFETY: `slot_ptr` is page aligned inside the mapping and a `SlotHeader` fits in
        // a page; every bit pattern is valid for it.
        unsafe { &*self.slot_ptr(slot).cast::<SlotHeader>() }
    }

    fn chunk_entry(&self, slot: u32, k: u64) -> &AtomicU32 {
        assert!(k < self.geo.n_chunks, "chunk-map entry {k} out of range");
        // SAFETY: the chunk map follows the slot header page and has `n_chunks` u32 entries
        // (`Geometry::slot_bytes`); `k < n_chunks`; u32 alignment holds (page + 4k).
        unsafe {
            &*self
                .slot_ptr(slot)
                .add(PAGE + 4 * k as usize)
                .cast::<AtomicU32>()
        }
    }

    /// Header contents.
    pub fn header_view(&self) -> HeaderView {
        let h = self.header();
        let root = if self.geo.root_bytes == 0 {
            &h.root[..self.geo.root_len as usize]
        } else {
            // SAFETY: the root region (see `init`) lies inside the mapping and is written
            // only by `init`, before the descriptor is shared.
            unsafe { std::slice::from_raw_parts(self.base.add(PAGE), self.geo.root_len as usize) }
        };
        HeaderView {
            owner_pid: h.owner_pid.load(Ordering::Acquire),
            rank: h.rank,
            world_size: h.world_size,
            root: bytes_to_path(root),
            created_unix_ms: h.created_unix_ms,
            closed: h.closed.load(Ordering::Acquire) != 0,
            geometry: self.geo,
        }
    }

    /// Make this process the owner of a dead engine's arena taken over with its saves in
    /// place (`Mapped::take_over_keeping`): the owner's pid stored first (a crash from here
    /// on leaves an arena whose owner is dead, which recovery handles as any), the clean
    /// close mark cleared.
    pub fn claim(&self, pid: u32) {
        let h = self.header();
        h.owner_pid.store(pid, Ordering::Release);
        h.closed.store(0, Ordering::Release);
    }

    /// Mark the arena as cleanly closed.
    pub fn mark_closed(&self) {
        self.header().closed.store(1, Ordering::Release);
    }

    /// Record a new save in `slot` and publish it as `STAGING` (rule 1).
    ///
    /// The caller must own the slot (it is `FREE` and no other thread uses it).
    pub fn begin(&self, slot: u32, rec: &SaveRecord<'_>) {
        let SaveRecord {
            step,
            file_len,
            data_start,
            n_file_chunks,
            partial_dir,
            file_name,
        } = *rec;
        assert!(n_file_chunks <= self.geo.n_chunks);
        let p = self.slot_ptr(slot).cast::<SlotHeader>();
        // SAFETY: the slot is FREE and owned by the caller, so no other thread writes these
        // fields; readers in other processes ignore them until `state` says STAGING (rule 1).
        // Fields are written through the raw pointer, never through a shared reference.
        unsafe {
            debug_assert_eq!((*p).state.load(Ordering::Acquire), slot_state::FREE);
            (*p).step = step;
            (*p).file_len = file_len;
            (*p).data_start = data_start;
            (*p).n_file_chunks = n_file_chunks as u32;
            (*p).generation = (*p).generation.wrapping_add(1);
            let d = partial_dir.as_bytes();
            let d = &d[..d.len().min(MAX_NAME)];
            (*p).partial_len = d.len() as u32;
            (&mut (*p).partial_dir)[..d.len()].copy_from_slice(d);
            let f = file_name.as_bytes();
            let f = &f[..f.len().min(MAX_NAME)];
            (*p).file_name_len = f.len() as u32;
            (&mut (*p).file_name)[..f.len()].copy_from_slice(f);
        }
        for k in 0..n_file_chunks {
            self.chunk_entry(slot, k)
                .store(chunk_state::EMPTY, Ordering::Relaxed);
        }
        self.slot_header(slot)
            .state
            .store(slot_state::STAGING, Ordering::Release);
    }

    /// File chunk `k` of `slot` now lives complete in arena chunk `index` (rule 2).
    pub fn chunk_staged(&self, slot: u32, k: u64, index: u32) {
        self.chunk_entry(slot, k).store(
            (chunk_state::STAGED << 30) | (index & INDEX_MASK),
            Ordering::Release,
        );
    }

    /// File chunk `k` of `slot` is written to the file (rule 2).
    pub fn chunk_written(&self, slot: u32, k: u64) {
        let e = self.chunk_entry(slot, k);
        let idx = e.load(Ordering::Relaxed) & INDEX_MASK;
        e.store((chunk_state::WRITTEN << 30) | idx, Ordering::Release);
    }

    /// Every chunk of the save is staged (rule 3).
    pub fn staged(&self, slot: u32) {
        self.slot_header(slot)
            .state
            .store(slot_state::STAGED, Ordering::Release);
    }

    /// The write of file chunk `k` of `slot` failed or was skipped: its arena chunk is
    /// about to return to the pool and may be refilled by another save, so the entry must
    /// no longer claim to hold the chunk's bytes (rule 2). A `STAGED` slot with an `EMPTY`
    /// entry is a failed save that recovery refuses. Call before the lease drops.
    pub fn chunk_lost(&self, slot: u32, k: u64) {
        self.chunk_entry(slot, k)
            .store(chunk_state::EMPTY, Ordering::Release);
    }

    /// The slot's save committed and its chunks stay untouched until the next save starts.
    pub fn keep(&self, slot: u32) {
        self.slot_header(slot)
            .state
            .store(slot_state::KEPT, Ordering::Release);
    }

    /// The slot is free again (committed, failed or recovered).
    pub fn free(&self, slot: u32) {
        self.slot_header(slot)
            .state
            .store(slot_state::FREE, Ordering::Release);
    }

    /// Read a slot.
    pub fn slot_view(&self, slot: u32) -> SlotView {
        let h = self.slot_header(slot);
        let state = h.state.load(Ordering::Acquire);
        let n = (h.n_file_chunks as u64).min(self.geo.n_chunks);
        let chunks = (0..n)
            .map(|k| {
                let v = self.chunk_entry(slot, k).load(Ordering::Acquire);
                (v >> 30, v & INDEX_MASK)
            })
            .collect();
        let pl = (h.partial_len as usize).min(MAX_NAME);
        let fl = (h.file_name_len as usize).min(MAX_NAME);
        SlotView {
            slot,
            state,
            step: h.step,
            file_len: h.file_len,
            data_start: h.data_start,
            partial_dir: String::from_utf8_lossy(&h.partial_dir[..pl]).into_owned(),
            file_name: String::from_utf8_lossy(&h.file_name[..fl]).into_owned(),
            chunks,
        }
    }
}

pub(crate) fn bytes_to_path(b: &[u8]) -> std::path::PathBuf {
    use std::os::unix::ffi::OsStrExt;
    std::path::PathBuf::from(std::ffi::OsStr::from_bytes(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_publishes_the_magic_last_as_the_segment_bytes() {
        let geo = Geometry::new(1, PAGE as u64, 1, 3).unwrap();
        // Zero-filled, 8-byte aligned (what `ArenaHeader` needs; a segment is page aligned).
        let mut mem = vec![0u64; geo.total_len as usize / 8];
        let base = mem.as_mut_ptr().cast::<u8>();
        // SAFETY: `mem` is a zero-filled, writable, 8-byte aligned buffer of
        // `geo.total_len` bytes, made for a root of 3 bytes, used by nobody else, and it
        // outlives the descriptor (dropped at the end of this statement).
        let d = unsafe { Descriptor::init(base, geo, 7, 0, 1, b"/ck") };
        // SAFETY: `init` wrote the header at `base` (aligned, inside `mem`).
        let h = unsafe { &*base.cast::<ArenaHeader>() };
        assert_eq!(h.magic.load(Ordering::Acquire).to_ne_bytes(), MAGIC);
        assert_eq!(d.header_view().owner_pid, 7);
        // SAFETY: `mem` is `total_len` initialised bytes; `d` and `h` are not used again.
        let page = unsafe { std::slice::from_raw_parts(base, PAGE) };
        assert_eq!(&page[..8], b"SHMCKPT1");
        let parsed = super::super::layout::parse_header(page, geo.total_len).unwrap();
        assert_eq!(parsed.geometry, geo);
    }
}
