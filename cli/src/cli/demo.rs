//! `shmckpt demo`: the main job on an embedded default.

use std::path::PathBuf;
use std::time::Instant;

use shmckpt::{EngineConfig, Metadata, StepSel, Tensor};
use shmckpt_bench::gbps;
use shmckpt_bench::synthetic::{self, LayoutEntry};

use super::{CliResult, guard, human, progress, secs};

/// Arguments of `demo` (all optional).
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Checkpoint root (created if missing).
    #[arg(long, default_value = "shmckpt-demo")]
    pub dir: PathBuf,
    /// Number of saves.
    #[arg(long, default_value_t = 3)]
    pub steps: u64,
    /// Replace the built-in model by a mixed state of this many bytes (tests).
    #[arg(long, value_parser = super::parse_size, hide = true)]
    pub model_bytes: Option<u64>,
}

/// Run the demo in `--dir`: a new or empty directory (marked as the demo's), or one an
/// earlier demo marked, whose earlier output is replaced. Any other directory is refused
/// untouched: the demo keeps only its last `--steps` checkpoints.
pub fn run(a: DemoArgs) -> CliResult {
    let layout: Vec<LayoutEntry> = match a.model_bytes {
        Some(b) => synthetic::mixed(b, 16),
        None => synthetic::demo_model(),
    };
    let model = guard::layout_bytes(&layout)?;
    let staging = model
        .checked_add(64 << 20)
        .ok_or("the model size overflows 64 bits")?;
    guard::check_memory(model, staging)?;
    guard::claim_demo_dir(&a.dir)?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let t = Instant::now();
    let mut data = synthetic::materialize(&layout, 0, threads);
    let bytes: u64 = data.iter().map(|d| d.len() as u64).sum();
    println!(
        "model state: {} tensors, {} (built in {})",
        layout.len(),
        human(bytes),
        secs(t.elapsed())
    );

    let t = Instant::now();
    let engine = EngineConfig::new(&a.dir)
        .with_staging_capacity(staging)
        .with_keep_last(Some(a.steps.max(1) as usize))
        .build()?;
    println!(
        "engine: staging {} in /dev/shm/{} (reserved in {}), backend {}, root {}",
        human(engine.staging_capacity()),
        engine.shm_name(),
        secs(t.elapsed()),
        engine.backend(),
        a.dir.display()
    );

    let first = shmckpt::manifest::next_step(engine.config().root(), engine.latest()?)?;
    let pb = progress(a.steps, "saving");
    let mut handles = Vec::new();
    for i in 0..a.steps {
        let step = first + i;
        // "Train": change every tensor a little, so each step has its own bytes.
        for (k, d) in data.iter_mut().enumerate() {
            if let Some(b) = d.first_mut() {
                *b = (step as u8).wrapping_add(k as u8);
            }
        }
        let tensors: Vec<Tensor<'_>> = layout
            .iter()
            .zip(&data)
            .map(|(e, d)| Tensor::host(e.name.as_str(), e.dtype, e.shape.clone(), d))
            .collect();
        let meta: Metadata = [("source".to_owned(), "shmckpt demo".to_owned())].into();
        handles.push(engine.save(step, &tensors, &meta)?);
        pb.inc(1);
    }
    pb.finish_and_clear();
    let mut reports = Vec::new();
    for h in handles {
        reports.push(h.wait()?);
    }

    let t = Instant::now();
    let ck = engine.load(StepSel::Latest)?;
    let load_time = t.elapsed();
    let mut mismatches = 0;
    for (e, d) in layout.iter().zip(&data) {
        match ck.get(&e.name) {
            Some(t) if t.dtype == e.dtype && t.shape == e.shape && t.data.as_bytes() == &d[..] => {}
            _ => mismatches += 1,
        }
    }
    if ck.tensors.len() != layout.len() || mismatches > 0 {
        return Err(format!(
            "verification FAILED: {mismatches} of {} tensors differ",
            layout.len()
        )
        .into());
    }

    println!();
    println!(
        "{:>6} {:>10} {:>13} {:>13} {:>11} {:>13}",
        "step", "stall", "staging GB/s", "backpressure", "durable", "persist GB/s"
    );
    for r in &reports {
        println!(
            "{:>6} {:>10} {:>13.2} {:>13} {:>11} {:>13.2}",
            r.step,
            secs(r.timings.staging),
            gbps(r.bytes, r.timings.staging),
            secs(r.timings.backpressure),
            secs(r.timings.durable),
            r.persist_gbps()
        );
    }
    println!();
    println!(
        "loaded step {} back in {} ({:.2} GB/s): all {} tensors verified (CRC-32C and byte-exact)",
        ck.step,
        secs(load_time),
        gbps(bytes, load_time),
        ck.tensors.len()
    );
    println!(
        "checkpoints in {}: {:?}",
        a.dir.display(),
        engine.list()?.iter().map(|c| c.step).collect::<Vec<_>>()
    );
    engine.close();
    Ok(())
}
