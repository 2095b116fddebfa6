//! What the benchmark's runs share: the layout, the engine's settings, the reference
//! reads, the load timings and the report.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::json;
use shmckpt::{Dtype, Engine, EngineConfig};
use shmckpt_bench::reference::{RawTimes, raw_direct_reads};
use shmckpt_bench::synthetic::{self, LayoutEntry};
use shmckpt_bench::{gbps, median};

use super::BenchArgs;
use crate::cli::{CliResult, guard, human};

pub fn load_layout(a: &BenchArgs) -> Result<Vec<LayoutEntry>, Box<dyn std::error::Error>> {
    if let Some(p) = &a.layout {
        return guard::read_layout_file(p);
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
    a.engine
        .apply(EngineConfig::new(dir))
        .with_keep_last(Some(1))
        .with_staging_capacity(bytes + (64 << 20) + a.engine.chunk_size())
        .with_keep_in_memory(a.flash)
}

/// `--flash`: open a new engine on the run's root (it takes over the arena the closed one
/// kept: `flash_open_s`), `prepare` it (for device loads: register its arena with CUDA,
/// as a restarting trainer's first device load or `prepare_cuda` does:
/// `flash_prepare_s`), time `repeat` loads with `load` (each must be served from memory),
/// then remove the kept arena. Returns the JSON keys.
pub fn flash_loads(
    a: &BenchArgs,
    bytes: u64,
    file_bytes: u64,
    prepare: impl FnOnce(&Engine) -> Result<(), Box<dyn std::error::Error>>,
    mut load: impl FnMut(&Engine) -> Result<(Duration, shmckpt::LoadReport), Box<dyn std::error::Error>>,
) -> Result<serde_json::Map<String, serde_json::Value>, Box<dyn std::error::Error>> {
    let t = std::time::Instant::now();
    let engine = engine_for(a, bytes)?;
    let open_s = t.elapsed().as_secs_f64();
    let kept = engine.shm_name().to_owned();
    let res = (|| {
        let t = std::time::Instant::now();
        prepare(&engine)?;
        let prepare_s = t.elapsed().as_secs_f64();
        let mut runs = Vec::new();
        for _ in 0..a.repeat.max(1) {
            let (t, r) = load(&engine)?;
            if r.source != shmckpt::LoadSource::Memory {
                return Err(format!(
                    "flash restore did not serve the load: {}",
                    r.fallback_reason.unwrap_or_default()
                )
                .into());
            }
            runs.push(t.as_secs_f64());
        }
        Ok::<_, Box<dyn std::error::Error>>((prepare_s, runs))
    })();
    engine.close();
    let _ = shmckpt::flash::remove_kept(&kept);
    let (prepare_s, runs) = res?;
    let m = median(&runs);
    let v = json!({
        "flash_open_s": open_s,
        "flash_prepare_s": prepare_s,
        "flash_load_s": m,
        "flash_load_gbps": gbps(file_bytes, Duration::from_secs_f64(m)),
        "flash_load_runs_s": runs,
    });
    match v {
        serde_json::Value::Object(m) => Ok(m),
        _ => unreachable!("json! object"),
    }
}

/// Build the engine the benchmark measures, rooted at `--dir`.
pub fn engine_for(a: &BenchArgs, bytes: u64) -> Result<Engine, shmckpt::Error> {
    engine_config(a, &a.dir, bytes).build()
}

pub use crate::cli::guard::peak_rss;

/// One timed save.
#[derive(Debug, Clone, Copy)]
pub struct Run {
    pub stall: Duration,
    pub backpressure: Duration,
    pub durable: Duration,
    /// The raw O_DIRECT writes of the same bytes, measured beside this save.
    pub reference: Option<RawTimes>,
}

/// One timed load of the last checkpoint, with the raw O_DIRECT reads of its file beside it.
#[derive(Debug, Clone, Copy)]
pub struct LoadRun {
    pub load: Duration,
    pub reference: RawTimes,
}

/// The raw O_DIRECT write reference of one run (the better of one stream and 16 requests
/// in flight, both kept), unless `--no-reference`.
pub fn write_reference(
    a: &BenchArgs,
    bytes: u64,
) -> Result<Option<RawTimes>, Box<dyn std::error::Error>> {
    if a.no_reference {
        return Ok(None);
    }
    Ok(Some(shmckpt_bench::reference::raw_direct_writes(
        &a.dir, bytes,
    )?))
}

/// The rank file of the last save of a bench (`step`, committed in `last_dir`), for
/// `--load`.
pub fn last_saved_file(
    engine: &Engine,
    step: u64,
    last_dir: Option<&std::path::Path>,
) -> Result<std::path::PathBuf, Box<dyn std::error::Error>> {
    let m = engine.manifest(step)?;
    let dir = last_dir.ok_or("the last save reported no directory")?;
    Ok(dir.join(&m.files.first().ok_or("manifest without files")?.file))
}

/// Time `repeat` loads (`load(i)` returns the time of the i-th), each alternated with the
/// raw O_DIRECT reads of `file` (the reads first on even runs, after on odd ones, so drift
/// in the disk hits both alike).
pub fn time_loads(
    repeat: usize,
    file: &std::path::Path,
    mut load: impl FnMut(usize) -> Result<Duration, Box<dyn std::error::Error>>,
) -> Result<Vec<LoadRun>, Box<dyn std::error::Error>> {
    let mut out = Vec::new();
    for i in 0..repeat.max(1) {
        let reads_first = i % 2 == 0;
        let mut reference = None;
        if reads_first {
            reference = Some(raw_direct_reads(file)?);
        }
        let t = load(i)?;
        if !reads_first {
            reference = Some(raw_direct_reads(file)?);
        }
        out.push(LoadRun {
            load: t,
            reference: reference.expect("measured before or after"),
        });
    }
    Ok(out)
}

/// The `--load` keys of the JSON report: `load_s` (median), `reference_read_s` (the
/// better of the two raw read patterns, one stream of 16 MiB and 16 requests of 4 MiB in
/// flight, each taken as the median of its runs), `load_ratio` (raw read time over load
/// time: above 1 is faster than the raw read), `load_ratio_per_run_best` (the same against
/// the median of each run's faster pattern, a lower and noisier reference: the minimum of
/// two samples against one) and the details.
pub fn load_keys(file_bytes: u64, runs: &[LoadRun]) -> serde_json::Map<String, serde_json::Value> {
    let secs = |f: &dyn Fn(&LoadRun) -> Option<Duration>| -> Vec<f64> {
        runs.iter().filter_map(f).map(|d| d.as_secs_f64()).collect()
    };
    let load = secs(&|r| Some(r.load));
    let best = secs(&|r| Some(r.reference.best()));
    let single = secs(&|r| Some(r.reference.single));
    let uring = secs(&|r| r.reference.uring);
    let med = |v: &[f64]| if v.is_empty() { None } else { Some(median(v)) };
    let load_m = median(&load);
    let ref_m = match (med(&single), med(&uring)) {
        (Some(s), Some(u)) => s.min(u),
        (Some(s), None) => s,
        _ => unreachable!("every run has a single-stream read"),
    };
    let best_m = median(&best);
    let v = json!({
        "load_s": load_m,
        "load_gbps": gbps(file_bytes, Duration::from_secs_f64(load_m)),
        "reference_read_s": ref_m,
        "reference_read_gbps": gbps(file_bytes, Duration::from_secs_f64(ref_m)),
        "reference_read_single_s": med(&single),
        "reference_read_uring_s": med(&uring),
        "reference_read_per_run_best_s": best_m,
        "load_ratio": ref_m / load_m,
        "load_ratio_per_run_best": best_m / load_m,
        "load_runs": runs.iter().map(|r| json!({
            "load_s": r.load.as_secs_f64(),
            "reference_read_single_s": r.reference.single.as_secs_f64(),
            "reference_read_uring_s": r.reference.uring.map(|d| d.as_secs_f64()),
        })).collect::<Vec<_>>(),
    });
    match v {
        serde_json::Value::Object(m) => m,
        _ => unreachable!("json! object"),
    }
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
        .filter_map(|r| r.reference.map(|d| gbps(bytes, d.best())))
        .collect();
    let ref_s: Vec<f64> = runs
        .iter()
        .filter_map(|r| r.reference.map(|d| d.best().as_secs_f64()))
        .collect();
    let ref_single: Vec<f64> = runs
        .iter()
        .filter_map(|r| r.reference.map(|d| d.single.as_secs_f64()))
        .collect();
    let ref_uring: Vec<f64> = runs
        .iter()
        .filter_map(|r| r.reference.and_then(|d| d.uring).map(|d| d.as_secs_f64()))
        .collect();
    let med_or_nan = |v: &[f64]| if v.is_empty() { f64::NAN } else { median(v) };
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
        "reference_write_s": num(med_or_nan(&ref_s)),
        "reference_write_single_s": num(med_or_nan(&ref_single)),
        "reference_write_uring_s": num(med_or_nan(&ref_uring)),
        "ratio": num(ratio),
        "peak_rss_bytes": peak_rss(),
        "kept_dir": kept_dir.as_ref().map(|d| d.display().to_string()),
        "runs": runs.iter().map(|r| json!({
            "stall_s": r.stall.as_secs_f64(),
            "backpressure_s": r.backpressure.as_secs_f64(),
            "durable_s": r.durable.as_secs_f64(),
            "reference_s": r.reference.map(|d| d.best().as_secs_f64()),
            "reference_single_s": r.reference.map(|d| d.single.as_secs_f64()),
            "reference_uring_s": r.reference.and_then(|d| d.uring).map(|d| d.as_secs_f64()),
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
                .map_or("-".into(), |d| format!("{:.3}", d.best().as_secs_f64())),
            r.reference
                .map_or("-".into(), |d| format!("{:.2}", gbps(bytes, d.best()))),
        );
    }
    println!(
        "median: stall {:.3} s, durable {:.3} s, persist {:.2} GB/s, raw O_DIRECT write {:.2} GB/s (best of 1 stream and 16 in flight), ratio {:.3}",
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
