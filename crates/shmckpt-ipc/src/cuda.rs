//! CUDA IPC: exporting device allocations and mapping another process's.
//!
//! The library's CUDA façade ([`shmckpt::cuda`]) has no IPC: the few driver calls the
//! baseline needs are made here, through cudarc like the library's own, on its public
//! [`Context`] (retained primary context, `bind`) and [`DeviceSlice::new`].
#![allow(unsafe_code)]

use std::sync::Arc;

use cudarc::driver::result as driver;
use cudarc::driver::{DriverError, sys};
use shmckpt::DeviceSlice;
use shmckpt::cuda::{Context, device_count};

use crate::error::{Error, Result};

pub(crate) use shmckpt::cuda::init;

/// `Ok` for `CUDA_SUCCESS`, else the library's CUDA error naming `what` and the result.
fn check(r: sys::CUresult, what: &str) -> Result<()> {
    r.result().map_err(|e| driver_error(e, what))
}

/// The library's CUDA error for a failed driver call `what`.
fn driver_error(e: DriverError, what: &str) -> Error {
    shmckpt::Error::Cuda {
        call: what.to_owned(),
        code: Some(e.0 as i32),
        detail: e.error_name().map_or_else(
            |_| format!("{:?}", e.0),
            |n| n.to_string_lossy().into_owned(),
        ),
    }
    .into()
}

/// The driver's handle of device `ordinal`, or an error naming the number of devices.
fn device(ordinal: i32) -> Result<sys::CUdevice> {
    init()?;
    let n = device_count()?;
    if ordinal < 0 || ordinal >= n {
        return Err(Error::cuda(
            "cuDeviceGet",
            format!("device {ordinal} does not exist ({n} devices)"),
        ));
    }
    driver::device::get(ordinal).map_err(|e| driver_error(e, "cuDeviceGet"))
}

/// Restores the calling thread's previous current context on drop, so that exporting
/// handles does not change the trainer's CUDA state.
#[derive(Debug)]
pub(crate) struct CtxGuard {
    prev: sys::CUcontext,
}

impl CtxGuard {
    /// Remember the current context.
    pub(crate) fn save() -> Result<CtxGuard> {
        init()?;
        let prev = driver::ctx::get_current()
            .map_err(|e| driver_error(e, "cuCtxGetCurrent"))?
            .unwrap_or(std::ptr::null_mut());
        Ok(CtxGuard { prev })
    }
}

impl Drop for CtxGuard {
    fn drop(&mut self) {
        // SAFETY: `prev` was current on this thread (or null, which unbinds).
        let _ = unsafe { sys::cuCtxSetCurrent(self.prev) };
    }
}

/// The 16-byte UUID of device `ordinal` (stable across processes, unlike ordinals, which
/// depend on `CUDA_VISIBLE_DEVICES`).
pub fn device_uuid(ordinal: i32) -> Result<[u8; 16]> {
    let dev = device(ordinal)?;
    let uuid = driver::device::get_uuid(dev).map_err(|e| driver_error(e, "cuDeviceGetUuid"))?;
    Ok(uuid.bytes.map(|b| b as u8))
}

/// The ordinal, in this process, of the device with UUID `uuid`.
pub fn ordinal_of_uuid(uuid: &[u8; 16]) -> Result<i32> {
    for d in 0..device_count()? {
        if device_uuid(d)? == *uuid {
            return Ok(d);
        }
    }
    Err(Error::cuda(
        "cuDeviceGetUuid",
        format!(
            "no visible device has UUID {} (check CUDA_VISIBLE_DEVICES of both processes)",
            uuid.iter().map(|b| format!("{b:02x}")).collect::<String>()
        ),
    ))
}

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
        .map_err(|e| e.with_cuda_context(&format!("device pointer {ptr:#x}")))?;
    Ok((base, size))
}

/// A CUDA IPC memory handle (`CUipcMemHandle`, 64 opaque bytes). The same allocation
/// always exports the same bytes; a new allocation gets new bytes even at a reused
/// address.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcMemHandle(pub [u8; 64]);

impl std::fmt::Debug for IpcMemHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IpcMemHandle(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "..)")
    }
}

impl IpcMemHandle {
    fn to_sys(self) -> sys::CUipcMemHandle {
        sys::CUipcMemHandle {
            reserved: self.0.map(|b| b as std::ffi::c_char),
        }
    }
}

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
        e.with_cuda_context(&format!(
            "allocation {base:#x}: only cuMemAlloc-style allocations can be exported; \
             stream-ordered and virtual-memory allocations cannot"
        ))
    })?;
    Ok(IpcMemHandle(h.reserved.map(|b| b as u8)))
}

/// Another process's device allocation mapped into this process
/// (`cuIpcOpenMemHandle`, with `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`). Unmapped with
/// `cuIpcCloseMemHandle` on drop.
///
/// While a mapping is open, the exporter's allocation stays alive even after the exporter
/// frees it: its device memory comes back only when every mapping is closed. A handle can
/// be open only once per context: open it again only after the previous mapping dropped.
///
/// A slice of the mapping borrows it, so the mapping cannot be closed while a slice of it
/// may still be saved:
///
/// ```compile_fail,E0505
/// # fn f(mapping: shmckpt_ipc::cuda::IpcMapping) -> shmckpt_ipc::Result<()> {
/// let slice = mapping.slice(0, 16, 16)?;
/// drop(mapping); // error: `mapping` is still borrowed by `slice`
/// let _ = slice.len();
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct IpcMapping {
    ptr: u64,
    size: Option<usize>,
    ctx: Arc<Context>,
}

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
            if r == sys::CUresult::CUDA_ERROR_ALREADY_MAPPED {
                e.with_cuda_context("this handle is already open in this context")
            } else {
                e
            }
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
                return Err(Error::cuda(
                    "IpcMapping::slice",
                    format!(
                        "range {offset}+{len} lies outside the mapped allocation of {bound} bytes"
                    ),
                ));
            }
        }
        // SAFETY: `ptr + offset .. + len` lies inside the allocation mapped into this
        // process on this context's device (bounds checked above), which stays mapped
        // while `self` lives; the returned slice borrows `self`.
        Ok(unsafe { DeviceSlice::new(self.ptr + offset, len, self.ctx.ordinal()) })
    }
}

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
