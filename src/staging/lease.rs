//! [`ChunkLease`]: exclusive use of one arena chunk's bytes.
#![allow(unsafe_code)]

use std::ptr::NonNull;
use std::sync::Arc;

use super::Arena;

/// Exclusive use of one arena chunk. Dropping the lease returns the chunk to the pool, so a
/// lease must live as long as anyone (a DMA engine, the kernel) may access the chunk.
#[derive(Debug)]
pub struct ChunkLease {
    pub(super) arena: Arc<Arena>,
    pub(super) index: u32,
    pub(super) ptr: NonNull<u8>,
}

// SAFETY: the lease is the only handle to its chunk's bytes; moving it between threads moves
// that exclusive access along with it.
unsafe impl Send for ChunkLease {}

impl ChunkLease {
    /// Arena chunk index.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// Chunk length.
    pub fn len(&self) -> usize {
        self.arena.chunk_size() as usize
    }

    /// Always false (chunks are never empty).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Raw pointer to the chunk (for DMA and io_uring).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The chunk's bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the lease is the unique owner of this chunk; the arena (kept alive by the
        // `Arc`) maps `len` bytes at `ptr`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len()) }
    }

    /// The chunk's bytes, mutable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only live borrow.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len()) }
    }

    /// The arena this chunk belongs to.
    pub fn arena(&self) -> &Arc<Arena> {
        &self.arena
    }
}

impl Drop for ChunkLease {
    fn drop(&mut self) {
        self.arena.release(self.index);
    }
}
