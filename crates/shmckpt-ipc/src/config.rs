//! [`IpcConfig`]: the writer engine's settings plus the IPC-only ones.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use shmckpt::BackendKind;
use shmckpt::EngineConfig;

use super::{EXE_ENV, WRITER_SUBCOMMAND};

/// Settings of the IPC writer: the [`EngineConfig`] of the engine that runs in the writer
/// process, plus what only the IPC path has. Build with [`IpcConfig::new`] (or
/// [`IpcConfig::with_engine`]) and the `with_*` setters (each gives its default), then
/// [`IpcConfig::spawn`].
///
/// The writer's engine gets the root, staging capacity, chunk size, writer threads, queue
/// depth, copy threads, backend, O_DIRECT, retention, rank and in-flight saves of
/// `engine`; its shared-memory name and recovery-on-open are the writer's own.
#[derive(Debug, Clone)]
pub struct IpcConfig {
    pub(super) engine: EngineConfig,
    pub(super) exe: Option<PathBuf>,
    pub(super) cache: bool,
    pub(super) connect_timeout: Duration,
    pub(super) shutdown_timeout: Duration,
}

impl IpcConfig {
    /// A writer for checkpoints under `root` (an existing, writable directory that no
    /// other engine of the same rank uses), with all defaults.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self::with_engine(EngineConfig::new(root))
    }

    /// A writer whose engine uses `engine`'s settings.
    pub fn with_engine(engine: EngineConfig) -> Self {
        IpcConfig {
            engine,
            exe: None,
            cache: true,
            connect_timeout: Duration::from_secs(300),
            shutdown_timeout: Duration::from_secs(120),
        }
    }

    /// Change the writer engine's settings.
    pub fn map_engine(mut self, f: impl FnOnce(EngineConfig) -> EngineConfig) -> Self {
        self.engine = f(self.engine);
        self
    }

    /// The `shmckpt` executable to run as the writer. Default: `$SHMCKPT_EXE`, else this
    /// process's executable when its file name starts with `shmckpt`, else `shmckpt` on
    /// the `PATH`.
    pub fn with_exe(mut self, exe: impl Into<PathBuf>) -> Self {
        self.exe = Some(exe.into());
        self
    }

    /// Keep mapped handles open across saves while the trainer's allocations are
    /// unchanged (NVRx's cached structure); mappings a save no longer uses are closed after
    /// it. Off: every save opens its handles and closes them once staged. Default on.
    pub fn with_cache(mut self, on: bool) -> Self {
        self.cache = on;
        self
    }

    /// How long the writer may take to start, connect and open its engine (which
    /// prefaults its staging arena). A writer that exits early is noticed at once. Default
    /// 300 s.
    pub fn with_connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = d;
        self
    }

    /// How long shutdown waits for the writer to finish its saves and exit before it is
    /// killed (`SIGKILL`). Default 120 s.
    pub fn with_shutdown_timeout(mut self, d: Duration) -> Self {
        self.shutdown_timeout = d;
        self
    }

    /// The writer engine's settings.
    pub fn engine(&self) -> &EngineConfig {
        &self.engine
    }

    /// The checkpoint root.
    pub fn root(&self) -> &Path {
        self.engine.root()
    }

    /// Whether handles are cached.
    pub fn cache(&self) -> bool {
        self.cache
    }

    pub(super) fn exe(&self) -> PathBuf {
        if let Some(e) = &self.exe {
            return e.clone();
        }
        if let Some(e) = std::env::var_os(EXE_ENV) {
            return PathBuf::from(e);
        }
        if let Ok(e) = std::env::current_exe()
            && e.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("shmckpt"))
        {
            return e;
        }
        PathBuf::from("shmckpt")
    }

    /// The writer's command line after the executable (the `ipc-writer` subcommand of the
    /// CLI parses exactly this).
    pub fn writer_args(&self, socket: &Path, parent_pid: u32) -> Vec<OsString> {
        let e = &self.engine;
        let mut v: Vec<OsString> = vec![
            WRITER_SUBCOMMAND.into(),
            "--socket".into(),
            socket.into(),
            "--dir".into(),
            e.root().into(),
            "--parent-pid".into(),
            parent_pid.to_string().into(),
            "--staging-capacity".into(),
            e.staging_capacity().to_string().into(),
            "--chunk-size".into(),
            e.chunk_size().to_string().into(),
            "--writer-threads".into(),
            e.writer_threads().to_string().into(),
            "--queue-depth".into(),
            e.queue_depth().to_string().into(),
            "--copy-threads".into(),
            e.copy_threads().to_string().into(),
            "--backend".into(),
            match e.backend() {
                BackendKind::Auto => "auto",
                BackendKind::IoUring => "io_uring",
                BackendKind::Pwrite => "pwrite",
            }
            .into(),
            "--max-inflight-saves".into(),
            e.max_inflight_saves().to_string().into(),
            "--rank".into(),
            e.rank().0.to_string().into(),
            "--world-size".into(),
            e.rank().1.to_string().into(),
        ];
        if let Some(n) = e.keep_last() {
            v.extend(["--keep-last".into(), n.to_string().into()]);
        }
        if !e.direct_io() {
            v.push("--no-direct-io".into());
        }
        v
    }
}
