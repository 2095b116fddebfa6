//! Device and pinned host memory (benchmarks, tests, and owned saves).
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys;

use super::{Context, check};
use super::{Stream, length_matches};
use crate::error::{Error, Result};
use crate::tensor::DeviceSlice;

/// Device memory allocated with `cuMemAlloc` (benchmarks and tests; the engine's own
/// device memory is stream-ordered, from a pool of its own). Freed on drop.
#[derive(Debug)]
pub struct DeviceBuffer {
    ptr: u64,
    len: usize,
    ctx: Arc<Context>,
}

impl DeviceBuffer {
    /// Allocate `len` bytes (contents undefined).
    pub fn alloc(ctx: &Arc<Context>, len: usize) -> Result<DeviceBuffer> {
        ctx.bind()?;
        let mut ptr = 0;
        if len > 0 {
            // SAFETY: writes one device pointer; freed in Drop.
            check(unsafe { sys::cuMemAlloc_v2(&mut ptr, len) }, "cuMemAlloc")?;
        }
        Ok(DeviceBuffer {
            ptr,
            len,
            ctx: Arc::clone(ctx),
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device pointer.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The memory as a [`DeviceSlice`] for `save` and `load`, borrowed from the buffer.
    pub fn slice(&self) -> DeviceSlice<'_> {
        // SAFETY: the range is this allocation on this device; the returned slice borrows
        // `self`, so the allocation outlives every use of it.
        unsafe { DeviceSlice::new(self.ptr, self.len, self.ctx.ordinal()) }
    }

    /// A tensor whose bytes are this whole buffer (the borrow keeps the memory alive while
    /// the tensor is in use).
    pub fn tensor<'a>(
        &'a self,
        name: impl Into<std::borrow::Cow<'a, str>>,
        dtype: crate::Dtype,
        shape: impl Into<Vec<usize>>,
    ) -> crate::Tensor<'a> {
        crate::Tensor::cuda(name, dtype, shape, self.slice())
    }

    /// Copy `src` (same length) to the device, synchronously.
    pub fn upload(&mut self, src: &[u8]) -> Result<()> {
        length_matches("upload", src.len(), self.len)?;
        if self.len == 0 {
            return Ok(());
        }
        self.ctx.bind()?;
        check(
            // SAFETY: both ranges are valid for `len` bytes; the call is synchronous.
            unsafe { sys::cuMemcpyHtoD_v2(self.ptr, src.as_ptr().cast(), self.len) },
            "cuMemcpyHtoD",
        )
    }

    /// Copy the device bytes into `dst` (same length), synchronously.
    pub fn download(&self, dst: &mut [u8]) -> Result<()> {
        length_matches("download", dst.len(), self.len)?;
        if self.len == 0 {
            return Ok(());
        }
        self.ctx.bind()?;
        check(
            // SAFETY: both ranges are valid for `len` bytes; the call is synchronous.
            unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), self.ptr, self.len) },
            "cuMemcpyDtoH",
        )
    }

    /// Set every byte to `value` (synchronously).
    pub fn memset(&mut self, value: u8) -> Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        self.ctx.bind()?;
        check(
            // SAFETY: `self.ptr..self.ptr + self.len` is this live device allocation (freed only
            // in Drop), and its context is current (bound above).
            unsafe { sys::cuMemsetD8_v2(self.ptr, value, self.len) },
            "cuMemsetD8",
        )?;
        self.ctx.synchronize()
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        let _ = self.ctx.bind();
        // Work queued on the memory through safe calls may still be pending (a
        // `Stream::memset_async` of it, a copy of a timing call that failed part way):
        // wait for all of the context's work before the memory goes back to the driver.
        let _ = self.ctx.synchronize();
        // SAFETY: frees exactly the allocation made in `alloc`, once; the context's queued
        // work has completed (synchronized above; if that failed, the context has a sticky
        // error and runs nothing more), and no borrow of `self` outlives this drop.
        let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}

impl Stream {
    /// Queue a memset of all of `buf` to `value` (tests use it to model a trainer that keeps
    /// writing its tensors on its own stream).
    pub fn memset_async(&self, buf: &mut DeviceBuffer, value: u8) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let ordinal = self.context().ordinal();
        if buf.context().ordinal() != ordinal {
            return Err(Error::cuda(
                "memset_async",
                format!(
                    "buffer of device {} on a stream of device {ordinal}",
                    buf.context().ordinal()
                ),
            ));
        }
        self.context().bind()?;
        check(
            // SAFETY: the range is `buf`'s allocation on this stream's context (same device,
            // checked above: one primary context per device), a live allocation (borrowed
            // here); dropping the buffer later synchronizes its context before `cuMemFree`, so
            // the memset never runs on freed memory; `self.raw()` is this live stream.
            unsafe {
                sys::cuMemsetD8Async(buf.ptr(), value, buf.len(), self.raw() as sys::CUstream)
            },
            "cuMemsetD8Async",
        )
    }
}

/// Page-locked host memory from `cuMemAllocHost` (the reference for the PCIe limit).
#[derive(Debug)]
pub struct PinnedHost {
    ptr: *mut u8,
    len: usize,
    ctx: Arc<Context>,
}

// SAFETY: the allocation is owned by the value and not tied to the allocating thread
// (pinned memory is usable from any thread); every copy into or out of it completes before
// the call that queued it returns (`SyncOnDrop`), so no access outlives the borrow of
// `self` that made it. Not `Sync`: `time_htod` reads it through `&self` while the DMA runs.
unsafe impl Send for PinnedHost {}

/// Synchronizes a stream when dropped: every exit of a call that queued copies into or out
/// of borrowed memory (an error returned by `?` as much as the normal end) waits for them,
/// so no copy outlives the borrow.
struct SyncOnDrop<'a> {
    stream: Option<&'a Stream>,
}

impl<'a> SyncOnDrop<'a> {
    fn new(stream: &'a Stream) -> SyncOnDrop<'a> {
        SyncOnDrop {
            stream: Some(stream),
        }
    }

    /// Synchronize now and report the error, if any.
    fn finish(mut self) -> Result<()> {
        match self.stream.take() {
            Some(s) => s.synchronize(),
            None => Ok(()),
        }
    }
}

impl Drop for SyncOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(s) = self.stream.take()
            && let Err(e) = s.synchronize()
        {
            // A failed synchronize leaves a sticky context error: the context runs nothing
            // more, so no copy can still be writing.
            tracing::error!(error = %e, "could not synchronize a stream after a failed copy");
        }
    }
}

impl PinnedHost {
    /// Allocate `len` pinned bytes.
    pub fn alloc(ctx: &Arc<Context>, len: usize) -> Result<PinnedHost> {
        ctx.bind()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        check(
            // SAFETY: `p` is a live local the driver writes one host pointer into; the context is
            // current (bound above); the allocation is freed once, in Drop.
            unsafe { sys::cuMemAllocHost_v2(&mut p, len.max(1)) },
            "cuMemAllocHost",
        )?;
        // SAFETY: `p` is a fresh host allocation of at least `len` bytes that nothing else
        // references; zeroing it makes every byte initialised, so `as_slice` is sound.
        unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, len) };
        Ok(PinnedHost {
            ptr: p.cast(),
            len,
            ctx: Arc::clone(ctx),
        })
    }

    /// Whether buffers of `lens` bytes, back to back, fit in this memory (checked sum).
    fn check_fits(&self, call: &'static str, mut lens: impl Iterator<Item = usize>) -> Result<()> {
        lens.try_fold(0usize, |acc, l| acc.checked_add(l))
            .filter(|&t| t <= self.len)
            .map(drop)
            .ok_or_else(|| {
                Error::cuda(
                    call,
                    format!(
                        "pinned buffer of {} bytes is too small for the copy",
                        self.len
                    ),
                )
            })
    }

    /// Time one plain pinned device-to-host copy of each buffer in `srcs`, back to back on
    /// one stream, into this memory (which must be large enough).
    pub fn time_dtoh(&mut self, srcs: &[&DeviceBuffer], stream: &Stream) -> Result<Duration> {
        self.check_fits("time_dtoh", srcs.iter().map(|b| b.len()))?;
        stream.context().bind()?;
        let t = Instant::now();
        let mut at = 0;
        // Declared after the borrows of `self` and `srcs` it protects and before the first
        // copy: every exit from here on (the `?` below too) synchronizes the stream first.
        let sync = SyncOnDrop::new(stream);
        for b in srcs {
            // SAFETY: `at + len <= self.len` (checked total), so the destination is inside
            // this allocation; `self` is borrowed mutably (nobody else reads or writes it)
            // and `b` is borrowed (a live allocation) until `sync` synchronizes the stream,
            // which happens on every exit of this function, the error return included.
            unsafe { stream.copy_dtoh(self.ptr.add(at), b.ptr(), b.len())? };
            at += b.len();
        }
        sync.finish()?;
        Ok(t.elapsed())
    }

    /// Time one plain pinned host-to-device copy from this memory into each buffer of
    /// `dsts`, back to back on one stream (the PCIe limit of a restore).
    pub fn time_htod(&self, dsts: &mut [&mut DeviceBuffer], stream: &Stream) -> Result<Duration> {
        self.check_fits("time_htod", dsts.iter().map(|b| b.len()))?;
        stream.context().bind()?;
        let t = Instant::now();
        let mut at = 0;
        // Every exit from here on (the `?` below too) synchronizes the stream first.
        let sync = SyncOnDrop::new(stream);
        for b in dsts.iter_mut() {
            // SAFETY: `at + len <= self.len` (checked total): initialised memory (zeroed at
            // allocation) inside this allocation, which `&self` keeps alive and unwritten
            // (`PinnedHost` is not `Sync`, writes need `&mut self`); `b` is a live
            // allocation borrowed mutably. Both borrows last until `sync` synchronizes the
            // stream, on every exit of this function, the error return included.
            unsafe { stream.copy_htod(b.ptr(), self.ptr.add(at), b.len())? };
            at += b.len();
        }
        sync.finish()?;
        Ok(t.elapsed())
    }

    /// The bytes (zero until a copy wrote them).
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: an owned allocation of `len` bytes, zeroed in `alloc` (so initialised)
        // and written since only by copies queued through `&mut self` (`time_dtoh`), each
        // complete before that call returned; so nothing writes it while `&self` is lent.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: frees the allocation made in `alloc`, once; no copy into or out of it is
        // pending (each completed before the call that queued it returned).
        let _ = unsafe { sys::cuMemFreeHost(self.ptr.cast()) };
    }
}
