//! Streams and events: the engine's own, and borrowed handles of the caller's.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::sys;

use super::{Context, check};
use crate::error::Result;

/// A non-blocking stream of the engine's own.
#[derive(Debug)]
pub struct Stream {
    raw: sys::CUstream,
    ctx: Arc<Context>,
}

// SAFETY: stream handles are usable from any thread with their context current.
unsafe impl Send for Stream {}
// SAFETY: as above; enqueuing is thread-safe in the driver.
unsafe impl Sync for Stream {}

impl Stream {
    /// A new non-blocking stream on `ctx`.
    pub fn new(ctx: &Arc<Context>) -> Result<Stream> {
        ctx.bind()?;
        let mut raw = std::ptr::null_mut();
        check(
            // SAFETY: `raw` is a live local the driver writes one handle into; the context is
            // current (bound above); the handle is destroyed once, in Drop.
            unsafe {
                sys::cuStreamCreate(&mut raw, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
            },
            "cuStreamCreate",
        )?;
        Ok(Stream {
            raw,
            ctx: Arc::clone(ctx),
        })
    }

    /// The context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The raw `CUstream` handle.
    pub fn raw(&self) -> u64 {
        self.raw as u64
    }

    /// This stream, borrowed, for [`SaveOptions::after_stream`](crate::SaveOptions).
    pub fn handle(&self) -> StreamRef<'_> {
        StreamRef {
            raw: self.raw as u64,
            device: self.ctx.ordinal(),
            _owner: PhantomData,
        }
    }

    /// Block until everything queued has run.
    pub fn synchronize(&self) -> Result<()> {
        check(
            // SAFETY: live stream.
            unsafe { sys::cuStreamSynchronize(self.raw) },
            "cuStreamSynchronize",
        )
    }

    /// Make later work on this stream wait for `event`.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        check(
            // SAFETY: live stream and event.
            unsafe { sys::cuStreamWaitEvent(self.raw, event.raw, 0) },
            "cuStreamWaitEvent",
        )
    }

    /// Make later work on this stream wait for a caller's raw `CUevent`.
    ///
    /// # Safety
    /// `event` must be a live `CUevent` of this process.
    pub unsafe fn wait_raw_event(&self, event: u64) -> Result<()> {
        check(
            // SAFETY: the caller guarantees the event handle is live.
            unsafe { sys::cuStreamWaitEvent(self.raw, event as sys::CUevent, 0) },
            "cuStreamWaitEvent",
        )
    }

    /// Queue a device-to-host copy.
    ///
    /// # Safety
    /// - `dst..dst+len` is host memory that stays valid, and is not read or written by
    ///   anyone else, until an event recorded after this copy has completed;
    /// - `src..src+len` is device memory of this stream's device, valid until then.
    pub unsafe fn copy_dtoh(&self, dst: *mut u8, src: u64, len: usize) -> Result<()> {
        check(
            // SAFETY: the caller upholds the buffer contract above.
            unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast::<c_void>(), src, len, self.raw) },
            "cuMemcpyDtoHAsync",
        )
    }

    /// Queue a device-to-device copy.
    ///
    /// # Safety
    /// - `src..src+len` is device memory of this stream's device, valid and unmodified
    ///   until an event recorded after this copy has completed;
    /// - `dst..dst+len` is device memory of this stream's device, not read or written by
    ///   anyone else until then, and not overlapping `src..src+len`.
    pub unsafe fn copy_dtod(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        check(
            // SAFETY: the caller upholds the buffer contract above.
            unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, len, self.raw) },
            "cuMemcpyDtoDAsync",
        )
    }

    /// Queue the device-to-device copies `copies` (`(dst, src, len)` each), in one driver
    /// call when `batched` and the driver has `cuMemcpyBatchAsync` (CUDA 12.8+, see
    /// `batch.rs`), else one `cuMemcpyDtoDAsync` each. Returns whether they went in one
    /// call. A batch the driver refuses is queued again copy by copy (harmless: each copy
    /// writes the same bytes to the same place, in stream order).
    ///
    /// # Safety
    /// Every copy satisfies [`Stream::copy_dtod`]'s contract, and no two copies' ranges
    /// overlap where one of them is a destination (the batch runs them in no set order).
    pub unsafe fn copy_dtod_many(
        &self,
        copies: &[(u64, u64, usize)],
        batched: bool,
    ) -> Result<bool> {
        let copies: Vec<(u64, u64, usize)> = copies.iter().copied().filter(|c| c.2 > 0).collect();
        if copies.is_empty() {
            return Ok(batched);
        }
        if let Some(f) = batched.then(super::batch::batch_fn).flatten() {
            let mut dsts: Vec<sys::CUdeviceptr> = copies.iter().map(|c| c.0).collect();
            let mut srcs: Vec<sys::CUdeviceptr> = copies.iter().map(|c| c.1).collect();
            let mut sizes: Vec<usize> = copies.iter().map(|c| c.2).collect();
            let here = super::batch::MemLocation {
                type_: super::batch::LOCATION_DEVICE,
                id: self.ctx.ordinal(),
            };
            let mut attrs = [super::batch::MemcpyAttributes {
                src_access_order: super::batch::SRC_ACCESS_ORDER_STREAM,
                src_loc_hint: here,
                dst_loc_hint: here,
                flags: 0,
            }];
            let mut attr_idx = [0usize];
            let mut fail = usize::MAX;
            // SAFETY: the three arrays have `copies.len()` entries each, and one attribute
            // (stream-ordered reads) applies from copy 0: they and `fail` are locals that
            // outlive the call, which reads them only during the call. Each copy satisfies
            // `copy_dtod`'s contract (the caller's), so the batch reads and writes only
            // what those copies would, on this stream (a stream of ours, never the legacy
            // NULL stream, which the batch API refuses).
            let r = unsafe {
                f(
                    dsts.as_mut_ptr(),
                    srcs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    copies.len(),
                    attrs.as_mut_ptr(),
                    attr_idx.as_mut_ptr(),
                    1,
                    &mut fail,
                    self.raw,
                )
            };
            match check(r, "cuMemcpyBatchAsync") {
                Ok(()) => return Ok(true),
                Err(e) => {
                    tracing::warn!(error = %e, copies = copies.len(), fail, "batched copies refused: queued one by one")
                }
            }
        }
        for &(dst, src, len) in &copies {
            // SAFETY: the caller's contract, copy by copy.
            unsafe { self.copy_dtod(dst, src, len)? };
        }
        Ok(false)
    }

    /// Queue a host-to-device copy.
    ///
    /// # Safety
    /// - `src..src+len` is host memory that stays valid and unmodified until the copy
    ///   completed (synchronize the stream or an event recorded after it);
    /// - `dst..dst+len` is device memory of this stream's device, not used by anyone else
    ///   until then.
    pub unsafe fn copy_htod(&self, dst: u64, src: *const u8, len: usize) -> Result<()> {
        check(
            // SAFETY: the caller upholds the buffer contract above.
            unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast::<c_void>(), len, self.raw) },
            "cuMemcpyHtoDAsync",
        )
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: the stream is ours; pending work completes before the driver frees it.
        let _ = unsafe { sys::cuStreamDestroy_v2(self.raw) };
    }
}

/// An event without timing (cheap to record and query).
#[derive(Debug)]
pub struct Event {
    raw: sys::CUevent,
    ctx: Arc<Context>,
}

// SAFETY: event handles are usable from any thread.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    /// A new event on `ctx`; [`Event::synchronize`] spins on it (the driver's default).
    pub fn new(ctx: &Arc<Context>) -> Result<Event> {
        Event::with_sync(ctx, false)
    }

    /// A new event on `ctx`. `blocking`: [`Event::synchronize`] puts its thread to sleep
    /// until the event completes (`CU_EVENT_BLOCKING_SYNC`) instead of spinning on a core.
    pub fn with_sync(ctx: &Arc<Context>, blocking: bool) -> Result<Event> {
        ctx.bind()?;
        let mut flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        if blocking {
            flags |= sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32;
        }
        let mut raw = std::ptr::null_mut();
        check(
            // SAFETY: `raw` is a live local the driver writes one handle into; the context is
            // current (bound above); the handle is destroyed once, in Drop.
            unsafe { sys::cuEventCreate(&mut raw, flags) },
            "cuEventCreate",
        )?;
        Ok(Event {
            raw,
            ctx: Arc::clone(ctx),
        })
    }

    /// Record on `stream`.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        check(
            // SAFETY: live event and stream of the same context.
            unsafe { sys::cuEventRecord(self.raw, stream.raw) },
            "cuEventRecord",
        )
    }

    /// Record on a caller's raw `CUstream`.
    ///
    /// # Safety
    /// `stream` must be a live `CUstream` (or 0, the legacy default stream) of this
    /// event's context.
    pub unsafe fn record_raw(&self, stream: u64) -> Result<()> {
        check(
            // SAFETY: the caller guarantees the stream handle.
            unsafe { sys::cuEventRecord(self.raw, stream as sys::CUstream) },
            "cuEventRecord",
        )
    }

    /// Make later work on a caller's raw `CUstream` wait for this event (as recorded now).
    ///
    /// # Safety
    /// `stream` must be a live `CUstream` (or 0, the legacy default stream) of this
    /// event's context.
    pub unsafe fn hold_raw(&self, stream: u64) -> Result<()> {
        check(
            // SAFETY: the caller guarantees the stream handle; the event is live.
            unsafe { sys::cuStreamWaitEvent(stream as sys::CUstream, self.raw, 0) },
            "cuStreamWaitEvent",
        )
    }

    /// Make later work on `stream` (of this event's device) wait for this event as
    /// recorded now. The calling thread's current context is left as it was.
    pub fn hold(&self, stream: StreamRef<'_>) -> Result<()> {
        let _restore = super::CtxGuard::save()?;
        self.ctx.bind()?;
        // SAFETY: a `StreamRef` is borrowed from a live stream, or made with `from_raw`,
        // whose contract is that the handle is live while it is used.
        unsafe { self.hold_raw(stream.raw()) }
    }

    /// This event, borrowed, for [`SaveOptions::after_event`](crate::SaveOptions).
    pub fn handle(&self) -> EventRef<'_> {
        EventRef {
            raw: self.raw as u64,
            device: self.ctx.ordinal(),
            _owner: PhantomData,
        }
    }

    /// True when the work before the record has completed.
    pub fn query(&self) -> Result<bool> {
        // SAFETY: live event.
        let r = unsafe { sys::cuEventQuery(self.raw) };
        if r == sys::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check(r, "cuEventQuery").map(|()| true)
    }

    /// Block until the work before the record has completed.
    pub fn synchronize(&self) -> Result<()> {
        check(
            // SAFETY: live event.
            unsafe { sys::cuEventSynchronize(self.raw) },
            "cuEventSynchronize",
        )
    }

    /// The context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: the event is ours.
        let _ = unsafe { sys::cuEventDestroy_v2(self.raw) };
    }
}

/// A `CUstream` the engine orders its copies after, borrowed for `'a`.
///
/// Safe code gets one from a [`Stream`] it holds ([`Stream::handle`]), so the stream
/// cannot be destroyed while a save may still wait on it:
///
/// ```compile_fail,E0505
/// # fn f(ctx: &std::sync::Arc<shmckpt::cuda::Context>) -> shmckpt::Result<()> {
/// let stream = shmckpt::cuda::Stream::new(ctx)?;
/// let opts = shmckpt::SaveOptions::new().after_stream(stream.handle());
/// drop(stream); // error: `stream` is still borrowed by `opts`
/// let _ = opts;
/// # Ok(()) }
/// ```
///
/// A raw handle from another library (PyTorch's `cudaStream_t`, passed as an integer)
/// goes through the `unsafe` [`StreamRef::from_raw`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamRef<'a> {
    raw: u64,
    device: i32,
    _owner: PhantomData<&'a ()>,
}

impl StreamRef<'_> {
    /// Wrap a raw `CUstream` (`cudaStream_t`) of device ordinal `device`, for any lifetime
    /// the caller picks.
    ///
    /// # Safety
    /// `raw` must be a live `CUstream` (or 0, the legacy default stream) of the primary
    /// context of device `device` in this process, and stay live until the save that
    /// receives it has been staged.
    #[allow(unsafe_code)]
    pub unsafe fn from_raw(raw: u64, device: i32) -> Self {
        StreamRef {
            raw,
            device,
            _owner: PhantomData,
        }
    }

    /// The raw handle.
    pub fn raw(&self) -> u64 {
        self.raw
    }

    /// The device ordinal.
    pub fn device(&self) -> i32 {
        self.device
    }
}

/// A `CUevent` the engine orders its copies after, borrowed for `'a` (see [`StreamRef`]).
///
/// ```compile_fail,E0505
/// # fn f(ctx: &std::sync::Arc<shmckpt::cuda::Context>) -> shmckpt::Result<()> {
/// let event = shmckpt::cuda::Event::new(ctx)?;
/// let opts = shmckpt::SaveOptions::new().after_event(event.handle());
/// drop(event); // error: `event` is still borrowed by `opts`
/// let _ = opts;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventRef<'a> {
    raw: u64,
    device: i32,
    _owner: PhantomData<&'a ()>,
}

impl EventRef<'_> {
    /// Wrap a raw `CUevent` (`cudaEvent_t`) of device ordinal `device`, for any lifetime
    /// the caller picks.
    ///
    /// # Safety
    /// `raw` must be a live `CUevent` of device `device` in this process, and stay live
    /// until the save that receives it has been staged.
    #[allow(unsafe_code)]
    pub unsafe fn from_raw(raw: u64, device: i32) -> Self {
        EventRef {
            raw,
            device,
            _owner: PhantomData,
        }
    }

    /// The raw handle.
    pub fn raw(&self) -> u64 {
        self.raw
    }

    /// The device ordinal.
    pub fn device(&self) -> i32 {
        self.device
    }
}
