//! Writer throughput: time from `save` to durable (written, fdatasynced, committed) for
//! each backend, against the raw O_DIRECT sequential write of the same bytes measured in
//! the same run (`raw_direct_write`). Compare the two throughputs, not absolute numbers:
//! the disk is shared and noisy.

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use shmckpt::{BackendKind, Dtype, EngineConfig, Metadata, Tensor};
use shmckpt_bench::synthetic;

const BYTES: u64 = 512 << 20;

fn writer(c: &mut Criterion) {
    let layout = synthetic::uniform(BYTES, 16, Dtype::F32);
    let data = synthetic::materialize(&layout, 0, 2);
    let tensors: Vec<Tensor<'_>> = layout
        .iter()
        .zip(&data)
        .map(|(e, d)| Tensor::host(e.name.as_str(), e.dtype, e.shape.clone(), d))
        .collect();
    let mut g = c.benchmark_group("persist");
    g.throughput(Throughput::Bytes(BYTES));
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(20));
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    g.bench_function("raw_o_direct_reference", |b| {
        b.iter_custom(|iters| {
            (0..iters)
                .map(|_| shmckpt_bench::reference::raw_direct_write(dir.path(), BYTES).unwrap())
                .sum()
        })
    });
    for (name, kind) in [
        ("io_uring", BackendKind::IoUring),
        ("pwrite", BackendKind::Pwrite),
    ] {
        let root = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let engine = EngineConfig::new(root.path())
            .with_backend(kind)
            .with_staging_capacity(BYTES + (16 << 20))
            .with_keep_last(Some(1))
            .build()
            .unwrap();
        let mut step = 0u64;
        g.bench_with_input(BenchmarkId::new("save_to_durable", name), &kind, |b, _| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    step += 1;
                    let r = engine
                        .save(step, &tensors, &Metadata::new())
                        .unwrap()
                        .wait()
                        .unwrap();
                    total += r.timings.durable;
                }
                total
            })
        });
    }
    g.finish();
}

criterion_group!(benches, writer);
criterion_main!(benches);
