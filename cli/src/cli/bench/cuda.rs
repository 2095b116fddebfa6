//! `shmckpt bench --source cuda`: the synthetic state lives on the GPU (allocated here with
//! cudarc). In the same run it measures the plain pinned `cuMemcpyDtoH` of the same bytes
//! (the PCIe limit) and the raw O_DIRECT write (the disk limit), alternated with the saves.

use std::time::{Duration, Instant};

use serde_json::json;
use shmckpt::cuda::{self, Context, DeviceBuffer, PinnedHost, Stream};
use shmckpt::{LoadInto, LoadRequest};
use shmckpt_bench::synthetic::LayoutEntry;
use shmckpt_bench::{gbps, median};

use super::BenchArgs;
use super::common::{Run, engine_for, load_layout, report};
use crate::cli::CliResult;

pub fn run(a: BenchArgs) -> CliResult {
    cuda::init()?;
    crate::cli::guard::create_dir_all(&a.dir)?;
    let layout = load_layout(&a)?;
    let ctx = Context::new(0)?;
    let (free0, total) = ctx.mem_info()?;

    // The state, on the device, with the documented deterministic content.
    let t = Instant::now();
    let mut bufs = super::variant::alloc_state(&ctx, &layout, 0)?;
    let bytes: u64 = bufs.iter().map(|b| b.len() as u64).sum();
    let fill_s = t.elapsed();
    let (free_alloc, _) = ctx.mem_info()?;

    let engine = engine_for(&a, bytes)?;
    let register = engine.prepare_cuda(&[0])?.unwrap_or_default();

    // The PCIe reference: one plain pinned DtoH of the same buffers, same order.
    let stream = Stream::new(&ctx)?;
    let mut pinned = PinnedHost::alloc(&ctx, bytes as usize)?;
    let refs: Vec<&DeviceBuffer> = bufs.iter().collect();
    pinned.time_dtoh(&refs, &stream)?; // warm-up: first touch of the pinned pages

    let first = shmckpt::manifest::next_step(engine.config().root(), engine.latest()?)?;
    let mut runs = Vec::new();
    let mut d2h = Vec::new();
    let mut file_bytes = 0;
    let mut last_dir = None;
    let mut direct = false;
    let mut gpu_free_delta: i64 = 0;
    for i in 0..a.repeat.max(1) {
        let swap = i % 2 == 1;
        let mut reference = None;
        if !swap {
            d2h.push(pinned.time_dtoh(&refs, &stream)?);
            reference = super::common::write_reference(&a, bytes)?;
        }
        let tensors = super::variant::tensors(&layout, &bufs);
        let (free_before, _) = ctx.mem_info()?;
        let h = engine.save(first + i as u64, &tensors, &shmckpt::Metadata::new())?;
        let staged = h.staged().ok_or("save returned before staging")?;
        let (free_after, _) = ctx.mem_info()?;
        gpu_free_delta = gpu_free_delta.min(free_after as i64 - free_before as i64);
        let r = h.wait()?;
        file_bytes = r.bytes;
        direct = r.direct_io;
        last_dir = r.dir.clone();
        if swap {
            reference = super::common::write_reference(&a, bytes)?;
            d2h.push(pinned.time_dtoh(&refs, &stream)?);
        }
        runs.push(Run {
            stall: staged.staging,
            backpressure: staged.backpressure,
            durable: r.timings.durable,
            reference,
        });
    }
    let (free_after_saves, _) = ctx.mem_info()?;
    drop(refs);
    let mut load_extra = serde_json::Map::new();
    if a.load {
        // Load the last checkpoint back into the state's own buffers (same bytes), timed
        // to the end of the device copies (`load_into_device` returns after they finished).
        let step = first + (a.repeat.max(1) - 1) as u64;
        let file = super::common::last_saved_file(&engine, step, last_dir.as_deref())?;
        let runs = super::common::time_loads(a.repeat, &file, |_| {
            let mut dest = device_dests(&layout, &mut bufs);
            let t = Instant::now();
            engine.load_with(&LoadRequest::new(step), LoadInto::device(&mut dest))?;
            Ok(t.elapsed())
        })?;
        load_extra = super::common::load_keys(file_bytes, &runs);
        let (read, depth) = a.engine.device_read();
        load_extra.insert("device_read".into(), json!(read));
        load_extra.insert("device_read_depth".into(), json!(depth));
        // The PCIe limit of a restore: one plain pinned HtoD of the same bytes.
        let mut dsts: Vec<&mut DeviceBuffer> = bufs.iter_mut().collect();
        pinned.time_htod(&mut dsts, &stream)?; // warm-up
        let h2d: Vec<f64> = (0..a.repeat.max(1))
            .map(|_| {
                pinned
                    .time_htod(&mut dsts, &stream)
                    .map(|d| d.as_secs_f64())
            })
            .collect::<Result<_, _>>()?;
        load_extra.insert("h2d_s".into(), json!(median(&h2d)));
        load_extra.insert("h2d_runs_s".into(), json!(h2d));
    }
    let backend = engine.backend().as_str();
    engine.close();
    drop(pinned);
    if a.flash {
        let step = first + (a.repeat.max(1) - 1) as u64;
        let flash = super::common::flash_loads(
            &a,
            bytes,
            file_bytes,
            |e| {
                e.prepare_cuda(&[0])?;
                Ok(())
            },
            |e| {
                let mut dest = device_dests(&layout, &mut bufs);
                let t = Instant::now();
                let r = e
                    .load_with(&LoadRequest::new(step), LoadInto::device(&mut dest))?
                    .report;
                Ok((t.elapsed(), r))
            },
        )?;
        load_extra.extend(flash);
    }
    let (free_engine_closed, _) = ctx.mem_info()?;
    drop(bufs);
    let (free_freed, _) = ctx.mem_info()?;

    let kept_dir = if a.keep {
        last_dir
    } else {
        if let Some(d) = &last_dir {
            std::fs::remove_dir_all(d)
                .map_err(|e| crate::cli::guard::io_err("remove", d.as_ref(), e))?;
        }
        None
    };
    let d2h_s: Vec<f64> = d2h.iter().map(Duration::as_secs_f64).collect();
    let stall_s: Vec<f64> = runs.iter().map(|r| r.stall.as_secs_f64()).collect();
    let durable_s: Vec<f64> = runs.iter().map(|r| r.durable.as_secs_f64()).collect();
    let ref_s: Vec<f64> = runs
        .iter()
        .filter_map(|r| r.reference.map(|d| d.best().as_secs_f64()))
        .collect();
    let d2h_m = median(&d2h_s);
    let extra = json!({
        "device": ctx.name(),
        "driver_version": cuda::driver_version().unwrap_or(0),
        "fill_s": fill_s.as_secs_f64(),
        "register_s": register.as_secs_f64(),
        "d2h_s": d2h_m,
        "d2h_gbps": gbps(bytes, Duration::from_secs_f64(d2h_m)),
        "d2h_runs_s": d2h_s,
        "stall_ratio": median(&stall_s) / d2h_m,
        "stall_second_s": stall_s.get(1).copied(),
        "durable_ratio": if ref_s.is_empty() { None } else { Some(median(&durable_s) / median(&ref_s)) },
        "gpu_total_bytes": total,
        "gpu_free_before_alloc_bytes": free0,
        "gpu_free_after_alloc_bytes": free_alloc,
        "gpu_free_change_during_save_bytes": gpu_free_delta,
        "gpu_mem_used_after_bytes": total - free_after_saves,
        "gpu_mem_retained_by_saves_bytes": free_alloc as i64 - free_after_saves as i64,
        "gpu_free_after_engine_close_bytes": free_engine_closed,
        "gpu_free_after_release_bytes": free_freed,
    });
    let mut extra = match extra {
        serde_json::Value::Object(m) => m,
        _ => unreachable!("json! object"),
    };
    extra.extend(load_extra);
    report(
        &a, &layout, bytes, file_bytes, &runs, backend, direct, kept_dir, extra,
    )
}

/// The state's device buffers as load destinations, under their layout names.
fn device_dests<'a>(
    layout: &'a [LayoutEntry],
    bufs: &'a mut [DeviceBuffer],
) -> Vec<(&'a str, &'a mut DeviceBuffer)> {
    layout
        .iter()
        .map(|e| e.name.as_str())
        .zip(bufs.iter_mut())
        .collect()
}
