//! `bench --source host`: host tensors, saves alternated with the raw O_DIRECT write.

use shmckpt::{LoadInto, LoadRequest, Metadata, Tensor};
use shmckpt_bench::synthetic;

use super::BenchArgs;
use super::common::{Run, engine_for, load_layout, report};
use crate::cli::CliResult;

/// `bench --source host`.
pub fn run(a: BenchArgs) -> CliResult {
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
        if reference_first {
            reference = super::common::write_reference(&a, bytes)?;
        }
        let tensors: Vec<Tensor<'_>> = layout
            .iter()
            .zip(&data)
            .map(|(e, d)| Tensor::host(e.name.as_str(), e.dtype, e.shape.clone(), d))
            .collect();
        let h = engine.save(first + i as u64, &tensors, &Metadata::new())?;
        let staged = h.staged().ok_or("save returned before staging")?;
        let r = h.wait()?;
        file_bytes = r.bytes;
        direct = r.direct_io;
        last_dir = r.dir.clone();
        if !reference_first {
            reference = super::common::write_reference(&a, bytes)?;
        }
        runs.push(Run {
            stall: staged.staging,
            backpressure: staged.backpressure,
            durable: r.timings.durable,
            reference,
        });
    }
    let mut extra = serde_json::Map::new();
    if a.load {
        let step = first + (a.repeat.max(1) - 1) as u64;
        let file = super::common::last_saved_file(&engine, step, last_dir.as_deref())?;
        let runs = super::common::time_loads(a.repeat, &file, |i| {
            let t = std::time::Instant::now();
            let ck = engine.load(step)?;
            let took = t.elapsed();
            if i == 0 {
                // Check the bytes once, outside the timing: a fast wrong load is no result.
                for (e, d) in layout.iter().zip(&data) {
                    let got = ck.get(&e.name).ok_or("tensor missing from the load")?;
                    if got.data.as_bytes() != &d[..] {
                        return Err(format!("load returned wrong bytes for {}", e.name).into());
                    }
                }
            }
            drop(ck);
            Ok(took)
        })?;
        extra = super::common::load_keys(file_bytes, &runs);
    }
    let backend = engine.backend().as_str();
    engine.close();
    if a.flash {
        let step = first + (a.repeat.max(1) - 1) as u64;
        let flash = super::common::flash_loads(
            &a,
            bytes,
            file_bytes,
            |_| Ok(()),
            |e| {
                let t = std::time::Instant::now();
                let got = e.load_with(&LoadRequest::new(step), LoadInto::owned())?;
                let took = t.elapsed();
                drop(got.checkpoint);
                Ok((took, got.report))
            },
        )?;
        extra.extend(flash);
    }
    // Without --keep, `run` removes the whole run directory.
    let kept_dir = if a.keep { last_dir } else { None };
    report(
        &a, &layout, bytes, file_bytes, &runs, backend, direct, kept_dir, extra,
    )
}
