//! The writer process: maps the trainer's handles, stages with its own engine.

use std::collections::{BTreeMap, HashMap};
use std::io::{self, BufReader};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::cuda::{self, IpcMapping, IpcMemHandle};
use crate::error::{Error, Result};
use shmckpt::EngineConfig;
use shmckpt::Metadata;
use shmckpt::Tensor;
use shmckpt::cuda::Context;
use shmckpt::{Engine, SaveHandle, SaveReport};

use super::PROTOCOL_VERSION;
use super::wire::{
    Reply, Request, WireAlloc, WireReport, WireTensor, WriterStats, decode, lock, process_memory,
    read_frame_bytes, secs, to_wire, unhex, write_frame,
};

/// How the writer process runs (built by the `ipc-writer` subcommand from
/// [`IpcConfig::writer_args`](crate::IpcConfig::writer_args)).
#[derive(Debug, Clone)]
pub struct WriterOptions {
    /// The trainer's listening socket.
    pub socket: PathBuf,
    /// The trainer's pid: the writer dies with it (`PR_SET_PDEATHSIG`), and exits at once
    /// if it is not its parent any more. `None` skips both (manual runs).
    pub parent_pid: Option<u32>,
    /// The writer's engine.
    pub engine: EngineConfig,
}

pub(super) struct Cached {
    pub(super) mapping: IpcMapping,
    pub(super) size: u64,
    /// Sequence number of the last save that used it.
    pub(super) used: u64,
}

pub(super) struct Writer {
    pub(super) engine: Engine,
    pub(super) contexts: BTreeMap<i32, Arc<Context>>,
    /// Trainer device UUID (hex) → ordinal here.
    pub(super) devices: HashMap<String, i32>,
    pub(super) cache: HashMap<(i32, IpcMemHandle), Cached>,
    pub(super) seq: u64,
    pub(super) stats: WriterStats,
}

impl Writer {
    pub(super) fn device(&mut self, a: &WireAlloc) -> Result<i32> {
        if let Some(&d) = self.devices.get(&a.uuid) {
            return Ok(d);
        }
        let uuid: [u8; 16] = unhex(&a.uuid)
            .ok_or_else(|| Error::Ipc(format!("malformed device UUID {:?}", a.uuid)))?;
        // The trainer's ordinal is right unless the two processes see different devices.
        let d = match cuda::device_uuid(a.ordinal) {
            Ok(u) if u == uuid => a.ordinal,
            _ => cuda::ordinal_of_uuid(&uuid)?,
        };
        if let std::collections::btree_map::Entry::Vacant(e) = self.contexts.entry(d) {
            e.insert(Context::new(d)?);
        }
        self.devices.insert(a.uuid.clone(), d);
        Ok(d)
    }

    pub(super) fn close_where(
        &mut self,
        stale: impl Fn(&Cached) -> bool,
    ) -> (usize, u64, Duration) {
        let t = Instant::now();
        let keys: Vec<_> = self
            .cache
            .iter()
            .filter(|(_, c)| stale(c))
            .map(|(k, _)| *k)
            .collect();
        let mut bytes = 0;
        for k in &keys {
            if let Some(c) = self.cache.remove(k) {
                bytes += c.size;
                drop(c.mapping);
            }
        }
        let took = t.elapsed();
        self.stats.closes += keys.len() as u64;
        self.stats.close_total_s += secs(took);
        (keys.len(), bytes, took)
    }

    pub(super) fn close_all(&mut self) -> (usize, u64, Duration) {
        self.close_where(|_| true)
    }

    pub(super) fn prepare(&mut self, allocs: &[WireAlloc]) -> Result<Reply> {
        cuda::init()?;
        let mut devs = Vec::new();
        for a in allocs {
            devs.push(self.device(a)?);
        }
        devs.sort_unstable();
        devs.dedup();
        let reg = self.engine.prepare_cuda(&devs)?;
        Ok(Reply::Prepared {
            id: 0,
            devices: devs,
            registration_s: reg.map(secs),
        })
    }

    pub(super) fn save(
        &mut self,
        step: u64,
        cache: bool,
        allocs: &[WireAlloc],
        tensors: &[WireTensor],
        metadata: &Metadata,
    ) -> Result<(Reply, SaveHandle)> {
        self.seq += 1;
        let seq = self.seq;
        if !cache && !self.cache.is_empty() {
            // A handle can be open only once per context: start uncached saves clean.
            self.close_all();
        }
        // Devices and contexts (first use only), then the handles.
        let t = Instant::now();
        let mut keys = Vec::with_capacity(allocs.len());
        if !allocs.is_empty() {
            cuda::init()?;
        }
        for a in allocs {
            let d = self.device(a)?;
            let h: [u8; 64] =
                unhex(&a.handle).ok_or_else(|| Error::Ipc("malformed IPC handle".into()))?;
            keys.push((d, IpcMemHandle(h)));
        }
        let setup = t.elapsed();
        let t = Instant::now();
        let (mut opened, mut reused) = (0, 0);
        for (k, a) in keys.iter().zip(allocs) {
            if let Some(c) = self.cache.get_mut(k) {
                if c.used != seq {
                    reused += 1;
                }
                c.used = seq;
                continue;
            }
            let ctx = &self.contexts[&k.0];
            let mapping = IpcMapping::open(ctx, &k.1)?;
            if let Some(s) = mapping.size()
                && (s as u64) < a.size
            {
                return Err(Error::cuda(
                    "cuIpcOpenMemHandle",
                    format!(
                        "IPC mapping is {s} bytes but the trainer's allocation is {} bytes",
                        a.size
                    ),
                ));
            }
            opened += 1;
            self.cache.insert(
                *k,
                Cached {
                    mapping,
                    size: a.size,
                    used: seq,
                },
            );
        }
        let open = t.elapsed();
        self.stats.opens += opened as u64;
        self.stats.open_total_s += secs(open);

        let mut list = Vec::with_capacity(tensors.len());
        for t in tensors {
            let source = match t.alloc {
                None if t.len == 0 => None,
                None => {
                    return Err(Error::Ipc(format!(
                        "tensor {:?} has {} bytes but no allocation",
                        t.name, t.len
                    )));
                }
                Some(i) => {
                    let k = keys.get(i).ok_or_else(|| {
                        Error::Ipc(format!(
                            "tensor {:?} names allocation {i} of {}",
                            t.name,
                            keys.len()
                        ))
                    })?;
                    let c = &self.cache[k];
                    let len = usize::try_from(t.len)
                        .map_err(|_| Error::Ipc(format!("tensor {:?} is too large", t.name)))?;
                    Some(c.mapping.slice(t.offset, len, c.size as usize)?)
                }
            };
            list.push(match source {
                Some(s) => Tensor::cuda(t.name.as_str(), t.dtype, t.shape.clone(), s),
                None => Tensor::host(t.name.as_str(), t.dtype, t.shape.clone(), &[]),
            });
        }
        let h = self.engine.save(step, &list, metadata)?;
        let s = h.staged().ok_or_else(|| {
            Error::from(shmckpt::Error::Internal(
                "save returned before staging".into(),
            ))
        })?;
        Ok((
            Reply::Staged {
                id: 0,
                step,
                bytes: s.bytes,
                writer_staging_s: secs(s.staging),
                backpressure_s: secs(s.backpressure),
                registration_s: secs(s.registration),
                setup_s: secs(setup),
                open_s: secs(open),
                opened,
                reused,
                handle_s: 0.0,
            },
            h,
        ))
    }

    /// After a save was staged (and answered): with the cache off close everything, with
    /// it on close what this save did not use (the trainer's allocations changed).
    pub(super) fn after_save(&mut self, cache: bool) {
        let seq = self.seq;
        let (n, _, took) = if cache {
            self.close_where(|c| c.used != seq)
        } else {
            self.close_all()
        };
        self.stats.last_closed = n;
        self.stats.last_close_s = secs(took);
    }

    pub(super) fn stats(&self) -> WriterStats {
        let mut s = self.stats.clone();
        let (hwm, rss, shm) = process_memory(std::process::id());
        s.vm_hwm_bytes = hwm;
        s.vm_rss_bytes = rss;
        s.rss_shmem_bytes = shm;
        s.cached_mappings = self.cache.len();
        s.cached_bytes = self.cache.values().map(|c| c.size).sum();
        s
    }
}

pub(super) fn with_id(mut r: Reply, new: u64) -> Reply {
    match &mut r {
        Reply::Ready { .. } => {}
        Reply::Prepared { id, .. }
        | Reply::Staged { id, .. }
        | Reply::Durable { id, .. }
        | Reply::DurableFailed { id, .. }
        | Reply::Released { id, .. }
        | Reply::Stats { id, .. }
        | Reply::Failed { id, .. }
        | Reply::Bye { id } => *id = new,
    }
    r
}

pub(super) fn wire_report(r: &SaveReport) -> WireReport {
    WireReport {
        step: r.step,
        dir: r.dir.clone(),
        file: r.file.clone(),
        bytes: r.bytes,
        tensors: r.tensors,
        staging_s: secs(r.timings.staging),
        backpressure_s: secs(r.timings.backpressure),
        durable_s: secs(r.timings.durable),
        committed_s: r.timings.committed.map(secs),
        backend: r.backend,
        direct_io: r.direct_io,
        retired: r.retired.clone(),
    }
}

/// Run the writer process: connect to the trainer, open the engine, serve requests until
/// `shutdown` or until the socket closes. Used by the hidden `ipc-writer` subcommand.
///
/// No CUDA call is made before a request needs one, and every such request first checks
/// the driver ([`cuda::init`](crate::cuda::init)), so a machine without CUDA gets an error reply.
pub fn run_writer(opts: WriterOptions) -> Result<()> {
    // 1. Die with the trainer. The check after prctl closes the race with a trainer that
    //    died before it (we would have been reparented already).
    if let Some(ppid) = opts.parent_pid {
        rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))
            .map_err(|e| Error::Ipc(format!("prctl(PR_SET_PDEATHSIG): {e}")))?;
        let now = rustix::process::Pid::as_raw(rustix::process::getppid());
        if i64::from(now) != i64::from(ppid) {
            return Err(Error::Ipc(format!(
                "the trainer (pid {ppid}) exited before the writer started"
            )));
        }
    }
    // 2. Connect.
    let stream =
        UnixStream::connect(&opts.socket).map_err(|e| Error::io("connect", &opts.socket, e))?;
    let out = Arc::new(Mutex::new(
        stream
            .try_clone()
            .map_err(|e| Error::io("dup", &opts.socket, e))?,
    ));
    let send =
        |out: &Mutex<UnixStream>, r: &Reply| -> io::Result<()> { write_frame(&mut *lock(out), r) };
    // 3. The engine.
    let engine = match Engine::open(opts.engine) {
        Ok(e) => e,
        Err(e) => {
            let e = Error::from(e);
            let _ = send(
                &out,
                &Reply::Failed {
                    id: 0,
                    error: to_wire(&e),
                },
            );
            return Err(e);
        }
    };
    let pid = std::process::id();
    let ready = Reply::Ready {
        version: PROTOCOL_VERSION,
        pid,
        shm_name: engine.shm_name().to_owned(),
        staging_bytes: engine.staging_capacity(),
        backend: engine.backend(),
    };
    if let Err(e) = send(&out, &ready) {
        return Err(Error::Ipc(format!("cannot greet the trainer: {e}")));
    }
    let mut w = Writer {
        stats: WriterStats {
            pid,
            shm_name: engine.shm_name().to_owned(),
            staging_bytes: engine.staging_capacity(),
            ..WriterStats::default()
        },
        engine,
        contexts: BTreeMap::new(),
        devices: HashMap::new(),
        cache: HashMap::new(),
        seq: 0,
    };

    // 4. Durable replies, in commit order, from their own thread.
    let (dtx, drx) = crossbeam_channel::unbounded::<(u64, SaveHandle)>();
    let durable = {
        let out = Arc::clone(&out);
        std::thread::Builder::new()
            .name("shmckpt-ipc-durable".into())
            .spawn(move || {
                for (id, h) in drx {
                    let msg = match h.wait() {
                        Ok(r) => Reply::Durable {
                            id,
                            report: wire_report(&r),
                        },
                        Err(e) => Reply::DurableFailed {
                            id,
                            error: to_wire(&e.into()),
                        },
                    };
                    if let Err(e) = send(&out, &msg) {
                        tracing::debug!(error = %e, "cannot report a durable save");
                    }
                }
            })
            .map_err(|e| Error::Ipc(format!("cannot start the durable thread: {e}")))?
    };

    // 5. Serve.
    let mut input = BufReader::new(stream);
    let mut bye = None;
    loop {
        let raw = match read_frame_bytes(&mut input) {
            Ok(Some(r)) => r,
            Ok(None) => {
                tracing::info!("trainer closed the socket; IPC writer exits");
                break;
            }
            Err(e) => {
                tracing::warn!(error = %e, "IPC socket broken; IPC writer exits");
                break;
            }
        };
        let got = Instant::now();
        let req: Request = match decode(&raw) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "malformed request; IPC writer exits");
                break;
            }
        };
        let fail = |id: u64, e: &Error| Reply::Failed {
            id,
            error: to_wire(e),
        };
        let sent = match req {
            Request::Prepare { id, allocs } => {
                let r = w
                    .prepare(&allocs)
                    .map_or_else(|e| fail(id, &e), |r| with_id(r, id));
                send(&out, &r)
            }
            Request::Save {
                id,
                step,
                cache,
                allocs,
                tensors,
                metadata,
            } => match w.save(step, cache, &allocs, &tensors, &metadata) {
                Ok((mut staged, h)) => {
                    if let Reply::Staged { handle_s, .. } = &mut staged {
                        *handle_s = secs(got.elapsed());
                    }
                    let r = send(&out, &with_id(staged, id));
                    let _ = dtx.send((id, h));
                    w.after_save(cache);
                    r
                }
                Err(e) => {
                    if !cache {
                        w.close_all();
                    }
                    send(&out, &fail(id, &e))
                }
            },
            Request::Release { id } => {
                let (closed, bytes, took) = w.close_all();
                send(
                    &out,
                    &Reply::Released {
                        id,
                        closed,
                        bytes,
                        took_s: secs(took),
                    },
                )
            }
            Request::Stats { id } => send(
                &out,
                &Reply::Stats {
                    id,
                    stats: w.stats(),
                },
            ),
            Request::Shutdown { id } => {
                bye = Some(id);
                break;
            }
        };
        if let Err(e) = sent {
            tracing::warn!(error = %e, "cannot answer the trainer; IPC writer exits");
            break;
        }
    }
    // 6. Stop: unmap the trainer's memory first (its device memory comes back at once),
    //    then let the saves in flight commit (their bytes are in staging already), report
    //    them, and say goodbye.
    w.close_all();
    // Each save's failure is reported to the trainer by the durable thread.
    if let Err(e) = w.engine.flush() {
        tracing::warn!(error = %e, "a save in flight failed");
    }
    drop(dtx);
    if durable.join().is_err() {
        tracing::error!("IPC durable thread panicked");
    }
    if let Some(id) = bye {
        let _ = send(&out, &Reply::Bye { id });
    }
    drop(w);
    Ok(())
}
