//! Write observation (feature `fs-observer`): wraps a backend and reports every completed
//! write, with the bytes it transferred, to the installed filesystem observer
//! ([`FsObserver::written`](crate::observe::FsObserver::written)), while it tracks writes.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::io;
use std::os::fd::BorrowedFd;

use super::{Completion, IoBackend, IoOp, OpKind};

/// A backend whose completed writes are recorded.
pub struct RecordingBackend {
    inner: Box<dyn IoBackend>,
    writes: HashMap<u64, Pending>,
}

/// A write in flight: descriptor, buffer address, length, offset.
#[derive(Clone, Copy)]
struct Pending {
    fd: std::os::fd::RawFd,
    buf: usize,
    len: u32,
    offset: u64,
}

impl RecordingBackend {
    /// Wrap `inner`.
    pub(crate) fn new(inner: Box<dyn IoBackend>) -> Self {
        RecordingBackend {
            inner,
            writes: HashMap::new(),
        }
    }
}

impl IoBackend for RecordingBackend {
    fn backend(&self) -> super::Backend {
        self.inner.backend()
    }

    fn queue_depth(&self) -> usize {
        self.inner.queue_depth()
    }

    /// # Safety
    /// The contract of [`IoBackend::push`]: the buffer stays valid (and untouched by
    /// others) and the fd open until this request's completion is returned by `wait`.
    unsafe fn push(&mut self, op: IoOp) -> io::Result<()> {
        let tracked = op.kind == OpKind::Write
            && crate::observe::observer().is_some_and(|o| o.tracking_writes());
        if tracked {
            let p = Pending {
                fd: op.fd,
                buf: op.buf as usize,
                len: op.len,
                offset: op.offset,
            };
            self.writes.insert(op.user_data, p);
        }
        // SAFETY: the same request, under the caller's contract.
        let r = unsafe { self.inner.push(op) };
        if r.is_err() && tracked {
            self.writes.remove(&op.user_data);
        }
        r
    }

    fn wait(&mut self, min: usize, out: &mut Vec<Completion>) -> io::Result<()> {
        let start = out.len();
        self.inner.wait(min, out)?;
        for c in &out[start..] {
            let Some(op) = self.writes.remove(&c.user_data) else {
                continue;
            };
            let Ok(n) = usize::try_from(c.result) else {
                continue; // failed: nothing written
            };
            let n = n.min(op.len as usize);
            // SAFETY: `push`'s contract keeps `op.buf` valid for `op.len` bytes and
            // unwritten by others until this completion is returned to our caller, which
            // happens after this loop; `n <= op.len`.
            let data = unsafe { std::slice::from_raw_parts(op.buf as *const u8, n) };
            // SAFETY: `push`'s contract keeps `op.fd` open until then too.
            let fd = unsafe { BorrowedFd::borrow_raw(op.fd) };
            if let Some(o) = crate::observe::observer() {
                o.written(fd, op.offset, data);
            }
        }
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.inner.in_flight()
    }
}
