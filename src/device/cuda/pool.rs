//! Stream-ordered device memory from a pool of the engine's own: the transient buffer of
//! the opt-in device snapshot.
//!
//! `cuMemFree` synchronizes the whole device (and the buffer's drop synchronized the
//! context before it), so a save's staging waited for every kernel the trainer queued
//! after its snapshot; `cuMemFreeAsync` queues the free on the stream that used the memory,
//! behind its last copy, and waits for nothing else. The pool is the engine's (`cuMemPoolCreate`, not the device's default
//! pool that a CUDA runtime may use), with a release threshold of zero, and is trimmed to
//! zero after each use: the memory goes back to the driver, not to a cache.
#![allow(unsafe_code)]

use std::sync::Arc;

use cudarc::driver::sys;

use super::{Context, Stream, check};
use crate::error::Result;

/// A device memory pool of the engine's own, on one device.
#[derive(Debug)]
pub(crate) struct MemPool {
    raw: sys::CUmemoryPool,
    ctx: Arc<Context>,
}

// SAFETY: a memory pool handle may be used from any thread (the driver's pool calls are
// thread-safe); the handle itself is immutable.
unsafe impl Send for MemPool {}
// SAFETY: as above.
unsafe impl Sync for MemPool {}

impl MemPool {
    /// A new pool of device memory on `ctx`'s device (release threshold zero: memory goes
    /// back to the driver at the next synchronization after it is freed).
    pub(crate) fn new(ctx: &Arc<Context>) -> Result<Arc<MemPool>> {
        ctx.bind()?;
        let props = sys::CUmemPoolProps {
            allocType: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            handleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: ctx.ordinal(),
            },
            win32SecurityAttributes: std::ptr::null_mut(),
            reserved: [0; 64],
        };
        let mut raw = std::ptr::null_mut();
        check(
            // SAFETY: `props` is a fully initialized properties struct that outlives the call;
            // the driver writes one pool handle, destroyed in Drop.
            unsafe { sys::cuMemPoolCreate(&mut raw, &props) },
            "cuMemPoolCreate",
        )?;
        Ok(Arc::new(MemPool {
            raw,
            ctx: Arc::clone(ctx),
        }))
    }

    /// Allocate `len` bytes (contents undefined), ordered on `stream`: work queued on
    /// `stream` after this call may use the memory. `stream` must be of this pool's device.
    pub(crate) fn alloc(
        self: &Arc<Self>,
        stream: &Arc<Stream>,
        len: usize,
    ) -> Result<StreamBuffer> {
        if stream.context().ordinal() != self.ctx.ordinal() {
            return Err(crate::error::Error::cuda(
                "cuMemAllocFromPoolAsync",
                format!(
                    "stream of device {} for a pool of device {}",
                    stream.context().ordinal(),
                    self.ctx.ordinal()
                ),
            ));
        }
        self.ctx.bind()?;
        let mut ptr = 0;
        if len > 0 {
            check(
                // SAFETY: writes one device pointer; the pool and the stream are live and of
                // the same device (checked above); freed in `StreamBuffer`'s Drop, on the same
                // stream.
                unsafe {
                    sys::cuMemAllocFromPoolAsync(
                        &mut ptr,
                        len,
                        self.raw,
                        stream.raw() as sys::CUstream,
                    )
                },
                "cuMemAllocFromPoolAsync",
            )?;
        }
        Ok(StreamBuffer {
            ptr,
            len,
            stream: Arc::clone(stream),
            _pool: Arc::clone(self),
        })
    }

    /// Give every byte the pool holds that no allocation uses back to the driver. Memory
    /// whose stream-ordered free has not run yet stays: synchronize its stream first.
    pub(crate) fn trim(&self) -> Result<()> {
        self.ctx.bind()?;
        check(
            // SAFETY: live pool; no pointer arguments.
            unsafe { sys::cuMemPoolTrimTo(self.raw, 0) },
            "cuMemPoolTrimTo",
        )
    }

    /// Bytes of device memory the pool holds now (used or cached).
    pub(crate) fn reserved(&self) -> Result<u64> {
        self.ctx.bind()?;
        let mut v: u64 = 0;
        check(
            // SAFETY: this attribute is a `cuuint64_t`, written into `v`, which outlives the
            // call.
            unsafe {
                sys::cuMemPoolGetAttribute(
                    self.raw,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
                    (&mut v as *mut u64).cast(),
                )
            },
            "cuMemPoolGetAttribute",
        )?;
        Ok(v)
    }
}

impl Drop for MemPool {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: destroys the pool made in `new`, once. Every `StreamBuffer` holds an
        // `Arc` of its pool, so none is alive here; a free still queued on a stream makes
        // the driver release the pool's resources after it runs (documented behaviour of
        // `cuMemPoolDestroy`).
        let _ = unsafe { sys::cuMemPoolDestroy(self.raw) };
    }
}

/// Device memory from a [`MemPool`], allocated and freed in the order of one stream.
///
/// Dropping it queues its free on that stream: work queued there before the drop that
/// reads or writes the memory completes first, without any wait on the host. Work on the
/// memory must therefore be queued on the stream it was allocated on only.
#[derive(Debug)]
pub(crate) struct StreamBuffer {
    ptr: u64,
    len: usize,
    stream: Arc<Stream>,
    _pool: Arc<MemPool>,
}

impl StreamBuffer {
    /// The device pointer.
    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for StreamBuffer {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        let _ = self.stream.context().bind();
        // SAFETY: frees exactly the allocation made in `MemPool::alloc`, once, on the stream
        // it was allocated on. Every use of the memory is queued on that stream (the type's
        // contract; the snapshot's copies into and out of it are), so the free runs after
        // all of them in stream order; no borrow of `self` outlives this drop.
        let _ = unsafe { sys::cuMemFreeAsync(self.ptr, self.stream.raw() as sys::CUstream) };
    }
}
