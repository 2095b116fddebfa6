//! The tensors' bytes captured for staging: host slices and device ranges as raw
//! pointers, so staging can run on another thread.
#![allow(unsafe_code)]

use std::collections::BTreeSet;
use std::marker::PhantomData;

use crate::tensor::{DeviceSlice, Source, Tensor};

/// Where one tensor's bytes are (a raw form of [`Source`], so staging can run on another
/// thread).
#[derive(Debug, Clone, Copy)]
enum SrcPtr {
    Host { ptr: *const u8, len: usize },
    Cuda(DeviceSlice<'static>),
}

/// The sources of one save; host bytes borrowed for `'a`.
#[derive(Debug)]
pub struct Sources<'a> {
    v: Vec<SrcPtr>,
    _borrow: PhantomData<&'a [u8]>,
}

// SAFETY: the pointers are only read; host bytes are shared borrows for `'a` (or, after
// `into_static`, valid by that function's contract), and device ranges are valid by
// `DeviceSlice::new`'s contract, on whatever thread staging runs.
unsafe impl Send for Sources<'_> {}
// SAFETY: as above (read-only).
unsafe impl Sync for Sources<'_> {}

impl<'a> Sources<'a> {
    /// Capture the sources of `tensors`.
    pub fn new(tensors: &[Tensor<'a>]) -> Sources<'a> {
        let v = tensors
            .iter()
            .map(|t| match t.source {
                Source::Host(b) => SrcPtr::Host {
                    ptr: b.as_ptr(),
                    len: b.len(),
                },
                Source::Cuda(d) => {
                    // SAFETY: the same range as `d`; `Sources<'a>` keeps the borrow for `'a`
                    // (or `into_static`'s contract keeps it valid), like `d` did.
                    SrcPtr::Cuda(unsafe { DeviceSlice::new(d.ptr(), d.len(), d.device()) })
                }
            })
            .collect();
        Sources {
            v,
            _borrow: PhantomData,
        }
    }

    /// Forget the borrow, so staging can outlive the caller's stack frame.
    ///
    /// # Safety
    /// Every host slice must stay valid and unmodified, and every device range valid,
    /// until staging of the save has finished (the handle reports it staged).
    pub unsafe fn into_static(self) -> Sources<'static> {
        Sources {
            v: self.v,
            _borrow: PhantomData,
        }
    }

    /// Devices the save reads from.
    pub fn devices(&self) -> BTreeSet<i32> {
        self.v
            .iter()
            .filter_map(|s| match s {
                SrcPtr::Cuda(d) if !d.is_empty() => Some(d.device()),
                _ => None,
            })
            .collect()
    }

    /// Host bytes of tensor `i` (`None` for device tensors).
    pub fn host(&self, i: usize) -> Option<&[u8]> {
        match self.v[i] {
            // SAFETY: borrowed for `'a` (or valid by `into_static`'s contract) and never
            // written through; the slice cannot outlive `self`.
            SrcPtr::Host { ptr, len } => Some(unsafe { std::slice::from_raw_parts(ptr, len) }),
            SrcPtr::Cuda(_) => None,
        }
    }

    pub(super) fn device(&self, i: usize) -> Option<DeviceSlice<'static>> {
        match self.v[i] {
            SrcPtr::Cuda(d) => Some(d),
            SrcPtr::Host { .. } => None,
        }
    }
}
