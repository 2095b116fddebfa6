//! A save's staged chunks kept for its upload: the remote tier uploads from the staging
//! arena, not from a second read of the local file.
//!
//! Each chunk written locally is offered to its save's [`Feed`] (on the writer thread,
//! before the save can settle) and held there, pinned, until the uploader takes it into a
//! multipart part; the part's payload owns the lease, so the chunk returns to the arena
//! when that part's upload ends. Under pressure ([`crate::staging::Arena::acquire`] finding
//! no free chunk) every *spillable* feed gives its held chunks back: the upload then reads
//! those bytes from the local file. Only the chunks inside parts in flight stay pinned
//! (at most `(concurrency + 1) x part_size`: the parts in flight and the one being
//! filled), so the local tier never waits on the remote one beyond that.
//! A remote-only save has no local file: its feed is not spillable, and its upload is the
//! only drain of its chunks.

use std::sync::{Arc, Mutex, Weak};

use crate::staging::ChunkLease;
use crate::util::lock;

enum Slot {
    /// Not offered (yet), or never will be (its write failed).
    Pending,
    /// Pinned for the upload: the lease and the chunk's bytes that belong to the file.
    Held(ChunkLease, usize),
    /// Taken by the uploader, or given back (spilled, closed).
    Gone,
}

struct FeedState {
    slots: Vec<Slot>,
    closed: bool,
    spilled: u64,
}

/// The chunks of one save held for its upload.
pub(crate) struct Feed {
    state: Mutex<FeedState>,
    spillable: bool,
    chunk_size: u64,
}

impl std::fmt::Debug for Feed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Feed")
            .field("spillable", &self.spillable)
            .field("chunk_size", &self.chunk_size)
            .finish()
    }
}

/// A lease's first `len` bytes as the owner of a [`bytes::Bytes`] (a part's payload).
struct LeaseBytes(ChunkLease, usize);

impl AsRef<[u8]> for LeaseBytes {
    fn as_ref(&self) -> &[u8] {
        &self.0.as_slice()[..self.1]
    }
}

impl Feed {
    /// Bytes per chunk (file chunk `k` covers `k * chunk_size ..`).
    pub(crate) fn chunk_size(&self) -> u64 {
        self.chunk_size
    }

    /// Hold file chunk `chunk` (its first `len` bytes belong to the file). A closed feed,
    /// or an index out of range, drops the lease at once.
    pub(crate) fn offer(&self, chunk: u64, lease: ChunkLease, len: usize) {
        let mut g = lock(&self.state);
        let ok = !g.closed && len <= lease.len();
        match usize::try_from(chunk).ok().and_then(|i| g.slots.get_mut(i)) {
            Some(s) if ok => *s = Slot::Held(lease, len),
            _ => {
                drop(g);
                drop(lease);
            }
        }
    }

    /// The held chunk `chunk` as bytes (zero-copy: the bytes own the lease), or `None`
    /// when it is not held (spilled, never offered): then it is read from the file.
    pub(crate) fn take(&self, chunk: u64) -> Option<bytes::Bytes> {
        let mut g = lock(&self.state);
        let s = usize::try_from(chunk)
            .ok()
            .and_then(|i| g.slots.get_mut(i))?;
        match std::mem::replace(s, Slot::Gone) {
            Slot::Held(lease, len) => Some(bytes::Bytes::from_owner(LeaseBytes(lease, len))),
            other => {
                *s = other;
                None
            }
        }
    }

    /// Give every held chunk back to the arena (spillable feeds only). Returns how many.
    pub(crate) fn spill(&self) -> usize {
        if !self.spillable {
            return 0;
        }
        let freed = self.release_held(false);
        if freed > 0 {
            lock(&self.state).spilled += freed as u64;
        }
        freed
    }

    /// Chunks this feed gave back under pressure (their bytes are read from the file).
    pub(crate) fn spilled(&self) -> u64 {
        lock(&self.state).spilled
    }

    /// The save's upload is over (done, failed, skipped): give back what is held and
    /// drop whatever is offered later.
    pub(crate) fn close(&self) {
        self.release_held(true);
    }

    fn release_held(&self, close: bool) -> usize {
        let mut g = lock(&self.state);
        if close {
            g.closed = true;
        }
        let mut out = Vec::new();
        for s in g.slots.iter_mut() {
            if matches!(s, Slot::Held(..)) {
                out.push(std::mem::replace(s, Slot::Gone));
            }
        }
        drop(g);
        let n = out.len();
        drop(out); // the leases return their chunks, outside the lock
        n
    }
}

/// The feeds of one engine's saves, for the arena's reclaim hook.
#[derive(Debug, Default)]
pub(crate) struct Feeds {
    live: Mutex<Vec<Weak<Feed>>>,
}

impl Feeds {
    /// A new save's feed of `n_chunks` chunks of `chunk_size` bytes.
    pub(crate) fn feed(&self, n_chunks: u64, chunk_size: u64, spillable: bool) -> Arc<Feed> {
        let n = usize::try_from(n_chunks).unwrap_or(0);
        let f = Arc::new(Feed {
            state: Mutex::new(FeedState {
                slots: (0..n).map(|_| Slot::Pending).collect(),
                closed: false,
                spilled: 0,
            }),
            spillable,
            chunk_size,
        });
        let mut live = lock(&self.live);
        live.retain(|w| w.strong_count() > 0);
        live.push(Arc::downgrade(&f));
        f
    }

    /// Spill every live feed (the arena's reclaim hook). Returns the chunks given back.
    pub(crate) fn spill_all(&self) -> usize {
        let live: Vec<Arc<Feed>> = lock(&self.live).iter().filter_map(Weak::upgrade).collect();
        let n: usize = live.iter().map(|f| f.spill()).sum();
        if n > 0 {
            tracing::debug!(
                chunks = n,
                "staging needs chunks held for uploads: those are read from the local file instead"
            );
        }
        n
    }
}
