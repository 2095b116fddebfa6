//! `shmckpt bench`: saves of a synthetic state against the raw O_DIRECT write of the same
//! bytes to the same directory, alternated, medians reported.

use std::path::PathBuf;

use super::{CliResult, guard, parse_size};

mod common;
mod cuda;
mod host;
mod ipc;
mod memory;
mod variant;

use common::load_layout;

/// How `bench --source cuda` saves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// shmckpt: the trainer's engine copies into its pinned shared-memory staging.
    Shm,
    /// The CUDA IPC writer process (NVRx / Megatron design).
    Ipc,
    /// Both, alternated on the same tensors, plus the device-memory experiment.
    Compare,
}

/// IPC handle caching of the writer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum IpcCache {
    /// Keep mapped handles across saves.
    On,
    /// Open and close every handle each save.
    Off,
    /// One writer of each (compare only).
    Both,
}

/// Where the benchmarked tensors live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SourceKind {
    /// Host memory.
    Host,
    /// CUDA device memory (allocated by the benchmark).
    Cuda,
}

/// Arguments of `bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Total bytes of the synthetic state (e.g. 4GiB).
    #[arg(long, value_parser = parse_size, default_value = "1GiB")]
    pub size: u64,
    /// Number of tensors.
    #[arg(long, default_value_t = 64)]
    pub tensors: usize,
    /// Dtype of the tensors (bf16, f32, ...), or `mixed` for the anchors' mixed state.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// JSON file `[{"name","dtype","shape"}, ...]` giving the exact tensors (overrides
    /// --size, --tensors, --dtype).
    #[arg(long)]
    pub layout: Option<PathBuf>,
    /// Checkpoint root (on the disk to measure; created if missing).
    #[arg(long, default_value = "shmckpt-bench")]
    pub dir: PathBuf,
    /// Saves to time (each alternated with one reference write).
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Where the tensors live.
    #[arg(long, value_enum, default_value = "host")]
    pub source: SourceKind,
    /// Keep the last checkpoint (its directory is reported as `kept_dir`).
    #[arg(long)]
    pub keep: bool,
    /// Engine tuning.
    #[command(flatten)]
    pub engine: super::engine_args::EngineArgs,
    /// Also time loading the last checkpoint saved (to the device with `--source cuda`),
    /// alternated with raw O_DIRECT reads of its file (`load_s`, `reference_read_s`,
    /// `load_ratio`).
    #[arg(long)]
    pub load: bool,
    /// With --load: keep the arena in shared memory (flash restore), then time loads that
    /// a new engine serves from it (`flash_load_s`, `flash_load_runs_s`; the new
    /// engine's open, which adopts the kept image, in `flash_open_s`, and with
    /// `--source cuda` its arena's CUDA registration in `flash_prepare_s`).
    #[arg(long, requires = "load")]
    pub flash: bool,
    /// Skip the reference write (then no ratio is reported).
    #[arg(long)]
    pub no_reference: bool,
    /// With `--source cuda`: save through shmckpt (`shm`), through the CUDA IPC writer
    /// process (`ipc`, the NVRx / Megatron design), or both alternated (`compare`).
    #[arg(long, value_enum, default_value = "shm")]
    pub mode: Mode,
    /// IPC handle cache of the writer (`--mode ipc|compare`): `on` keeps mapped handles
    /// across saves, `off` opens and closes them every save, `both` (compare only, the
    /// default there) runs one writer of each.
    #[arg(long, value_enum)]
    pub ipc_cache: Option<IpcCache>,
}

/// Run the benchmark in a fresh subdirectory of `--dir` (so it can never see, let alone
/// delete, checkpoints it did not write), after checking that the state and its staging
/// fit in memory. The subdirectory is removed at the end unless `--keep`.
pub fn run(mut a: BenchArgs) -> CliResult {
    if a.source == SourceKind::Host && a.mode != Mode::Shm {
        return Err("--mode ipc and --mode compare need --source cuda".into());
    }
    if a.load && a.mode != Mode::Shm {
        return Err("--load needs --mode shm".into());
    }
    let layout = load_layout(&a)?;
    let bytes = guard::layout_bytes(&layout)?;
    let chunk = a.engine.chunk_size();
    let staging = bytes
        .checked_add((64 << 20) + chunk)
        .ok_or("the requested size overflows 64 bits")?;
    guard::check_memory(
        if a.source == SourceKind::Host {
            bytes
        } else {
            0
        },
        staging,
    )?;
    let work = guard::fresh_subdir(&a.dir, "shmckpt-bench")?;
    a.dir = work.clone();
    let keep = a.keep;
    // One dispatch on (source, mode).
    let res = match (a.source, a.mode) {
        (SourceKind::Host, _) => host::run(a),
        (SourceKind::Cuda, Mode::Shm) => cuda::run(a),
        (SourceKind::Cuda, Mode::Ipc | Mode::Compare) => ipc::run(a),
    };
    if !keep || res.is_err() {
        std::fs::remove_dir_all(&work).map_err(|e| guard::io_err("remove", &work, e))?;
    }
    res
}
