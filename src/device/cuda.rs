//! The one funnel for CUDA driver calls (cudarc `sys`, dynamic loading).
//!
//! Every call checks its `CUresult`. Nothing here runs before [`init`] has checked that
//! `libcuda` can be loaded: cudarc panics on a missing library, we return
//! [`Error::Cuda`] instead. The engine allocates no device memory: [`DeviceBuffer`] and
//! [`PinnedHost`] exist for benchmarks and tests.
#![allow(unsafe_code)]

use std::ffi::{CStr, c_void};
use std::marker::PhantomData;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::sys;

use crate::error::{Error, Result};
use crate::staging::Arena;
use crate::tensor::DeviceSlice;

fn length_matches(op: &str, got: usize, want: usize) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(Error::Cuda(format!(
            "{op}: host buffer of {got} bytes for a device buffer of {want} bytes"
        )))
    }
}

/// Whether `libcuda` can be loaded (no CUDA call is made).
pub fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: `is_culib_present` only tries to dlopen the library names and drops the
    // handles; it has no preconditions.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// Load the driver and call `cuInit` once. Fails with a clear error where there is no
/// driver (never panics).
pub fn init() -> Result<()> {
    static INIT: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    INIT.get_or_init(|| {
        if !driver_present() {
            return Err("no CUDA driver found (libcuda.so could not be loaded)".to_owned());
        }
        // SAFETY: the library is present (checked above), so the lazy symbol lookup in
        // cudarc succeeds; cuInit has no pointer arguments.
        let r = unsafe { sys::cuInit(0) };
        check(r, "cuInit").map_err(|e| e.to_string())
    })
    .clone()
    .map_err(Error::Cuda)
}

fn error_name(r: sys::CUresult) -> String {
    let mut p: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorName writes a pointer to a static string (or leaves it null).
    let ok = unsafe { sys::cuGetErrorName(r, &mut p) } == sys::CUresult::CUDA_SUCCESS;
    if ok && !p.is_null() {
        // SAFETY: the driver returned a valid NUL-terminated static string.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    } else {
        format!("{r:?}")
    }
}

fn check(r: sys::CUresult, what: &str) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda(format!("{what} failed: {}", error_name(r))))
    }
}

/// Driver version (e.g. 13000 for CUDA 13.0).
pub fn driver_version() -> Result<i32> {
    init()?;
    let mut v = 0;
    // SAFETY: writes one int.
    check(
        unsafe { sys::cuDriverGetVersion(&mut v) },
        "cuDriverGetVersion",
    )?;
    Ok(v)
}

/// Number of CUDA devices.
pub fn device_count() -> Result<i32> {
    init()?;
    let mut n = 0;
    // SAFETY: writes one int.
    check(unsafe { sys::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount")?;
    Ok(n)
}

/// A device's retained primary context (the one CUDA runtimes and PyTorch use).
#[derive(Debug)]
pub struct Context {
    ordinal: i32,
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
}

// SAFETY: a CUDA context handle may be used from any thread (it is made current per thread
// with cuCtxSetCurrent); the handle itself is immutable.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Context {
    /// Retain device `ordinal`'s primary context.
    pub fn new(ordinal: i32) -> Result<Arc<Context>> {
        init()?;
        let n = device_count()?;
        if ordinal < 0 || ordinal >= n {
            return Err(Error::Cuda(format!(
                "device {ordinal} does not exist ({n} devices)"
            )));
        }
        let mut dev = 0;
        // SAFETY: writes one device handle.
        check(
            unsafe { sys::cuDeviceGet(&mut dev, ordinal) },
            "cuDeviceGet",
        )?;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: writes one context handle; released in Drop.
        check(
            unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) },
            "cuDevicePrimaryCtxRetain",
        )?;
        Ok(Arc::new(Context { ordinal, dev, ctx }))
    }

    /// Device ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// Make this context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        // SAFETY: `ctx` is a retained, live context.
        check(unsafe { sys::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")
    }

    /// Wait for all work on the device (used when the caller gives no stream or event).
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: no arguments; the context is current.
        check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
    }

    /// Free and total device memory.
    pub fn mem_info(&self) -> Result<(u64, u64)> {
        self.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: writes two integers; the context is current.
        check(
            unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) },
            "cuMemGetInfo",
        )?;
        Ok((free as u64, total as u64))
    }

    /// Device name.
    pub fn name(&self) -> String {
        let mut buf = [0 as std::ffi::c_char; 128];
        // SAFETY: the driver writes at most `len` bytes, NUL-terminated.
        let r = unsafe { sys::cuDeviceGetName(buf.as_mut_ptr(), 128, self.dev) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return format!("device {}", self.ordinal);
        }
        // SAFETY: NUL-terminated within the buffer.
        unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned()
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `new`.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.dev) };
    }
}

/// Restores the calling thread's previous current context on drop, so the engine does not
/// change the trainer's CUDA state.
#[derive(Debug)]
pub struct CtxGuard {
    prev: sys::CUcontext,
}

impl CtxGuard {
    /// Remember the current context.
    pub fn save() -> Result<CtxGuard> {
        init()?;
        let mut prev = std::ptr::null_mut();
        // SAFETY: writes one handle (null when none is current).
        check(
            unsafe { sys::cuCtxGetCurrent(&mut prev) },
            "cuCtxGetCurrent",
        )?;
        Ok(CtxGuard { prev })
    }
}

impl Drop for CtxGuard {
    fn drop(&mut self) {
        // SAFETY: `prev` was current on this thread (or null, which unbinds).
        let _ = unsafe { sys::cuCtxSetCurrent(self.prev) };
    }
}

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
        // SAFETY: writes one handle; destroyed in Drop.
        check(
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
        // SAFETY: live stream.
        check(
            unsafe { sys::cuStreamSynchronize(self.raw) },
            "cuStreamSynchronize",
        )
    }

    /// Queue a memset of all of `buf` to `value` (tests use it to model a trainer that keeps
    /// writing its tensors on its own stream).
    pub fn memset_async(&self, buf: &mut DeviceBuffer, value: u8) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        self.ctx.bind()?;
        // SAFETY: the range is `buf`'s allocation on this context; `cuMemFree` (on drop)
        // waits for pending work on the memory.
        check(
            unsafe { sys::cuMemsetD8Async(buf.ptr(), value, buf.len(), self.raw) },
            "cuMemsetD8Async",
        )
    }

    /// Make later work on this stream wait for `event`.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        // SAFETY: live stream and event.
        check(
            unsafe { sys::cuStreamWaitEvent(self.raw, event.raw, 0) },
            "cuStreamWaitEvent",
        )
    }

    /// Make later work on this stream wait for a caller's raw `CUevent`.
    ///
    /// # Safety
    /// `event` must be a live `CUevent` of this process.
    pub unsafe fn wait_raw_event(&self, event: u64) -> Result<()> {
        // SAFETY: the caller guarantees the event handle is live.
        check(
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
        // SAFETY: the caller upholds the buffer contract above.
        check(
            unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast::<c_void>(), src, len, self.raw) },
            "cuMemcpyDtoHAsync",
        )
    }

    /// Queue a host-to-device copy.
    ///
    /// # Safety
    /// - `src..src+len` is host memory that stays valid and unmodified until the copy
    ///   completed (synchronize the stream or an event recorded after it);
    /// - `dst..dst+len` is device memory of this stream's device, not used by anyone else
    ///   until then.
    pub unsafe fn copy_htod(&self, dst: u64, src: *const u8, len: usize) -> Result<()> {
        // SAFETY: the caller upholds the buffer contract above.
        check(
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
    /// A new event on `ctx`.
    pub fn new(ctx: &Arc<Context>) -> Result<Event> {
        ctx.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: writes one handle; destroyed in Drop.
        check(
            unsafe {
                sys::cuEventCreate(&mut raw, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
            },
            "cuEventCreate",
        )?;
        Ok(Event {
            raw,
            ctx: Arc::clone(ctx),
        })
    }

    /// Record on `stream`.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        // SAFETY: live event and stream of the same context.
        check(
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
        // SAFETY: the caller guarantees the stream handle.
        check(
            unsafe { sys::cuEventRecord(self.raw, stream as sys::CUstream) },
            "cuEventRecord",
        )
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
        // SAFETY: live event.
        check(
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

/// The staging arena's data region registered with the driver (page-locked, portable to
/// every context). Unregistered on drop, before the arena can be unmapped (the
/// registration holds an `Arc` of the arena).
#[derive(Debug)]
pub struct HostRegistration {
    arena: Arc<Arena>,
    ctx: Arc<Context>,
    took: Duration,
}

impl HostRegistration {
    /// Register `arena`'s data region (`cuMemHostRegister`, portable).
    pub fn new(arena: &Arc<Arena>, ctx: &Arc<Context>) -> Result<HostRegistration> {
        ctx.bind()?;
        let (ptr, len) = arena.data_region();
        let t = Instant::now();
        // SAFETY: the region is a live, page-aligned mapping owned by `arena`, which this
        // registration keeps alive until it unregisters in Drop.
        check(
            unsafe {
                sys::cuMemHostRegister_v2(
                    ptr.cast::<c_void>(),
                    len,
                    sys::CU_MEMHOSTREGISTER_PORTABLE,
                )
            },
            "cuMemHostRegister",
        )?;
        Ok(HostRegistration {
            arena: Arc::clone(arena),
            ctx: Arc::clone(ctx),
            took: t.elapsed(),
        })
    }

    /// How long registration took.
    pub fn took(&self) -> Duration {
        self.took
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        let (ptr, _) = self.arena.data_region();
        // SAFETY: unregisters exactly the pointer registered in `new`; the mapping is still
        // alive because we hold the arena.
        let r = unsafe { sys::cuMemHostUnregister(ptr.cast::<c_void>()) };
        if let Err(e) = check(r, "cuMemHostUnregister") {
            tracing::warn!(error = %e, "could not unregister staging memory");
        }
    }
}

/// Device memory allocated with `cuMemAlloc` (benchmarks and tests; the engine never
/// allocates device memory). Freed on drop.
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
        // SAFETY: both ranges are valid for `len` bytes; the call is synchronous.
        check(
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
        // SAFETY: both ranges are valid for `len` bytes; the call is synchronous.
        check(
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
        // SAFETY: the range is this allocation.
        check(
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
        // SAFETY: frees exactly the allocation made in `alloc`; no copy into or out of it
        // can be pending because every engine call that used it returned.
        let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}

/// Page-locked host memory from `cuMemAllocHost` (the reference for the PCIe limit).
#[derive(Debug)]
pub struct PinnedHost {
    ptr: *mut u8,
    len: usize,
    ctx: Arc<Context>,
}

// SAFETY: owned memory; access goes through `&`/`&mut self`.
unsafe impl Send for PinnedHost {}

impl PinnedHost {
    /// Allocate `len` pinned bytes.
    pub fn alloc(ctx: &Arc<Context>, len: usize) -> Result<PinnedHost> {
        ctx.bind()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one pointer; freed in Drop.
        check(
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

    /// Time one plain pinned device-to-host copy of each buffer in `srcs`, back to back on
    /// one stream, into this memory (which must be large enough).
    pub fn time_dtoh(&mut self, srcs: &[&DeviceBuffer], stream: &Stream) -> Result<Duration> {
        srcs.iter()
            .try_fold(0usize, |acc, b| acc.checked_add(b.len()))
            .filter(|&t| t <= self.len)
            .ok_or_else(|| {
                Error::Cuda(format!(
                    "pinned buffer of {} bytes is too small for the copy",
                    self.len
                ))
            })?;
        stream.context().bind()?;
        let t = Instant::now();
        let mut at = 0;
        for b in srcs {
            // SAFETY: `at + len <= self.len` (checked total); `self` is borrowed mutably
            // until the stream is synchronized below; `b` is a live allocation.
            unsafe { stream.copy_dtoh(self.ptr.add(at), b.ptr(), b.len())? };
            at += b.len();
        }
        stream.synchronize()?;
        Ok(t.elapsed())
    }

    /// The bytes (zero until a copy wrote them).
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: an owned allocation of `len` bytes, zeroed in `alloc` (so initialised)
        // and written since only through `&mut self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: frees the allocation made in `alloc`.
        let _ = unsafe { sys::cuMemFreeHost(self.ptr.cast()) };
    }
}

// ---------------------------------------------------------------------------------------
// CUDA IPC (the `--mode ipc` baseline: NVRx / Megatron's persistent writer process).
// ---------------------------------------------------------------------------------------

#[cfg(feature = "ipc")]
/// The 16-byte UUID of device `ordinal` (stable across processes, unlike ordinals, which
/// depend on `CUDA_VISIBLE_DEVICES`).
pub fn device_uuid(ordinal: i32) -> Result<[u8; 16]> {
    init()?;
    let n = device_count()?;
    if ordinal < 0 || ordinal >= n {
        return Err(Error::Cuda(format!(
            "device {ordinal} does not exist ({n} devices)"
        )));
    }
    let mut dev = 0;
    // SAFETY: writes one device handle; the ordinal is in range (checked above).
    check(
        unsafe { sys::cuDeviceGet(&mut dev, ordinal) },
        "cuDeviceGet",
    )?;
    let mut uuid = sys::CUuuid { bytes: [0; 16] };
    // SAFETY: writes one 16-byte `CUuuid` into our local.
    check(
        unsafe { sys::cuDeviceGetUuid_v2(&mut uuid, dev) },
        "cuDeviceGetUuid",
    )?;
    Ok(uuid.bytes.map(|b| b as u8))
}

#[cfg(feature = "ipc")]
/// The ordinal, in this process, of the device with UUID `uuid`.
pub fn ordinal_of_uuid(uuid: &[u8; 16]) -> Result<i32> {
    for d in 0..device_count()? {
        if device_uuid(d)? == *uuid {
            return Ok(d);
        }
    }
    Err(Error::Cuda(format!(
        "no visible device has UUID {} (check CUDA_VISIBLE_DEVICES of both processes)",
        uuid.iter().map(|b| format!("{b:02x}")).collect::<String>()
    )))
}

#[cfg(feature = "ipc")]
/// Base address and size of the device allocation that contains `ptr`
/// (`cuMemGetAddressRange`). For memory from a caching allocator this is the whole
/// segment the allocator got from the driver, not the tensor.
pub fn allocation_range(ctx: &Context, ptr: u64) -> Result<(u64, usize)> {
    ctx.bind()?;
    let (mut base, mut size) = (0u64, 0usize);
    // SAFETY: writes one pointer and one size into our locals; the driver validates `ptr`
    // (an address it did not allocate is CUDA_ERROR_NOT_FOUND, nothing is dereferenced).
    let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) };
    check(r, "cuMemGetAddressRange")
        .map_err(|e| Error::Cuda(format!("{e} (device pointer {ptr:#x})")))?;
    Ok((base, size))
}

#[cfg(feature = "ipc")]
/// A CUDA IPC memory handle (`CUipcMemHandle`, 64 opaque bytes). The same allocation
/// always exports the same bytes; a new allocation gets new bytes even at a reused
/// address.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcMemHandle(pub [u8; 64]);

#[cfg(feature = "ipc")]
impl std::fmt::Debug for IpcMemHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IpcMemHandle(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "..)")
    }
}

#[cfg(feature = "ipc")]
impl IpcMemHandle {
    fn to_sys(self) -> sys::CUipcMemHandle {
        sys::CUipcMemHandle {
            reserved: self.0.map(|b| b as std::ffi::c_char),
        }
    }
}

#[cfg(feature = "ipc")]
/// Export the device allocation whose base address is `base` (`cuIpcGetMemHandle`) so
/// another process can map it with [`IpcMapping::open`]. `base` must be the start of an
/// allocation ([`allocation_range`] gives it).
///
/// Only `cuMemAlloc`-style allocations can be exported this way: stream-ordered pools
/// (`cuMemAllocAsync`) and virtual-memory allocations (`cuMemCreate`, PyTorch's
/// `expandable_segments`) are refused by the driver.
pub fn ipc_export(ctx: &Context, base: u64) -> Result<IpcMemHandle> {
    ctx.bind()?;
    let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
    // SAFETY: writes one 64-byte handle into our local; the driver validates `base`.
    let r = unsafe { sys::cuIpcGetMemHandle(&mut h, base) };
    check(r, "cuIpcGetMemHandle").map_err(|e| {
        Error::Cuda(format!(
            "{e} (allocation {base:#x}: only cuMemAlloc-style allocations can be exported; \
             stream-ordered and virtual-memory allocations cannot)"
        ))
    })?;
    Ok(IpcMemHandle(h.reserved.map(|b| b as u8)))
}

#[cfg(feature = "ipc")]
/// Another process's device allocation mapped into this process
/// (`cuIpcOpenMemHandle`, with `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`). Unmapped with
/// `cuIpcCloseMemHandle` on drop.
///
/// While a mapping is open, the exporter's allocation stays alive even after the exporter
/// frees it: its device memory comes back only when every mapping is closed. A handle can
/// be open only once per context: open it again only after the previous mapping dropped.
#[derive(Debug)]
pub struct IpcMapping {
    ptr: u64,
    size: Option<usize>,
    ctx: Arc<Context>,
}

#[cfg(feature = "ipc")]
impl IpcMapping {
    /// Map `handle` into `ctx` (which must be on the exporter's device; peer access to
    /// another device is enabled lazily).
    pub fn open(ctx: &Arc<Context>, handle: &IpcMemHandle) -> Result<IpcMapping> {
        ctx.bind()?;
        let mut ptr = 0u64;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: writes one device pointer into our local; the handle is passed by value
        // and validated by the driver (a handle of this process, a closed allocation or
        // garbage bytes are errors, nothing is dereferenced). Closed in Drop.
        let r = unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, handle.to_sys(), flags) };
        check(r, "cuIpcOpenMemHandle").map_err(|e| {
            let hint = if r == sys::CUresult::CUDA_ERROR_ALREADY_MAPPED {
                " (this handle is already open in this context)"
            } else {
                ""
            };
            Error::Cuda(format!("{e}{hint}"))
        })?;
        // The size of what was mapped, so that slices can be bounds-checked here and not
        // only against the exporter's word. Not every driver reports it for IPC mappings.
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: writes two integers into our locals; `ptr` was just mapped.
        let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) };
        let size = (r == sys::CUresult::CUDA_SUCCESS && base == ptr).then_some(size);
        Ok(IpcMapping {
            ptr,
            size,
            ctx: Arc::clone(ctx),
        })
    }

    /// The mapped address (the exporter's allocation base, in this process).
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Size of the mapped allocation as the driver reports it (`None` if it does not).
    pub fn size(&self) -> Option<usize> {
        self.size
    }

    /// Device ordinal of the mapping's context.
    pub fn device(&self) -> i32 {
        self.ctx.ordinal()
    }

    /// The `len` bytes at `offset` of the mapped allocation, for `save`. `alloc_size` is
    /// the allocation size the exporter reported; the range must lie inside it and inside
    /// the size the driver reports for the mapping. The slice borrows the mapping.
    pub fn slice(&self, offset: u64, len: usize, alloc_size: usize) -> Result<DeviceSlice<'_>> {
        let end = offset.checked_add(len as u64);
        let bound = self.size.map_or(alloc_size, |s| s.min(alloc_size)) as u64;
        match end {
            Some(end) if end <= bound => {}
            _ => {
                return Err(Error::Cuda(format!(
                    "range {offset}+{len} lies outside the mapped allocation of {bound} bytes"
                )));
            }
        }
        // SAFETY: `ptr + offset .. + len` lies inside the allocation mapped into this
        // process on this context's device (bounds checked above), which stays mapped
        // while `self` lives; the returned slice borrows `self`.
        Ok(unsafe { DeviceSlice::new(self.ptr + offset, len, self.ctx.ordinal()) })
    }
}

#[cfg(feature = "ipc")]
impl Drop for IpcMapping {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.bind() {
            tracing::warn!(error = %e, "cannot bind context to close an IPC mapping");
        }
        // SAFETY: unmaps exactly the pointer `cuIpcOpenMemHandle` returned; no copy from it
        // is pending (the engine's `save` returned, and with it every copy completed).
        let r = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        if let Err(e) = check(r, "cuIpcCloseMemHandle") {
            tracing::warn!(error = %e, ptr = self.ptr, "could not close an IPC mapping");
        }
    }
}
