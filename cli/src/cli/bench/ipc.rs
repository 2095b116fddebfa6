//! `shmckpt bench --source cuda --mode ipc|compare`: shmckpt's save against the CUDA IPC
//! design (NVRx / Megatron: a persistent writer process maps the trainer's allocations and
//! copies them itself), on the same device tensors and the same disk.
//!
//! `--mode ipc` measures the IPC writer alone and prints the same keys as `--mode shm`.
//! `--mode compare` alternates shmckpt saves and IPC saves (cached and/or uncached handles,
//! one writer process each, each mode in its own subdirectory of `--dir` since every
//! engine locks its root) of the same device tensors, with the plain pinned `cuMemcpyDtoH`
//! and the raw O_DIRECT write alternated too; then, per mode, it lets the trainer free a
//! freshly saved state and measures the device memory that comes back (`cuMemGetInfo`), what
//! stays retained, and the time of the cleanup that returns it.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};
use shmckpt::cuda::{self, Context, DeviceBuffer, PinnedHost, Stream};
use shmckpt_bench::reference::RawTimes;
use shmckpt_bench::synthetic::LayoutEntry;
use shmckpt_bench::{gbps, median};

use super::common::{load_layout, peak_rss, report};
use super::memory::memory_experiment;
use super::variant::{IpcRun, Saver, Variant, alloc_state, check_disk, tensors};
use super::{BenchArgs, IpcCache, Mode};
use crate::cli::{CliResult, human};

fn secs_of(v: &[Duration]) -> Vec<f64> {
    v.iter().map(Duration::as_secs_f64).collect()
}

fn num(x: f64) -> Value {
    if x.is_finite() { json!(x) } else { Value::Null }
}

fn med_or_nan(v: &[f64]) -> f64 {
    if v.is_empty() { f64::NAN } else { median(v) }
}

/// The IPC keys of a variant.
fn ipc_keys(v: &Variant) -> Map<String, Value> {
    let mut m = Map::new();
    let Some(c) = v.client() else { return m };
    let f = |g: fn(&IpcRun) -> Duration| secs_of(&v.ipc.iter().map(g).collect::<Vec<_>>());
    let open = f(|r| r.open);
    let steady_open: Vec<f64> = open.iter().skip(1).copied().collect();
    let stats = c.stats().ok();
    m.insert("ipc_cache".into(), json!(c.config().cache()));
    m.insert("ipc_sync_s".into(), num(med_or_nan(&f(|r| r.sync))));
    m.insert("ipc_export_s".into(), num(med_or_nan(&f(|r| r.export))));
    m.insert(
        "ipc_export_first_s".into(),
        num(f(|r| r.export).first().copied().unwrap_or(f64::NAN)),
    );
    m.insert(
        "ipc_allocations".into(),
        json!(v.ipc.first().map_or(0, |r| r.allocations)),
    );
    m.insert("ipc_open_s".into(), num(med_or_nan(&open)));
    m.insert(
        "ipc_open_first_s".into(),
        num(open.first().copied().unwrap_or(f64::NAN)),
    );
    m.insert("ipc_open_steady_s".into(), num(med_or_nan(&steady_open)));
    m.insert(
        "ipc_setup_first_s".into(),
        num(f(|r| r.setup).first().copied().unwrap_or(f64::NAN)),
    );
    m.insert("ipc_close_s".into(), num(med_or_nan(&f(|r| r.close))));
    m.insert("ipc_request_s".into(), num(med_or_nan(&f(|r| r.request))));
    m.insert(
        "ipc_writer_handle_s".into(),
        num(med_or_nan(&f(|r| r.writer_handle))),
    );
    m.insert(
        "ipc_message_s".into(),
        num(med_or_nan(&f(|r| {
            r.request.saturating_sub(r.writer_handle)
        }))),
    );
    m.insert(
        "ipc_writer_staging_s".into(),
        num(med_or_nan(&f(|r| r.writer_staging))),
    );
    m.insert(
        "ipc_runs".into(),
        json!(
            v.ipc
                .iter()
                .map(|r| json!({
                    "sync_s": r.sync.as_secs_f64(),
                    "export_s": r.export.as_secs_f64(),
                    "open_s": r.open.as_secs_f64(),
                    "opened": r.opened,
                    "reused": r.reused,
                    "writer_staging_s": r.writer_staging.as_secs_f64(),
                    "request_s": r.request.as_secs_f64(),
                    "writer_handle_s": r.writer_handle.as_secs_f64(),
                    "close_s": r.close.as_secs_f64(),
                    "closed": r.closed,
                }))
                .collect::<Vec<_>>()
        ),
    );
    m.insert("writer_pid".into(), json!(c.pid()));
    m.insert("writer_context_bytes".into(), json!(v.writer_context_bytes));
    m.insert("writer_staging_bytes".into(), json!(c.staging_bytes()));
    if let Some(s) = stats {
        m.insert("writer_peak_rss_bytes".into(), json!(s.vm_hwm_bytes));
        m.insert("writer_rss_bytes".into(), json!(s.vm_rss_bytes));
        m.insert("writer_rss_shmem_bytes".into(), json!(s.rss_shmem_bytes));
        m.insert("writer_cached_bytes".into(), json!(s.cached_bytes));
    } else {
        m.insert("writer_peak_rss_bytes".into(), json!(c.writer_peak_rss()));
    }
    m
}

/// The keys `bench --source cuda` prints for one mode, from its runs.
fn mode_keys(v: &Variant, refs: &[Duration], d2h_m: f64, bytes: u64) -> Map<String, Value> {
    let stall = secs_of(&v.runs.iter().map(|r| r.stall).collect::<Vec<_>>());
    let durable = secs_of(&v.runs.iter().map(|r| r.durable).collect::<Vec<_>>());
    let persist: Vec<f64> = v
        .runs
        .iter()
        .map(|r| gbps(v.file_bytes, r.durable))
        .collect();
    let ref_gbps: Vec<f64> = refs.iter().map(|d| gbps(bytes, *d)).collect();
    let ref_m = med_or_nan(&ref_gbps);
    let steady: Vec<f64> = stall.iter().skip(1).copied().collect();
    let mut m = match json!({
        "backend": v.backend,
        "direct_io": v.direct,
        "file_bytes": v.file_bytes,
        "repeat": v.runs.len(),
        "stall_s": num(med_or_nan(&stall)),
        "stall_first_s": num(stall.first().copied().unwrap_or(f64::NAN)),
        "stall_steady_s": num(med_or_nan(&steady)),
        "staging_gbps": num(gbps(v.file_bytes, Duration::from_secs_f64(med_or_nan(&stall).max(0.0)))),
        "backpressure_s": num(med_or_nan(&secs_of(&v.runs.iter().map(|r| r.backpressure).collect::<Vec<_>>()))),
        "durable_s": num(med_or_nan(&durable)),
        "durable_first_s": num(durable.first().copied().unwrap_or(f64::NAN)),
        "persist_gbps": num(med_or_nan(&persist)),
        "reference_write_gbps": num(ref_m),
        "ratio": num(med_or_nan(&persist) / ref_m),
        "d2h_gbps": num(gbps(bytes, Duration::from_secs_f64(d2h_m))),
        "stall_ratio": num(med_or_nan(&stall) / d2h_m),
        "register_s": v.register.as_secs_f64(),
        "gpu_free_change_during_save_bytes": v.gpu_free_delta,
        "runs": v.runs.iter().map(|r| json!({
            "stall_s": r.stall.as_secs_f64(),
            "backpressure_s": r.backpressure.as_secs_f64(),
            "durable_s": r.durable.as_secs_f64(),
        })).collect::<Vec<_>>(),
    }) {
        Value::Object(m) => m,
        _ => unreachable!("json! object"),
    };
    m.extend(ipc_keys(v));
    m
}

pub fn run(a: BenchArgs) -> CliResult {
    let cache = a.ipc_cache.unwrap_or(match a.mode {
        Mode::Compare => IpcCache::Both,
        _ => IpcCache::On,
    });
    if a.mode == Mode::Ipc && cache == IpcCache::Both {
        return Err("--ipc-cache both needs --mode compare".into());
    }
    cuda::init()?;
    crate::cli::guard::create_dir_all(&a.dir)?;
    let layout = load_layout(&a)?;
    let modes = match (a.mode, cache) {
        (Mode::Compare, IpcCache::Both) => 3,
        (Mode::Compare, _) => 2,
        _ => 1,
    };
    check_disk(&a.dir, modes, layout.iter().map(LayoutEntry::len).sum())?;
    let ctx = Context::new(0)?;
    let (free0, total) = ctx.mem_info()?;
    let t = Instant::now();
    let bufs = alloc_state(&ctx, &layout, 0)?;
    let bytes: u64 = bufs.iter().map(|b| b.len() as u64).sum();
    let fill_s = t.elapsed();
    let (free_alloc, _) = ctx.mem_info()?;

    let caches: Vec<bool> = match cache {
        IpcCache::On => vec![true],
        IpcCache::Off => vec![false],
        IpcCache::Both => vec![true, false],
    };
    let mut variants = Vec::new();
    if a.mode == Mode::Compare {
        variants.push(Variant::shm(&a, a.dir.join("shm"), bytes)?);
        for &c in &caches {
            let sub = if c { "ipc-cached" } else { "ipc-uncached" };
            variants.push(Variant::ipc(&a, &ctx, a.dir.join(sub), bytes, c)?);
        }
    } else {
        variants.push(Variant::ipc(&a, &ctx, a.dir.clone(), bytes, caches[0])?);
    }

    // The PCIe reference, as in `--mode shm`.
    let stream = Stream::new(&ctx)?;
    let mut pinned = PinnedHost::alloc(&ctx, bytes as usize)?;
    let refs: Vec<&DeviceBuffer> = bufs.iter().collect();
    pinned.time_dtoh(&refs, &stream)?;

    let n = variants.len();
    let mut d2h = Vec::new();
    let mut references: Vec<Duration> = Vec::new();
    let mut single_refs: Vec<Option<RawTimes>> = Vec::new();
    for i in 0..a.repeat.max(1) {
        let swap = i % 2 == 1;
        let mut reference = None;
        if !swap {
            d2h.push(pinned.time_dtoh(&refs, &stream)?);
            reference = super::common::write_reference(&a, bytes)?;
        }
        let ts = tensors(&layout, &bufs);
        // Rotate which mode goes first, so drift hits all alike.
        for k in 0..n {
            variants[(i + k) % n].save(&ctx, &ts)?;
        }
        if swap {
            reference = super::common::write_reference(&a, bytes)?;
            d2h.push(pinned.time_dtoh(&refs, &stream)?);
        }
        references.extend(reference.map(|r| r.best()));
        single_refs.push(reference);
    }
    let (free_after_saves, _) = ctx.mem_info()?;
    drop(pinned);
    drop(refs);
    let d2h_s = secs_of(&d2h);
    let d2h_m = median(&d2h_s);

    // Per-mode summaries while everything is alive (the writers' stats).
    let summaries: Vec<(&'static str, Map<String, Value>)> = variants
        .iter()
        .map(|v| (v.name, mode_keys(v, &references, d2h_m, bytes)))
        .collect();

    // The device-memory experiment, on fresh state, after the main state is freed.
    drop(bufs);
    let mut memory = Map::new();
    if a.mode == Mode::Compare {
        for v in &mut variants {
            memory.insert(v.name.into(), memory_experiment(&ctx, &layout, v)?);
        }
    }

    let device = ctx.name();
    let driver = cuda::driver_version().unwrap_or(0);
    let common = json!({
        "device": device,
        "driver_version": driver,
        "fill_s": fill_s.as_secs_f64(),
        "d2h_s": d2h_m,
        "d2h_gbps": gbps(bytes, Duration::from_secs_f64(d2h_m)),
        "d2h_runs_s": d2h_s,
        "gpu_total_bytes": total,
        "gpu_free_before_alloc_bytes": free0,
        "gpu_free_after_alloc_bytes": free_alloc,
        "gpu_mem_used_after_bytes": total - free_after_saves,
        "trainer_peak_rss_bytes": peak_rss(),
    });
    let Value::Object(common) = common else {
        unreachable!("json! object")
    };

    // Clean up: stop the writers and engines, remove the checkpoints unless --keep.
    let mut kept = Vec::new();
    let mut file_bytes = 0;
    let mut direct = false;
    let mut backend = String::new();
    let mut runs_single = Vec::new();
    for v in variants {
        file_bytes = v.file_bytes;
        direct = v.direct;
        backend.clone_from(&v.backend);
        if a.mode == Mode::Ipc {
            runs_single = v.runs.clone();
        }
        match v.saver {
            Saver::Shm(e) => e.close(),
            Saver::Ipc(c) => (*c).shutdown()?,
        }
        if let Some(d) = v.last_dir {
            if a.keep {
                kept.push(d.display().to_string());
            } else if d.exists() {
                std::fs::remove_dir_all(&d)
                    .map_err(|e| crate::cli::guard::io_err("remove", d.as_ref(), e))?;
            }
        }
    }

    if a.mode == Mode::Ipc {
        // The same keys as `--mode shm`, so scripts compare them directly.
        for (r, reference) in runs_single.iter_mut().zip(&single_refs) {
            r.reference = *reference;
        }
        let mut extra = common;
        let (_, mut m) = summaries.into_iter().next().expect("one variant");
        for k in [
            "stall_s",
            "stall_first_s",
            "stall_steady_s",
            "staging_gbps",
            "backpressure_s",
            "durable_s",
            "durable_first_s",
            "persist_gbps",
            "reference_write_gbps",
            "ratio",
            "runs",
            "backend",
            "direct_io",
            "file_bytes",
            "repeat",
            "d2h_gbps",
        ] {
            m.remove(k); // `report` computes these from the runs
        }
        extra.extend(m);
        extra.insert("mode".into(), json!("ipc"));
        extra.insert(
            "peak_rss_bytes_note".into(),
            json!("trainer process; see writer_peak_rss_bytes"),
        );
        let kept_dir = kept.first().map(PathBuf::from);
        return report(
            &a,
            &layout,
            bytes,
            file_bytes,
            &runs_single,
            &backend,
            direct,
            kept_dir,
            extra,
        );
    }

    // compare: shm keys at the top level, every mode under "modes".
    let ref_s = secs_of(&references);
    let mut obj = Map::new();
    obj.insert("system".into(), json!("shmckpt"));
    obj.insert("version".into(), json!(env!("CARGO_PKG_VERSION")));
    obj.insert("source".into(), json!("cuda"));
    obj.insert("mode".into(), json!("compare"));
    obj.insert("bytes".into(), json!(bytes));
    obj.insert("tensors".into(), json!(layout.len()));
    obj.insert("reference_write_s".into(), num(med_or_nan(&ref_s)));
    obj.insert("peak_rss_bytes".into(), json!(peak_rss()));
    obj.extend(common);
    if let Some((_, shm)) = summaries.iter().find(|(n, _)| *n == "shm") {
        for (k, val) in shm {
            obj.entry(k.clone()).or_insert(val.clone());
        }
    }
    let find = |name: &str, key: &str| -> Value {
        summaries
            .iter()
            .find(|(n, _)| *n == name)
            .and_then(|(_, m)| m.get(key).cloned())
            .unwrap_or(Value::Null)
    };
    obj.insert("ipc_export_s".into(), find("ipc_cached", "ipc_export_s"));
    obj.insert(
        "ipc_export_uncached_s".into(),
        find("ipc_uncached", "ipc_export_s"),
    );
    obj.insert(
        "ipc_open_cached_s".into(),
        find("ipc_cached", "ipc_open_steady_s"),
    );
    obj.insert(
        "ipc_open_first_s".into(),
        find("ipc_cached", "ipc_open_first_s"),
    );
    obj.insert(
        "ipc_open_uncached_s".into(),
        find("ipc_uncached", "ipc_open_s"),
    );
    obj.insert(
        "ipc_close_uncached_s".into(),
        find("ipc_uncached", "ipc_close_s"),
    );
    obj.insert("ipc_message_s".into(), find("ipc_cached", "ipc_message_s"));
    obj.insert(
        "ipc_message_uncached_s".into(),
        find("ipc_uncached", "ipc_message_s"),
    );
    obj.insert(
        "writer_peak_rss_bytes".into(),
        find("ipc_cached", "writer_peak_rss_bytes"),
    );
    obj.insert(
        "writer_context_bytes".into(),
        find("ipc_cached", "writer_context_bytes"),
    );
    let mem = |name: &str, key: &str| -> Value {
        memory
            .get(name)
            .and_then(|m| m.get(key).cloned())
            .unwrap_or(Value::Null)
    };
    obj.insert("retained_bytes".into(), mem("ipc_cached", "retained_bytes"));
    obj.insert("release_s".into(), mem("ipc_cached", "release_s"));
    obj.insert("shm_retained_bytes".into(), mem("shm", "retained_bytes"));
    obj.insert(
        "modes".into(),
        Value::Object(
            summaries
                .iter()
                .map(|(n, m)| ((*n).to_owned(), Value::Object(m.clone())))
                .collect(),
        ),
    );
    obj.insert("memory".into(), Value::Object(memory.clone()));
    obj.insert("kept_dirs".into(), json!(kept));
    if a.json {
        println!("{}", Value::Object(obj));
        return Ok(());
    }

    println!(
        "state: {} in {} tensors on {device}, backend {backend}, O_DIRECT {direct}, dir {}",
        human(bytes),
        layout.len(),
        a.dir.display()
    );
    println!(
        "references: pinned cuMemcpyDtoH {:.3} s ({:.2} GB/s), raw O_DIRECT write {}",
        d2h_m,
        gbps(bytes, Duration::from_secs_f64(d2h_m)),
        if ref_s.is_empty() {
            "-".to_owned()
        } else {
            format!(
                "{:.3} s ({:.2} GB/s)",
                median(&ref_s),
                bytes as f64 / median(&ref_s) / 1e9
            )
        }
    );
    let g = |m: &Map<String, Value>, k: &str| {
        m.get(k)
            .and_then(Value::as_f64)
            .map_or("-".to_owned(), |x| format!("{x:.3}"))
    };
    println!(
        "{:>13} {:>11} {:>11} {:>9} {:>8} {:>9} {:>10} {:>11} {:>9} {:>9}",
        "mode",
        "stall 1st s",
        "stall stdy",
        "durable s",
        "GB/s",
        "export s",
        "open 1st s",
        "open stdy s",
        "message s",
        "close s"
    );
    for (name, m) in &summaries {
        println!(
            "{:>13} {:>11} {:>11} {:>9} {:>8} {:>9} {:>10} {:>11} {:>9} {:>9}",
            name,
            g(m, "stall_first_s"),
            g(m, "stall_steady_s"),
            g(m, "durable_s"),
            g(m, "persist_gbps"),
            g(m, "ipc_export_s"),
            g(m, "ipc_open_first_s"),
            g(m, "ipc_open_steady_s"),
            g(m, "ipc_message_s"),
            g(m, "ipc_close_s"),
        );
    }
    println!("device memory after the trainer frees a saved state:");
    println!(
        "{:>13} {:>16} {:>16} {:>12} {:>18}",
        "mode", "returned on free", "retained", "cleanup s", "returned by cleanup"
    );
    let b = |m: &Value, k: &str| {
        m.get(k)
            .and_then(Value::as_i64)
            .map_or("-".to_owned(), |x| format!("{x}"))
    };
    for (name, m) in &memory {
        println!(
            "{:>13} {:>16} {:>16} {:>12} {:>18}",
            name,
            b(m, "returned_on_free_bytes"),
            b(m, "retained_bytes"),
            m.get("release_s")
                .and_then(Value::as_f64)
                .map_or("-".into(), |x| format!("{x:.3}")),
            b(m, "returned_on_release_bytes"),
        );
    }
    for (name, m) in &summaries {
        if let Some(c) = m.get("writer_context_bytes") {
            println!(
                "{name}: writer context {c} B, writer peak RSS {} B, writer staging {} B",
                m.get("writer_peak_rss_bytes")
                    .cloned()
                    .unwrap_or(Value::Null),
                m.get("writer_staging_bytes")
                    .cloned()
                    .unwrap_or(Value::Null)
            );
        }
    }
    println!(
        "trainer peak RSS {} B (shm arena, pinned reference buffer and fill buffer included)",
        peak_rss()
    );
    Ok(())
}
