//! The opt-in device snapshot (issue 24), in the `gpu` test binary (`gpu.rs`).

use shmckpt::cuda::{Stream, batch_copies_supported, driver_version};
use shmckpt::{Dtype, EngineConfig, Metadata, SaveOptions};
use shmckpt_bench::synthetic::{self, LayoutEntry};

use super::{common, expected, tensors, upload};

/// The opt-in device snapshot (issue 24): a save asked for one copies the bytes it had not
/// queued yet into a transient device buffer; a stream held after the request may
/// overwrite the tensors at once. The checkpoint has the values at the call, the
/// snapshot's size is reported, and its memory is back once the save is staged.
#[test]
#[ignore = "needs a CUDA GPU: SHMCKPT_REQUIRE_GPU=1 cargo test --test gpu -- --ignored"]
fn gpu_snapshot_on_request_keeps_the_values_and_gives_its_memory_back() {
    let Some(ctx) = common::gpu() else { return };
    let layout = synthetic::mixed(1 << 30, 40);
    let total: u64 = layout.iter().map(|e| e.len()).sum();
    let mut bufs = upload(&ctx, &layout, 24);
    let dir = common::gpu_test_dir("gpu-snapshot");
    let engine = EngineConfig::new(dir.path())
        .with_staging_capacity((1 << 30) + (256 << 20))
        .build()
        .unwrap();
    engine.prepare_cuda(&[0]).unwrap();
    let trainer = Stream::new(&ctx).unwrap();
    // Warm-up save (the engine's reusable events), then the measured one.
    engine
        .save(1, &tensors(&layout, &bufs), &Metadata::new())
        .unwrap()
        .wait()
        .unwrap();
    let (free_before, _) = ctx.mem_info().unwrap();
    let opts = SaveOptions::new()
        .after_stream(trainer.handle())
        .snapshot_on_request();
    // SAFETY: `bufs` outlive the save; the only writes to them (the memsets below) are
    // queued on `trainer` after `hold_stream`, which orders them after the last read of
    // them (the snapshot's device-to-device copies and the copies queued before).
    let h =
        unsafe { engine.save_async(2, &tensors(&layout, &bufs), &Metadata::new(), &opts) }.unwrap();
    h.request_snapshot();
    h.hold_stream(trainer.handle()).unwrap();
    let snap = h.snapshot_bytes();
    let (free_during, _) = ctx.mem_info().unwrap();
    for b in &mut bufs {
        trainer.memset_async(b, 0xA5).unwrap();
    }
    let staged = h.wait_staged().unwrap();
    h.wait().unwrap();
    trainer.synchronize().unwrap();
    let (free_after, _) = ctx.mem_info().unwrap();
    eprintln!(
        "state {total} B, snapshot {snap} B; free before {free_before}, during {free_during}, after {free_after}"
    );
    assert_eq!(staged.snapshot_bytes, snap);
    // Everything but what was queued before the request (at most 256 MiB and a chunk),
    // each tensor's range rounded up to 256 bytes.
    assert!(
        snap <= total + 256 * layout.len() as u64,
        "{snap} > {total}"
    );
    assert!(snap + (256 << 20) + (8 << 20) >= total, "{snap} of {total}");
    assert!(
        free_during + snap <= free_before,
        "the snapshot is device memory"
    );
    assert_eq!(free_after, free_before, "the snapshot's memory comes back");
    let ck = engine.load(2).unwrap();
    for (k, e) in layout.iter().enumerate() {
        assert!(
            ck.get(&e.name).unwrap().data.as_bytes() == &expected(&layout, k, 24)[..],
            "{} does not hold the values at the call",
            e.name
        );
    }
    let mut host = vec![0u8; layout[0].len() as usize];
    bufs[0].download(&mut host).unwrap();
    assert!(host.iter().all(|&b| b == 0xA5), "the trainer's writes ran");
}

/// The snapshot's copies queued in one driver call (`cuMemcpyBatchAsync`, CUDA 12.8+) and
/// one by one: 1,200 device tensors of odd sizes (1 B to 1.2 MiB, five dtypes), overwritten
/// on the trainer's stream right after the request. Both ways, the checkpoint holds the
/// values at the call, byte for byte, and the report says which way the copies went.
#[test]
#[ignore = "needs a CUDA GPU: SHMCKPT_REQUIRE_GPU=1 cargo test --test gpu -- --ignored"]
fn gpu_snapshot_of_many_tensors_batched_or_not_is_exact() {
    let Some(ctx) = common::gpu() else { return };
    let v = driver_version().unwrap();
    assert_eq!(
        batch_copies_supported(),
        v >= 12080,
        "driver {v}: the batch API is there from 12.8 on"
    );
    let dtypes = [Dtype::U8, Dtype::BF16, Dtype::F32, Dtype::I64, Dtype::F16];
    let layout: Vec<LayoutEntry> = (0..1200usize)
        .map(|i| {
            let d = dtypes[i % dtypes.len()];
            let bytes = 1 + (i * 2_654_435_761) % (1_200 << 10);
            LayoutEntry {
                name: format!("t.{i}"),
                dtype: d,
                shape: vec![(bytes / d.alignment() as usize) | 1],
            }
        })
        .collect();
    let total: u64 = layout.iter().map(|e| e.len()).sum();
    assert!(
        total > 600 << 20,
        "{total}: more than the copies queued ahead"
    );
    for (round, batch) in [true, false].into_iter().enumerate() {
        let seed = 40 + round as u64;
        let mut bufs = upload(&ctx, &layout, seed);
        let dir = common::gpu_test_dir("gpu-snapshot-batch");
        let engine = EngineConfig::new(dir.path())
            .with_staging_capacity(total + (256 << 20))
            .with_batch_device_copies(batch)
            .build()
            .unwrap();
        engine.prepare_cuda(&[0]).unwrap();
        let trainer = Stream::new(&ctx).unwrap();
        let opts = SaveOptions::new()
            .after_stream(trainer.handle())
            .snapshot_on_request();
        // SAFETY: `bufs` outlive the save; the only writes to them (the memsets below) are
        // queued on `trainer` after `hold_stream`, which orders them after the last read
        // of them (the snapshot's copies and the copies queued before it).
        let h = unsafe { engine.save_async(1, &tensors(&layout, &bufs), &Metadata::new(), &opts) }
            .unwrap();
        h.request_snapshot();
        h.hold_stream(trainer.handle()).unwrap();
        for b in &mut bufs {
            trainer.memset_async(b, 0x5A).unwrap();
        }
        let staged = h.wait_staged().unwrap();
        h.wait().unwrap();
        trainer.synchronize().unwrap();
        assert!(
            staged.snapshot_bytes + (256 << 20) + (8 << 20) >= total,
            "a snapshot of the rest: {} of {total}",
            staged.snapshot_bytes
        );
        assert_eq!(
            staged.snapshot_batched,
            batch && batch_copies_supported(),
            "batch {batch}"
        );
        let ck = engine.load(1).unwrap();
        for (k, e) in layout.iter().enumerate() {
            assert!(
                ck.get(&e.name).unwrap().data.as_bytes() == &expected(&layout, k, seed)[..],
                "{} (batch {batch}) does not hold the values at the call",
                e.name
            );
        }
        let mut host = vec![0u8; layout[7].len() as usize];
        bufs[7].download(&mut host).unwrap();
        assert!(host.iter().all(|&b| b == 0x5A), "the trainer's writes ran");
    }
}
