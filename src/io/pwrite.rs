//! The portable backend: each request is a blocking `pwrite`/`pread` performed at `push`.
#![allow(unsafe_code)]

use std::collections::VecDeque;
use std::io;

use super::{Completion, IoBackend, IoOp, OpKind};

/// Blocking `pwrite`/`pread`, exposed through the queue interface.
#[derive(Debug)]
pub struct PwriteBackend {
    depth: usize,
    done: VecDeque<Completion>,
}

impl PwriteBackend {
    /// A backend that accepts `depth` requests before they must be reaped.
    pub fn new(depth: usize) -> Self {
        PwriteBackend {
            depth: depth.max(1),
            done: VecDeque::new(),
        }
    }
}

impl IoBackend for PwriteBackend {
    fn backend(&self) -> super::Backend {
        super::Backend::Pwrite
    }

    fn queue_depth(&self) -> usize {
        self.depth
    }

    /// # Safety
    /// The contract of [`IoBackend::push`]: the buffer stays valid (and untouched by
    /// others) until this request's completion is returned by `wait`.
    unsafe fn push(&mut self, op: IoOp) -> io::Result<()> {
        if self.done.len() >= self.depth {
            return Err(io::Error::other("pwrite queue full"));
        }
        let res = match op.kind {
            // SAFETY: the caller guarantees `buf` is valid for `len` bytes (see trait docs).
            OpKind::Write => unsafe {
                libc::pwrite(
                    op.fd,
                    op.buf.cast_const().cast(),
                    op.len as usize,
                    op.offset as libc::off_t,
                )
            },
            // SAFETY: as above, and the buffer is writable for reads.
            OpKind::Read => unsafe {
                libc::pread(
                    op.fd,
                    op.buf.cast(),
                    op.len as usize,
                    op.offset as libc::off_t,
                )
            },
        };
        let result = if res < 0 {
            -io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO)
        } else {
            res as i32
        };
        self.done.push_back(Completion {
            user_data: op.user_data,
            result,
        });
        Ok(())
    }

    fn wait(&mut self, _min: usize, out: &mut Vec<Completion>) -> io::Result<()> {
        out.extend(self.done.drain(..));
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.done.len()
    }
}
