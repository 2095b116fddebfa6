//! Staging copy throughput: the trainer's stall for host tensors (the time `save` takes to
//! copy into the shared-memory arena), by number of copy threads. Each iteration waits for
//! the save to be durable outside the timed region, so saves do not overlap.

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use shmckpt::{Dtype, EngineConfig, Metadata, Tensor};
use shmckpt_bench::synthetic;

const BYTES: u64 = 256 << 20;

fn staging(c: &mut Criterion) {
    let layout = synthetic::uniform(BYTES, 32, Dtype::BF16);
    let data = synthetic::materialize(&layout, 0, 2);
    let tensors: Vec<Tensor<'_>> = layout
        .iter()
        .zip(&data)
        .map(|(e, d)| Tensor::host(e.name.as_str(), e.dtype, e.shape.clone(), d))
        .collect();
    let mut g = c.benchmark_group("staging_copy");
    g.throughput(Throughput::Bytes(BYTES));
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(10));
    for threads in [1usize, 2, 4] {
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let engine = EngineConfig::new(dir.path())
            .with_staging_capacity(BYTES + (16 << 20))
            .with_copy_threads(threads)
            .with_keep_last(Some(1))
            .build()
            .unwrap();
        let mut step = 0u64;
        g.bench_with_input(BenchmarkId::from_parameter(threads), &threads, |b, _| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    step += 1;
                    let h = engine.save(step, &tensors, &Metadata::new()).unwrap();
                    total += h.staged().unwrap().staging;
                    h.wait().unwrap();
                }
                total
            })
        });
    }
    g.finish();
}

criterion_group!(benches, staging);
criterion_main!(benches);
