//! Latches: a stream of the trainer's waits, on the device, until the engine opens the latch,
//! without a thread of the trainer waiting on the host.
//!
//! A latch is a 32-bit cell in pinned host memory mapped into the device's address space.
//! [`Latch::hold`] queues `cuStreamWaitValue32(cell >= 1)` on a stream: later work on that
//! stream waits on the device. The engine opens it once its last copies are queued
//! ([`Latch::open_after`]: `cuStreamWriteValue32(cell, 1)` on its own stream, behind those
//! copies), or from the host ([`Latch::open_now`], and on drop: a latch is never left shut).
//!
//! A cell is reused only once every device operation on it has run: each hold and each
//! device-side open records an event after itself, and an opened latch's cell goes back to
//! the pool's free list when those events have completed (checked when a cell is taken).
//! The pages are freed when the pool drops, after waiting for the events still pending.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;

use super::{Context, Event, Stream, StreamRef, check};
use crate::error::{Error, Result};
use crate::util::lock;

/// Cells per page of pinned memory (4 bytes each).
const CELLS: usize = 1024;
const PAGE: usize = CELLS * 4;

/// One page of pinned, device-mapped host memory.
#[derive(Debug)]
struct Page {
    host: *mut u32,
    dev: u64,
}

/// The latches of one device's context.
#[derive(Debug)]
pub(crate) struct LatchPool {
    ctx: Arc<Context>,
    inner: Mutex<Cells>,
}

#[derive(Debug, Default)]
struct Cells {
    pages: Vec<Page>,
    /// Free cells: (page, index).
    free: Vec<(usize, usize)>,
    /// Opened cells whose device operations may still be pending: the cell and the events
    /// recorded after those operations.
    retired: Vec<((usize, usize), Vec<Event>)>,
    /// A cell was given up with a device operation on it that no event tracks: the pages
    /// are never freed.
    leaked: bool,
}

// SAFETY: the page pointers are owned by the pool (allocated in `take`, freed in Drop) and
// only reached through atomics; the mutex serializes the lists.
unsafe impl Send for LatchPool {}
// SAFETY: as above.
unsafe impl Sync for LatchPool {}

impl LatchPool {
    /// An empty pool on `ctx` (no memory until the first latch).
    pub(crate) fn new(ctx: &Arc<Context>) -> Arc<LatchPool> {
        Arc::new(LatchPool {
            ctx: Arc::clone(ctx),
            inner: Mutex::new(Cells::default()),
        })
    }

    /// A shut latch (its cell 0), from a free cell, a retired one whose device operations
    /// have all run, or a new page.
    pub(crate) fn take(self: &Arc<Self>) -> Result<Latch> {
        let mut c = lock(&self.inner);
        let mut i = 0;
        while i < c.retired.len() {
            // A cell whose events cannot be queried is never reused.
            let done = c.retired[i].1.iter().all(|e| e.query().unwrap_or(false));
            if done {
                let (cell, _) = c.retired.swap_remove(i);
                c.free.push(cell);
            } else {
                i += 1;
            }
        }
        if c.free.is_empty() {
            self.ctx.bind()?;
            let mut host: *mut c_void = std::ptr::null_mut();
            check(
                // SAFETY: `host` is a live local the driver writes one pointer into; the
                // context is current (bound above); freed once, in Drop.
                unsafe {
                    sys::cuMemHostAlloc(
                        &mut host,
                        PAGE,
                        sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
                    )
                },
                "cuMemHostAlloc",
            )?;
            let mut dev: sys::CUdeviceptr = 0;
            let r = check(
                // SAFETY: `host` was just allocated with DEVICEMAP in this context; `dev` is a
                // live local.
                unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0) },
                "cuMemHostGetDevicePointer",
            );
            if let Err(e) = r {
                // SAFETY: allocated above, not shared yet.
                let _ = unsafe { sys::cuMemFreeHost(host) };
                return Err(e);
            }
            let page = c.pages.len();
            c.pages.push(Page {
                host: host.cast::<u32>(),
                dev,
            });
            c.free.extend((0..CELLS).rev().map(|i| (page, i)));
        }
        let cell = c.free.pop().expect("a page was added");
        let latch = Latch {
            pool: Arc::clone(self),
            cell,
            host: c.pages[cell.0].host.wrapping_add(cell.1),
            dev: c.pages[cell.0].dev + 4 * cell.1 as u64,
            events: Vec::new(),
            open: false,
            tracked: true,
        };
        drop(c);
        // No device operation refers to the cell (free, or retired with its events done).
        latch.cell().store(0, Ordering::Release);
        Ok(latch)
    }
}

impl Drop for LatchPool {
    fn drop(&mut self) {
        let c = self.inner.get_mut().unwrap_or_else(|e| e.into_inner());
        if c.leaked {
            return;
        }
        let _ = self.ctx.bind();
        for (_, events) in &c.retired {
            for e in events {
                // Every retired latch is open: its holds complete.
                let _ = e.synchronize();
            }
        }
        for p in &c.pages {
            // SAFETY: allocated by `cuMemHostAlloc` in `take`, freed once; every latch holds
            // an `Arc` of the pool (so none is alive), and the device operations on its cells
            // have completed (waited for above).
            let _ = unsafe { sys::cuMemFreeHost(p.host.cast::<c_void>()) };
        }
    }
}

/// One latch: shut when taken, opened once ([`open_after`](Self::open_after),
/// [`open_now`](Self::open_now), or on drop).
#[derive(Debug)]
pub(crate) struct Latch {
    pool: Arc<LatchPool>,
    cell: (usize, usize),
    host: *mut u32,
    dev: u64,
    /// Events recorded after each device operation on the cell.
    events: Vec<Event>,
    open: bool,
    /// Every device operation on the cell has an event in `events` (else the cell is
    /// never reused, nor its page freed).
    tracked: bool,
}

// SAFETY: the cell is reached only through an atomic; the pool keeps its page alive.
unsafe impl Send for Latch {}
// SAFETY: as above.
unsafe impl Sync for Latch {}

impl Latch {
    fn cell(&self) -> &AtomicU32 {
        // SAFETY: `host` points at a 4-byte aligned cell of a live page of the pool (kept
        // alive by `self.pool`), reached only through atomics by the host; the device reads
        // and writes it with its own memory operations.
        unsafe { AtomicU32::from_ptr(self.host) }
    }

    /// Make later work on `stream` (of the pool's device) wait, on the device, until the
    /// latch opens; returns at once.
    pub(crate) fn hold(&mut self, stream: StreamRef<'_>) -> Result<()> {
        if stream.device() != self.pool.ctx.ordinal() {
            return Err(Error::Internal(
                "a latch held on another device's stream".into(),
            ));
        }
        let _restore = super::CtxGuard::save()?;
        self.pool.ctx.bind()?;
        let e = Event::new(&self.pool.ctx)?;
        check(
            // SAFETY: a `StreamRef` is borrowed from a live stream, or made with `from_raw`,
            // whose contract keeps it live; `dev` is the device address of this latch's cell,
            // in a page that stays allocated until the event recorded next has completed.
            unsafe {
                sys::cuStreamWaitValue32_v2(
                    stream.raw() as sys::CUstream,
                    self.dev,
                    1,
                    sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
                )
            },
            "cuStreamWaitValue32",
        )?;
        // SAFETY: as above: a live stream of this event's context.
        let r = unsafe { e.record_raw(stream.raw()) };
        self.track(e, r)
    }

    /// Open the latch on the device once the work queued on `stream` so far has run (the
    /// engine's stream, behind the save's copies). On an error the latch stays shut (the
    /// caller opens it from the host once the copies are done).
    pub(crate) fn open_after(&mut self, stream: &Stream) -> Result<()> {
        if self.open {
            return Ok(());
        }
        stream.context().bind()?;
        let e = Event::new(stream.context())?;
        check(
            // SAFETY: live stream; `dev` is this latch's cell, whose page stays allocated until
            // the event recorded next has completed.
            unsafe {
                sys::cuStreamWriteValue32_v2(
                    stream.raw() as sys::CUstream,
                    self.dev,
                    1,
                    sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
                )
            },
            "cuStreamWriteValue32",
        )?;
        self.open = true;
        let r = e.record(stream);
        self.track(e, r)
    }

    /// Keep `e`, recorded after a device operation on the cell, or (`r` an error: the
    /// operation is queued but untracked) never reuse the cell.
    fn track(&mut self, e: Event, r: Result<()>) -> Result<()> {
        match r {
            Ok(()) => {
                self.events.push(e);
                Ok(())
            }
            Err(err) => {
                self.tracked = false;
                Err(err)
            }
        }
    }

    /// Open the latch from the host, now.
    fn open_now(&mut self) {
        self.cell().store(1, Ordering::Release);
        self.open = true;
    }
}

impl Drop for Latch {
    fn drop(&mut self) {
        if !self.open {
            self.open_now();
        }
        let events = std::mem::take(&mut self.events);
        let mut c = lock(&self.pool.inner);
        if self.tracked {
            c.retired.push((self.cell, events));
        } else {
            c.leaked = true;
        }
    }
}
