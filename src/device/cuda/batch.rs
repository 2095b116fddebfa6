//! Many device-to-device copies in one driver call: `cuMemcpyBatchAsync` (CUDA 12.8+).
//!
//! The device snapshot ([`crate::SaveOptions::snapshot_on_request`]) copies every device
//! tensor not yet staged into its buffer: one `cuMemcpyDtoDAsync` per tensor costs the
//! calling thread a few microseconds each (1,168 tensors of an 8 GiB optimizer state),
//! time the trainer's optimizer step waits for. The batch API queues them all at once.
//!
//! Our bindings target the CUDA 12.0 API, which lacks this entry point, so it is looked
//! up at run time with `cuGetProcAddress` **as of CUDA 12.8** (the version is part of the
//! request: CUDA 13 changed the function's parameters, and asking for the 12.8 version
//! returns the entry point with the 12.8 signature below on every newer driver). A driver
//! older than 12.8, or one that does not return it, gets one call per copy, as before.

#![allow(unsafe_code)]

use std::ffi::{c_int, c_uint, c_void};
use std::sync::OnceLock;

use cudarc::driver::sys;

/// `CUmemLocation` (CUDA 12.8: a location type and an id; 8 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct MemLocation {
    pub(super) type_: c_int,
    pub(super) id: c_int,
}

/// `CUmemcpyAttributes` (CUDA 12.8).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct MemcpyAttributes {
    pub(super) src_access_order: c_int,
    pub(super) src_loc_hint: MemLocation,
    pub(super) dst_loc_hint: MemLocation,
    pub(super) flags: c_uint,
}

/// `CU_MEMCPY_SRC_ACCESS_ORDER_STREAM`: the sources are read in stream order, as a
/// `cuMemcpyDtoDAsync` reads them.
pub(super) const SRC_ACCESS_ORDER_STREAM: c_int = 1;
/// `CU_MEM_LOCATION_TYPE_DEVICE`.
pub(super) const LOCATION_DEVICE: c_int = 1;

/// `cuMemcpyBatchAsync` as of CUDA 12.8: `(dsts, srcs, sizes, count, attrs, attrsIdxs,
/// numAttrs, failIdx, hStream)`.
pub(super) type BatchFn = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut MemcpyAttributes,
    *mut usize,
    usize,
    *mut usize,
    sys::CUstream,
) -> sys::CUresult;

/// The first driver version with `cuMemcpyBatchAsync`, and the version asked for.
const BATCH_VERSION: c_int = 12080;

/// The driver's `cuMemcpyBatchAsync` with the CUDA 12.8 signature, when it has one (looked
/// up once, after [`super::init`]).
pub(super) fn batch_fn() -> Option<BatchFn> {
    static F: OnceLock<Option<BatchFn>> = OnceLock::new();
    *F.get_or_init(|| {
        let v = super::driver_version().ok()?;
        if v < BATCH_VERSION {
            return None;
        }
        let mut p: *mut c_void = std::ptr::null_mut();
        let mut status = sys::CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SUCCESS;
        // SAFETY: the symbol name is a NUL-terminated static string; the driver writes one
        // pointer and one status into our locals. `cuGetProcAddress_v2` exists in every
        // driver since CUDA 12.0, and this one is at least 12.8 (checked above).
        let r = unsafe {
            sys::cuGetProcAddress_v2(
                c"cuMemcpyBatchAsync".as_ptr(),
                &mut p,
                BATCH_VERSION,
                sys::CUdriverProcAddress_flags::CU_GET_PROC_ADDRESS_DEFAULT as u64,
                &mut status,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS
            || status != sys::CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SUCCESS
            || p.is_null()
        {
            tracing::debug!(?r, ?status, "cuMemcpyBatchAsync not available");
            return None;
        }
        // SAFETY: the driver returned the entry point of `cuMemcpyBatchAsync` as of CUDA
        // 12.8 (the version requested), whose C signature is `BatchFn`: the pointer types
        // are the same size and ABI (`CUdeviceptr` is a 64-bit integer, `size_t` is
        // `usize`, the attributes are laid out as the 12.8 header declares them, and
        // `CUstream` is a pointer).
        Some(unsafe { std::mem::transmute::<*mut c_void, BatchFn>(p) })
    })
}

/// Whether this machine's driver queues many device-to-device copies in one call
/// (`cuMemcpyBatchAsync`, CUDA 12.8+); the device snapshot uses it when it does. `false`
/// without a driver.
pub fn batch_copies_supported() -> bool {
    super::init().is_ok() && batch_fn().is_some()
}
