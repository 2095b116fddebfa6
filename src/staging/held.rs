//! A committed save's image held in its staging chunks for the replication of its step
//! (`EngineConfig::with_replica_hold`, `docs/replicas.md`): the replica sender sends the
//! image from the arena instead of reading the committed file back.
//!
//! The pattern is the remote tier's (`remote::s3::feed`): at commit, when the image is whole in
//! the arena (the latest save to have begun, its file chunks in distinct arena chunks, all
//! free again after their writes), its chunks are taken out of the free pool as leases
//! ([`Arena::finish_slot_holding`](super::Arena::finish_slot_holding)). The sender takes
//! them piece by piece ([`HeldImage::take`]): a piece whose chunks are consecutive in the
//! mapping is a zero-copy view that owns their leases ([`HeldView`]), other pieces are
//! copied out (the leases dropped after the copy). Under staging pressure
//! ([`super::Arena::acquire`] finding no free chunk) every chunk not taken yet is given
//! back at once ([`HeldImages::spill_all`]; those pieces are then read from the committed
//! file), so a save never waits on a held image beyond the chunks of the pieces in flight.
#![allow(unsafe_code)]

use std::ptr::NonNull;
use std::sync::{Arc, Mutex, Weak};

use super::ChunkLease;
use crate::error::{Error, Result};
use crate::util::lock;

enum Slot {
    /// Held for the sender.
    Held(ChunkLease),
    /// Given back under staging pressure: read from the committed file.
    Spilled,
    /// Taken by the sender (a piece), given back with a piece that could not be served
    /// from staging, or at close.
    Gone,
}

struct State {
    slots: Vec<Slot>,
    /// Chunks given back under pressure.
    spilled: u64,
}

struct Inner {
    state: Mutex<State>,
    chunk_size: u64,
    len: u64,
    step: u64,
}

impl Inner {
    /// Give back every chunk still held (`Spilled` under pressure, `Gone` at close).
    fn release(&self, pressure: bool) -> usize {
        let mut g = lock(&self.state);
        let mut out = Vec::new();
        for s in g.slots.iter_mut() {
            if matches!(s, Slot::Held(_)) {
                out.push(std::mem::replace(
                    s,
                    if pressure { Slot::Spilled } else { Slot::Gone },
                ));
            }
        }
        if pressure {
            g.spilled += out.len() as u64;
        }
        drop(g);
        let n = out.len();
        drop(out); // the leases return their chunks, outside the lock
        n
    }
}

/// A committed image whose chunks are held out of the staging arena's free pool (see the
/// module). Dropping it (or [`HeldImage::close`]) gives back every chunk not taken.
pub struct HeldImage {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for HeldImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeldImage")
            .field("step", &self.inner.step)
            .field("len", &self.inner.len)
            .field("chunk_size", &self.inner.chunk_size)
            .finish()
    }
}

/// One piece of a held image ([`HeldImage::take`]).
#[derive(Debug)]
pub enum HeldPiece {
    /// Zero-copy: the piece's chunks are consecutive in the arena's mapping; the view owns
    /// their leases.
    Staged(HeldView),
    /// The piece's chunks were held but not consecutive: copied out (one memcpy), their
    /// leases given back.
    Copied(crate::AlignedBytes),
    /// Not (wholly) held any more (given back under pressure, or never held): read it from
    /// the committed file.
    File,
}

/// Bytes of consecutive staging chunks, read-only, owning their leases: the chunks return
/// to the pool only when the view drops, so no save can reuse them while it exists.
pub struct HeldView {
    leases: Vec<ChunkLease>,
    ptr: NonNull<u8>,
    len: usize,
}

impl std::fmt::Debug for HeldView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeldView")
            .field("chunks", &self.leases.len())
            .field("len", &self.len)
            .finish()
    }
}

// SAFETY: the view owns the leases of the chunks it points into (exclusive use of those
// chunks, `ChunkLease` is `Send`); the pointer is only ever read through `as_slice`.
unsafe impl Send for HeldView {}

impl HeldView {
    /// The piece's bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is the first leased chunk's address and the leases' chunks lie one
        // after the other in the arena's mapping (checked when the view was made), so
        // `[ptr, ptr + leases.len() * chunk_size)` is mapped (the leases' `Arc` keeps the
        // mapping alive) and `len` is at most that. The leases give this view exclusive
        // use of those chunks: nothing writes them while the view (and so the borrow)
        // lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// Address of the first byte.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view is empty (never: a piece has bytes).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The arena chunks the view holds, in order.
    pub fn chunks(&self) -> Vec<u32> {
        self.leases.iter().map(ChunkLease::index).collect()
    }
}

impl HeldImage {
    /// Hold `leases` (file chunk `k` in `leases[k]`; `None`: not held, read from the file)
    /// as the image of `step`, `len` bytes, registered with `registry` for the reclaim hook.
    pub(super) fn new(
        registry: &HeldImages,
        step: u64,
        len: u64,
        chunk_size: u64,
        leases: Vec<Option<ChunkLease>>,
    ) -> HeldImage {
        let inner = Arc::new(Inner {
            state: Mutex::new(State {
                slots: leases
                    .into_iter()
                    .map(|l| l.map_or(Slot::Gone, Slot::Held))
                    .collect(),
                spilled: 0,
            }),
            chunk_size,
            len,
            step,
        });
        let mut live = lock(&registry.live);
        live.retain(|w| w.strong_count() > 0);
        live.push(Arc::downgrade(&inner));
        HeldImage { inner }
    }

    /// The step.
    pub fn step(&self) -> u64 {
        self.inner.step
    }

    /// The image's length in bytes (the committed file's).
    pub fn len(&self) -> u64 {
        self.inner.len
    }

    /// Whether the image is empty (never: a file has a header).
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// Bytes per staging chunk (file chunk `k` covers `k * chunk_size ..`).
    pub fn chunk_size(&self) -> u64 {
        self.inner.chunk_size
    }

    /// Chunks still held (not taken, not given back).
    pub fn held_chunks(&self) -> usize {
        lock(&self.inner.state)
            .slots
            .iter()
            .filter(|s| matches!(s, Slot::Held(_)))
            .count()
    }

    /// Chunks given back under staging pressure.
    pub fn spilled_chunks(&self) -> u64 {
        lock(&self.inner.state).spilled
    }

    /// Take the piece `[start, end)` of the image: `start` a multiple of the chunk size,
    /// `end` one too or the image's length (a piece never straddles a chunk), each piece
    /// taken once. Every chunk of the piece held: a [`HeldPiece::Staged`] view when they
    /// are consecutive in the mapping, else [`HeldPiece::Copied`]; otherwise
    /// [`HeldPiece::File`] (the piece's chunks still held are given back).
    pub fn take(&self, start: u64, end: u64) -> Result<HeldPiece> {
        let cs = self.inner.chunk_size;
        if start >= end
            || end > self.inner.len
            || !start.is_multiple_of(cs)
            || !(end.is_multiple_of(cs) || end == self.inner.len)
        {
            return Err(Error::Config(format!(
                "[{start}, {end}) is not a piece of a held image of {} bytes in chunks of {cs}",
                self.inner.len
            )));
        }
        let (k0, k1) = ((start / cs) as usize, end.div_ceil(cs) as usize);
        let mut g = lock(&self.inner.state);
        let all = g.slots[k0..k1].iter().all(|s| matches!(s, Slot::Held(_)));
        let taken: Vec<ChunkLease> = g.slots[k0..k1]
            .iter_mut()
            .filter_map(|s| match std::mem::replace(s, Slot::Gone) {
                Slot::Held(l) => Some(l),
                other => {
                    *s = other;
                    None
                }
            })
            .collect();
        drop(g);
        if !all {
            return Ok(HeldPiece::File); // `taken` drops: those chunks go back
        }
        let len = (end - start) as usize;
        let base = taken[0].as_ptr() as usize;
        let consecutive = taken
            .iter()
            .enumerate()
            .all(|(j, l)| l.as_ptr() as usize == base + j * cs as usize);
        if consecutive {
            let ptr = NonNull::new(taken[0].as_ptr()).expect("a chunk's address is not null");
            return Ok(HeldPiece::Staged(HeldView {
                leases: taken,
                ptr,
                len,
            }));
        }
        let mut out = crate::AlignedBytes::zeroed(len);
        let dst = out.as_bytes_mut();
        for (j, l) in taken.iter().enumerate() {
            let at = j * cs as usize;
            let n = (len - at).min(cs as usize);
            dst[at..at + n].copy_from_slice(&l.as_slice()[..n]);
        }
        drop(taken);
        Ok(HeldPiece::Copied(out))
    }

    /// Give back every chunk not taken (the replication of the step is over). Views taken
    /// keep theirs until they drop.
    pub fn close(&self) {
        self.inner.release(false);
    }
}

impl Drop for HeldImage {
    fn drop(&mut self) {
        self.close();
    }
}

/// The held images of one engine, for the arena's reclaim hook.
#[derive(Default)]
pub struct HeldImages {
    live: Mutex<Vec<Weak<Inner>>>,
}

impl std::fmt::Debug for HeldImages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HeldImages")
    }
}

impl HeldImages {
    /// Staging ran short: give back every chunk held and not taken, of every image.
    /// Returns how many chunks were given back.
    pub fn spill_all(&self) -> usize {
        let live: Vec<Arc<Inner>> = lock(&self.live).iter().filter_map(Weak::upgrade).collect();
        let n: usize = live.iter().map(|i| i.release(true)).sum();
        if n > 0 {
            tracing::debug!(
                chunks = n,
                "staging needs chunks held for replication: those pieces are read from the committed file instead"
            );
        }
        n
    }
}

/// A save's held image, set at its commit, taken once by its replication
/// (`SaveHandle::held_image`).
#[derive(Debug, Default)]
pub struct HeldCell(Mutex<Option<HeldImage>>);

impl HeldCell {
    /// Set the image (the engine, at commit).
    pub(crate) fn set(&self, image: HeldImage) {
        *lock(&self.0) = Some(image);
    }

    /// Take the image, if the save's image is held and was not taken yet.
    pub fn take(&self) -> Option<HeldImage> {
        lock(&self.0).take()
    }
}
