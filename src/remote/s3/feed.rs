//! A save's staged chunks streamed to its upload: the remote tier uploads from the staging
//! arena, not from a second read of the local file, and starts while the save is still
//! being written locally.
//!
//! The uploader takes a save's job when the save starts (not when it is committed
//! locally). Each chunk written locally is offered to its save's [`Feed`] (on the writer
//! thread, right after its write and CRC) and the uploader, waiting on the feed, cuts it
//! into multipart parts at once: parts go to the bucket while the local writers drain the
//! rest of the save. A part's payload owns its chunks' leases, so a chunk returns to the
//! arena only when both its local write and its part's upload are done. The end of the
//! upload (CompleteMultipartUpload, the manifest part, the bucket commit) waits for the
//! save's local outcome ([`Feed::local_committed`] / [`Feed::local_failed`]): a save that
//! fails locally aborts its upload, and nothing of it reaches the bucket.
//!
//! Under pressure ([`crate::staging::Arena::acquire`] finding no free chunk) every
//! *spillable* feed gives its held chunks back: the upload then reads those bytes from the
//! local file once the save is committed locally. Only the chunks inside parts in flight
//! stay pinned (at most `concurrency x part_size`; the part being filled is copied out of
//! its chunks under pressure), so the local tier never waits on the remote one beyond that.
//! A remote-only save has no local file: its feed is not spillable, and its upload is the
//! only drain of its chunks.

use std::fs::File;
use std::sync::{Arc, Mutex, Weak};

use crate::error::Error;
use crate::manifest::FileEntry;
use crate::staging::ChunkLease;
use crate::util::lock;

enum Slot {
    /// Not offered (yet), or never will be (its write failed).
    Pending,
    /// Pinned for the upload: the lease and the chunk's bytes that belong to the file.
    Held(ChunkLease, usize),
    /// Given back under staging pressure: read from the local file.
    Spilled,
    /// Taken by the uploader, or given back at close.
    Gone,
}

/// The save's local outcome, as the commit thread reports it.
#[derive(Clone)]
pub(crate) enum Local {
    /// Committed locally: its file (`None`: remote only) and its entry (CRCs).
    Committed(Option<Arc<File>>, FileEntry),
    /// The save failed locally: nothing of it may reach the bucket.
    Failed(Arc<Error>),
}

struct FeedState {
    slots: Vec<Slot>,
    closed: bool,
    spilled: u64,
    /// Times staging ran short since the feed was made (reclaim hook calls).
    pressure: u64,
    local: Option<Local>,
}

/// The chunks of one save held for its upload.
pub(crate) struct Feed {
    state: Mutex<FeedState>,
    /// Wakes the uploader waiting for a chunk or the local outcome.
    wake: tokio::sync::Notify,
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

/// What the uploader gets for a chunk ([`Feed::next`]).
pub(crate) enum Next {
    /// The staged bytes (zero-copy: the bytes own the lease).
    Held(bytes::Bytes),
    /// Not held (given back under pressure): read it from this committed file.
    File(Arc<File>),
    /// Staging ran short while waiting: give back what the part being filled pins, then
    /// ask again.
    Pressure,
    /// The save failed locally, or its remote copy was closed (skipped, shut down).
    Stop(Arc<Error>),
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
                return;
            }
        }
        drop(g);
        self.wake.notify_one();
    }

    /// The save is committed locally (`file`: its committed file, `None` remote only).
    pub(crate) fn local_committed(&self, file: Option<File>, entry: FileEntry) {
        self.set_local(Local::Committed(file.map(Arc::new), entry));
    }

    /// The save failed locally (or never started), with the save's shared error: its
    /// upload must be aborted.
    pub(crate) fn local_failed_arc(&self, e: Arc<Error>) {
        self.set_local(Local::Failed(e));
    }

    fn set_local(&self, l: Local) {
        let mut g = lock(&self.state);
        if g.local.is_none() {
            g.local = Some(l);
        }
        drop(g);
        self.wake.notify_one();
    }

    /// The local outcome, if known.
    pub(crate) fn local(&self) -> Option<Local> {
        lock(&self.state).local.clone()
    }

    /// Wait for the local outcome.
    pub(crate) async fn wait_local(&self) -> Local {
        loop {
            let notified = self.wake.notified();
            if let Some(l) = self.local() {
                return l;
            }
            notified.await;
        }
    }

    /// Wait for file chunk `chunk`: its staged bytes when held, else (spilled, or never
    /// offered by a save that ended) the committed file to read it from. `pressure`: the
    /// caller's last seen pressure count; [`Next::Pressure`] (and the new count) when
    /// staging ran short since.
    pub(crate) async fn next(&self, chunk: u64, pressure: &mut u64) -> Next {
        let i = usize::try_from(chunk).unwrap_or(usize::MAX);
        loop {
            let notified = self.wake.notified();
            {
                let mut g = lock(&self.state);
                if g.closed {
                    return Next::Stop(Arc::new(Error::Shutdown(
                        "the save's remote copy was closed".into(),
                    )));
                }
                if let Some(Local::Failed(e)) = &g.local {
                    return Next::Stop(Arc::clone(e));
                }
                let Some(s) = g.slots.get_mut(i) else {
                    return Next::Stop(Arc::new(Error::Internal(format!(
                        "file chunk {chunk} is outside the save"
                    ))));
                };
                match std::mem::replace(s, Slot::Gone) {
                    Slot::Held(lease, len) => {
                        return Next::Held(bytes::Bytes::from_owner(LeaseBytes(lease, len)));
                    }
                    other => *s = other,
                }
                // Not held: once committed, from the file.
                if let Some(Local::Committed(file, _)) = &g.local {
                    return match file {
                        Some(f) => Next::File(Arc::clone(f)),
                        None => Next::Stop(Arc::new(Error::Internal(format!(
                            "file chunk {chunk} of a save without a local file is not staged"
                        )))),
                    };
                }
                if g.pressure != *pressure {
                    *pressure = g.pressure;
                    return Next::Pressure;
                }
            }
            notified.await;
        }
    }

    /// Staging ran short: give every held chunk back to the arena (spillable feeds only)
    /// and tell the uploader. Returns how many chunks were given back.
    pub(crate) fn spill(&self) -> usize {
        lock(&self.state).pressure += 1;
        let freed = if self.spillable {
            self.release_held(false)
        } else {
            0
        };
        self.wake.notify_one();
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
        self.wake.notify_one();
    }

    fn release_held(&self, close: bool) -> usize {
        let mut g = lock(&self.state);
        if close {
            g.closed = true;
        }
        let mut out = Vec::new();
        for s in g.slots.iter_mut() {
            if matches!(s, Slot::Held(..)) {
                let to = if close { Slot::Gone } else { Slot::Spilled };
                out.push(std::mem::replace(s, to));
            }
        }
        if !close {
            g.spilled += out.len() as u64;
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
                pressure: 0,
                local: None,
            }),
            wake: tokio::sync::Notify::new(),
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
