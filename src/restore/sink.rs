//! Where restored bytes go when they pass through staging chunks: caller host buffers
//! ([`HostSink`]) or device memory ([`DeviceSink`], the one place that joins `device` and
//! `restore`).
#![allow(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::ReadSink;
use crate::device::cuda::CtxGuard;
use crate::device::pipeline::{CudaStaging, DeviceState};
use crate::error::{Error, Result};
use crate::tensor::DeviceSlice;

/// Copies each piece into the caller's buffer of its tensor (file order).
pub(crate) struct HostSink<'a> {
    pub(crate) dest: Vec<&'a mut [u8]>,
}

impl ReadSink for HostSink<'_> {
    fn piece(&mut self, tensor: usize, at: u64, bytes: &[u8]) -> Result<()> {
        let at = at as usize;
        self.dest[tensor][at..at + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }
}

/// A [`ReadSink`] that copies restored bytes to device memory (`cuMemcpyHtoDAsync` from
/// the staging chunk, synchronized before the chunk is reused).
pub(crate) struct DeviceSink {
    dest: Vec<Option<DeviceSlice<'static>>>,
    streams: BTreeMap<i32, Arc<DeviceState>>,
    used: BTreeSet<i32>,
    _guard: Option<CtxGuard>,
}

impl DeviceSink {
    /// Copy tensor `i` (file order) to `dest[i]` (a piece of a tensor without a
    /// destination is an error).
    ///
    /// # Safety
    /// Every destination must be device memory of its device, valid for writes of its
    /// length, and not used by anyone else until the load returns.
    pub(crate) unsafe fn new(
        cuda: &CudaStaging,
        dest: Vec<Option<DeviceSlice<'_>>>,
    ) -> Result<DeviceSink> {
        let dest: Vec<Option<DeviceSlice<'static>>> = dest
            .iter()
            .map(|d| {
                // SAFETY: the same ranges; this function's contract keeps them valid until
                // the load returns, and the sink does not outlive the load.
                d.map(|d| unsafe { DeviceSlice::new(d.ptr(), d.len(), d.device()) })
            })
            .collect();
        let devices: BTreeSet<i32> = dest.iter().flatten().map(|d| d.device()).collect();
        // No device destination (host buffers only): never touch the driver.
        let guard = if devices.is_empty() {
            None
        } else {
            Some(CtxGuard::save()?)
        };
        cuda.prepare(&devices)?;
        let streams = devices
            .iter()
            .map(|&d| Ok((d, cuda.device(d)?)))
            .collect::<Result<_>>()?;
        Ok(DeviceSink {
            dest,
            streams,
            used: BTreeSet::new(),
            _guard: guard,
        })
    }
}

impl ReadSink for DeviceSink {
    fn piece(&mut self, tensor: usize, at: u64, bytes: &[u8]) -> Result<()> {
        let Some(d) = self.dest.get(tensor).copied().flatten() else {
            return Err(Error::Destination {
                name: format!("#{tensor}"),
                reason: "no device destination".into(),
            });
        };
        if at + bytes.len() as u64 > d.len() as u64 {
            return Err(Error::Destination {
                name: format!("#{tensor}"),
                reason: "device buffer too small".into(),
            });
        }
        let st = &self.streams[&d.device()];
        self.used.insert(d.device());
        st.ctx.bind()?;
        // SAFETY: the destination range lies in the caller's buffer (`DeviceSink::new`'s
        // contract, length checked above); `bytes` stays valid until `chunk_end`, which
        // synchronizes the stream before the staging chunk is reused.
        unsafe {
            st.stream
                .copy_htod(d.ptr() + at, bytes.as_ptr(), bytes.len())
        }
    }

    fn chunk_end(&mut self) -> Result<()> {
        for d in std::mem::take(&mut self.used) {
            self.streams[&d].stream.synchronize()?;
        }
        Ok(())
    }
}
