//! The IPC writer process without a GPU: its lifetime (it goes away when the client drops
//! and when the trainer is SIGKILLed, and is reaped), the protocol's error paths, and a
//! clear error, never a panic or a hang, for a save on a machine without a CUDA driver.
//! The GPU side is in tests/gpu_ipc.rs.

use crate::common;

use std::io::BufRead;
use std::path::Path;
use std::process::Stdio;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use shmckpt::cuda;
use shmckpt::{DeviceSlice, Dtype, Engine, EngineConfig, Error, Metadata, Tensor};
use shmckpt_ipc::cuda::IpcMemHandle;
use shmckpt_ipc::{Error as IpcError, IpcAllocation, IpcConfig, IpcTensor, IpcWriterClient};

/// The writer executable: `$SHMCKPT_EXE`, else the one cargo built.
fn exe() -> std::path::PathBuf {
    std::env::var_os("SHMCKPT_EXE")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_shmckpt").into())
}

fn config(root: &Path) -> IpcConfig {
    IpcConfig::new(root)
        .with_exe(exe())
        .map_engine(|e| {
            e.with_staging_capacity(1 << 20)
                .with_chunk_size(64 << 10)
                .with_writer_threads(1)
        })
        .with_connect_timeout(Duration::from_secs(60))
        .with_shutdown_timeout(Duration::from_secs(30))
}

/// Run `f` on a thread; fail the test if it takes longer than `limit` (a hang).
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(v) => v,
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("hung for more than {limit:?}"),
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("the test body panicked"),
    }
}

/// State letter of a process (`R`, `S`, `Z`, ...), `None` when no such process exists.
fn proc_state(pid: u32) -> Option<char> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) S ...": the state follows the last ')'.
    s.rsplit_once(')')?.1.trim_start().chars().next()
}

fn remove_shm(name: &str) {
    if !name.is_empty() {
        let _ = std::fs::remove_file(Path::new("/dev/shm").join(name));
    }
}

#[test]
fn writer_exits_and_is_reaped_when_the_client_drops() {
    within(Duration::from_secs(120), || {
        let dir = common::real_dir("ipc-drop");
        let client = config(dir.path()).spawn().unwrap();
        let pid = client.pid();
        assert!(
            matches!(proc_state(pid), Some(c) if c != 'Z'),
            "writer runs"
        );
        let st = client.stats().unwrap();
        assert_eq!(st.pid, pid);
        assert!(st.vm_hwm_bytes > 0 && st.staging_bytes >= 1 << 20);
        assert_eq!(st.cached_mappings, 0);
        let shm = client.shm_name().to_owned();
        assert!(
            Path::new("/dev/shm").join(&shm).exists(),
            "writer arena {shm}"
        );
        drop(client);
        // Reaped by the client: no process, not even a zombie.
        assert_eq!(
            proc_state(pid),
            None,
            "writer {pid} still exists after drop"
        );
        assert!(
            !Path::new("/dev/shm").join(&shm).exists(),
            "writer removed its arena on a clean exit"
        );
        // A second writer on the same root works (the first released its lock).
        let c2 = config(dir.path()).spawn().unwrap();
        c2.shutdown().unwrap();
    });
}

/// Child role of `writer_dies_with_a_killed_trainer`: the trainer.
fn trainer_role() {
    let root = std::env::var("SHMCKPT_IPC_TEST_ROOT").unwrap();
    // Spawned from a short-lived thread on purpose: the writer must not die when that
    // thread ends (PR_SET_PDEATHSIG follows the spawning thread).
    let client = std::thread::spawn(move || config(Path::new(&root)).spawn().unwrap())
        .join()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    client
        .stats()
        .expect("writer still alive after its spawning thread ended");
    println!("WRITER_PID={} SHM={}", client.pid(), client.shm_name());
    use std::io::Write;
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_secs(120));
    panic!("the trainer was not killed");
}

#[test]
fn writer_dies_with_a_killed_trainer() {
    if common::run_role(&[("trainer", trainer_role)]) {
        return;
    }
    let test = common::current_test();
    // Orphans are reparented to us, so we can see the writer exit and reap it ourselves
    // (whatever pid 1 of this container does with orphans).
    rustix::process::set_child_subreaper(Some(rustix::process::getpid())).unwrap();
    within(Duration::from_secs(120), move || {
        let dir = common::real_dir("ipc-kill");
        let mut trainer = common::child_command_of(&test, "trainer")
            .env("SHMCKPT_IPC_TEST_ROOT", dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let out = std::io::BufReader::new(trainer.stdout.take().unwrap());
        let mut writer = None;
        for line in out.lines() {
            let line = line.unwrap();
            // libtest prints "test ipc::writer_dies_with_a_killed_trainer ... " on the same line.
            if let Some((_, rest)) = line.split_once("WRITER_PID=") {
                let (pid, shm) = rest.split_once(" SHM=").unwrap();
                writer = Some((pid.parse::<u32>().unwrap(), shm.to_owned()));
                break;
            }
        }
        let (wpid, shm) = writer.expect("the trainer reported its writer");
        assert!(matches!(proc_state(wpid), Some(c) if c != 'Z'));

        trainer.kill().unwrap(); // SIGKILL: no destructor runs in the trainer
        trainer.wait().unwrap();

        // The writer gets SIGKILL from the kernel (PR_SET_PDEATHSIG) and, reparented to
        // us, is reaped here.
        let t = Instant::now();
        let pid = rustix::process::Pid::from_raw(wpid as i32).unwrap();
        let status = loop {
            match rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::NOHANG) {
                Ok(Some((_, s))) => break s,
                Ok(None) => {}
                Err(e) => panic!("writer {wpid} is not our child after the trainer died: {e}"),
            }
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "writer {wpid} outlived its trainer"
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        eprintln!(
            "writer {wpid} gone {:?} after the trainer's SIGKILL: {status:?}",
            t.elapsed()
        );
        // Killed by the kernel with its trainer (PR_SET_PDEATHSIG), or, when it saw the
        // trainer's socket close first (the kernel closes a dying process's descriptors
        // before it signals the children), exited cleanly on its own (documented in
        // `ipc`): either way it did not outlive the trainer.
        let killed = status.terminating_signal() == Some(libc::SIGKILL);
        let exited_on_close = status.exit_status() == Some(0);
        assert!(
            killed || exited_on_close,
            "writer {wpid} ended with {status:?}: neither killed with its trainer nor exited on the closed socket"
        );
        assert_eq!(proc_state(wpid), None, "no zombie left");
        // A killed writer leaves its staging arena for recovery; this test cleans it up.
        remove_shm(&shm);
    });
}

#[test]
fn save_without_a_cuda_driver_is_a_clear_error() {
    if cuda::driver_present() {
        common::skip(
            common::REQUIRE_NO_GPU,
            "a CUDA driver is present; tests/gpu_ipc.rs covers this machine",
        );
        return;
    }
    let dir = common::real_dir("ipc-nocuda");
    let root = dir.path().to_owned();
    within(Duration::from_secs(120), move || {
        let client = config(&root).spawn().unwrap();
        // The trainer side: a device tensor cannot even be exported.
        // SAFETY: never dereferenced: the client fails before any CUDA call.
        let slice = unsafe { DeviceSlice::new(0x1000, 16, 0) };
        let err = client
            .save(
                1,
                &[Tensor::cuda("w", Dtype::F32, vec![4], slice)],
                &Metadata::new(),
            )
            .unwrap_err();
        assert!(
            matches!(&err, IpcError::Shmckpt(Error::Cuda { call, code: None, detail })
                if call == "cuInit" && detail.contains("no CUDA driver")),
            "{err:?}"
        );

        // The writer side: handles exported elsewhere reach a writer without a driver.
        let alloc = IpcAllocation {
            ordinal: 0,
            uuid: [7; 16],
            handle: IpcMemHandle([1; 64]),
            size: 4096,
        };
        let t = IpcTensor {
            name: "w".into(),
            dtype: Dtype::F32,
            shape: vec![4],
            len: 16,
            alloc: Some(0),
            offset: 0,
        };
        let err = client
            .save_exported(1, &[alloc], &[t], &Metadata::new())
            .unwrap_err();
        match &err {
            IpcError::Shmckpt(Error::Cuda { call, detail, .. }) => {
                assert!(call.contains("IPC writer"), "{call}");
                assert!(detail.contains("no CUDA driver"), "{detail}");
            }
            other => panic!("unexpected {other:?}"),
        }
        let err = client.prepare(&[0]).unwrap_err();
        assert!(
            matches!(&err, IpcError::Shmckpt(Error::Cuda { .. })),
            "{err:?}"
        );

        // The writer is still there and well; a host tensor is refused on this side.
        assert_eq!(client.stats().unwrap().cached_mappings, 0);
        let bytes = [1u8, 2, 3, 4];
        let err = client
            .save(
                1,
                &[Tensor::host("h", Dtype::U8, vec![4], &bytes)],
                &Metadata::new(),
            )
            .unwrap_err();
        assert!(
            matches!(&err, IpcError::Shmckpt(Error::Config(m)) if m.contains("host memory")),
            "{err:?}"
        );

        // Empty tensors need no device: a full round trip through the writer.
        let empty = [
            Tensor::host("e0", Dtype::F32, vec![0], &[]),
            Tensor::host("e1", Dtype::BF16, vec![3, 0], &[]),
        ];
        let meta: Metadata = [("k".to_owned(), "v".to_owned())].into();
        let h = client.save(1, &empty, &meta).unwrap();
        assert_eq!(h.staged().allocations, 0);
        let r = h.wait().unwrap();
        assert_eq!((r.step, r.tensors), (1, 2));
        assert!(r.dir.is_some() && r.durable >= r.writer.durable);
        // The same step again: the writer's typed error comes back typed.
        let err = client.save(1, &empty, &meta).map(|_| ()).unwrap_err();
        assert!(
            matches!(err, IpcError::Shmckpt(Error::StepExists { step: 1, .. })),
            "{err:?}"
        );
        client.shutdown().unwrap();

        let engine = Engine::open(EngineConfig::new(&root)).unwrap();
        let ck = engine.load(1).unwrap();
        assert_eq!(ck.tensors.len(), 2);
        assert_eq!(ck.get("e1").unwrap().shape, vec![3, 0]);
        assert_eq!(
            engine
                .manifest(1)
                .unwrap()
                .metadata
                .get("k")
                .map(String::as_str),
            Some("v")
        );
    });
}

#[test]
fn spawn_failures_are_clear_errors() {
    within(Duration::from_secs(120), || {
        let dir = common::real_dir("ipc-spawn");
        // No such root: refused before spawning.
        let err = config(&dir.path().join("missing")).spawn().unwrap_err();
        assert!(
            matches!(err, IpcError::Shmckpt(Error::RootMissing { .. })),
            "{err:?}"
        );
        // No such executable.
        let err = config(dir.path())
            .with_exe(dir.path().join("no-such-shmckpt"))
            .spawn()
            .unwrap_err();
        assert!(
            matches!(&err, IpcError::Ipc(m) if m.contains("cannot run")),
            "{err:?}"
        );
        // The writer's engine refuses its settings: the writer reports it and exits.
        let err = config(dir.path())
            .map_engine(|e| e.with_chunk_size(1000))
            .spawn()
            .unwrap_err();
        assert!(
            matches!(&err, IpcError::Shmckpt(Error::Config(m)) if m.contains("chunk_size")),
            "{err:?}"
        );
        // A root locked by another engine of the same rank.
        let engine = Engine::open(
            EngineConfig::new(dir.path())
                .with_staging_capacity(1 << 20)
                .with_chunk_size(64 << 10),
        )
        .unwrap();
        let err = config(dir.path()).spawn().unwrap_err();
        assert!(
            matches!(&err, IpcError::Ipc(m) if m.contains("lock")),
            "{err:?}"
        );
        drop(engine);
        // An executable that is not a writer at all (exits at once).
        let err = config(dir.path())
            .with_exe("/bin/true")
            .spawn()
            .unwrap_err();
        assert!(
            matches!(&err, IpcError::Ipc(m) if m.contains("exited")),
            "{err:?}"
        );
        let c = config(dir.path()).spawn().unwrap();
        c.shutdown().unwrap();
    });
}

#[test]
fn writer_dies_when_the_socket_closes_without_shutdown() {
    within(Duration::from_secs(120), || {
        let dir = common::real_dir("ipc-eof");
        let client: IpcWriterClient = config(dir.path()).spawn().unwrap();
        let pid = client.pid();
        // Kill the writer behind the client's back: calls fail with a clear error, and
        // dropping the client still reaps it.
        rustix::process::kill_process(
            rustix::process::Pid::from_raw(pid as i32).unwrap(),
            rustix::process::Signal::KILL,
        )
        .unwrap();
        let t = Instant::now();
        let err = loop {
            match client.stats() {
                Err(e) => break e,
                Ok(_) => {
                    assert!(t.elapsed() < Duration::from_secs(5));
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        };
        assert!(
            matches!(&err, IpcError::Ipc(m) if m.contains("gone")),
            "{err:?}"
        );
        let shm = client.shm_name().to_owned();
        let err = client.shutdown().unwrap_err();
        assert!(matches!(err, IpcError::Ipc(_)), "{err:?}");
        assert_eq!(proc_state(pid), None);
        remove_shm(&shm);
    });
}
