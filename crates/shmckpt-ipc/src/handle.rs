//! What the trainer gets back: staging and durable reports, and the save handle.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cuda::IpcMemHandle;
use crate::error::{Error, Result};
use shmckpt::Dtype;

use super::conn::Inner;
use super::wire::{WireAlloc, WireError, WireReport, dur, from_wire, hex, lock};

/// What is known when [`IpcWriterClient::save`](crate::IpcWriterClient::save) returns.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct IpcStaged {
    /// Step.
    pub step: u64,
    /// File bytes staged by the writer.
    pub bytes: u64,
    /// The trainer's stall: from the `save` call until it returned.
    pub stall: Duration,
    /// Part of it spent synchronizing the trainer's devices.
    pub sync: Duration,
    /// Part of it spent exporting handles (`cuMemGetAddressRange` + `cuIpcGetMemHandle`).
    pub export: Duration,
    /// Allocations exported (one handle each).
    pub allocations: usize,
    /// Writer: time in `cuIpcOpenMemHandle` for the handles it had not cached.
    pub open: Duration,
    /// Writer: handles opened by this save.
    pub opened: usize,
    /// Writer: handles reused from its cache.
    pub reused: usize,
    /// Writer: resolving devices and creating contexts (first use of a device).
    pub setup: Duration,
    /// Writer: time in its engine's `save` (device-to-host copies into its staging).
    pub writer_staging: Duration,
    /// Trainer: from sending the request to receiving the reply (the writer's work plus
    /// encoding, transfer and decoding of both messages).
    pub request: Duration,
    /// Writer: from the request's bytes received to the reply sent (decoding, opening,
    /// staging). `request - writer_handle` is the messaging cost.
    pub writer_handle: Duration,
    /// Part of `writer_staging` spent waiting for staging space.
    pub backpressure: Duration,
    /// Part of `writer_staging` spent registering the writer's arena with CUDA.
    pub registration: Duration,
}

/// A committed IPC save.
#[derive(Debug, Clone, PartialEq)]
pub struct IpcSaveReport {
    /// Step.
    pub step: u64,
    /// Committed directory (`None` while other ranks are still writing).
    pub dir: Option<PathBuf>,
    /// This rank's file.
    pub file: PathBuf,
    /// File bytes.
    pub bytes: u64,
    /// Tensors saved.
    pub tensors: usize,
    /// Backend the writer used.
    pub backend: shmckpt::Backend,
    /// Whether the file was written with O_DIRECT.
    pub direct_io: bool,
    /// Steps deleted by retention after this commit.
    pub retired: Vec<u64>,
    /// The writer engine's timings, from its `save` call.
    pub writer: WriterTimings,
    /// Time to durable on the trainer's clock, from its `save` call: the trainer's time
    /// before the writer's engine started (stall minus the writer's staging) plus the
    /// writer's time to durable.
    pub durable: Duration,
    /// Time to committed, on the same clock; `None` when the save committed nothing
    /// (`dir` is `None`).
    pub committed: Option<Duration>,
    /// The staging facts.
    pub staged: IpcStaged,
}

/// The writer engine's timings of a save (its [`SaveTimings`](shmckpt::SaveTimings), on
/// the writer's clock).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WriterTimings {
    /// Time the writer's `save` took to stage (its device-to-host copies).
    pub staging: Duration,
    /// Part of `staging` spent waiting for staging space.
    pub backpressure: Duration,
    /// Time to durable.
    pub durable: Duration,
    /// Time to committed (`None` when the save committed nothing).
    pub committed: Option<Duration>,
}

/// What [`IpcWriterClient::prepare`](crate::IpcWriterClient::prepare) did.
#[derive(Debug, Clone, PartialEq)]
pub struct IpcPrepared {
    /// Device ordinals in the writer.
    pub devices: Vec<i32>,
    /// Time the writer took to register its staging arena, when this call registered it.
    pub registration: Option<Duration>,
    /// Round trip of the request (context creation included).
    pub took: Duration,
}

/// What [`IpcWriterClient::release`](crate::IpcWriterClient::release) did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IpcReleased {
    /// Mappings closed.
    pub closed: usize,
    /// Bytes of trainer allocations they kept alive.
    pub bytes: u64,
    /// Time the writer spent closing them.
    pub writer_took: Duration,
    /// Round trip of the request as the trainer saw it.
    pub took: Duration,
}

/// A tensor already exported by the caller, for [`IpcWriterClient::save_exported`](crate::IpcWriterClient::save_exported).
#[derive(Debug, Clone)]
pub struct IpcTensor {
    /// Name.
    pub name: String,
    /// Dtype.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Bytes.
    pub len: u64,
    /// Index into the allocations; `None` for a zero-length tensor.
    pub alloc: Option<usize>,
    /// Offset of the first byte inside the allocation.
    pub offset: u64,
}

/// An allocation already exported by the caller, for [`IpcWriterClient::save_exported`](crate::IpcWriterClient::save_exported).
#[derive(Debug, Clone)]
pub struct IpcAllocation {
    /// Device ordinal in the caller's process.
    pub ordinal: i32,
    /// Device UUID ([`cuda::device_uuid`](crate::cuda::device_uuid)).
    pub uuid: [u8; 16],
    /// The handle ([`cuda::ipc_export`](crate::cuda::ipc_export) of the allocation base).
    pub handle: IpcMemHandle,
    /// Allocation size.
    pub size: u64,
}

impl IpcAllocation {
    pub(super) fn wire(&self) -> WireAlloc {
        WireAlloc {
            ordinal: self.ordinal,
            uuid: hex(&self.uuid),
            handle: hex(&self.handle.0),
            size: self.size,
        }
    }
}

/// An IPC save in flight. Dropping it does not cancel the save.
pub struct IpcSaveHandle {
    pub(super) inner: Arc<Inner>,
    pub(super) id: u64,
    pub(super) staged: Box<IpcStaged>,
    pub(super) taken: bool,
}

impl std::fmt::Debug for IpcSaveHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcSaveHandle")
            .field("step", &self.staged.step)
            .field("id", &self.id)
            .finish()
    }
}

impl IpcSaveHandle {
    /// The step.
    pub fn step(&self) -> u64 {
        self.staged.step
    }

    /// Staging facts (the trainer's stall and its parts).
    pub fn staged(&self) -> IpcStaged {
        *self.staged
    }

    /// True once the writer reported the save committed or failed.
    pub fn is_done(&self) -> bool {
        let st = lock(&self.inner.state);
        st.durable.contains_key(&self.id) || st.closed.is_some()
    }

    /// Block until the writer reports the checkpoint committed (or failed).
    pub fn wait(self) -> Result<IpcSaveReport> {
        match self.wait_until(None) {
            Ok(r) => r,
            Err(_) => unreachable!("no deadline"),
        }
    }

    /// Like [`IpcSaveHandle::wait`], giving up after `timeout` (returns the handle back).
    pub fn wait_timeout(
        self,
        timeout: Duration,
    ) -> std::result::Result<Result<IpcSaveReport>, IpcSaveHandle> {
        self.wait_until(Some(Instant::now() + timeout))
    }

    pub(super) fn wait_until(
        mut self,
        deadline: Option<Instant>,
    ) -> std::result::Result<Result<IpcSaveReport>, IpcSaveHandle> {
        let inner = Arc::clone(&self.inner);
        let mut st = lock(&inner.state);
        loop {
            if let Some(r) = st.durable.remove(&self.id) {
                drop(st);
                self.taken = true;
                return Ok(self.finish(r));
            }
            if let Some(why) = &st.closed {
                let e = Error::Ipc(format!(
                    "writer (pid {}) is gone before step {} was committed: {why}",
                    inner.pid, self.staged.step
                ));
                drop(st);
                self.taken = true;
                return Ok(Err(e));
            }
            st = match deadline {
                None => inner.changed.wait(st).unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        drop(st);
                        return Err(self);
                    }
                    inner
                        .changed
                        .wait_timeout(st, d - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
        }
    }

    pub(super) fn finish(
        &self,
        r: std::result::Result<WireReport, WireError>,
    ) -> Result<IpcSaveReport> {
        let w = r.map_err(|e| from_wire(e, self.inner.pid))?;
        let s = *self.staged;
        // The trainer's time before the writer's engine started, on the writer's clock.
        let lead = s.stall.saturating_sub(s.writer_staging);
        Ok(IpcSaveReport {
            step: w.step,
            dir: w.dir,
            file: w.file,
            bytes: w.bytes,
            tensors: w.tensors,
            backend: w.backend,
            direct_io: w.direct_io,
            retired: w.retired,
            writer: WriterTimings {
                staging: dur(w.staging_s),
                backpressure: dur(w.backpressure_s),
                durable: dur(w.durable_s),
                committed: w.committed_s.map(dur),
            },
            durable: lead + dur(w.durable_s),
            committed: w.committed_s.map(|c| lead + dur(c)),
            staged: s,
        })
    }
}

impl Drop for IpcSaveHandle {
    fn drop(&mut self) {
        if self.taken {
            return;
        }
        let mut st = lock(&self.inner.state);
        if st.durable.remove(&self.id).is_none() && st.closed.is_none() {
            st.abandoned.insert(self.id);
        }
    }
}
