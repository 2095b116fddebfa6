//! GPU integration tests. They need a CUDA GPU, so they are `#[ignore]`d: `cargo test`
//! reports them as ignored. Run them with
//! `SHMCKPT_REQUIRE_GPU=1 cargo test --release --test gpu -- --ignored`; with
//! `SHMCKPT_REQUIRE_GPU=1` a missing driver or GPU is a failure, without it the tests print
//! `SKIPPED` and return. `SHMCKPT_TEST_DIR` picks the checkpoint directory (default: the
//! target directory's tmp, which must be on a real filesystem).

#[path = "common/gpu.rs"]
mod common;
#[path = "gpu/latch.rs"]
mod latch;
#[path = "gpu/snapshot.rs"]
mod snapshot;

use std::sync::Arc;

use shmckpt::cuda::{Context, DeviceBuffer, Stream};
use shmckpt::{Dtype, EngineConfig, LoadInto, LoadRequest, Metadata, SaveOptions, Tensor};
use shmckpt_bench::synthetic::{self, LayoutEntry};

/// ≥ 4 GiB in ≥ 100 device tensors of mixed dtypes and odd sizes, random content.
fn big_layout() -> Vec<LayoutEntry> {
    let dtypes = [
        Dtype::BF16,
        Dtype::F32,
        Dtype::F16,
        Dtype::U8,
        Dtype::I64,
        Dtype::F8_E4M3,
        Dtype::F64,
    ];
    let mut v = Vec::new();
    let mut total = 0u64;
    let mut i = 0usize;
    while i < 120 || total < (4 << 30) + (1 << 20) {
        let d = dtypes[i % dtypes.len()];
        // Odd element counts, 1 B .. ~80 MiB.
        let elems = 1 + (i * 2_654_435_761) % (80 << 20) / d.alignment() as usize;
        let elems = elems | 1;
        let e = LayoutEntry {
            name: format!("gpu.{i}"),
            dtype: d,
            shape: vec![elems],
        };
        total += e.len();
        v.push(e);
        i += 1;
    }
    v
}

fn upload(ctx: &Arc<Context>, layout: &[LayoutEntry], seed: u64) -> Vec<DeviceBuffer> {
    let mut host = Vec::new();
    layout
        .iter()
        .enumerate()
        .map(|(k, e)| {
            host.resize(e.len() as usize, 0);
            synthetic::fill_parallel(&mut host, k as u64, seed, 8);
            let mut b = DeviceBuffer::alloc(ctx, host.len()).unwrap();
            b.upload(&host).unwrap();
            b
        })
        .collect()
}

fn expected(layout: &[LayoutEntry], k: usize, seed: u64) -> Vec<u8> {
    let mut host = vec![0u8; layout[k].len() as usize];
    synthetic::fill_parallel(&mut host, k as u64, seed, 8);
    host
}

fn tensors<'a>(layout: &'a [LayoutEntry], bufs: &'a [DeviceBuffer]) -> Vec<Tensor<'a>> {
    layout
        .iter()
        .zip(bufs)
        .map(|(e, b)| b.tensor(e.name.as_str(), e.dtype, e.shape.clone()))
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU: SHMCKPT_REQUIRE_GPU=1 cargo test --test gpu -- --ignored"]
fn gpu_round_trip_4gib_overwritten_after_save() {
    let Some(ctx) = common::gpu() else { return };
    let layout = big_layout();
    let bytes: u64 = layout.iter().map(LayoutEntry::len).sum();
    assert!(bytes >= 4 << 30 && layout.len() >= 100);
    let seed = 0x5eed;
    let mut bufs = upload(&ctx, &layout, seed);
    let dir = common::gpu_test_dir("gpu-rt");
    let engine = EngineConfig::new(dir.path())
        .with_staging_capacity(bytes + (256 << 20))
        .build()
        .unwrap();
    let h = engine
        .save(1, &tensors(&layout, &bufs), &Metadata::new())
        .unwrap();
    // The trainer overwrites its tensors the moment save returns.
    for b in &mut bufs {
        b.memset(0xEE).unwrap();
    }
    let report = h.wait().unwrap();
    eprintln!(
        "4 GiB round trip: {} bytes, stall {:?}, durable {:?}",
        report.bytes, report.timings.staging, report.timings.durable
    );
    // Back to (fresh) device buffers, then compared on the host with what was saved.
    let mut fresh: Vec<DeviceBuffer> = layout
        .iter()
        .map(|e| DeviceBuffer::alloc(&ctx, e.len() as usize).unwrap())
        .collect();
    for b in &mut fresh {
        b.memset(0x11).unwrap();
    }
    {
        let mut dest: Vec<(&str, &mut DeviceBuffer)> = layout
            .iter()
            .map(|e| e.name.as_str())
            .zip(fresh.iter_mut())
            .collect();
        assert_eq!(
            engine
                .load_with(&LoadRequest::latest(), LoadInto::device(&mut dest))
                .unwrap()
                .report
                .step,
            1
        );
    }
    let mut host = Vec::new();
    for (k, b) in fresh.iter().enumerate() {
        host.resize(b.len(), 0);
        b.download(&mut host).unwrap();
        assert!(
            host == expected(&layout, k, seed),
            "tensor {} differs after the round trip",
            layout[k].name
        );
    }
    // The overwritten buffers really were overwritten (the test would prove nothing otherwise).
    host.resize(bufs[0].len(), 0);
    bufs[0].download(&mut host).unwrap();
    assert!(host.iter().all(|&b| b == 0xEE));
    // And the file itself holds the saved bytes (host load, checksums verified).
    let ck = engine.load(1).unwrap();
    for (k, e) in layout.iter().enumerate().step_by(17) {
        assert!(ck.get(&e.name).unwrap().data.as_bytes() == &expected(&layout, k, seed)[..]);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: SHMCKPT_REQUIRE_GPU=1 cargo test --test gpu -- --ignored"]
fn gpu_memory_unchanged_by_save_and_returned_after_free() {
    let Some(ctx) = common::gpu() else { return };
    let layout = synthetic::uniform(512 << 20, 16, Dtype::BF16);
    let dir = common::gpu_test_dir("gpu-mem");
    let engine = EngineConfig::new(dir.path())
        .with_staging_capacity(600 << 20)
        .build()
        .unwrap();
    engine.prepare_cuda(&[0]).unwrap();
    let (free_start, _) = ctx.mem_info().unwrap();
    let bufs = upload(&ctx, &layout, 3);
    let (free_alloc, _) = ctx.mem_info().unwrap();
    assert!(free_alloc < free_start, "the buffers take device memory");
    // Warm-up save (creates the engine's reusable events), then the measured save.
    engine
        .save(1, &tensors(&layout, &bufs), &Metadata::new())
        .unwrap()
        .wait()
        .unwrap();
    let (free_before, _) = ctx.mem_info().unwrap();
    let h = engine
        .save(2, &tensors(&layout, &bufs), &Metadata::new())
        .unwrap();
    let (free_staged, _) = ctx.mem_info().unwrap();
    h.wait().unwrap();
    let (free_durable, _) = ctx.mem_info().unwrap();
    eprintln!(
        "free: start {free_start}, with buffers {free_alloc}, before save {free_before}, staged {free_staged}, durable {free_durable}"
    );
    assert_eq!(
        free_staged, free_before,
        "a save must not take device memory"
    );
    assert_eq!(free_durable, free_before);
    drop(bufs);
    let (free_end, _) = ctx.mem_info().unwrap();
    eprintln!("free after the caller freed its buffers: {free_end}");
    assert_eq!(
        free_end, free_start,
        "all device memory comes back once the caller frees it"
    );
}

#[test]
#[ignore = "needs a CUDA GPU: SHMCKPT_REQUIRE_GPU=1 cargo test --test gpu -- --ignored"]
fn gpu_copy_waits_for_the_callers_stream() {
    let Some(ctx) = common::gpu() else { return };
    let layout = synthetic::uniform(256 << 20, 4, Dtype::U8);
    let mut bufs = upload(&ctx, &layout, 4);
    let dir = common::gpu_test_dir("gpu-order");
    let engine = EngineConfig::new(dir.path())
        .with_staging_capacity(300 << 20)
        .build()
        .unwrap();
    let trainer = Stream::new(&ctx).unwrap();
    // The "trainer" queues writes of 0x5A on its own stream and saves without waiting.
    for b in &mut bufs {
        trainer.memset_async(b, 0x5A).unwrap();
    }
    // SAFETY: `trainer` is a live stream of device 0 for the whole test.
    let opts = SaveOptions::new().after_stream(trainer.handle());
    engine
        .save_with(1, &tensors(&layout, &bufs), &Metadata::new(), &opts)
        .unwrap()
        .wait()
        .unwrap();
    let ck = engine.load(1).unwrap();
    for t in &ck.tensors {
        assert!(
            t.data.as_bytes().iter().all(|&b| b == 0x5A),
            "{} missed the trainer's writes",
            t.name
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: SHMCKPT_REQUIRE_GPU=1 cargo test --test gpu -- --ignored"]
fn gpu_async_save_reports_staged_then_durable_and_mixed_sources_work() {
    let Some(ctx) = common::gpu() else { return };
    let layout = synthetic::mixed(300 << 20, 50);
    let bufs = upload(&ctx, &layout, 5);
    let host_extra = vec![7u8; 12345];
    let dir = common::gpu_test_dir("gpu-async");
    let engine = EngineConfig::new(dir.path())
        .with_staging_capacity(400 << 20)
        .build()
        .unwrap();
    let mut ts = tensors(&layout, &bufs);
    ts.push(Tensor::host(
        "host.bytes",
        Dtype::U8,
        vec![host_extra.len()],
        &host_extra,
    ));
    // SAFETY: `bufs` and `host_extra` outlive the wait below and are not modified.
    let h = unsafe { engine.save_async(1, &ts, &Metadata::new(), &SaveOptions::new()) }.unwrap();
    let staged = h.wait_staged().unwrap();
    assert!(h.is_staged());
    assert_eq!(staged.step, 1);
    h.wait().unwrap();
    let ck = engine.load(1).unwrap();
    for (k, e) in layout.iter().enumerate() {
        assert!(ck.get(&e.name).unwrap().data.as_bytes() == &expected(&layout, k, 5)[..]);
    }
    assert_eq!(
        ck.get("host.bytes").unwrap().data.as_bytes(),
        &host_extra[..]
    );
}

/// Restore to device memory from disk, then (flash restore) from the arena a closed engine
/// kept in shared memory: both byte-exact, and each reports the path that served it.
#[test]
#[ignore = "needs a CUDA GPU: SHMCKPT_REQUIRE_GPU=1 cargo test --test gpu -- --ignored"]
fn gpu_restore_from_disk_and_from_memory_byte_exact() {
    let Some(ctx) = common::gpu() else { return };
    let layout: Vec<LayoutEntry> = big_layout().into_iter().take(40).collect();
    let bytes: u64 = layout.iter().map(LayoutEntry::len).sum();
    let seed = 0xf1a5;
    let bufs = upload(&ctx, &layout, seed);
    let dir = common::gpu_test_dir("gpu-flash");
    let cfg = || {
        EngineConfig::new(dir.path())
            .with_staging_capacity(bytes + (256 << 20))
            .with_keep_in_memory(true)
    };
    let engine = cfg().build().unwrap();
    engine
        .save(1, &tensors(&layout, &bufs), &Metadata::new())
        .unwrap()
        .wait()
        .unwrap();
    let kept = engine.shm_name().to_owned();
    engine.close();
    let check = |engine: &shmckpt::Engine, want: shmckpt::LoadSource| {
        let mut fresh: Vec<DeviceBuffer> = layout
            .iter()
            .map(|e| DeviceBuffer::alloc(&ctx, e.len() as usize).unwrap())
            .collect();
        for b in &mut fresh {
            b.memset(0x11).unwrap();
        }
        let t = std::time::Instant::now();
        let report = {
            let mut dest: Vec<(&str, &mut DeviceBuffer)> = layout
                .iter()
                .map(|e| e.name.as_str())
                .zip(fresh.iter_mut())
                .collect();
            engine
                .load_with(&LoadRequest::new(1), LoadInto::device(&mut dest))
                .unwrap()
                .report
        };
        eprintln!(
            "{bytes} bytes to the device from {:?} in {:?}",
            report.source,
            t.elapsed()
        );
        assert_eq!(report.source, want, "{report:?}");
        let mut host = Vec::new();
        for (k, b) in fresh.iter().enumerate() {
            host.resize(b.len(), 0);
            b.download(&mut host).unwrap();
            assert!(
                host == expected(&layout, k, seed),
                "{} differs",
                layout[k].name
            );
        }
    };
    // A new engine attaches the kept arena: memory serves step 1.
    let engine = cfg().build().unwrap();
    check(&engine, shmckpt::LoadSource::Memory);
    engine.close();
    // Without the option, the disk serves it.
    let engine = EngineConfig::new(dir.path())
        .with_staging_capacity(bytes + (256 << 20))
        .build()
        .unwrap();
    check(&engine, shmckpt::LoadSource::Disk);
    engine.close();
    shmckpt::flash::remove_kept(&kept).unwrap();
}

/// `DeviceRing::load_split` (the DCP reader's path): every other tensor to the device
/// through the registered ring, the rest back in host memory, one read of the file; then a
/// flipped byte makes it fail with the checksum error naming the tensor.
#[test]
#[ignore = "needs a CUDA GPU: SHMCKPT_REQUIRE_GPU=1 cargo test --test gpu -- --ignored"]
fn gpu_split_load_device_and_host_byte_exact() {
    let Some(ctx) = common::gpu() else { return };
    let layout: Vec<LayoutEntry> = big_layout().into_iter().take(24).collect();
    let bytes: u64 = layout.iter().map(LayoutEntry::len).sum();
    let seed = 0x5b1d;
    let bufs = upload(&ctx, &layout, seed);
    let dir = common::gpu_test_dir("gpu-split");
    let engine = EngineConfig::new(dir.path())
        .with_staging_capacity(bytes + (256 << 20))
        .build()
        .unwrap();
    engine
        .save(1, &tensors(&layout, &bufs), &Metadata::new())
        .unwrap()
        .wait()
        .unwrap();
    engine.close();
    let step_dir = dir.path().join(shmckpt::manifest::step_dir_name(1));
    let ring = shmckpt::restore::DeviceRing::new(16 << 20, 4).unwrap();
    let opts = shmckpt::restore::ReadOptions::default();
    let mut fresh: Vec<DeviceBuffer> = layout
        .iter()
        .step_by(2)
        .map(|e| DeviceBuffer::alloc(&ctx, e.len() as usize).unwrap())
        .collect();
    for b in &mut fresh {
        b.memset(0x11).unwrap();
    }
    let dest: Vec<(&str, shmckpt::DeviceSlice<'_>)> = layout
        .iter()
        .step_by(2)
        .zip(&fresh)
        .map(|(e, b)| (e.name.as_str(), b.slice()))
        .collect();
    // Tensor 1 into a host buffer of the caller's, the other odd ones returned.
    let mut mine = vec![0u8; layout[1].len() as usize];
    let got = {
        let mut host: Vec<(&str, &mut [u8])> = vec![(layout[1].name.as_str(), &mut mine)];
        // SAFETY: each range is a whole live `DeviceBuffer` nobody else uses during the call.
        unsafe { ring.load_split(&step_dir, 0, &dest, &mut host, &opts) }.unwrap()
    };
    assert!(
        mine == expected(&layout, 1, seed),
        "{} differs",
        layout[1].name
    );
    let mut host = Vec::new();
    for (k, b) in fresh.iter().enumerate() {
        host.resize(b.len(), 0);
        b.download(&mut host).unwrap();
        assert!(
            host == expected(&layout, 2 * k, seed),
            "{} differs",
            layout[2 * k].name
        );
    }
    for (t, h) in got.entry.tensors.iter().zip(&got.host) {
        let k = layout.iter().position(|e| e.name == t.name).unwrap();
        match h {
            Some(h) => {
                assert!(k % 2 == 1 && k != 1, "{} came back to the host", t.name);
                assert!(
                    h.as_bytes() == expected(&layout, k, seed),
                    "{} differs",
                    t.name
                );
            }
            None => assert!(k % 2 == 0 || k == 1, "{} went to a destination", t.name),
        }
    }
    // Damage one byte of a device-bound tensor: the load fails naming it.
    let victim = &got
        .entry
        .tensors
        .iter()
        .find(|t| t.name == layout[0].name)
        .unwrap();
    let file = step_dir.join(&got.entry.file);
    let at = got.entry.data_start + victim.data_offsets[0] + 1;
    let mut img = std::fs::read(&file).unwrap();
    img[at as usize] ^= 0x40;
    std::fs::write(&file, &img).unwrap();
    // SAFETY: as above.
    let err = unsafe { ring.load_split(&step_dir, 0, &dest, &mut [], &opts) }.unwrap_err();
    match err {
        shmckpt::Error::Checksum { tensor, .. } => assert_eq!(tensor, layout[0].name),
        other => panic!("unexpected {other:?}"),
    }
}

/// The pinned reference copies of `shmckpt bench`: device → pinned → device, exact bytes
/// (each call synchronizes its stream before it returns, on every exit); a pinned buffer
/// too small is refused before any copy; a buffer dropped with a memset still queued on
/// a stream waits for it (its drop synchronizes before `cuMemFree`).
#[test]
#[ignore = "needs a CUDA GPU: SHMCKPT_REQUIRE_GPU=1 cargo test --test gpu -- --ignored"]
fn pinned_timing_copies_round_trip_exact_bytes() {
    let Some(ctx) = common::gpu() else { return };
    let sizes = [1usize, 4096, (3 << 20) | 7];
    let want: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(k, &n)| {
            let mut v = vec![0u8; n];
            synthetic::fill(&mut v, k as u64, 9, 0);
            v
        })
        .collect();
    let srcs: Vec<DeviceBuffer> = want
        .iter()
        .map(|w| {
            let mut b = DeviceBuffer::alloc(&ctx, w.len()).unwrap();
            b.upload(w).unwrap();
            b
        })
        .collect();
    let total: usize = sizes.iter().sum();
    let stream = Stream::new(&ctx).unwrap();
    let mut pinned = shmckpt::cuda::PinnedHost::alloc(&ctx, total).unwrap();
    let refs: Vec<&DeviceBuffer> = srcs.iter().collect();
    pinned.time_dtoh(&refs, &stream).unwrap();
    assert!(pinned.as_slice() == want.concat().as_slice());

    let mut dsts: Vec<DeviceBuffer> = sizes
        .iter()
        .map(|&n| DeviceBuffer::alloc(&ctx, n).unwrap())
        .collect();
    let mut drefs: Vec<&mut DeviceBuffer> = dsts.iter_mut().collect();
    pinned.time_htod(&mut drefs, &stream).unwrap();
    for (b, w) in dsts.iter().zip(&want) {
        let mut got = vec![0u8; w.len()];
        b.download(&mut got).unwrap();
        assert!(got == *w);
    }

    let mut small = shmckpt::cuda::PinnedHost::alloc(&ctx, total - 1).unwrap();
    match small.time_dtoh(&refs, &stream) {
        Err(shmckpt::Error::Cuda { call, .. }) => assert_eq!(call, "time_dtoh"),
        other => panic!("unexpected {other:?}"),
    }
    assert!(small.as_slice().iter().all(|&b| b == 0));

    let mut b = DeviceBuffer::alloc(&ctx, 256 << 20).unwrap();
    stream.memset_async(&mut b, 0x11).unwrap();
    drop(b);
    stream.synchronize().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: SHMCKPT_REQUIRE_GPU=1 cargo test --test gpu -- --ignored"]
fn gpu_load_from_the_bucket_goes_through_two_registered_buffers() {
    let Some(ctx) = common::gpu() else { return };
    // ~40 MiB in tensors of odd sizes (one empty) through two 4 MiB registered buffers
    // and 5 MiB ranged GETs: ranges, buffers and tensors all straddle each other.
    let sizes: [usize; 5] = [17 << 20, 3, 0, (9 << 20) + 5, (14 << 20) + 4093];
    let host: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(k, &n)| {
            let mut v = vec![0u8; n];
            synthetic::fill_parallel(&mut v, k as u64, 0xb0c4e7, 8);
            v
        })
        .collect();
    let names: Vec<String> = (0..sizes.len()).map(|k| format!("t{k}")).collect();
    let dir = common::gpu_test_dir("gpu-remote");
    let engine = shmckpt::remote::testing::with_memory_bucket(
        EngineConfig::new(dir.path())
            .with_staging_capacity(64 << 20)
            .with_device_read(4 << 20, 2),
        "run",
        5 << 20,
    )
    .build()
    .unwrap();
    let tensors: Vec<Tensor<'_>> = names
        .iter()
        .zip(&host)
        .map(|(n, d)| Tensor::host(n.as_str(), Dtype::U8, vec![d.len()], d))
        .collect();
    let h = engine.save(2, &tensors, &Metadata::new()).unwrap();
    let progress = h.remote().unwrap();
    h.wait().unwrap();
    progress.wait().unwrap();
    // Not on disk any more: the device load falls back to the bucket.
    std::fs::remove_dir_all(dir.path().join("step-2")).unwrap();
    let mut fresh: Vec<DeviceBuffer> = sizes
        .iter()
        .map(|&n| {
            let mut b = DeviceBuffer::alloc(&ctx, n).unwrap();
            b.memset(0x11).unwrap();
            b
        })
        .collect();
    {
        let mut dest: Vec<(&str, &mut DeviceBuffer)> = names
            .iter()
            .map(String::as_str)
            .zip(fresh.iter_mut())
            .collect();
        let report = engine
            .load_with(&LoadRequest::latest(), LoadInto::device(&mut dest))
            .unwrap()
            .report;
        assert_eq!(report.step, 2);
        assert_eq!(report.source, shmckpt::LoadSource::Remote);
    }
    for (k, b) in fresh.iter().enumerate() {
        let mut got = vec![0u8; sizes[k]];
        b.download(&mut got).unwrap();
        assert!(
            got == host[k],
            "tensor t{k} differs after the load from the bucket"
        );
    }
    // What went through the registered buffers: every data byte, from 8 MiB of staging.
    for b in &mut fresh {
        b.memset(0x22).unwrap();
    }
    let slices: Vec<(&str, shmckpt::DeviceSlice<'_>)> = names
        .iter()
        .map(String::as_str)
        .zip(fresh.iter().map(|b| b.slice()))
        .collect();
    // SAFETY: each slice is a whole buffer of `fresh`, which nothing else uses until the
    // call returns.
    #[allow(unsafe_code)]
    let into = unsafe { shmckpt::LoadInto::device_raw(&slices) };
    let req = LoadRequest::new(2).with_sources(shmckpt::Sources::BUCKET);
    let load = engine.load_with(&req, into).unwrap().remote.unwrap();
    let data: u64 = sizes.iter().map(|&n| n as u64).sum();
    assert_eq!(load.staged, data);
    assert_eq!(load.staging, 8 << 20);
    for (k, b) in fresh.iter().enumerate() {
        let mut got = vec![0u8; sizes[k]];
        b.download(&mut got).unwrap();
        assert!(got == host[k], "tensor t{k} differs after the second load");
    }
    engine.close();
}
