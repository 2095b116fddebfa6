//! The one funnel for CUDA driver calls (cudarc `sys`, dynamic loading).
//!
//! Every call checks its `CUresult`. Nothing here runs before [`init`] has checked that
//! `libcuda` can be loaded: cudarc panics on a missing library, we return
//! [`Error::Cuda`] instead. The engine allocates no device memory, except the transient
//! buffer of the opt-in device snapshot ([`crate::SaveOptions::snapshot_on_request`], a
//! stream-ordered allocation from a memory pool of the engine's own, `pool.rs`); [`DeviceBuffer`] and
//! [`PinnedHost`] serve benchmarks and tests.
#![allow(unsafe_code)]

mod alloc;
mod batch;
mod latch;
mod pool;
mod register;
mod stream;

pub use alloc::{DeviceBuffer, PinnedHost};
pub use batch::batch_copies_supported;
pub(crate) use latch::{Latch, LatchPool};
pub(crate) use pool::{MemPool, StreamBuffer};
pub use register::HostRegistration;
pub use stream::{Event, EventRef, Stream, StreamRef};

use std::ffi::CStr;
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;

use crate::error::{Error, Result};

fn length_matches(op: &str, got: usize, want: usize) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(Error::cuda(
            op,
            format!("host buffer of {got} bytes for a device buffer of {want} bytes"),
        ))
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
    .map_err(|m| Error::cuda("cuInit", m))
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
        Err(Error::Cuda {
            call: what.to_owned(),
            code: Some(r as i32),
            detail: error_name(r),
        })
    }
}

/// The driver's handle of device `ordinal` (after `init`), or an error naming the number
/// of devices when there is no such device.
fn device(ordinal: i32) -> Result<sys::CUdevice> {
    init()?;
    let n = device_count()?;
    if ordinal < 0 || ordinal >= n {
        return Err(Error::cuda(
            "cuDeviceGet",
            format!("device {ordinal} does not exist ({n} devices)"),
        ));
    }
    let mut dev = 0;
    check(
        // SAFETY: writes one device handle into our local; the ordinal is in range.
        unsafe { sys::cuDeviceGet(&mut dev, ordinal) },
        "cuDeviceGet",
    )?;
    Ok(dev)
}

/// Driver version (e.g. 13000 for CUDA 13.0).
pub fn driver_version() -> Result<i32> {
    init()?;
    let mut v = 0;
    check(
        // SAFETY: `v` is a live local `c_int` the driver writes the version into; the
        // driver is initialised (`init` above).
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
        let dev = device(ordinal)?;
        let mut ctx = std::ptr::null_mut();
        check(
            // SAFETY: `ctx` is a live local the driver writes one context handle into; `dev` is a
            // valid handle (`device` checked the ordinal); released once, in Drop.
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
        check(
            // SAFETY: `free` and `total` are live local `usize`s the driver writes into; the
            // context is current (bound above).
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
        check(
            // SAFETY: `prev` is a live local the driver writes one context handle into (null
            // when none is current); the driver is initialised (`init` above).
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
