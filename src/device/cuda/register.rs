//! Registering the staging arena with the driver (page-locking it for DMA).
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys;

use super::{Context, check};
use crate::error::Result;
use crate::staging::Arena;

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
        check(
            // SAFETY: the region is a live, page-aligned mapping owned by `arena`, which this
            // registration keeps alive until it unregisters in Drop.
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
