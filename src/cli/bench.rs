//! `shmckpt bench`: saves of a synthetic state against the raw O_DIRECT write of the same
//! bytes to the same directory, alternated, medians reported.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::json;
use shmckpt::synthetic::{self, LayoutEntry};
use shmckpt::util::{gbps, median};
use shmckpt::{BackendKind, Dtype, Engine, EngineConfig, Metadata, Tensor};

use super::{CliResult, human, parse_size};

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
    /// Write backend: auto, io_uring, pwrite.
    #[arg(long, default_value = "auto")]
    pub backend: BackendKind,
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
    /// Chunk size (default 8MiB).
    #[arg(long, value_parser = parse_size)]
    pub chunk_size: Option<u64>,
    /// Writer threads (default 2).
    #[arg(long)]
    pub writer_threads: Option<usize>,
    /// Queue depth per writer (default 8).
    #[arg(long)]
    pub queue_depth: Option<u32>,
    /// Host staging copy threads (default: CPUs, at most 4).
    #[arg(long)]
    pub copy_threads: Option<usize>,
    /// Skip the reference write (then no ratio is reported).
    #[arg(long)]
    pub no_reference: bool,
    /// With `--source cuda`: save through shmckpt (`shm`), through the CUDA IPC writer
    /// process (`ipc`, the NVRx / Megatron design), or both alternated (`compare`).
    #[arg(long, value_enum, default_value = "shm")]
    pub mode: super::bench_ipc::Mode,
    /// IPC handle cache of the writer (`--mode ipc|compare`): `on` keeps mapped handles
    /// across saves, `off` opens and closes them every save, `both` (compare only, the
    /// default there) runs one writer of each.
    #[arg(long, value_enum)]
    pub ipc_cache: Option<super::bench_ipc::IpcCache>,
}

pub fn load_layout(a: &BenchArgs) -> Result<Vec<LayoutEntry>, Box<dyn std::error::Error>> {
    if let Some(p) = &a.layout {
        let bytes = std::fs::read(p)?;
        let l: Vec<LayoutEntry> = serde_json::from_slice(&bytes)
            .map_err(|e| format!("{}: not a layout: {e}", p.display()))?;
        return Ok(l);
    }
    if a.dtype.eq_ignore_ascii_case("mixed") {
        return Ok(synthetic::mixed(a.size, a.tensors));
    }
    let d: Dtype = a.dtype.parse()?;
    Ok(synthetic::uniform(a.size, a.tensors, d))
}

/// Settings of the engine the benchmark measures, rooted at `dir`: staging for one save's
/// file image (header included) plus slack, newest checkpoint kept, tuning flags applied.
pub fn engine_config(a: &BenchArgs, dir: &std::path::Path, bytes: u64) -> EngineConfig {
    let chunk = a.chunk_size.unwrap_or(shmckpt::engine::DEFAULT_CHUNK_SIZE);
    let mut cfg = EngineConfig::new(dir)
        .with_backend(a.backend)
        .with_keep_last(Some(1))
        .with_chunk_size(chunk)
        .with_staging_capacity(bytes + (64 << 20) + chunk);
    if let Some(n) = a.writer_threads {
        cfg = cfg.with_writer_threads(n);
    }
    if let Some(n) = a.queue_depth {
        cfg = cfg.with_queue_depth(n);
    }
    if let Some(n) = a.copy_threads {
        cfg = cfg.with_copy_threads(n);
    }
    cfg
}

/// Build the engine the benchmark measures, rooted at `--dir`.
pub fn engine_for(a: &BenchArgs, bytes: u64) -> Result<Engine, shmckpt::Error> {
    engine_config(a, &a.dir, bytes).build()
}

/// Peak resident set size of this process (VmHWM), bytes.
pub fn peak_rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// One timed save.
#[derive(Debug, Clone, Copy)]
pub struct Run {
    pub stall: Duration,
    pub backpressure: Duration,
    pub durable: Duration,
    pub reference: Option<Duration>,
}

pub fn run(a: BenchArgs) -> CliResult {
    if a.source == SourceKind::Cuda {
        return super::bench_cuda::run(a);
    }
    if a.mode != super::bench_ipc::Mode::Shm {
        return Err("--mode ipc and --mode compare need --source cuda".into());
    }
    std::fs::create_dir_all(&a.dir)?;
    let layout = load_layout(&a)?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let data = synthetic::materialize(&layout, 0, threads);
    let bytes: u64 = data.iter().map(|d| d.len() as u64).sum();
    let engine = engine_for(&a, bytes)?;
    let first = shmckpt::manifest::next_step(engine.config().root(), engine.latest()?)?;
    let mut runs = Vec::new();
    let mut file_bytes = 0;
    let mut last_dir = None;
    let mut direct = false;
    for i in 0..a.repeat.max(1) {
        // Alternate which of the pair goes first, so drift in the disk hits both alike.
        let reference_first = i % 2 == 0;
        let mut reference = None;
        if !a.no_reference && reference_first {
            reference = Some(shmckpt::reference::raw_direct_write(&a.dir, bytes)?);
        }
        let tensors: Vec<Tensor<'_>> = layout
            .iter()
            .zip(&data)
            .map(|(e, d)| Tensor::host(e.name.as_str(), e.dtype, e.shape.clone(), d))
            .collect();
        let h = engine.save(first + i as u64, &tensors, &Metadata::new())?;
        let staged = h.staged();
        let r = h.wait()?;
        file_bytes = r.bytes;
        direct = r.direct_io;
        last_dir = r.dir.clone();
        if !a.no_reference && !reference_first {
            reference = Some(shmckpt::reference::raw_direct_write(&a.dir, bytes)?);
        }
        runs.push(Run {
            stall: staged.staging,
            backpressure: staged.backpressure,
            durable: r.timings.durable,
            reference,
        });
    }
    let backend = engine.backend();
    engine.close();
    let kept_dir = if a.keep {
        last_dir
    } else {
        if let Some(d) = &last_dir {
            std::fs::remove_dir_all(d)?;
        }
        None
    };
    report(
        &a,
        &layout,
        bytes,
        file_bytes,
        &runs,
        backend,
        direct,
        kept_dir,
        serde_json::Map::new(),
    )
}

/// Print the table or the JSON object. `extra` adds source-specific keys.
#[allow(clippy::too_many_arguments)]
pub fn report(
    a: &BenchArgs,
    layout: &[LayoutEntry],
    bytes: u64,
    file_bytes: u64,
    runs: &[Run],
    backend: &str,
    direct: bool,
    kept_dir: Option<PathBuf>,
    extra: serde_json::Map<String, serde_json::Value>,
) -> CliResult {
    let s = |f: fn(&Run) -> Duration| runs.iter().map(|r| f(r).as_secs_f64()).collect::<Vec<_>>();
    let stall = s(|r| r.stall);
    let durable = s(|r| r.durable);
    let persist: Vec<f64> = runs.iter().map(|r| gbps(file_bytes, r.durable)).collect();
    let refs: Vec<f64> = runs
        .iter()
        .filter_map(|r| r.reference.map(|d| gbps(bytes, d)))
        .collect();
    let ref_s: Vec<f64> = runs
        .iter()
        .filter_map(|r| r.reference.map(|d| d.as_secs_f64()))
        .collect();
    let persist_m = median(&persist);
    let ref_m = if refs.is_empty() {
        f64::NAN
    } else {
        median(&refs)
    };
    let ratio = persist_m / ref_m;
    let steady: Vec<f64> = stall.iter().skip(1).copied().collect();
    let num = |x: f64| if x.is_finite() { json!(x) } else { json!(null) };
    let mut obj = json!({
        "system": "shmckpt",
        "version": env!("CARGO_PKG_VERSION"),
        "source": format!("{:?}", a.source).to_lowercase(),
        "backend": backend,
        "direct_io": direct,
        "bytes": bytes,
        "file_bytes": file_bytes,
        "tensors": layout.len(),
        "repeat": runs.len(),
        "stall_s": num(median(&stall)),
        "stall_first_s": num(stall[0]),
        "stall_steady_s": num(if steady.is_empty() { f64::NAN } else { median(&steady) }),
        "staging_gbps": num(gbps(file_bytes, Duration::from_secs_f64(median(&stall)))),
        "backpressure_s": num(median(&s(|r| r.backpressure))),
        "durable_s": num(median(&durable)),
        "durable_first_s": num(durable[0]),
        "persist_gbps": num(persist_m),
        "reference_write_gbps": num(ref_m),
        "reference_write_s": num(if ref_s.is_empty() { f64::NAN } else { median(&ref_s) }),
        "ratio": num(ratio),
        "peak_rss_bytes": peak_rss(),
        "kept_dir": kept_dir.as_ref().map(|d| d.display().to_string()),
        "runs": runs.iter().map(|r| json!({
            "stall_s": r.stall.as_secs_f64(),
            "backpressure_s": r.backpressure.as_secs_f64(),
            "durable_s": r.durable.as_secs_f64(),
            "reference_s": r.reference.map(|d| d.as_secs_f64()),
        })).collect::<Vec<_>>(),
    });
    obj.as_object_mut().expect("object").extend(extra.clone());
    if a.json {
        println!("{obj}");
        return Ok(());
    }
    println!(
        "state: {} in {} tensors ({} file), backend {}, O_DIRECT {}, dir {}",
        human(bytes),
        layout.len(),
        human(file_bytes),
        backend,
        direct,
        a.dir.display()
    );
    println!(
        "{:>4} {:>10} {:>13} {:>10} {:>13} {:>13} {:>13}",
        "run", "stall s", "backpress. s", "durable s", "persist GB/s", "raw write s", "raw GB/s"
    );
    for (i, r) in runs.iter().enumerate() {
        println!(
            "{:>4} {:>10.3} {:>13.3} {:>10.3} {:>13.2} {:>13} {:>13}",
            i,
            r.stall.as_secs_f64(),
            r.backpressure.as_secs_f64(),
            r.durable.as_secs_f64(),
            gbps(file_bytes, r.durable),
            r.reference
                .map_or("-".into(), |d| format!("{:.3}", d.as_secs_f64())),
            r.reference
                .map_or("-".into(), |d| format!("{:.2}", gbps(bytes, d))),
        );
    }
    println!(
        "median: stall {:.3} s, durable {:.3} s, persist {:.2} GB/s, raw O_DIRECT write {:.2} GB/s, ratio {:.3}",
        median(&stall),
        median(&durable),
        persist_m,
        ref_m,
        ratio
    );
    for (k, v) in &extra {
        println!("{k}: {v}");
    }
    Ok(())
}
