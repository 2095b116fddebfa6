//! GPU tests of the CUDA IPC baseline (`--mode ipc`). Like tests/gpu.rs they are
//! `#[ignore]`d; run them with
//! `SHMCKPT_REQUIRE_GPU=1 cargo test --test gpu_ipc -- --ignored --test-threads=1`. With
//! `SHMCKPT_REQUIRE_GPU=1` a missing driver or GPU is a failure, without it the tests print
//! `SKIPPED` and return. `SHMCKPT_TEST_DIR` picks the checkpoint directory. The device-memory
//! tests read `cuMemGetInfo`, which counts every process on the GPU: run them one at a time
//! (`--test-threads=1`) on an otherwise idle GPU.

#[path = "common/gpu.rs"]
mod common;

use std::path::PathBuf;
use std::sync::Arc;

use shmckpt::cuda::{Context, DeviceBuffer, Stream};
use shmckpt::{DeviceSlice, Dtype, Engine, EngineConfig, Metadata, Tensor};
use shmckpt_bench::synthetic::{self, LayoutEntry};
use shmckpt_ipc::{IpcAllocation, IpcConfig, IpcTensor, IpcWriterClient};

/// The writer executable: `$SHMCKPT_EXE`, else the one cargo built.
fn exe() -> PathBuf {
    std::env::var_os("SHMCKPT_EXE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_shmckpt")))
}

fn client(root: &std::path::Path, cache: bool, staging: u64) -> IpcWriterClient {
    IpcConfig::new(root)
        .with_exe(exe())
        .with_cache(cache)
        .map_engine(|e| e.with_staging_capacity(staging).with_chunk_size(1 << 20))
        .spawn()
        .expect("spawn the IPC writer")
}

fn bytes_of(k: usize, len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    synthetic::fill(&mut v, k as u64, seed, 0);
    v
}

/// Mixed dtypes and odd sizes; a third of the tensors live inside one shared allocation
/// at odd offsets (as in a caching allocator's segment), the rest in their own.
struct State {
    layout: Vec<LayoutEntry>,
    /// (buffer index, offset) of each tensor; `None` for zero-size tensors.
    place: Vec<Option<(usize, usize)>>,
    bufs: Vec<DeviceBuffer>,
}

impl State {
    fn layout() -> Vec<LayoutEntry> {
        let dtypes = [
            Dtype::BF16,
            Dtype::F32,
            Dtype::F16,
            Dtype::U8,
            Dtype::I64,
            Dtype::F8_E4M3,
            Dtype::F64,
            Dtype::I32,
        ];
        let mut v: Vec<LayoutEntry> = (0..40)
            .map(|i| {
                let d = dtypes[i % dtypes.len()];
                let elems = (1 + (i * 2_654_435_761) % (3 << 20) / d.alignment() as usize) | 1;
                LayoutEntry {
                    name: format!("ipc.{i}"),
                    dtype: d,
                    shape: vec![elems],
                }
            })
            .collect();
        v.push(LayoutEntry {
            name: "ipc.empty".into(),
            dtype: Dtype::F32,
            shape: vec![0, 7],
        });
        v.push(LayoutEntry {
            name: "ipc.scalar".into(),
            dtype: Dtype::F64,
            shape: vec![],
        });
        v
    }

    fn new(ctx: &Arc<Context>, seed: u64) -> State {
        let layout = Self::layout();
        let mut place = Vec::new();
        let mut bufs = Vec::new();
        // The shared segment: every third tensor, at offsets 1 + 513 * k past the previous.
        let mut seg_len = 0usize;
        let mut seg_members = Vec::new();
        for (k, e) in layout.iter().enumerate() {
            let len = e.len() as usize;
            if len > 0 && k % 3 == 0 {
                seg_len += 1 + 513 * (k % 5);
                seg_members.push((k, seg_len));
                seg_len += len;
            }
        }
        let mut seg_host = vec![0xA5u8; seg_len];
        for &(k, off) in &seg_members {
            let len = layout[k].len() as usize;
            seg_host[off..off + len].copy_from_slice(&bytes_of(k, len, seed));
        }
        let mut seg = DeviceBuffer::alloc(ctx, seg_len).unwrap();
        seg.upload(&seg_host).unwrap();
        bufs.push(seg);
        for (k, e) in layout.iter().enumerate() {
            let len = e.len() as usize;
            if len == 0 {
                place.push(None);
            } else if let Some(&(_, off)) = seg_members.iter().find(|(m, _)| *m == k) {
                place.push(Some((0, off)));
            } else {
                let mut b = DeviceBuffer::alloc(ctx, len).unwrap();
                b.upload(&bytes_of(k, len, seed)).unwrap();
                bufs.push(b);
                place.push(Some((bufs.len() - 1, 0)));
            }
        }
        State {
            layout,
            place,
            bufs,
        }
    }

    /// Allocations holding tensors (the handles the trainer exports).
    fn allocations(&self) -> usize {
        self.bufs.len()
    }

    fn tensors(&self) -> Vec<Tensor<'_>> {
        self.layout
            .iter()
            .zip(&self.place)
            .map(|(e, p)| match *p {
                None => Tensor::host(e.name.as_str(), e.dtype, e.shape.clone(), &[]),
                Some((b, off)) => {
                    let buf = &self.bufs[b];
                    // SAFETY: `off + len` lies inside `buf` (built so in `new`), which
                    // outlives every save of the test.
                    let s =
                        unsafe { DeviceSlice::new(buf.ptr() + off as u64, e.len() as usize, 0) };
                    Tensor::cuda(e.name.as_str(), e.dtype, e.shape.clone(), s)
                }
            })
            .collect()
    }

    /// Upload new content (seed) into the same allocations.
    fn refill(&mut self, seed: u64) {
        for (k, (e, p)) in self.layout.iter().zip(&self.place).enumerate() {
            if let Some((b, off)) = *p {
                let len = e.len() as usize;
                let mut host = vec![0u8; self.bufs[b].len()];
                self.bufs[b].download(&mut host).unwrap();
                host[off..off + len].copy_from_slice(&bytes_of(k, len, seed));
                self.bufs[b].upload(&host).unwrap();
            }
        }
    }

    fn bytes(&self) -> u64 {
        self.layout.iter().map(LayoutEntry::len).sum()
    }
}

fn check_step(root: &std::path::Path, step: u64, layout: &[LayoutEntry], seed: u64) {
    let engine = Engine::open(EngineConfig::new(root).with_staging_capacity(64 << 20)).unwrap();
    let ck = engine.load(step).unwrap();
    assert_eq!(ck.tensors.len(), layout.len());
    for (k, e) in layout.iter().enumerate() {
        let t = ck.get(&e.name).unwrap();
        assert_eq!((t.dtype, &t.shape), (e.dtype, &e.shape), "{}", e.name);
        assert!(
            t.data.as_bytes() == &bytes_of(k, e.len() as usize, seed)[..],
            "step {step}: tensor {} differs",
            e.name
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: SHMCKPT_REQUIRE_GPU=1 cargo test --test gpu_ipc -- --ignored --test-threads=1"]
fn ipc_round_trip_exact_bytes_cached_and_uncached() {
    let Some(ctx) = common::gpu() else { return };
    for cache in [true, false] {
        let mut st = State::new(&ctx, 11);
        assert!(st.bytes() > 32 << 20);
        let dir = common::gpu_test_dir(if cache {
            "ipc-rt-cached"
        } else {
            "ipc-rt-uncached"
        });
        let c = client(dir.path(), cache, st.bytes() + (16 << 20));
        let n_alloc = st.allocations();

        let h = c.save(1, &st.tensors(), &Metadata::new()).unwrap();
        let s1 = h.staged();
        assert_eq!(
            (s1.allocations, s1.opened, s1.reused),
            (n_alloc, n_alloc, 0)
        );
        // The trainer overwrites its tensors the moment save returns.
        for b in &mut st.bufs {
            b.memset(0xEE).unwrap();
        }
        let r1 = h.wait().unwrap();
        eprintln!(
            "cache {cache}: step 1 stall {:?} (sync {:?}, export {:?}, open {:?}, writer staging {:?}), durable {:?}",
            s1.stall, s1.sync, s1.export, s1.open, s1.writer_staging, r1.durable
        );

        // Same allocations, new bytes: the cached mappings must see them.
        st.refill(22);
        let h = c.save(2, &st.tensors(), &Metadata::new()).unwrap();
        let s2 = h.staged();
        if cache {
            assert_eq!(
                (s2.opened, s2.reused),
                (0, n_alloc),
                "cached handles reused"
            );
        } else {
            assert_eq!(
                (s2.opened, s2.reused),
                (n_alloc, 0),
                "uncached handles reopened"
            );
        }
        h.wait().unwrap();
        let stats = c.stats().unwrap();
        eprintln!(
            "cache {cache}: step 2 stall {:?}, open {:?}; writer {stats:?}",
            s2.stall, s2.open
        );
        if cache {
            assert_eq!(stats.cached_mappings, n_alloc);
        } else {
            assert_eq!((stats.cached_mappings, stats.last_closed), (0, n_alloc));
        }
        c.shutdown().unwrap();
        check_step(dir.path(), 1, &st.layout, 11);
        check_step(dir.path(), 2, &st.layout, 22);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: SHMCKPT_REQUIRE_GPU=1 cargo test --test gpu_ipc -- --ignored --test-threads=1"]
fn ipc_save_waits_for_the_trainers_stream() {
    let Some(ctx) = common::gpu() else { return };
    let layout = synthetic::uniform(256 << 20, 4, Dtype::U8);
    let mut bufs: Vec<DeviceBuffer> = layout
        .iter()
        .map(|e| DeviceBuffer::alloc(&ctx, e.len() as usize).unwrap())
        .collect();
    for b in &mut bufs {
        b.memset(0).unwrap();
    }
    let dir = common::gpu_test_dir("ipc-order");
    let c = client(dir.path(), true, 300 << 20);
    let trainer = Stream::new(&ctx).unwrap();
    // Writes queued on the trainer's own stream, not waited for: `save` must order the
    // writer's copies after them.
    for b in &mut bufs {
        trainer.memset_async(b, 0x5A).unwrap();
    }
    let ts: Vec<Tensor<'_>> = layout
        .iter()
        .zip(&bufs)
        .map(|(e, b)| b.tensor(e.name.as_str(), e.dtype, e.shape.clone()))
        .collect();
    c.save(1, &ts, &Metadata::new()).unwrap().wait().unwrap();
    c.shutdown().unwrap();
    let engine =
        Engine::open(EngineConfig::new(dir.path()).with_staging_capacity(64 << 20)).unwrap();
    for t in &engine.load(1).unwrap().tensors {
        assert!(
            t.data.as_bytes().iter().all(|&b| b == 0x5A),
            "{} missed the trainer's writes",
            t.name
        );
    }
}

const GIB: u64 = 1 << 30;

fn free(ctx: &Context) -> i64 {
    ctx.mem_info().unwrap().0 as i64
}

fn alloc_state(ctx: &Arc<Context>, n: usize, each: usize) -> Vec<DeviceBuffer> {
    (0..n)
        .map(|k| {
            let mut b = DeviceBuffer::alloc(ctx, each).unwrap();
            b.memset(k as u8 + 1).unwrap();
            b
        })
        .collect()
}

fn save_all(c: &IpcWriterClient, step: u64, bufs: &[DeviceBuffer]) {
    let names: Vec<String> = (0..bufs.len()).map(|k| format!("m.{k}")).collect();
    let ts: Vec<Tensor<'_>> = names
        .iter()
        .zip(bufs)
        .map(|(n, b)| b.tensor(n.as_str(), Dtype::U8, vec![b.len()]))
        .collect();
    c.save(step, &ts, &Metadata::new()).unwrap().wait().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: SHMCKPT_REQUIRE_GPU=1 cargo test --test gpu_ipc -- --ignored --test-threads=1"]
fn ipc_cached_handles_keep_freed_memory_until_release() {
    let Some(ctx) = common::gpu() else { return };
    let dir = common::gpu_test_dir("ipc-mem");
    let each = (GIB / 4) as usize;
    let c = client(dir.path(), true, GIB + (16 << 20));
    c.prepare(&[0]).unwrap();

    let f0 = free(&ctx);
    let bufs = alloc_state(&ctx, 4, each);
    save_all(&c, 1, &bufs);
    assert_eq!(c.stats().unwrap().cached_bytes, GIB);
    drop(bufs); // the trainer frees its tensors
    let f_freed = free(&ctx);
    let retained = f0 - f_freed;
    eprintln!("cached: retained after the trainer freed 1 GiB: {retained} bytes");
    assert!(
        retained >= (GIB as i64) * 9 / 10,
        "the writer's mappings keep the memory: {retained}"
    );

    let rel = c.release().unwrap();
    let f_rel = free(&ctx);
    eprintln!("release: {rel:?}; returned {} bytes", f_rel - f_freed);
    assert_eq!((rel.closed, rel.bytes), (4, GIB));
    assert!(
        f0 - f_rel <= (GIB as i64) / 10,
        "memory back after release: {}",
        f0 - f_rel
    );
    assert_eq!(c.stats().unwrap().cached_mappings, 0);

    // Uncached: nothing stays mapped after the save.
    let bufs = alloc_state(&ctx, 4, each);
    c.save_with_cache(2, &tensors_of(&bufs), &Metadata::new(), false)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(c.stats().unwrap().cached_mappings, 0);
    drop(bufs);
    let left = f0 - free(&ctx);
    eprintln!("uncached: retained after free: {left} bytes");
    assert!(left <= (GIB as i64) / 10, "uncached keeps nothing: {left}");

    // Cached again, and the client dropped without release: the writer's exit unmaps.
    let bufs = alloc_state(&ctx, 4, each);
    save_all(&c, 3, &bufs);
    drop(bufs);
    assert!(f0 - free(&ctx) >= (GIB as i64) * 9 / 10);
    drop(c);
    let left = f0 - free(&ctx);
    eprintln!("after the writer exited: {left} bytes not back");
    assert!(
        left <= (GIB as i64) / 10,
        "no leaked mapping after the writer exits: {left}"
    );
}

fn tensors_of(bufs: &[DeviceBuffer]) -> Vec<Tensor<'_>> {
    bufs.iter()
        .enumerate()
        .map(|(k, b)| b.tensor(format!("m.{k}"), Dtype::U8, vec![b.len()]))
        .collect()
}

/// A reallocated buffer exports a new handle. A cache keyed by the trainer's *structure*
/// (NVRx assumes it constant and does not rebuild) keeps using the old mapping, and the
/// writer silently saves the freed allocation's old bytes, kept alive by that very
/// mapping: reproduced by re-sending the old handle for the new buffer. Re-exporting (what
/// `save` does every time) gets the new bytes and closes the stale mapping.
#[test]
#[ignore = "needs a CUDA GPU: SHMCKPT_REQUIRE_GPU=1 cargo test --test gpu_ipc -- --ignored --test-threads=1"]
fn ipc_reallocated_buffer_and_the_stale_cache_failure_mode() {
    let Some(ctx) = common::gpu() else { return };
    let dir = common::gpu_test_dir("ipc-stale");
    let len = 8 << 20;
    let c = client(dir.path(), true, 64 << 20);
    let uuid = shmckpt_ipc::cuda::device_uuid(0).unwrap();

    let mut old = DeviceBuffer::alloc(&ctx, len).unwrap();
    old.memset(0x11).unwrap();
    let old_ptr = old.ptr();
    let old_handle = shmckpt_ipc::cuda::ipc_export(&ctx, old.ptr()).unwrap();
    save_all(&c, 1, std::slice::from_ref(&old));
    drop(old); // the trainer frees the tensor and allocates a new one
    let mut new = DeviceBuffer::alloc(&ctx, len).unwrap();
    new.memset(0x22).unwrap();
    let new_handle = shmckpt_ipc::cuda::ipc_export(&ctx, new.ptr()).unwrap();
    eprintln!(
        "address reused: {}, handle changed: {}",
        new.ptr() == old_ptr,
        new_handle != old_handle
    );
    assert_ne!(
        new_handle, old_handle,
        "a new allocation exports a new handle"
    );

    // Structure-keyed cache: step 2 re-sends step 1's handle for the same tensor.
    let h = c
        .save_exported(
            2,
            &[IpcAllocation {
                ordinal: 0,
                uuid,
                handle: old_handle,
                size: len as u64,
            }],
            &[IpcTensor {
                name: "m.0".into(),
                dtype: Dtype::U8,
                shape: vec![len],
                len: len as u64,
                alloc: Some(0),
                offset: 0,
            }],
            &Metadata::new(),
        )
        .unwrap();
    assert_eq!((h.staged().opened, h.staged().reused), (0, 1));
    h.wait().unwrap();

    // Re-exported: the new bytes, and the old mapping closed as stale.
    let h = c
        .save(3, &tensors_of(std::slice::from_ref(&new)), &Metadata::new())
        .unwrap();
    assert_eq!((h.staged().opened, h.staged().reused), (1, 0));
    h.wait().unwrap();
    assert_eq!(
        c.stats().unwrap().last_closed,
        1,
        "the old mapping was closed as stale"
    );
    c.shutdown().unwrap();

    let engine =
        Engine::open(EngineConfig::new(dir.path()).with_staging_capacity(64 << 20)).unwrap();
    let b = |s: u64| {
        engine
            .load(s)
            .unwrap()
            .get("m.0")
            .unwrap()
            .data
            .as_bytes()
            .to_vec()
    };
    assert!(b(1).iter().all(|&x| x == 0x11));
    let stale = b(2);
    eprintln!(
        "step 2 (old handle, trainer's tensor holds 0x22): saved 0x{:02x}",
        stale[0]
    );
    assert!(
        stale.iter().all(|&x| x == 0x11),
        "the stale mapping saved the freed bytes"
    );
    assert!(
        b(3).iter().all(|&x| x == 0x22),
        "re-exported: the new buffer's bytes"
    );
}

const ROLE_ENV: &str = "SHMCKPT_IPC_TEST_ROLE";

/// The trainer of `ipc_killed_trainer_leaves_no_writer_and_returns_device_memory`: a child
/// role, not a test. That test re-executes this binary with only itself and
/// `SHMCKPT_IPC_TEST_ROLE=gpu-trainer`, and its first statement runs this instead.
fn gpu_trainer_role() {
    let ctx = common::gpu().expect("the trainer child has the parent's GPU");
    let dir = common::gpu_test_dir("ipc-killed");
    let c = client(dir.path(), true, GIB + (16 << 20));
    let bufs = alloc_state(&ctx, 4, (GIB / 4) as usize);
    save_all(&c, 1, &bufs);
    assert_eq!(c.stats().unwrap().cached_mappings, 4);
    println!("WRITER_PID={} SHM={}", c.pid(), c.shm_name());
    use std::io::Write;
    std::io::stdout().flush().unwrap();
    std::thread::sleep(std::time::Duration::from_secs(120));
    panic!("the trainer was not killed");
}

#[test]
#[ignore = "needs a CUDA GPU: SHMCKPT_REQUIRE_GPU=1 cargo test --test gpu_ipc -- --ignored --test-threads=1"]
fn ipc_killed_trainer_leaves_no_writer_and_returns_device_memory() {
    use std::io::BufRead;
    use std::time::{Duration, Instant};
    if std::env::var(ROLE_ENV).as_deref() == Ok("gpu-trainer") {
        gpu_trainer_role();
        return;
    }
    let Some(ctx) = common::gpu() else { return };
    // The orphaned writer is reparented to us: we see it die and reap it.
    rustix::process::set_child_subreaper(Some(rustix::process::getpid())).unwrap();
    let f0 = free(&ctx);
    let mut trainer = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "ipc_killed_trainer_leaves_no_writer_and_returns_device_memory",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE_ENV, "gpu-trainer")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = std::io::BufReader::new(trainer.stdout.take().unwrap());
    let mut writer = None;
    for line in out.lines() {
        let line = line.unwrap();
        if let Some((_, rest)) = line.split_once("WRITER_PID=") {
            let (pid, shm) = rest.split_once(" SHM=").unwrap();
            writer = Some((pid.parse::<i32>().unwrap(), shm.to_owned()));
            break;
        }
    }
    let (wpid, shm) = writer.expect("the trainer reported its writer");
    let taken = f0 - free(&ctx);
    eprintln!("trainer and writer hold {taken} bytes of device memory");
    assert!(taken >= GIB as i64, "the trainer's state is on the device");

    trainer.kill().unwrap();
    trainer.wait().unwrap();
    let t = Instant::now();
    let pid = rustix::process::Pid::from_raw(wpid).unwrap();
    loop {
        match rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::NOHANG) {
            Ok(Some((_, s))) => {
                eprintln!("writer {wpid} gone after {:?}: {s:?}", t.elapsed());
                break;
            }
            Ok(None) => {}
            Err(e) => panic!("writer {wpid} is not our child after the trainer died: {e}"),
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "writer {wpid} outlived its trainer"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        !std::path::Path::new(&format!("/proc/{wpid}")).exists(),
        "no zombie"
    );
    // The driver frees both processes' memory, the mapped allocations included.
    let t = Instant::now();
    let left = loop {
        let left = f0 - free(&ctx);
        if left <= 64 << 20 || t.elapsed() > Duration::from_secs(20) {
            break left;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    eprintln!(
        "{left} bytes not back {:?} after the writer died",
        t.elapsed()
    );
    assert!(left <= 64 << 20, "device memory leaked: {left} bytes");
    let _ = std::fs::remove_file(std::path::Path::new("/dev/shm").join(shm));
}
