//! Attaching to an arena that another (usually dead) process created, to inspect its
//! descriptor and copy staged chunks out of it: the staging side of crash recovery.
//!
//! Nothing in such a segment is trusted. It is opened without following links, only when it
//! is a regular file of the caller's uid (unless the caller explicitly allows foreign
//! arenas), never mapped: the descriptor is read with `pread` and parsed by
//! [`super::layout`] with checked arithmetic against the segment's real (`fstat`) size, and
//! a sparse descriptor (fewer bytes allocated than its geometry claims, which no engine
//! ever creates: an arena's data pages are allocated in the background, its descriptor's
//! before it is written) is refused before its slot tables are read. Reads past the end, a `SIGBUS` on a
//! full tmpfs, or an allocation sized by a hostile count cannot happen.
#![forbid(unsafe_code)]

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use super::descriptor::{HeaderView, SlotView, bytes_to_path, chunk_state, slot_state};
use super::layout::{self, Geometry, PAGE, ParsedHeader};
use super::shm::{SHM_MOUNT, open_existing};
use crate::error::{Error, Result};

/// How to attach.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AttachOptions {
    /// Open for writing (recovery marks recovered slots free).
    pub write: bool,
    /// Accept a segment owned by another uid (an explicit, documented opt-in: the
    /// `--allow-foreign` flag of `shmckpt recover`).
    pub allow_foreign: bool,
}

/// An arena of another process, with its descriptor checked.
#[derive(Debug)]
pub struct AttachedArena {
    file: File,
    name: String,
    len: u64,
    header: HeaderView,
    writable: bool,
}

impl AttachedArena {
    /// Open `/dev/shm/<name>` read-only and check its descriptor (magic, version, geometry
    /// against the segment size). Nothing in the segment is written.
    ///
    /// Fails with [`Error::UnsafePath`] for a link, a non-regular file or another user's
    /// segment, [`Error::Io`] when it cannot be opened, and [`Error::Recovery`] when it is
    /// not a shmckpt arena of this layout version or its descriptor does not fit it.
    pub fn open(name: &str) -> Result<AttachedArena> {
        AttachedArena::open_with(name, AttachOptions::default())
    }

    /// [`AttachedArena::open`] with options.
    ///
    /// The segment is opened read-only first; only once the link, file-type, owner and
    /// descriptor checks passed is it opened for writing (when `opts.write`), and that second
    /// open must reach the same inode.
    pub fn open_with(name: &str, opts: AttachOptions) -> Result<AttachedArena> {
        use std::os::unix::fs::MetadataExt;
        let (file, len, allocated) = open_existing(name, false, opts.allow_foreign)?;
        let mut a = AttachedArena::from_file(file, name, len, allocated, false)?;
        if opts.write {
            let path = a.path();
            let (rw, _, _) = open_existing(name, true, opts.allow_foreign)?;
            let was = a
                .file
                .metadata()
                .map_err(|e| Error::io("fstat", &path, e))?;
            let now = rw.metadata().map_err(|e| Error::io("fstat", &path, e))?;
            if (was.dev(), was.ino(), was.len()) != (now.dev(), now.ino(), now.len()) {
                return Err(Error::Recovery {
                    arena: name.to_owned(),
                    reason: "the segment was replaced while it was being checked".into(),
                });
            }
            a.file = rw;
            a.writable = true;
        }
        Ok(a)
    }

    /// Check the descriptor of an already opened segment file of `len` bytes, of which
    /// `allocated` are backed.
    pub(crate) fn from_file(
        file: File,
        name: &str,
        len: u64,
        allocated: u64,
        writable: bool,
    ) -> Result<AttachedArena> {
        let refuse = |reason: String| Error::Recovery {
            arena: name.to_owned(),
            reason,
        };
        let path = PathBuf::from(SHM_MOUNT).join(name);
        let mut page = vec![0u8; PAGE];
        if len < PAGE as u64 {
            return Err(refuse(format!(
                "segment of {len} bytes is smaller than a header"
            )));
        }
        file.read_exact_at(&mut page, 0)
            .map_err(|e| Error::io_at("read", &path, 0, e))?;
        let h: ParsedHeader = layout::parse_header(&page, len).map_err(refuse)?;
        let geo = h.geometry;
        // An engine allocates its descriptor's pages before writing it (its data pages may
        // still be allocating, in the background); a hole there could be backed by nothing
        // on a full tmpfs. Sizes are rounded to pages by the kernel.
        if allocated < geo.data_offset {
            return Err(refuse(format!(
                "sparse segment: {allocated} of the {} descriptor bytes are allocated",
                geo.data_offset
            )));
        }
        let root = match h.inline_root {
            Some(r) => r,
            None => {
                let mut r = vec![0u8; geo.root_len as usize];
                file.read_exact_at(&mut r, PAGE as u64)
                    .map_err(|e| Error::io_at("read", &path, PAGE as u64, e))?;
                r
            }
        };
        let header = HeaderView {
            owner_pid: h.owner_pid,
            rank: h.rank,
            world_size: h.world_size,
            root: bytes_to_path(&root),
            created_unix_ms: h.created_unix_ms,
            closed: h.closed,
            geometry: geo,
        };
        Ok(AttachedArena {
            file,
            name: name.to_owned(),
            len,
            header,
            writable,
        })
    }

    /// A second descriptor of the segment, for writing (attached with `write`).
    pub(crate) fn writable_file(&self) -> std::io::Result<File> {
        if !self.writable {
            return Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                "attached read-only",
            ));
        }
        self.file.try_clone()
    }

    fn path(&self) -> PathBuf {
        PathBuf::from(SHM_MOUNT).join(&self.name)
    }

    fn geo(&self) -> &Geometry {
        &self.header.geometry
    }

    /// A refusal of this arena, with why.
    fn refusal(&self, reason: String) -> Error {
        Error::Recovery {
            arena: self.name.clone(),
            reason,
        }
    }

    /// The header of the slot at `off`, read now and parsed.
    fn slot_header(&self, off: u64) -> Result<layout::ParsedSlot> {
        let mut page = vec![0u8; PAGE];
        self.file
            .read_exact_at(&mut page, off)
            .map_err(|e| Error::io_at("read", self.path(), off, e))?;
        layout::parse_slot(&page, self.geo()).map_err(|reason| self.refusal(reason))
    }

    /// The segment name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The arena header.
    pub fn header(&self) -> HeaderView {
        self.header.clone()
    }

    /// Number of save slots.
    pub fn slot_count(&self) -> u32 {
        self.geo().n_slots
    }

    /// Read slot `slot` (`< slot_count()`). A slot that cannot be read (out of range, I/O
    /// error) reads as a slot in an unknown state with no chunks, which recovery refuses.
    pub fn slot(&self, slot: u32) -> SlotView {
        self.try_slot(slot).unwrap_or_else(|e| {
            tracing::warn!(arena = %self.name, slot, error = %e, "slot cannot be read");
            SlotView {
                slot,
                state: u32::MAX,
                step: 0,
                file_len: 0,
                data_start: 0,
                partial_dir: String::new(),
                file_name: String::new(),
                chunks: Vec::new(),
            }
        })
    }

    /// Read slot `slot`, with the reason when it cannot be read.
    pub fn try_slot(&self, slot: u32) -> Result<SlotView> {
        let path = self.path();
        let Some(off) = self.geo().slot_offset(slot) else {
            return Err(self.refusal(format!("slot {slot} out of range")));
        };
        let s = self.slot_header(off)?;
        let mut chunks = Vec::new();
        if s.state != slot_state::FREE && s.n_file_chunks > 0 {
            // `n_file_chunks <= n_chunks`, and the chunk map lies inside the segment and is
            // allocated (checked at open), so this is bounded by memory the segment holds.
            let map_at = off + PAGE as u64;
            let mut raw = vec![0u8; 4 * s.n_file_chunks as usize];
            self.file
                .read_exact_at(&mut raw, map_at)
                .map_err(|e| Error::io_at("read", &path, map_at, e))?;
            chunks = raw
                .chunks_exact(4)
                .map(|b| {
                    let v = u32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
                    (v >> 30, v & ((1 << 30) - 1))
                })
                .collect();
        }
        Ok(SlotView {
            slot,
            state: s.state,
            step: s.step,
            file_len: s.file_len,
            data_start: s.data_start,
            partial_dir: String::from_utf8_lossy(&s.partial_dir).into_owned(),
            file_name: String::from_utf8_lossy(&s.file_name).into_owned(),
            chunks,
        })
    }

    /// Mark slot `slot` free (its save was recovered or found committed), so that a retry
    /// skips it. Needs an arena opened for writing.
    pub fn release_slot(&self, slot: u32) -> Result<()> {
        let off = self.writable_slot(slot)?;
        self.write_slot_state(off, slot_state::FREE)
    }

    /// The offset of slot `slot`'s header, for a write: the arena must be opened for
    /// writing and the slot in range.
    fn writable_slot(&self, slot: u32) -> Result<u64> {
        if !self.writable {
            return Err(self.refusal("opened read-only".into()));
        }
        self.geo()
            .slot_offset(slot)
            .ok_or_else(|| self.refusal(format!("slot {slot} out of range")))
    }

    /// Write `state` into the slot header at `off` ([`Self::writable_slot`]).
    fn write_slot_state(&self, off: u64, state: u32) -> Result<()> {
        let at = off + layout::SLOT_STATE_OFFSET;
        self.file
            .write_all_at(&state.to_ne_bytes(), at)
            .map_err(|e| Error::io_at("write", self.path(), at, e))
    }

    /// Make `v`, a slot recovery committed from this arena whose every file chunk is still
    /// `STAGED` in it (a memory-only save's, or a save none of whose chunks had been
    /// written), the arena's kept image for flash restore: its chunk-map entries become
    /// `WRITTEN` (the bytes are the committed file's), then its state `KEPT`, as a
    /// committed save of a keeping engine leaves its slot. The slot must read free already
    /// (recovery marks a recovered slot free first), so a crash in between leaves a free
    /// slot, which nothing reads. The next engine's flash restore checks every tensor's
    /// CRC-32C against the manifest before it serves a byte, as for any kept image.
    ///
    /// Needs an arena opened for writing; refuses a view whose chunks are not all `STAGED`
    /// or whose chunk count is not the slot's.
    pub fn keep_recovered(&self, v: &SlotView) -> Result<()> {
        let path = self.path();
        let off = self.writable_slot(v.slot)?;
        if v.chunks.is_empty() || v.chunks.iter().any(|&(s, _)| s != chunk_state::STAGED) {
            return Err(self.refusal(format!(
                "slot {} does not hold step {} whole in the arena",
                v.slot, v.step
            )));
        }
        let map_at = off + PAGE as u64;
        // The slot's own count, re-read: the view must describe this slot as it is now.
        let s = self.slot_header(off)?;
        if s.state != slot_state::FREE
            || s.step != v.step
            || s.n_file_chunks != v.chunks.len() as u64
        {
            return Err(self.refusal(format!("slot {} changed since it was recovered", v.slot)));
        }
        let map: Vec<u8> = v
            .chunks
            .iter()
            .flat_map(|&(_, index)| ((chunk_state::WRITTEN << 30) | index).to_ne_bytes())
            .collect();
        self.file
            .write_all_at(&map, map_at)
            .map_err(|e| Error::io_at("write", &path, map_at, e))?;
        self.write_slot_state(off, slot_state::KEPT)
    }

    /// Copy `out.len()` bytes of arena chunk `index`, starting `at` bytes into the chunk,
    /// into `out`. Returns `None` (copying nothing useful) when `index` is not a chunk of
    /// this arena, the range runs past the end of the chunk, or the read fails.
    ///
    /// The copy is only meaningful while nobody writes the chunk, i.e. after its owner
    /// died; bytes changing underneath would only make the copy torn.
    pub fn read_chunk(&self, index: u32, at: u64, out: &mut [u8]) -> Option<()> {
        let off = self
            .geo()
            .chunk_range(u64::from(index), at, out.len() as u64)?;
        // The geometry was checked against the size at open; check the read against it too
        // (defence in depth: a range past the checked size is never read).
        if off.checked_add(out.len() as u64)? > self.len {
            return None;
        }
        self.file.read_exact_at(out, off).ok()
    }

    /// Put `data` into arena chunk `index`, from byte `at` of the chunk: the counterpart of
    /// [`Self::read_chunk`], for a save's bytes read back from its file
    /// (`crate::recover::rebuild::restage_written`). Needs an arena opened for writing whose
    /// owner is dead (nobody else writes the chunk), and the range inside the chunk.
    pub(crate) fn write_chunk(&self, index: u32, at: u64, data: &[u8]) -> Result<()> {
        if !self.writable {
            return Err(self.refusal("opened read-only".into()));
        }
        let off = self
            .geo()
            .chunk_range(u64::from(index), at, data.len() as u64)
            .filter(|off| {
                off.checked_add(data.len() as u64)
                    .is_some_and(|e| e <= self.len)
            })
            .ok_or_else(|| {
                self.refusal(format!("chunk {index} has no bytes {at}+{}", data.len()))
            })?;
        self.file
            .write_all_at(data, off)
            .map_err(|e| Error::io_at("write", self.path(), off, e))
    }

    /// File chunk `k` of `STAGED` slot `slot` (step `step`), recorded `WRITTEN` in arena
    /// chunk `index`, is whole in that arena chunk again ([`Self::write_chunk`] wrote it):
    /// its entry becomes `STAGED` (the descriptor's rule 2: after the bytes). The slot is
    /// read again first and must still be that step's, `STAGED`, with that entry.
    pub(crate) fn restaged(&self, slot: u32, step: u64, k: u64, index: u32) -> Result<()> {
        let off = self.writable_slot(slot)?;
        let path = self.path();
        let s = self.slot_header(off)?;
        let at = self
            .geo()
            .entry_offset(slot, k)
            .filter(|_| k < s.n_file_chunks)
            .ok_or_else(|| self.refusal(format!("chunk {k} of slot {slot} out of range")))?;
        let mut raw = [0u8; 4];
        self.file
            .read_exact_at(&mut raw, at)
            .map_err(|e| Error::io_at("read", &path, at, e))?;
        if s.state != slot_state::STAGED
            || s.step != step
            || u32::from_ne_bytes(raw) != (chunk_state::WRITTEN << 30) | index
        {
            return Err(self.refusal(format!(
                "slot {slot} changed: chunk {k} of step {step} is no longer written to arena chunk {index}"
            )));
        }
        let entry = (chunk_state::STAGED << 30) | index;
        self.file
            .write_all_at(&entry.to_ne_bytes(), at)
            .map_err(|e| Error::io_at("write", &path, at, e))
    }

    /// Remove the name from `/dev/shm`, if it still names the segment that was opened.
    pub fn unlink(&self) -> std::io::Result<()> {
        use std::os::unix::fs::MetadataExt;
        let mine = self.file.metadata()?;
        let dir = std::fs::File::open(SHM_MOUNT)?;
        let now = rustix::fs::statat(
            &dir,
            self.name.as_str(),
            rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
        )?;
        if now.st_ino != mine.ino() || now.st_dev != mine.dev() {
            return Err(std::io::Error::other(format!(
                "{} was replaced since it was opened; not removing it",
                self.path().display()
            )));
        }
        rustix::fs::unlinkat(&dir, self.name.as_str(), rustix::fs::AtFlags::empty())?;
        Ok(())
    }
}

/// Steps of the saves that this user's staging arenas recorded for `root` (any rank) still
/// hold in a slot (neither free nor kept): their partial directories hold chunks that
/// recovery needs, and [`crate::commit::clean_stale`] keeps them. Nothing is written; links,
/// non-regular files, other users' segments and arenas that cannot be read are skipped.
pub(crate) fn staged_steps(root: &std::path::Path) -> std::collections::BTreeSet<u64> {
    use std::os::unix::fs::MetadataExt;
    let want = std::fs::canonicalize(root).unwrap_or_else(|_| root.to_owned());
    let me = rustix::process::geteuid().as_raw();
    let mut out = std::collections::BTreeSet::new();
    let Ok(rd) = std::fs::read_dir(SHM_MOUNT) else {
        return out;
    };
    for e in rd.flatten() {
        let Some(name) = e.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        // `DirEntry::metadata` does not follow a link.
        let ours = e
            .metadata()
            .is_ok_and(|m| m.file_type().is_file() && m.uid() == me);
        if !name.starts_with(super::NAME_PREFIX) || !ours {
            continue;
        }
        let Ok(a) = AttachedArena::open(&name) else {
            continue;
        };
        let h = a.header();
        if h.root != want && h.root != root {
            continue;
        }
        out.extend(
            (0..a.slot_count())
                .map(|s| a.slot(s))
                .filter(|v| v.state != slot_state::FREE && v.state != slot_state::KEPT)
                .map(|v| v.step),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    //! Random descriptor headers and slot tables: attaching and listing never panic, never
    //! read out of bounds (overflow checks are on in test builds), and accept only what
    //! fits the file.
    use super::*;
    use crate::staging::descriptor::{MAGIC, VERSION};
    use proptest::prelude::*;
    use std::io::Write;

    fn header_bytes(
        n_slots: u32,
        data_offset: u64,
        chunk_size: u64,
        n_chunks: u64,
        slot_bytes: u64,
        root_len: u32,
    ) -> Vec<u8> {
        use super::super::descriptor::ArenaHeader;
        use std::mem::offset_of;
        let mut h = vec![0u8; PAGE];
        h[..8].copy_from_slice(&MAGIC);
        let put32 =
            |h: &mut Vec<u8>, o: usize, v: u32| h[o..o + 4].copy_from_slice(&v.to_ne_bytes());
        let put64 =
            |h: &mut Vec<u8>, o: usize, v: u64| h[o..o + 8].copy_from_slice(&v.to_ne_bytes());
        put32(&mut h, offset_of!(ArenaHeader, version), VERSION);
        put32(&mut h, offset_of!(ArenaHeader, n_slots), n_slots);
        put64(&mut h, offset_of!(ArenaHeader, data_offset), data_offset);
        put64(&mut h, offset_of!(ArenaHeader, chunk_size), chunk_size);
        put64(&mut h, offset_of!(ArenaHeader, n_chunks), n_chunks);
        put64(&mut h, offset_of!(ArenaHeader, slot_bytes), slot_bytes);
        put32(&mut h, offset_of!(ArenaHeader, root_len), root_len);
        h
    }

    fn attach_bytes(bytes: &[u8]) -> Result<AttachedArena> {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(bytes).unwrap();
        let len = bytes.len() as u64;
        AttachedArena::from_file(f, "proptest", len, len, false)
    }

    /// Everything a listing does with an arena.
    fn list_all(a: &AttachedArena) {
        let h = a.header();
        let g = h.geometry;
        assert!(g.total_len <= a.len);
        for s in 0..a.slot_count() {
            let v = a.slot(s);
            assert!(v.chunks.len() as u64 <= g.n_chunks);
            for &(_, idx) in &v.chunks {
                let mut b = [0u8; 16];
                let _ = a.read_chunk(idx, 0, &mut b);
                let _ = a.read_chunk(idx, g.chunk_size.saturating_sub(8), &mut b);
            }
        }
        assert!(a.try_slot(a.slot_count()).is_err());
    }

    #[test]
    fn the_issue_repro_is_refused() {
        // n_chunks = 2^62 with 4 KiB chunks: wrapped to a tiny size before.
        let mut h = header_bytes(1, 32700, 4096, 1 << 62, 4096, 0);
        h.resize(8192, 0);
        h[4096 + 4..4096 + 8].copy_from_slice(&100_000u32.to_ne_bytes());
        let e = attach_bytes(&h).unwrap_err().to_string();
        assert!(e.contains("proptest") && e.contains("inconsistent"), "{e}");
    }

    #[test]
    fn a_consistent_small_arena_attaches() {
        let g = Geometry::new(2, 4096, 1, 5).unwrap();
        let mut b = header_bytes(1, g.data_offset, 4096, 2, g.slot_bytes, 5);
        let ro = std::mem::offset_of!(super::super::descriptor::ArenaHeader, root);
        b[ro..ro + 5].copy_from_slice(b"/ckpt");
        b.resize(g.total_len as usize, 0);
        let so = g.slot_offset(0).unwrap() as usize;
        b[so..so + 4].copy_from_slice(&slot_state::STAGED.to_ne_bytes());
        b[so + 4..so + 8].copy_from_slice(&7u32.to_ne_bytes()); // clamped to 2 chunks
        let e = g.entry_offset(0, 1).unwrap() as usize;
        b[e..e + 4].copy_from_slice(&((1u32 << 30) | 1).to_ne_bytes());
        let d = g.chunk_range(1, 0, 3).unwrap() as usize;
        b[d..d + 3].copy_from_slice(b"abc");
        let a = attach_bytes(&b).unwrap();
        assert_eq!(a.header().root, std::path::Path::new("/ckpt"));
        let v = a.slot(0);
        assert_eq!(v.chunks, [(0, 0), (1, 1)]);
        let mut out = [0u8; 3];
        a.read_chunk(1, 0, &mut out).unwrap();
        assert_eq!(&out, b"abc");
        assert!(a.read_chunk(2, 0, &mut out).is_none());
        assert!(a.read_chunk(1, 4094, &mut out).is_none());
        assert!(a.release_slot(0).is_err(), "read-only");
        // One byte short of the geometry: refused.
        b.pop();
        assert!(attach_bytes(&b).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Arbitrary header fields: no panic, and an arena is accepted only when its geometry
        /// is exactly consistent and fits the file.
        #[test]
        fn random_headers_never_panic(
            n_slots in prop_oneof![0u32..4, any::<u32>()],
            chunk_size in prop_oneof![Just(4096u64), Just(8192), any::<u64>()],
            n_chunks in prop_oneof![0u64..8, any::<u64>(), Just(1 << 62), Just(1 << 32)],
            root_len in prop_oneof![0u32..5000, any::<u32>()],
            consistent in any::<bool>(),
            data_offset in any::<u64>(),
            slot_bytes in any::<u64>(),
            file_len in 0usize..(64 << 10),
            fill in any::<u8>(),
        ) {
            let (d, s) = match Geometry::new(n_chunks, chunk_size, n_slots, u64::from(root_len)) {
                Some(g) if consistent => (g.data_offset, g.slot_bytes),
                _ => (data_offset, slot_bytes),
            };
            let mut b = header_bytes(n_slots, d, chunk_size, n_chunks, s, root_len);
            b.resize(file_len.max(PAGE), fill);
            match attach_bytes(&b) {
                Ok(a) => {
                    let g = a.header().geometry;
                    prop_assert!(g.total_len <= b.len() as u64);
                    prop_assert_eq!((g.n_chunks, g.chunk_size, g.n_slots), (n_chunks, chunk_size, n_slots));
                    list_all(&a);
                }
                Err(e) => prop_assert!(e.to_string().contains("proptest"), "{}", e),
            }
        }

        /// A valid header over random slot tables and chunk maps: every slot reads, every
        /// chunk-map entry is bounded, and reading chunks named by random entries stays
        /// inside the file.
        #[test]
        fn random_slot_tables_never_panic(
            n_slots in 1u32..4,
            n_chunks in 1u64..6,
            root_len in prop_oneof![0u32..10, 3000u32..9000],
            slots in proptest::collection::vec(any::<u8>(), 0..(4 * 4096)),
        ) {
            let g = Geometry::new(n_chunks, 4096, n_slots, u64::from(root_len)).unwrap();
            let mut b = header_bytes(n_slots, g.data_offset, 4096, n_chunks, g.slot_bytes, root_len);
            b.resize(g.total_len as usize, 0);
            let so = g.slots_offset as usize;
            let n = slots.len().min(g.data_offset as usize - so);
            b[so..so + n].copy_from_slice(&slots[..n]);
            let a = attach_bytes(&b).unwrap();
            prop_assert_eq!(a.header().root.as_os_str().len(), root_len as usize);
            list_all(&a);
        }
    }
}
