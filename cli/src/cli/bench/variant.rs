//! One way of saving in the IPC comparison (the trainer's own engine, or an IPC writer
//! process) and the helpers it needs.

use std::path::{Path, PathBuf};
use std::time::Duration;

use shmckpt::cuda::{Context, DeviceBuffer};
use shmckpt::{Engine, Metadata, Tensor};
use shmckpt_bench::synthetic::{self, LayoutEntry};
use shmckpt_ipc::{IpcConfig, IpcWriterClient};

use super::BenchArgs;
use super::common::Run;
use crate::cli::human;

pub(super) enum Saver {
    Shm(Box<Engine>),
    Ipc(Box<IpcWriterClient>),
}

/// IPC facts of one save.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct IpcRun {
    pub(super) sync: Duration,
    pub(super) export: Duration,
    pub(super) allocations: usize,
    pub(super) open: Duration,
    pub(super) opened: usize,
    pub(super) reused: usize,
    pub(super) setup: Duration,
    pub(super) writer_staging: Duration,
    pub(super) request: Duration,
    pub(super) writer_handle: Duration,
    pub(super) close: Duration,
    pub(super) closed: usize,
}

pub(super) struct Variant {
    pub(super) name: &'static str,
    pub(super) saver: Saver,
    pub(super) next_step: u64,
    pub(super) runs: Vec<Run>,
    pub(super) ipc: Vec<IpcRun>,
    pub(super) register: Duration,
    /// Device memory the writer process's context took (free before spawn − after prepare).
    pub(super) writer_context_bytes: i64,
    pub(super) gpu_free_delta: i64,
    pub(super) file_bytes: u64,
    pub(super) direct: bool,
    pub(super) backend: String,
    pub(super) last_dir: Option<PathBuf>,
}

/// The same settings for the writer process.
pub(super) fn ipc_config(a: &BenchArgs, dir: &Path, bytes: u64, cache: bool) -> IpcConfig {
    IpcConfig::with_engine(super::common::engine_config(a, dir, bytes)).with_cache(cache)
}

pub(super) fn next_step(dir: &Path) -> Result<u64, shmckpt::Error> {
    let latest = shmckpt::manifest::list_committed(dir)?
        .last()
        .map(|c| c.step);
    shmckpt::manifest::next_step(dir, latest)
}

pub(super) fn free(ctx: &Context) -> Result<u64, shmckpt::Error> {
    Ok(ctx.mem_info()?.0)
}

impl Variant {
    pub(super) fn shm(
        a: &BenchArgs,
        dir: PathBuf,
        bytes: u64,
    ) -> Result<Variant, Box<dyn std::error::Error>> {
        crate::cli::guard::create_dir_all(&dir)?;
        let engine = super::common::engine_config(a, &dir, bytes).build()?;
        let register = engine.prepare_cuda(&[0])?.unwrap_or_default();
        let backend = engine.backend().to_string();
        Ok(Variant {
            name: "shm",
            next_step: next_step(&dir)?,
            saver: Saver::Shm(Box::new(engine)),
            runs: Vec::new(),
            ipc: Vec::new(),
            register,
            writer_context_bytes: 0,
            gpu_free_delta: 0,
            file_bytes: 0,
            direct: false,
            backend,
            last_dir: None,
        })
    }

    pub(super) fn ipc(
        a: &BenchArgs,
        ctx: &Context,
        dir: PathBuf,
        bytes: u64,
        cache: bool,
    ) -> Result<Variant, Box<dyn std::error::Error>> {
        crate::cli::guard::create_dir_all(&dir)?;
        let before = free(ctx)?;
        let client = ipc_config(a, &dir, bytes, cache).spawn()?;
        let prep = client.prepare(&[0])?;
        let after = free(ctx)?;
        let backend = client.backend().to_string();
        Ok(Variant {
            name: if cache { "ipc_cached" } else { "ipc_uncached" },
            next_step: next_step(&dir)?,
            saver: Saver::Ipc(Box::new(client)),
            runs: Vec::new(),
            ipc: Vec::new(),
            register: prep.registration.unwrap_or_default(),
            writer_context_bytes: before as i64 - after as i64,
            gpu_free_delta: 0,
            file_bytes: 0,
            direct: false,
            backend,
            last_dir: None,
        })
    }

    pub(super) fn client(&self) -> Option<&IpcWriterClient> {
        match &self.saver {
            Saver::Ipc(c) => Some(c),
            Saver::Shm(_) => None,
        }
    }

    /// One save, waited until durable. Returns the run (without reference).
    pub(super) fn save(
        &mut self,
        ctx: &Context,
        tensors: &[Tensor<'_>],
    ) -> Result<Run, Box<dyn std::error::Error>> {
        let step = self.next_step;
        self.next_step += 1;
        let before = free(ctx)?;
        let run = match &self.saver {
            Saver::Shm(e) => {
                let h = e.save(step, tensors, &Metadata::new())?;
                let staged = h.staged().ok_or("save returned before staging")?;
                let during = free(ctx)?;
                self.gpu_free_delta = self.gpu_free_delta.min(during as i64 - before as i64);
                let r = h.wait()?;
                self.file_bytes = r.bytes;
                self.direct = r.direct_io;
                self.last_dir = r.dir.clone();
                Run {
                    stall: staged.staging,
                    backpressure: staged.backpressure,
                    durable: r.timings.durable,
                    reference: None,
                }
            }
            Saver::Ipc(c) => {
                let h = c.save(step, tensors, &Metadata::new())?;
                let st = h.staged();
                let during = free(ctx)?;
                self.gpu_free_delta = self.gpu_free_delta.min(during as i64 - before as i64);
                let r = h.wait()?;
                // The writer answers in order: its closing after this save is done now.
                let stats = c.stats()?;
                self.file_bytes = r.bytes;
                self.direct = r.direct_io;
                self.last_dir = r.dir.clone();
                self.ipc.push(IpcRun {
                    sync: st.sync,
                    export: st.export,
                    allocations: st.allocations,
                    open: st.open,
                    opened: st.opened,
                    reused: st.reused,
                    setup: st.setup,
                    writer_staging: st.writer_staging,
                    request: st.request,
                    writer_handle: st.writer_handle,
                    close: Duration::from_secs_f64(stats.last_close_s),
                    closed: stats.last_closed,
                });
                Run {
                    stall: st.stall,
                    backpressure: st.backpressure,
                    durable: r.durable,
                    reference: None,
                }
            }
        };
        self.runs.push(run);
        Ok(run)
    }
}

/// Refuse to start when the disk cannot hold what the run writes: every mode keeps its
/// newest checkpoint (retention keeps one, as in `--mode shm`, which deletes the older one
/// after each commit) and writes the next beside it, and the raw reference writes one more
/// file of the state's size.
pub(super) fn check_disk(
    dir: &Path,
    modes: usize,
    bytes: u64,
) -> Result<(), Box<dyn std::error::Error>> {
    let st = rustix::fs::statvfs(dir)?;
    let free = st.f_bavail.saturating_mul(st.f_frsize);
    let need = (modes as u64 + 1).saturating_mul(bytes + (64 << 20));
    if free < need {
        return Err(format!(
            "{} has {} free but this run needs about {} ({} modes' checkpoints plus one being \
             written); run fewer modes at once (--ipc-cache on, then --ipc-cache off) or use a \
             larger disk",
            dir.display(),
            human(free),
            human(need),
            modes
        )
        .into());
    }
    Ok(())
}

pub(super) fn alloc_state(
    ctx: &std::sync::Arc<Context>,
    layout: &[LayoutEntry],
    seed: u64,
) -> Result<Vec<DeviceBuffer>, Box<dyn std::error::Error>> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut bufs = Vec::with_capacity(layout.len());
    let mut host = Vec::new();
    for (k, e) in layout.iter().enumerate() {
        let len = e.len() as usize;
        host.resize(len, 0u8);
        synthetic::fill_parallel(&mut host, k as u64, seed, threads);
        let mut b = DeviceBuffer::alloc(ctx, len)?;
        b.upload(&host)?;
        bufs.push(b);
    }
    Ok(bufs)
}

pub(super) fn tensors<'a>(layout: &'a [LayoutEntry], bufs: &'a [DeviceBuffer]) -> Vec<Tensor<'a>> {
    layout
        .iter()
        .zip(bufs)
        .map(|(e, b)| b.tensor(e.name.as_str(), e.dtype, e.shape.clone()))
        .collect()
}
