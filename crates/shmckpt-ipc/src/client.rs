//! The trainer side: [`IpcWriterClient`] and its reader thread.

use std::collections::{BTreeMap, HashMap};
use std::os::unix::net::UnixStream;
use std::process::{Child, ExitStatus};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::cuda::{self, CtxGuard};
use crate::error::{Error, Result};
use shmckpt::Metadata;
use shmckpt::cuda::Context;
use shmckpt::{Source, Tensor};

use super::config::IpcConfig;
use super::conn::Inner;
use super::handle::{IpcAllocation, IpcPrepared, IpcReleased, IpcSaveHandle, IpcStaged, IpcTensor};
use super::wire::{
    Reply, Request, WireAlloc, WireTensor, WriterStats, dur, hex, lock, process_memory,
};

impl IpcConfig {
    /// Spawn the writer and connect to it.
    pub fn spawn(self) -> Result<IpcWriterClient> {
        IpcWriterClient::spawn(self)
    }
}

/// The trainer's side of the IPC baseline: owns the writer process (see the
/// [module documentation](crate)). `Send + Sync`; requests are serialized.
pub struct IpcWriterClient {
    pub(super) inner: Arc<Inner>,
    pub(super) cfg: IpcConfig,
    pub(super) child: Mutex<Option<Child>>,
    pub(super) keeper: Option<(mpsc::Sender<()>, JoinHandle<()>)>,
    pub(super) reader: Option<JoinHandle<()>>,
    pub(super) stream: UnixStream,
    pub(super) shm_name: String,
    pub(super) staging_bytes: u64,
    pub(super) backend: shmckpt::Backend,
    pub(super) contexts: Mutex<BTreeMap<i32, DeviceCtx>>,
}

impl std::fmt::Debug for IpcWriterClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcWriterClient")
            .field("pid", &self.inner.pid)
            .field("root", &self.cfg.root())
            .field("cache", &self.cfg.cache)
            .finish()
    }
}

/// A device's primary context in the trainer and its UUID.
pub(super) type DeviceCtx = (Arc<Context>, [u8; 16]);

impl IpcWriterClient {
    /// The writer's pid.
    pub fn pid(&self) -> u32 {
        self.inner.pid
    }

    /// The writer's staging segment in `/dev/shm`.
    pub fn shm_name(&self) -> &str {
        &self.shm_name
    }

    /// Bytes of the writer's staging arena.
    pub fn staging_bytes(&self) -> u64 {
        self.staging_bytes
    }

    /// The writer's write backend (`io_uring` or `pwrite`).
    pub fn backend(&self) -> shmckpt::Backend {
        self.backend
    }

    /// The settings.
    pub fn config(&self) -> &IpcConfig {
        &self.cfg
    }

    /// Peak resident set size (`VmHWM`) of the writer process, read from `/proc` (0 once
    /// it exited).
    pub fn writer_peak_rss(&self) -> u64 {
        process_memory(self.inner.pid).0
    }

    /// The writer's statistics (memory, cached mappings, open/close times).
    pub fn stats(&self) -> Result<WriterStats> {
        match self.inner.call(|id| Request::Stats { id }, None)? {
            Reply::Stats { stats, .. } => Ok(stats),
            other => Err(self.unexpected(&other)),
        }
    }

    pub(super) fn unexpected(&self, r: &Reply) -> Error {
        Error::Ipc(format!(
            "writer (pid {}) sent an unexpected {r:?}",
            self.inner.pid
        ))
    }

    pub(super) fn context(&self, device: i32) -> Result<DeviceCtx> {
        let mut m = lock(&self.contexts);
        if let Some(c) = m.get(&device) {
            return Ok(c.clone());
        }
        let ctx = Context::new(device)?;
        let uuid = cuda::device_uuid(device)?;
        m.insert(device, (Arc::clone(&ctx), uuid));
        Ok((ctx, uuid))
    }

    /// Set up the writer for `devices` now (its CUDA context on each, and the
    /// registration of its staging arena) instead of at the first save.
    pub fn prepare(&self, devices: &[i32]) -> Result<IpcPrepared> {
        let t = Instant::now();
        let mut allocs = Vec::new();
        for &d in devices {
            let (_, uuid) = self.context(d)?;
            allocs.push(WireAlloc {
                ordinal: d,
                uuid: hex(&uuid),
                handle: String::new(),
                size: 0,
            });
        }
        match self
            .inner
            .call(|id| Request::Prepare { id, allocs }, None)?
        {
            Reply::Prepared {
                devices,
                registration_s,
                ..
            } => Ok(IpcPrepared {
                devices,
                registration: registration_s.map(dur),
                took: t.elapsed(),
            }),
            other => Err(self.unexpected(&other)),
        }
    }

    /// Save `tensors` (device memory of this process) as checkpoint `step` through the
    /// writer, with the configured cache setting. Returns when the writer has copied every
    /// byte to its host staging: the caller may then overwrite or free its tensors.
    ///
    /// Synchronizes every device the tensors are on first (see the module's *Ordering*).
    /// Host tensors are refused unless empty: the IPC design moves device memory only.
    pub fn save(
        &self,
        step: u64,
        tensors: &[Tensor<'_>],
        metadata: &Metadata,
    ) -> Result<IpcSaveHandle> {
        self.save_with_cache(step, tensors, metadata, self.cfg.cache)
    }

    /// [`IpcWriterClient::save`] with the handle cache on or off for this save. Turning it
    /// off closes every cached mapping before the save opens its own.
    pub fn save_with_cache(
        &self,
        step: u64,
        tensors: &[Tensor<'_>],
        metadata: &Metadata,
        cache: bool,
    ) -> Result<IpcSaveHandle> {
        let started = Instant::now();
        for t in tensors {
            if let Source::Host(b) = t.source
                && !b.is_empty()
            {
                return Err(Error::config(format!(
                    "tensor {:?} is in host memory: IPC mode saves device tensors only",
                    t.name
                )));
            }
        }
        let devices: std::collections::BTreeSet<i32> = tensors
            .iter()
            .filter_map(|t| match t.source {
                Source::Cuda(d) if !d.is_empty() => Some(d.device()),
                _ => None,
            })
            .collect();
        let mut sync = Duration::ZERO;
        let mut export = Duration::ZERO;
        let mut allocs: Vec<IpcAllocation> = Vec::new();
        let mut wire: Vec<IpcTensor> = Vec::with_capacity(tensors.len());
        if !devices.is_empty() {
            cuda::init()?;
            // Leave the caller's current context as it was.
            let _guard = CtxGuard::save()?;
            let mut ctxs = BTreeMap::new();
            for &d in &devices {
                ctxs.insert(d, self.context(d)?);
            }
            // Ordering: every write the trainer queued must be complete before the writer
            // (another process, another context) copies.
            let t = Instant::now();
            for (ctx, _) in ctxs.values() {
                ctx.synchronize()?;
            }
            sync = t.elapsed();
            let t = Instant::now();
            let mut by_base: HashMap<(i32, u64), usize> = HashMap::new();
            for tensor in tensors {
                let (alloc, offset, len) = match tensor.source {
                    Source::Cuda(d) if !d.is_empty() => {
                        let (ctx, uuid) = &ctxs[&d.device()];
                        let (base, size) = cuda::allocation_range(ctx, d.ptr())?;
                        let offset = d.ptr().saturating_sub(base);
                        if offset + d.len() as u64 > size as u64 {
                            return Err(Error::config(format!(
                                "tensor {:?} ({} bytes at {:#x}) extends past the end of its \
                                 allocation ({size} bytes at {base:#x})",
                                tensor.name,
                                d.len(),
                                d.ptr()
                            )));
                        }
                        let idx = match by_base.get(&(d.device(), base)) {
                            Some(&i) => i,
                            None => {
                                let handle = cuda::ipc_export(ctx, base)?;
                                allocs.push(IpcAllocation {
                                    ordinal: d.device(),
                                    uuid: *uuid,
                                    handle,
                                    size: size as u64,
                                });
                                by_base.insert((d.device(), base), allocs.len() - 1);
                                allocs.len() - 1
                            }
                        };
                        (Some(idx), offset, d.len() as u64)
                    }
                    _ => (None, 0, 0),
                };
                wire.push(IpcTensor {
                    name: tensor.name.to_string(),
                    dtype: tensor.dtype,
                    shape: tensor.shape.clone(),
                    len,
                    alloc,
                    offset,
                });
            }
            export = t.elapsed();
        } else {
            wire.extend(tensors.iter().map(|t| IpcTensor {
                name: t.name.to_string(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                len: 0,
                alloc: None,
                offset: 0,
            }));
        }
        let mut h = self.send_save(step, &allocs, &wire, metadata, cache, started)?;
        h.staged.sync = sync;
        h.staged.export = export;
        Ok(h)
    }

    /// Save tensors whose allocations the caller exported itself (for example a PyTorch
    /// trainer's `storage._share_cuda_()` handles). The caller must have completed every
    /// write to them (synchronized) before calling, and must not write them until this
    /// returns.
    pub fn save_exported(
        &self,
        step: u64,
        allocations: &[IpcAllocation],
        tensors: &[IpcTensor],
        metadata: &Metadata,
    ) -> Result<IpcSaveHandle> {
        self.send_save(
            step,
            allocations,
            tensors,
            metadata,
            self.cfg.cache,
            Instant::now(),
        )
    }

    pub(super) fn send_save(
        &self,
        step: u64,
        allocations: &[IpcAllocation],
        tensors: &[IpcTensor],
        metadata: &Metadata,
        cache: bool,
        started: Instant,
    ) -> Result<IpcSaveHandle> {
        let allocs: Vec<WireAlloc> = allocations.iter().map(IpcAllocation::wire).collect();
        let tensors: Vec<WireTensor> = tensors
            .iter()
            .map(|t| WireTensor {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                len: t.len,
                alloc: t.alloc,
                offset: t.offset,
            })
            .collect();
        let t_request = Instant::now();
        let reply = self.inner.call(
            |id| Request::Save {
                id,
                step,
                cache,
                allocs,
                tensors,
                metadata: metadata.clone(),
            },
            None,
        )?;
        match reply {
            Reply::Staged {
                id,
                step,
                bytes,
                writer_staging_s,
                backpressure_s,
                registration_s,
                setup_s,
                open_s,
                opened,
                reused,
                handle_s,
            } => Ok(IpcSaveHandle {
                inner: Arc::clone(&self.inner),
                id,
                staged: Box::new(IpcStaged {
                    step,
                    bytes,
                    stall: started.elapsed(),
                    sync: Duration::ZERO,
                    export: Duration::ZERO,
                    allocations: allocations.len(),
                    open: dur(open_s),
                    opened,
                    reused,
                    setup: dur(setup_s),
                    writer_staging: dur(writer_staging_s),
                    request: t_request.elapsed(),
                    writer_handle: dur(handle_s),
                    backpressure: dur(backpressure_s),
                    registration: dur(registration_s),
                }),
                taken: false,
            }),
            other => Err(self.unexpected(&other)),
        }
    }

    /// Make the writer close every cached mapping (the IPC equivalent of finalizing the
    /// async queue and emptying the cache): the trainer's freed allocations come back.
    pub fn release(&self) -> Result<IpcReleased> {
        let t = Instant::now();
        match self.inner.call(|id| Request::Release { id }, None)? {
            Reply::Released {
                closed,
                bytes,
                took_s,
                ..
            } => Ok(IpcReleased {
                closed,
                bytes,
                writer_took: dur(took_s),
                took: t.elapsed(),
            }),
            other => Err(self.unexpected(&other)),
        }
    }

    /// Finish the saves in flight, stop the writer and reap it. An error says the writer
    /// did not stop on request and was killed, or exited with a failure. Dropping the
    /// client does the same and logs instead.
    pub fn shutdown(mut self) -> Result<()> {
        self.stop()
    }

    pub(super) fn stop(&mut self) -> Result<()> {
        let Some(mut child) = lock(&self.child).take() else {
            return Ok(());
        };
        let pid = self.inner.pid;
        let deadline = Instant::now() + self.cfg.shutdown_timeout;
        let asked = self
            .inner
            .call(|id| Request::Shutdown { id }, Some(deadline));
        let mut result = match &asked {
            Ok(Reply::Bye { .. }) => Ok(()),
            Ok(other) => Err(self.unexpected(other)),
            Err(e) => Err(Error::Ipc(format!(
                "writer (pid {pid}) did not shut down: {e}"
            ))),
        };
        // Wait for the exit, then kill.
        let status: Option<ExitStatus> = loop {
            match child.try_wait() {
                Ok(Some(s)) => break Some(s),
                Ok(None) if Instant::now() < deadline && asked.is_ok() => {
                    std::thread::sleep(Duration::from_millis(2))
                }
                Ok(None) => {
                    tracing::warn!(pid, "IPC writer did not exit; killing it");
                    let _ = child.kill();
                    break child.wait().ok();
                }
                Err(e) => {
                    tracing::warn!(pid, error = %e, "cannot wait for the IPC writer");
                    let _ = child.kill();
                    break child.wait().ok();
                }
            }
        };
        if let (Ok(()), Some(s)) = (&result, status)
            && !s.success()
        {
            result = Err(Error::Ipc(format!("writer (pid {pid}) exited with {s}")));
        }
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        if let Some((tx, h)) = self.keeper.take() {
            drop(tx);
            let _ = h.join();
        }
        result
    }
}

impl Drop for IpcWriterClient {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            tracing::warn!(error = %e, "IPC writer shutdown");
        }
    }
}
