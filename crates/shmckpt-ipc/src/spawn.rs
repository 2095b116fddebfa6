//! Starting the writer process and connecting to it.

use std::collections::BTreeMap;
use std::io::{self, Read};
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

use super::client::IpcWriterClient;
use super::config::IpcConfig;
use super::conn::{ClientState, Inner};
use super::wire::{Reply, from_wire, read_frame};
use super::{EXE_ENV, PROTOCOL_VERSION, WRITER_SUBCOMMAND};

pub(super) static SOCKET_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A private directory for the listening socket (short path: `sun_path` is 108 bytes).
pub(super) fn socket_dir() -> Result<PathBuf> {
    let name = format!(
        "shmckpt-ipc-{}-{}-{}",
        std::process::id(),
        SOCKET_COUNTER.fetch_add(1, Ordering::Relaxed),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis())
            % 1_000_000
    );
    let mut base = std::env::temp_dir();
    if base.as_os_str().len() + name.len() + 16 > 100 {
        base = PathBuf::from("/tmp");
    }
    let dir = base.join(name);
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .map_err(|e| Error::io("mkdir", &dir, e))?;
    Ok(dir)
}

impl IpcWriterClient {
    /// Spawn the writer process (once), wait for it to connect and open its engine.
    pub fn spawn(cfg: IpcConfig) -> Result<IpcWriterClient> {
        if !cfg.root().is_dir() {
            return Err(shmckpt::Error::RootMissing {
                path: cfg.root().to_owned(),
            }
            .into());
        }
        let dir = socket_dir()?;
        let res = Self::spawn_in(cfg, &dir);
        let _ = std::fs::remove_dir_all(&dir);
        res
    }

    pub(super) fn spawn_in(cfg: IpcConfig, dir: &Path) -> Result<IpcWriterClient> {
        let sock = dir.join("w.sock");
        let listener = UnixListener::bind(&sock).map_err(|e| Error::io("bind", &sock, e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("fcntl(O_NONBLOCK)", &sock, e))?;
        let exe = cfg.exe();
        let mut cmd = Command::new(&exe);
        cmd.args(cfg.writer_args(&sock, std::process::id()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());

        // PR_SET_PDEATHSIG fires when the *thread* that spawned the child exits: spawn from a
        // thread that lives until the child has been reaped.
        let (child_tx, child_rx) = mpsc::channel();
        let (stop_tx, stop_rx) = mpsc::channel::<()>();
        let keeper = std::thread::Builder::new()
            .name("shmckpt-ipc-parent".into())
            .spawn(move || {
                let _ = child_tx.send(cmd.spawn());
                // Returns when the client drops the sender, after reaping the child.
                let _ = stop_rx.recv();
            })
            .map_err(|e| Error::Ipc(format!("cannot start the spawner thread: {e}")))?;
        let spawned = child_rx
            .recv()
            .map_err(|_| Error::Ipc("the spawner thread died".into()))
            .and_then(|r| {
                r.map_err(|e| {
                    Error::Ipc(format!(
                        "cannot run {} {WRITER_SUBCOMMAND}: {e} (set {EXE_ENV} or IpcConfig::with_exe)",
                        exe.display()
                    ))
                })
            });
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                drop(stop_tx);
                let _ = keeper.join();
                return Err(e);
            }
        };
        let pid = child.id();
        let abort = |mut child: Child, stop_tx: mpsc::Sender<()>, keeper: JoinHandle<()>| {
            let _ = child.kill();
            let _ = child.wait();
            drop(stop_tx);
            let _ = keeper.join();
        };

        // Accept, watching the child.
        let deadline = Instant::now() + cfg.connect_timeout;
        let stream = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    abort(child, stop_tx, keeper);
                    return Err(Error::io("accept", &sock, e));
                }
            }
            if let Ok(Some(status)) = child.try_wait() {
                drop(stop_tx);
                let _ = keeper.join();
                return Err(Error::Ipc(format!(
                    "writer (pid {pid}) exited before connecting: {status}"
                )));
            }
            if Instant::now() >= deadline {
                abort(child, stop_tx, keeper);
                return Err(Error::Ipc(format!(
                    "writer (pid {pid}) did not connect within {:?}",
                    cfg.connect_timeout
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        drop(listener);
        let _ = std::fs::remove_file(&sock);

        // The writer speaks first, once its engine is open (its staging arena prefaulted,
        // which takes a while for large arenas): wait for data while watching the child.
        let hello = stream
            .set_nonblocking(false)
            .and_then(|()| stream.set_read_timeout(Some(Duration::from_millis(100))))
            .and_then(|()| {
                let mut first = [0u8; 1];
                loop {
                    match (&stream).read(&mut first) {
                        Ok(0) => return Ok(None),
                        Ok(_) => break,
                        Err(e)
                            if matches!(
                                e.kind(),
                                io::ErrorKind::WouldBlock
                                    | io::ErrorKind::TimedOut
                                    | io::ErrorKind::Interrupted
                            ) =>
                        {
                            if let Ok(Some(status)) = child.try_wait() {
                                return Err(io::Error::other(format!("it exited: {status}")));
                            }
                            if Instant::now() >= deadline {
                                return Err(io::Error::other(format!(
                                    "not ready within {:?}",
                                    cfg.connect_timeout
                                )));
                            }
                        }
                        Err(e) => return Err(e),
                    }
                }
                stream.set_read_timeout(Some(Duration::from_secs(30)))?;
                read_frame::<Reply>(&mut io::Cursor::new(first).chain(&stream))
            });
        let (shm_name, staging_bytes, backend) = match hello {
            Ok(Some(Reply::Ready {
                version,
                shm_name,
                staging_bytes,
                backend,
                ..
            })) if version == PROTOCOL_VERSION => (shm_name, staging_bytes, backend),
            other => {
                let err = match other {
                    Ok(Some(Reply::Ready { version, .. })) => Error::Ipc(format!(
                        "writer (pid {pid}) speaks protocol {version}, this library {PROTOCOL_VERSION}"
                    )),
                    Ok(Some(Reply::Failed { error, .. })) => from_wire(error, pid),
                    Ok(Some(other)) => {
                        Error::Ipc(format!("writer (pid {pid}) sent {other:?} first"))
                    }
                    Ok(None) => {
                        Error::Ipc(format!("writer (pid {pid}) closed before it was ready"))
                    }
                    Err(e) => Error::Ipc(format!("writer (pid {pid}) did not say ready: {e}")),
                };
                // A writer that failed exits on its own; reap it (or kill it if it hangs).
                let t = Instant::now();
                while t.elapsed() < Duration::from_secs(5) {
                    if let Ok(Some(_)) = child.try_wait() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                abort(child, stop_tx, keeper);
                return Err(err);
            }
        };
        let _ = stream.set_read_timeout(None);
        let (out, rd) = match (stream.try_clone(), stream.try_clone()) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(e), _) | (_, Err(e)) => {
                abort(child, stop_tx, keeper);
                return Err(Error::Ipc(format!("cannot clone the socket: {e}")));
            }
        };
        let inner = Arc::new(Inner {
            out: Mutex::new(out),
            request: Mutex::new(()),
            next_id: AtomicU64::new(1),
            state: Mutex::new(ClientState::default()),
            changed: Condvar::new(),
            pid,
        });
        let reader = {
            let inner = Arc::clone(&inner);
            std::thread::Builder::new()
                .name("shmckpt-ipc-reader".into())
                .spawn(move || inner.read_loop(rd))
        };
        let reader = match reader {
            Ok(r) => r,
            Err(e) => {
                abort(child, stop_tx, keeper);
                return Err(Error::Ipc(format!("cannot start the reader thread: {e}")));
            }
        };
        tracing::info!(pid, shm = %shm_name, root = %cfg.root().display(), "IPC writer ready");
        Ok(IpcWriterClient {
            inner,
            cfg,
            child: Mutex::new(Some(child)),
            keeper: Some((stop_tx, keeper)),
            reader: Some(reader),
            stream,
            shm_name,
            staging_bytes,
            backend,
            contexts: Mutex::new(BTreeMap::new()),
        })
    }
}
