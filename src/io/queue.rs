//! A safe queue over an `IoBackend`: every request owns the chunk lease it reads into or
//! writes from, and the lease comes back only with the request's completion. This is the
//! one place that upholds the backend's buffer contract, so the writer pool and the reader
//! contain no `unsafe`.
#![allow(unsafe_code)]

use std::io;
use std::sync::Arc;

use super::file::FileTarget;
use super::{Completion, IoBackend, IoOp, OpKind};
use crate::slab::SlabRegion;
use crate::staging::ChunkLease;

/// A buffer a request can own while the kernel uses it.
///
/// # Safety
/// `io_ptr()` must be valid for reads and writes of `io_len()` bytes, those bytes must be
/// reachable through no other handle while the value lives, and they must not move or be
/// freed while it lives (moving the value itself is fine).
pub unsafe trait IoBuf: Send {
    /// Start of the buffer.
    fn io_ptr(&self) -> *mut u8;
    /// Its length.
    fn io_len(&self) -> usize;
}

// SAFETY: a lease is the only handle to its chunk, which lives in the arena's mapping; the
// lease keeps the arena alive (`Arc`) and frees nothing while it lives.
unsafe impl IoBuf for ChunkLease {
    fn io_ptr(&self) -> *mut u8 {
        self.as_ptr()
    }
    fn io_len(&self) -> usize {
        self.len()
    }
}

// SAFETY: a region is the only handle to its range of the slab (carved disjointly by the
// slab's sole owner), and keeps the slab allocation alive (`Arc`).
unsafe impl IoBuf for SlabRegion {
    fn io_ptr(&self) -> *mut u8 {
        self.as_ptr()
    }
    fn io_len(&self) -> usize {
        self.len()
    }
}

/// A finished request: the lease and tag that went in with it.
#[derive(Debug)]
pub struct Done<T, B = ChunkLease> {
    /// The buffer, free for the caller again.
    pub lease: B,
    /// The caller's tag.
    pub tag: T,
    /// Bytes transferred, or a negated errno.
    pub result: i32,
}

/// The backend broke with requests in flight. Their leases were leaked (the kernel may
/// still use the buffers); their tags come back so the owners can be told.
#[derive(Debug)]
pub struct Broken<T> {
    /// What the backend returned.
    pub error: io::Error,
    /// Tags of the requests that were in flight.
    pub tags: Vec<T>,
}

/// A read or write of `len` bytes at `at` inside a chunk, at `offset` in a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Read or write.
    pub kind: OpKind,
    /// Offset inside the chunk.
    pub at: usize,
    /// Bytes.
    pub len: usize,
    /// File offset.
    pub offset: u64,
}

/// One request in flight: its buffer and its file, both owned until the completion.
struct Slot<T, B> {
    lease: B,
    /// Keeps the fd open until the kernel is done with the request.
    _file: Arc<FileTarget>,
    tag: T,
}

/// A backend plus the requests in flight.
pub struct LeaseQueue<T, B: IoBuf = ChunkLease> {
    backend: Box<dyn IoBackend>,
    slots: Vec<Option<Slot<T, B>>>,
    free: Vec<usize>,
    completions: Vec<Completion>,
}

impl<T, B: IoBuf> LeaseQueue<T, B> {
    /// Wrap `backend`.
    pub(crate) fn new(backend: Box<dyn IoBackend>) -> Self {
        let depth = backend.queue_depth();
        LeaseQueue {
            backend,
            slots: (0..depth).map(|_| None).collect(),
            free: (0..depth).rev().collect(),
            completions: Vec::with_capacity(depth),
        }
    }

    /// Backend name.
    pub fn backend(&self) -> super::Backend {
        self.backend.backend()
    }

    /// Whether another request fits.
    pub fn has_room(&self) -> bool {
        !self.free.is_empty()
    }

    /// The backend's set-up left for an idle moment ([`IoBackend::idle_setup`]); call only
    /// with nothing in flight. Returns whether some is still left.
    pub fn idle_setup(&mut self) -> bool {
        debug_assert_eq!(self.in_flight(), 0);
        self.backend.idle_setup()
    }

    /// Requests in flight.
    pub fn in_flight(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    /// Queue `req` on `lease`'s chunk against `file`. The queue keeps the lease and a clone
    /// of `file` until the completion. On failure lease and tag come back with the error.
    #[allow(clippy::type_complexity, clippy::result_large_err)]
    pub fn push(
        &mut self,
        lease: B,
        tag: T,
        file: &Arc<FileTarget>,
        req: Request,
    ) -> Result<(), (B, T, io::Error)> {
        let Request {
            kind,
            at,
            len,
            offset,
        } = req;
        if at.checked_add(len).is_none_or(|end| end > lease.io_len()) || len > u32::MAX as usize {
            let e = io::Error::new(io::ErrorKind::InvalidInput, "request outside its chunk");
            return Err((lease, tag, e));
        }
        let Some(idx) = self.free.pop() else {
            return Err((lease, tag, io::Error::other("queue full")));
        };
        // SAFETY: `at + len <= lease.io_len()` was checked above, so the pointer and the
        // range stay inside the owned buffer.
        let buf = unsafe { lease.io_ptr().add(at) };
        let op = IoOp {
            kind,
            fd: file.fd_for(buf, offset, len as u64),
            buf,
            len: len as u32,
            offset,
            user_data: idx as u64,
        };
        // SAFETY: the lease (the only handle to these bytes) and an `Arc` of the file (which
        // keeps `op.fd` open) move into `slots[idx]` and leave it only when this request's
        // completion is reaped in `wait`, or never (both are leaked) if the backend breaks.
        // The io_uring backend submits to the kernel only in `wait`, so the fd must stay
        // open past this call: the slot's `Arc` is what guarantees it.
        match unsafe { self.backend.push(op) } {
            Ok(()) => {
                self.slots[idx] = Some(Slot {
                    lease,
                    _file: Arc::clone(file),
                    tag,
                });
                Ok(())
            }
            Err(e) => {
                self.free.push(idx);
                Err((lease, tag, e))
            }
        }
    }

    /// Submit, wait for at least `min` completions, and return the finished requests.
    pub fn wait(&mut self, min: usize) -> Result<Vec<Done<T, B>>, Broken<T>> {
        self.completions.clear();
        if let Err(error) = self.backend.wait(min, &mut self.completions) {
            let mut tags = Vec::new();
            for slot in self.slots.drain(..).flatten() {
                std::mem::forget(slot.lease);
                std::mem::forget(slot._file);
                tags.push(slot.tag);
            }
            self.free.clear();
            return Err(Broken { error, tags });
        }
        let mut out = Vec::with_capacity(self.completions.len());
        for c in self.completions.drain(..) {
            let idx = c.user_data as usize;
            match self.slots.get_mut(idx).and_then(Option::take) {
                Some(Slot { lease, tag, .. }) => {
                    self.free.push(idx);
                    out.push(Done {
                        lease,
                        tag,
                        result: c.result,
                    });
                }
                None => tracing::error!(user_data = c.user_data, "completion for an empty slot"),
            }
        }
        Ok(out)
    }
}

impl<T, B: IoBuf> Drop for LeaseQueue<T, B> {
    fn drop(&mut self) {
        // Buffers in flight belong to the kernel until reaped.
        while self.in_flight() > 0 {
            if self.wait(1).is_err() {
                break;
            }
        }
    }
}
