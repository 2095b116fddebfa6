//! The io_uring backend: one ring per writer thread, the staging arena registered as fixed
//! buffers (so the kernel does not pin pages per request), completions reaped in any order.
#![allow(unsafe_code)]

use std::io;

use std::sync::Arc;

use io_uring::{IoUring, opcode, types};

use crate::staging::Arena;

use super::{Completion, IoBackend, IoOp, OpKind};

/// Largest single registered buffer (the kernel's limit per iovec is 1 GiB).
const MAX_FIXED: usize = 1 << 30;

/// An io_uring with optional fixed buffers.
pub struct UringBackend {
    ring: IoUring,
    depth: usize,
    in_flight: usize,
    /// Registered regions, in index order: (start address, length).
    fixed: Vec<(usize, usize)>,
    /// Keeps the registered memory mapped while the registration exists.
    _arena: Option<Arc<Arena>>,
    /// The arena, until the writer thread registers it, once it is whole
    /// ([`IoBackend::idle_setup`]).
    pending: Option<Arc<Arena>>,
}

impl std::fmt::Debug for UringBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringBackend")
            .field("depth", &self.depth)
            .field("in_flight", &self.in_flight)
            .field("fixed_buffers", &self.fixed.len())
            .finish()
    }
}

impl UringBackend {
    /// Set up a ring with `depth` entries; `arena`, if given, is registered (split into
    /// ≤ 1 GiB pieces) as fixed buffers later, by [`IoBackend::idle_setup`]. A registration
    /// failure (e.g. `RLIMIT_MEMLOCK`) is logged and the ring works without fixed buffers.
    pub fn new(depth: u32, arena: Option<Arc<Arena>>) -> io::Result<Self> {
        let depth = depth.clamp(1, 4096);
        let ring = IoUring::builder().build(depth.next_power_of_two())?;
        // Probe once: a ring can be created where io_uring_enter is still denied.
        ring.submit()?;
        let mut me = UringBackend {
            ring,
            depth: depth as usize,
            in_flight: 0,
            fixed: Vec::new(),
            _arena: arena.clone(),
            pending: None,
        };
        // Registered by the writer thread at its first idle moment ([`IoBackend::idle_setup`],
        // at once when the arena is whole), not here on the thread opening the engine:
        // registering pins every page (0.4-0.6 s for a 12 GiB arena taken over at a restart,
        // once per ring), and pages not yet allocated would be faulted in on one thread.
        // Plain writes until then.
        me.pending = arena;
        Ok(me)
    }

    /// Register `arena`'s data region as fixed buffers (logged and skipped on failure).
    fn register(&mut self, arena: &Arc<Arena>) {
        {
            let (base, len) = arena.data_region();
            let mut iovs = Vec::new();
            let mut at = 0;
            while at < len {
                let n = (len - at).min(MAX_FIXED);
                iovs.push(libc::iovec {
                    // SAFETY: `at < len`, so the address lies inside the caller's region.
                    iov_base: unsafe { base.add(at) }.cast(),
                    iov_len: n,
                });
                at += n;
            }
            // SAFETY: the region is the arena's data region, which stays mapped while this
            // ring exists: `_arena` holds an `Arc` of it.
            match unsafe { self.ring.submitter().register_buffers(&iovs) } {
                Ok(()) => {
                    self.fixed = iovs
                        .iter()
                        .map(|v| (v.iov_base as usize, v.iov_len))
                        .collect()
                }
                Err(e) => {
                    tracing::warn!(error = %e, "io_uring fixed-buffer registration failed; using plain writes")
                }
            }
        }
    }

    fn fixed_index(&self, buf: *mut u8, len: u32) -> Option<u16> {
        let a = buf as usize;
        self.fixed
            .iter()
            .position(|&(s, l)| a >= s && a + len as usize <= s + l)
            .map(|i| i as u16)
    }
}

impl IoBackend for UringBackend {
    fn backend(&self) -> super::Backend {
        super::Backend::IoUring
    }

    fn queue_depth(&self) -> usize {
        self.depth
    }

    /// # Safety
    /// The contract of [`IoBackend::push`]: the buffer stays valid (and untouched by
    /// others) until this request's completion is returned by `wait`.
    unsafe fn push(&mut self, op: IoOp) -> io::Result<()> {
        if self.in_flight >= self.depth {
            return Err(io::Error::other("io_uring queue full"));
        }
        let fd = types::Fd(op.fd);
        let entry = match (op.kind, self.fixed_index(op.buf, op.len)) {
            (OpKind::Write, Some(i)) => opcode::WriteFixed::new(fd, op.buf, op.len, i)
                .offset(op.offset)
                .build(),
            (OpKind::Write, None) => opcode::Write::new(fd, op.buf, op.len)
                .offset(op.offset)
                .build(),
            (OpKind::Read, Some(i)) => opcode::ReadFixed::new(fd, op.buf, op.len, i)
                .offset(op.offset)
                .build(),
            (OpKind::Read, None) => opcode::Read::new(fd, op.buf, op.len)
                .offset(op.offset)
                .build(),
        }
        .user_data(op.user_data);
        // The ring has `depth.next_power_of_two()` slots and at most `depth` requests are in
        // flight, so the submission queue cannot be full after a submit.
        if self.ring.submission().is_full() {
            self.ring.submit()?;
        }
        // SAFETY: the caller upholds the trait contract: the buffer and fd stay valid and
        // untouched until this request's completion is reaped in `wait`.
        unsafe { self.ring.submission().push(&entry) }
            .map_err(|_| io::Error::other("io_uring submission queue full"))?;
        self.in_flight += 1;
        Ok(())
    }

    fn wait(&mut self, min: usize, out: &mut Vec<Completion>) -> io::Result<()> {
        let want = min.min(self.in_flight);
        loop {
            match self.ring.submit_and_wait(want) {
                Ok(_) => break,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) && want == 0 => break,
                Err(e) => return Err(e),
            }
        }
        for cqe in self.ring.completion() {
            self.in_flight -= 1;
            out.push(Completion {
                user_data: cqe.user_data(),
                result: cqe.result(),
            });
        }
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn idle_setup(&mut self) -> bool {
        let Some(a) = self.pending.take() else {
            return false;
        };
        if !a.fill_finished() {
            self.pending = Some(a);
            return true;
        }
        // A prefault that failed or was stopped leaves pages unallocated: no registration.
        if a.is_filled() {
            self.register(&a);
        }
        false
    }
}
