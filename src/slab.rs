//! One page-aligned allocation that a load reads a whole data section into with O_DIRECT,
//! then hands out as the tensors' bytes (views), with no copy. When the last view is
//! dropped the allocation goes back to the engine's [`SlabPool`], so the next load reuses
//! memory that is already faulted in (first touch of fresh memory costs about 1-3 s/GiB in
//! a VM, more than reading it from disk).
//!
//! Soundness: the bytes are only ever reached through values that own disjoint ranges of
//! them. A [`SlabBuilder`] owns the whole allocation and carves it, front to back, into
//! [`SlabRegion`]s (each the only handle to its range, for I/O); once every region is gone
//! (the builder checks that it is the only owner left), [`SlabBuilder::finish`] turns it
//! into views over checked, disjoint ranges. A view is the only handle to its range;
//! cloning one copies the bytes.
#![allow(unsafe_code)]

use std::ptr::NonNull;
use std::sync::{Arc, Mutex, Weak};

/// Alignment of every slab (O_DIRECT needs 4096).
pub(crate) const SLAB_ALIGN: usize = 4096;

/// A raw allocation of `cap` bytes, aligned to [`SLAB_ALIGN`], every byte initialized
/// (zeroed at allocation, written by loads afterwards).
struct Alloc {
    ptr: NonNull<u8>,
    cap: usize,
}

// SAFETY: `Alloc` is a plain heap allocation with no thread affinity.
unsafe impl Send for Alloc {}

impl Alloc {
    /// Anonymous private memory: zero pages, faulted in on first touch (no `memset`: for
    /// a load, the first touch is the read itself, or [`Populator`] ahead of it).
    fn new(cap: usize) -> Option<Alloc> {
        let len = cap.max(SLAB_ALIGN);
        // SAFETY: a fresh anonymous mapping with a null hint aliases nothing.
        let p = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE,
            )
        }
        .ok()?;
        NonNull::new(p.cast()).map(|ptr| Alloc { ptr, cap })
    }
}

impl Drop for Alloc {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `Alloc::new` with this length, unmapped once; every
        // region and view of it is gone (they hold the `Arc<Slab>` that owns this).
        unsafe {
            let _ = rustix::mm::munmap(self.ptr.as_ptr().cast(), self.cap.max(SLAB_ALIGN));
        }
    }
}

/// Allocations given back by dropped loads, for the next load. Holds at most one (the
/// largest seen last): the memory cost of the pool is the size of the last checkpoint
/// loaded through it, held after its tensors are dropped.
#[derive(Default)]
pub(crate) struct SlabPool {
    free: Mutex<Option<Alloc>>,
}

impl std::fmt::Debug for SlabPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let held = self.held_bytes();
        write!(f, "SlabPool({held} bytes held)")
    }
}

impl SlabPool {
    /// A new, empty pool.
    pub(crate) fn new() -> Arc<SlabPool> {
        Arc::new(SlabPool::default())
    }

    /// Bytes held for reuse.
    pub(crate) fn held_bytes(&self) -> usize {
        crate::util::lock(&self.free).as_ref().map_or(0, |a| a.cap)
    }

    /// Drop what is held.
    pub(crate) fn clear(&self) {
        crate::util::lock(&self.free).take();
    }

    /// A held allocation of at least `len` bytes and at most twice that, if any.
    fn take(&self, len: usize) -> Option<Alloc> {
        let mut g = crate::util::lock(&self.free);
        match g.as_ref() {
            Some(a) if a.cap >= len && a.cap / 2 <= len => g.take(),
            _ => None,
        }
    }

    fn give(&self, a: Alloc) {
        let mut g = crate::util::lock(&self.free);
        if g.as_ref().is_none_or(|held| held.cap <= a.cap) {
            *g = Some(a);
        }
    }
}

/// The shared allocation behind regions and views.
struct Slab {
    alloc: Option<Alloc>,
    pool: Weak<SlabPool>,
}

impl Slab {
    fn base(&self) -> *mut u8 {
        self.alloc
            .as_ref()
            .expect("present until drop")
            .ptr
            .as_ptr()
    }
}

// SAFETY: the bytes are reached only through `SlabRegion`s and views, each the only handle
// to a disjoint range (see the module comment); `Slab` itself hands out nothing.
unsafe impl Send for Slab {}
// SAFETY: as above: shared `&Slab` gives access to no bytes.
unsafe impl Sync for Slab {}

impl Drop for Slab {
    fn drop(&mut self) {
        if let (Some(a), Some(pool)) = (self.alloc.take(), self.pool.upgrade()) {
            pool.give(a);
        }
    }
}

/// The sole owner of a fresh or reused slab, carving it into regions front to back.
pub(crate) struct SlabBuilder {
    slab: Arc<Slab>,
    len: usize,
    next: usize,
    fresh: bool,
}

/// Faults in a fresh slab's pages ahead of the reads (`MADV_POPULATE_WRITE`), on another
/// thread, so that the first touch overlaps the I/O. Contents are never changed.
pub(crate) struct Populator {
    slab: Arc<Slab>,
    cap: usize,
}

impl Populator {
    /// Fault in `[off, off + len)` (clipped to the slab). False when the kernel refuses
    /// (older than 5.14): stop then.
    pub(crate) fn populate(&self, off: usize, len: usize) -> bool {
        if off >= self.cap {
            return true;
        }
        let len = len.min(self.cap - off);
        // SAFETY: the range lies inside the allocation, which the `Arc` keeps mapped;
        // MADV_POPULATE_WRITE only faults pages in (a present page is left as it is), so
        // no byte that a region or the kernel is writing changes.
        unsafe {
            rustix::mm::madvise(
                self.slab.base().add(off).cast(),
                len,
                rustix::mm::Advice::LinuxPopulateWrite,
            )
        }
        .is_ok()
    }
}

impl SlabBuilder {
    /// A slab of at least `len` bytes: reused from `pool` when it holds one that fits,
    /// else freshly allocated (`None` when the allocation fails).
    pub(crate) fn new(pool: Option<&Arc<SlabPool>>, len: usize) -> Option<SlabBuilder> {
        let cap = len.checked_next_multiple_of(SLAB_ALIGN)?;
        let (alloc, fresh) = match pool.and_then(|p| p.take(cap)) {
            Some(a) => (a, false),
            None => (Alloc::new(cap)?, true),
        };
        Some(SlabBuilder {
            slab: Arc::new(Slab {
                alloc: Some(alloc),
                pool: pool.map_or_else(Weak::new, Arc::downgrade),
            }),
            len,
            next: 0,
            fresh,
        })
    }

    /// A populator for a freshly allocated slab (`None` when it was reused: its pages are
    /// already there).
    pub(crate) fn populator(&self) -> Option<Populator> {
        self.fresh.then(|| Populator {
            slab: Arc::clone(&self.slab),
            cap: self.capacity(),
        })
    }

    /// Capacity in bytes (a multiple of [`SLAB_ALIGN`], at least the requested length).
    pub(crate) fn capacity(&self) -> usize {
        self.slab.alloc.as_ref().map_or(0, |a| a.cap)
    }

    /// The next `len` bytes (fewer at the end of the capacity) as a region; `None` once
    /// everything was carved.
    pub(crate) fn carve(&mut self, len: usize) -> Option<SlabRegion> {
        let cap = self.capacity();
        if self.next >= cap || len == 0 {
            return None;
        }
        let n = len.min(cap - self.next);
        let r = SlabRegion {
            slab: Arc::clone(&self.slab),
            off: self.next,
            len: n,
        };
        self.next += n;
        Some(r)
    }

    /// The first `len` bytes (as requested at creation), when no region is alive.
    pub(crate) fn bytes(&self) -> Option<&[u8]> {
        if Arc::strong_count(&self.slab) != 1 {
            return None;
        }
        // SAFETY: this builder holds the only `Arc` of the slab (no `Weak` to a `Slab` is
        // ever made, so none can be upgraded), so no region or view exists; `len <= cap`,
        // and every byte is initialized (`Alloc`).
        Some(unsafe { std::slice::from_raw_parts(self.slab.base(), self.len) })
    }

    /// Turn the slab into views over `ranges` (`[start, end)` in bytes, sorted, disjoint,
    /// inside the requested length). `None` if a region is still alive or a range breaks
    /// those rules.
    pub(crate) fn finish(self, ranges: &[(usize, usize)]) -> Option<Vec<SlabView>> {
        if Arc::strong_count(&self.slab) != 1 {
            return None;
        }
        let mut prev = 0usize;
        for &(s, e) in ranges {
            if s < prev || e < s || e > self.len {
                return None;
            }
            prev = e;
        }
        Some(
            ranges
                .iter()
                .map(|&(s, e)| SlabView {
                    slab: Arc::clone(&self.slab),
                    off: s,
                    len: e - s,
                })
                .collect(),
        )
    }
}

/// A range of a slab for one I/O request: the only handle to those bytes while it lives.
pub(crate) struct SlabRegion {
    slab: Arc<Slab>,
    off: usize,
    len: usize,
}

impl SlabRegion {
    /// Offset of the region in its slab.
    #[cfg(test)]
    fn offset(&self) -> usize {
        self.off
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Start of the region (for the I/O queue).
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        // SAFETY: `off < cap` (carved inside the allocation).
        unsafe { self.slab.base().add(self.off) }
    }

    /// The bytes.
    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: the region is the only handle to `[off, off + len)`, which lies inside
        // the allocation and is initialized; `&self` prevents writes through it meanwhile.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len) }
    }

    /// The bytes, mutable.
    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.as_ptr(), self.len) }
    }
}

/// A tensor's bytes inside a slab: the only handle to its range.
pub(crate) struct SlabView {
    slab: Arc<Slab>,
    off: usize,
    len: usize,
}

impl SlabView {
    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The bytes.
    pub(crate) fn as_bytes(&self) -> &[u8] {
        // SAFETY: the view is the only handle to `[off, off + len)` (disjoint ranges,
        // checked in `finish`), inside the allocation and initialized.
        unsafe { std::slice::from_raw_parts(self.slab.base().add(self.off), self.len) }
    }

    /// The bytes, mutable.
    pub(crate) fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_bytes`; `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.slab.base().add(self.off), self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_then_views_and_reuse() {
        let pool = SlabPool::new();
        let mut b = SlabBuilder::new(Some(&pool), 10_000).unwrap();
        assert_eq!(b.capacity(), 12_288);
        let r1 = b.carve(8192).unwrap();
        let r2 = b.carve(8192).unwrap();
        assert_eq!(
            (r1.offset(), r1.len(), r2.offset(), r2.len()),
            (0, 8192, 8192, 4096)
        );
        assert!(b.carve(1).is_none());
        // SAFETY: `r1` is the only handle to its range, which is `r1.len()` writable bytes
        // of the builder's live slab (nothing reads it until `r1` drops below).
        unsafe { r1.as_ptr().write_bytes(7, r1.len()) };
        assert!(b.bytes().is_none(), "regions alive");
        drop((r1, r2));
        assert_eq!(b.bytes().unwrap()[..8192], [7u8; 8192]);
        assert!(b.finish(&[(0, 8), (4, 16)]).is_none(), "overlap refused");
        let b = SlabBuilder::new(Some(&pool), 10_000).unwrap();
        assert!(b.finish(&[(3, 10_001)]).is_none(), "past the end refused");
        let b = SlabBuilder::new(Some(&pool), 10_000).unwrap();
        let mut v = b.finish(&[(0, 16), (16, 10_000)]).unwrap();
        v[0].as_bytes_mut().copy_from_slice(&[1; 16]);
        assert_eq!(v[1].len(), 9984);
        assert_eq!(pool.held_bytes(), 0);
        drop(v);
        assert_eq!(pool.held_bytes(), 12_288, "back in the pool");
        let b = SlabBuilder::new(Some(&pool), 9_000).unwrap();
        assert_eq!(pool.held_bytes(), 0, "reused");
        assert_eq!(b.bytes().unwrap()[..16], [1u8; 16], "the same memory");
    }
}
