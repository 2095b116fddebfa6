//! Stream latches (`EngineConfig::with_stream_latches`), in the `gpu` test binary
//! (`gpu.rs`): a stream held while a save's copies are still being queued waits on the
//! device, and never forever.

use std::sync::mpsc;
use std::time::Duration;

use shmckpt::cuda::{Event, Stream};
use shmckpt::{EngineConfig, Metadata, SaveOptions};
use shmckpt_bench::synthetic::{self, LayoutEntry};

use super::{common, expected, tensors, upload};

/// ~1 GiB in 300 device tensors of odd sizes: ~20 ms of copies at the PCIe limit, queued
/// 8 MiB ahead, so `hold_stream` returns long before the last copies are queued.
fn layout() -> Vec<LayoutEntry> {
    synthetic::mixed(1 << 30, 300)
}

/// Save with its copies ordered after an event recorded at the call, hold the trainer's
/// stream, then overwrite every tensor on that stream at once. With latches on (the
/// default) and off, the checkpoint holds the values at the call, byte for byte, and the
/// trainer's writes ran.
#[test]
#[ignore = "needs a CUDA GPU: SHMCKPT_REQUIRE_GPU=1 cargo test --test gpu -- --ignored"]
fn gpu_held_stream_overwrites_after_the_copies_with_latches_or_not() {
    let Some(ctx) = common::gpu() else { return };
    let layout = layout();
    let total: u64 = layout.iter().map(|e| e.len()).sum();
    for (round, latches) in [true, false, true].into_iter().enumerate() {
        let seed = 60 + round as u64;
        let mut bufs = upload(&ctx, &layout, seed);
        let dir = common::gpu_test_dir("gpu-latch");
        let engine = EngineConfig::new(dir.path())
            .with_staging_capacity(total + (256 << 20))
            .with_copy_ahead(8 << 20)
            .with_stream_latches(latches)
            .build()
            .unwrap();
        assert_eq!(engine.config().stream_latches(), latches);
        engine.prepare_cuda(&[0]).unwrap();
        let trainer = Stream::new(&ctx).unwrap();
        let at_call = Event::new(&ctx).unwrap();
        at_call.record(&trainer).unwrap();
        let opts = SaveOptions::new().after_event(at_call.handle());
        // SAFETY: `bufs` outlive the save; the only writes to them (the memsets below) are
        // queued on `trainer` after `hold_stream`, which orders them after the save's last
        // read of them.
        let h = unsafe { engine.save_async(1, &tensors(&layout, &bufs), &Metadata::new(), &opts) }
            .unwrap();
        h.hold_stream(trainer.handle()).unwrap();
        for b in &mut bufs {
            trainer.memset_async(b, 0xC3).unwrap();
        }
        h.wait().unwrap();
        trainer.synchronize().unwrap();
        let ck = engine.load(1).unwrap();
        for (k, e) in layout.iter().enumerate() {
            assert!(
                ck.get(&e.name).unwrap().data.as_bytes() == &expected(&layout, k, seed)[..],
                "{} (latches {latches}) does not hold the values at the call",
                e.name
            );
        }
        let mut host = vec![0u8; layout[5].len() as usize];
        bufs[5].download(&mut host).unwrap();
        assert!(host.iter().all(|&b| b == 0xC3), "the trainer's writes ran");
    }
}

/// A save whose first write fails stops staging (the failure is seen within a chunk or
/// two, about a millisecond, while ~20 ms of copies are still to be queued) and opens the
/// latch from the host: the held stream goes on, the save reports its error, and the next
/// save through the same engine is exact.
#[cfg(feature = "fault-injection")]
#[test]
#[ignore = "needs a CUDA GPU: SHMCKPT_REQUIRE_GPU=1 cargo test --test gpu -- --ignored"]
fn gpu_latch_of_a_failed_save_opens_and_the_next_save_is_exact() {
    use shmckpt::testing::io::fault::FaultPlan;
    use std::sync::Arc;

    let Some(ctx) = common::gpu() else { return };
    let layout = layout();
    let total: u64 = layout.iter().map(|e| e.len()).sum();
    let mut bufs = upload(&ctx, &layout, 70);
    let dir = common::gpu_test_dir("gpu-latch-fail");
    let plan = Arc::new(FaultPlan::new());
    let engine = EngineConfig::new(dir.path())
        .with_staging_capacity(total + (256 << 20))
        .with_copy_ahead(8 << 20)
        .with_faults(Arc::clone(&plan))
        .build()
        .unwrap();
    engine.prepare_cuda(&[0]).unwrap();
    plan.fail_write_at(0, libc::EIO);
    let trainer = Stream::new(&ctx).unwrap();
    let at_call = Event::new(&ctx).unwrap();
    at_call.record(&trainer).unwrap();
    let opts = SaveOptions::new().after_event(at_call.handle());
    // SAFETY: as above; after a failed save nothing reads the tensors once its handle
    // reports the failure (the held stream's memsets may overwrite them before).
    let h =
        unsafe { engine.save_async(1, &tensors(&layout, &bufs), &Metadata::new(), &opts) }.unwrap();
    h.hold_stream(trainer.handle()).unwrap();
    for b in &mut bufs {
        trainer.memset_async(b, 0x3C).unwrap();
    }
    let err = h.wait().unwrap_err();
    assert!(format!("{err}").contains("at offset 0"), "{err}");
    assert_eq!(plan.fired(), 1, "the write failed once");
    // The held stream goes on (a latch left shut would keep it waiting forever).
    let (tx, rx) = mpsc::channel();
    let t = std::thread::spawn(move || {
        let r = trainer.synchronize();
        let _ = tx.send(r.is_ok());
        trainer
    });
    assert_eq!(
        rx.recv_timeout(Duration::from_secs(60)),
        Ok(true),
        "the held stream finished its work"
    );
    let trainer = t.join().unwrap();
    // The engine and its latches serve the next save, exact.
    let bufs = upload(&ctx, &layout, 71);
    let at_call = Event::new(&ctx).unwrap();
    at_call.record(&trainer).unwrap();
    let opts = SaveOptions::new().after_event(at_call.handle());
    // SAFETY: `bufs` outlive the save and are not written while it runs.
    let h =
        unsafe { engine.save_async(2, &tensors(&layout, &bufs), &Metadata::new(), &opts) }.unwrap();
    h.hold_stream(trainer.handle()).unwrap();
    h.wait().unwrap();
    trainer.synchronize().unwrap();
    let ck = engine.load(2).unwrap();
    for (k, e) in layout.iter().enumerate() {
        assert!(
            ck.get(&e.name).unwrap().data.as_bytes() == &expected(&layout, k, 71)[..],
            "{} does not hold the values of step 2",
            e.name
        );
    }
}
