//! The CUDA IPC baseline (`--mode ipc`): the design NVIDIA NVRx and Megatron use for
//! asynchronous checkpoints, implemented faithfully so its costs can be measured against
//! shmckpt's own path on the same GPU.
//!
//! The trainer ([`IpcWriterClient`]) spawns one persistent writer process
//! (`shmckpt ipc-writer`, hidden subcommand) and talks to it over a Unix socket. For each
//! save the trainer synchronizes its devices, exports a CUDA IPC handle for every device
//! allocation holding a tensor (`cuMemGetAddressRange` + `cuIpcGetMemHandle`) and sends the
//! handles with each tensor's offset inside its allocation. The writer maps the handles
//! (`cuIpcOpenMemHandle`, the "rebuild"), copies device to host into its own pinned staging
//! arena with its own [`Engine`], and writes and commits the checkpoint exactly like
//! shmckpt (same writer pool, file format and commit). The trainer's `save` returns when
//! the writer reports its device-to-host copies done; [`IpcSaveHandle::wait`] returns when
//! the writer reports the checkpoint committed.
//!
//! Like NVRx with a constant state structure, the writer keeps the mapped handles open
//! across saves while the trainer's allocations are unchanged ([`IpcConfig::with_cache`]).
//! That is what makes IPC saves cheap after the first, and it is also its main cost: an open
//! mapping keeps the trainer's allocation alive even after the trainer frees it, until the
//! writer closes it ([`IpcWriterClient::release`]).
//!
//! # Ordering
//! The writer copies on its own stream in its own context, which cannot wait on the
//! trainer's streams. The trainer therefore synchronizes every device it saves from
//! (`cuCtxSynchronize` of the primary context, as [`Engine::save`] does) before it exports
//! the handles: every write queued before `save` has completed when the writer's copies
//! start. The trainer must not write the tensors until `save` returns (the writer's copies
//! have completed by then). Work queued in a context other than the device's primary
//! context is not covered.
//!
//! # Process lifetime
//! The writer is spawned from a dedicated thread of the client that lives until the writer
//! has been reaped, and the writer sets `PR_SET_PDEATHSIG(SIGKILL)` first thing (then checks
//! that its parent is still the trainer), so a trainer that dies for any reason takes the
//! writer with it; the kernel then closes its IPC mappings. The writer also exits when the
//! socket closes. Dropping the client asks the writer to finish its saves and exit, waits
//! (see [`IpcConfig::with_shutdown_timeout`]), then kills it, and always reaps it.
//!
//! # Protocol
//! Each message is a little-endian `u32` length followed by that many bytes of JSON (an
//! object tagged by `"op"`). The writer speaks first (`ready`, or `failed` with id 0 when
//! it cannot start). Requests carry an `id`; the writer answers each in order, and sends
//! `durable` / `durable_failed` for a save's id later, when its commit finished.
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::OsString;
use std::io::{self, BufReader, Read, Write};
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::config::{self, EngineConfig};
use crate::device::cuda::{self, Context, CtxGuard, IpcMapping, IpcMemHandle};
use crate::dtype::Dtype;
use crate::engine::{Engine, SaveHandle, SaveReport, SaveTimings};
use crate::error::{Error, Result};
use crate::io::BackendKind;
use crate::manifest::Metadata;
use crate::tensor::{Source, Tensor};

/// Version of the socket protocol; the writer refuses to talk to another version.
pub const PROTOCOL_VERSION: u32 = 1;
/// Name of the hidden subcommand that runs the writer.
pub const WRITER_SUBCOMMAND: &str = "ipc-writer";
/// Largest message accepted on the socket.
const MAX_FRAME: u32 = 256 << 20;
/// Environment variable naming the `shmckpt` executable to spawn as the writer.
pub const EXE_ENV: &str = "SHMCKPT_EXE";

// ---------------------------------------------------------------------------------------
// Wire format
// ---------------------------------------------------------------------------------------

/// One exported allocation.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct WireAlloc {
    /// Device ordinal in the trainer (a hint; the UUID decides).
    ordinal: i32,
    /// Device UUID, hex.
    uuid: String,
    /// `CUipcMemHandle`, hex (128 characters).
    handle: String,
    /// Allocation size the trainer's driver reports.
    size: u64,
}

/// One tensor: a range of an exported allocation (or no bytes at all).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct WireTensor {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    len: u64,
    /// Index into the save's allocations; `None` for a zero-length tensor.
    alloc: Option<usize>,
    /// Offset of the tensor's first byte inside its allocation.
    offset: u64,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum Request {
    Prepare {
        id: u64,
        allocs: Vec<WireAlloc>,
    },
    Save {
        id: u64,
        step: u64,
        cache: bool,
        allocs: Vec<WireAlloc>,
        tensors: Vec<WireTensor>,
        metadata: Metadata,
    },
    Release {
        id: u64,
    },
    Stats {
        id: u64,
    },
    Shutdown {
        id: u64,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct WireError {
    kind: String,
    message: String,
    #[serde(default)]
    step: Option<u64>,
    #[serde(default)]
    root: Option<PathBuf>,
    #[serde(default)]
    needed: Option<u64>,
    #[serde(default)]
    capacity: Option<u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct WireReport {
    step: u64,
    dir: Option<PathBuf>,
    file: PathBuf,
    bytes: u64,
    tensors: usize,
    staging_s: f64,
    backpressure_s: f64,
    durable_s: f64,
    committed_s: f64,
    backend: String,
    direct_io: bool,
    retired: Vec<u64>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum Reply {
    Ready {
        version: u32,
        pid: u32,
        shm_name: String,
        staging_bytes: u64,
        backend: String,
    },
    Prepared {
        id: u64,
        devices: Vec<i32>,
        registration_s: Option<f64>,
    },
    Staged {
        id: u64,
        step: u64,
        bytes: u64,
        writer_staging_s: f64,
        backpressure_s: f64,
        registration_s: f64,
        setup_s: f64,
        open_s: f64,
        opened: usize,
        reused: usize,
        /// From the request's bytes read to the reply sent: decoding plus handling.
        handle_s: f64,
    },
    Durable {
        id: u64,
        report: WireReport,
    },
    DurableFailed {
        id: u64,
        error: WireError,
    },
    Released {
        id: u64,
        closed: usize,
        bytes: u64,
        took_s: f64,
    },
    Stats {
        id: u64,
        stats: WriterStats,
    },
    Failed {
        id: u64,
        error: WireError,
    },
    Bye {
        id: u64,
    },
}

impl Reply {
    fn id(&self) -> u64 {
        match self {
            Reply::Ready { .. } => 0,
            Reply::Prepared { id, .. }
            | Reply::Staged { id, .. }
            | Reply::Durable { id, .. }
            | Reply::DurableFailed { id, .. }
            | Reply::Released { id, .. }
            | Reply::Stats { id, .. }
            | Reply::Failed { id, .. }
            | Reply::Bye { id } => *id,
        }
    }
}

/// The writer process's own view of itself ([`IpcWriterClient::stats`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WriterStats {
    /// Writer pid.
    pub pid: u32,
    /// Its staging segment in `/dev/shm`.
    pub shm_name: String,
    /// Bytes of its staging arena.
    pub staging_bytes: u64,
    /// Peak resident set size (`VmHWM`), bytes.
    pub vm_hwm_bytes: u64,
    /// Resident set size now (`VmRSS`), bytes.
    pub vm_rss_bytes: u64,
    /// Part of `VmRSS` that is shared memory (`RssShmem`: the staging arena), bytes.
    pub rss_shmem_bytes: u64,
    /// IPC mappings open now.
    pub cached_mappings: usize,
    /// Bytes of the trainer's allocations those mappings keep alive.
    pub cached_bytes: u64,
    /// Handles opened since start.
    pub opens: u64,
    /// Handles closed since start.
    pub closes: u64,
    /// Total time in `cuIpcOpenMemHandle`, seconds.
    pub open_total_s: f64,
    /// Total time in `cuIpcCloseMemHandle`, seconds.
    pub close_total_s: f64,
    /// Time the writer spent closing handles after the last save (uncached saves close
    /// every handle once staged, cached saves close the handles the save no longer uses),
    /// seconds. Off the trainer's critical path: done after the reply.
    pub last_close_s: f64,
    /// Handles closed after the last save.
    pub last_closed: usize,
}

fn write_frame<T: Serialize>(w: &mut impl Write, msg: &T) -> io::Result<()> {
    let body = serde_json::to_vec(msg).map_err(io::Error::other)?;
    let len = u32::try_from(body.len())
        .ok()
        .filter(|&l| l <= MAX_FRAME)
        .ok_or_else(|| io::Error::other(format!("message of {} bytes is too large", body.len())))?;
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(&body);
    w.write_all(&buf)?;
    w.flush()
}

/// Read one message; `Ok(None)` on a clean end of stream between messages.
fn read_frame<T: for<'de> Deserialize<'de>>(r: &mut impl Read) -> io::Result<Option<T>> {
    read_frame_bytes(r)?.map(|b| decode(&b)).transpose()
}

fn decode<T: for<'de> Deserialize<'de>>(body: &[u8]) -> io::Result<T> {
    serde_json::from_slice(body).map_err(|e| io::Error::other(format!("malformed message: {e}")))
}

/// The body of one message; `Ok(None)` on a clean end of stream between messages.
fn read_frame_bytes(r: &mut impl Read) -> io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let len = u32::from_le_bytes(len);
    if len > MAX_FRAME {
        return Err(io::Error::other(format!(
            "message of {len} bytes exceeds the limit of {MAX_FRAME}"
        )));
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body)?;
    Ok(Some(body))
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(2 * bytes.len());
    for &b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N || !s.is_ascii() {
        return None;
    }
    let nibble = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    };
    let mut out = [0u8; N];
    for (o, pair) in out.iter_mut().zip(s.as_bytes().chunks_exact(2)) {
        *o = (nibble(pair[0])? << 4) | nibble(pair[1])?;
    }
    Some(out)
}

fn to_wire(e: &Error) -> WireError {
    let mut w = WireError {
        kind: "other".into(),
        message: e.to_string(),
        step: None,
        root: None,
        needed: None,
        capacity: None,
    };
    match e {
        Error::Cuda(m) => {
            w.kind = "cuda".into();
            w.message = m.clone();
        }
        Error::Config(m) => {
            w.kind = "config".into();
            w.message = m.clone();
        }
        Error::StepExists { step, root } => {
            w.kind = "step_exists".into();
            w.step = Some(*step);
            w.root = Some(root.clone());
        }
        Error::TooLarge { needed, capacity } => {
            w.kind = "too_large".into();
            w.needed = Some(*needed);
            w.capacity = Some(*capacity);
        }
        _ => {}
    }
    w
}

fn from_wire(w: WireError, pid: u32) -> Error {
    match (w.kind.as_str(), w.step, w.root, w.needed, w.capacity) {
        ("cuda", ..) => Error::Cuda(format!("in the IPC writer (pid {pid}): {}", w.message)),
        ("config", ..) => Error::Config(w.message),
        ("step_exists", Some(step), Some(root), ..) => Error::StepExists { step, root },
        ("too_large", _, _, Some(needed), Some(capacity)) => Error::TooLarge { needed, capacity },
        _ => Error::Ipc(format!("writer (pid {pid}): {}", w.message)),
    }
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn dur(s: f64) -> Duration {
    Duration::try_from_secs_f64(s).unwrap_or_default()
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// `VmHWM`, `VmRSS` and `RssShmem` of a process, in bytes (zeros when unreadable).
pub fn process_memory(pid: u32) -> (u64, u64, u64) {
    let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return (0, 0, 0);
    };
    let field = |name: &str| {
        s.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    (field("VmHWM:"), field("VmRSS:"), field("RssShmem:"))
}

// ---------------------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------------------

/// Settings of the IPC writer. Build with [`IpcConfig::new`] and the `with_*` setters
/// (each gives its default), then [`IpcConfig::spawn`].
#[derive(Debug, Clone)]
pub struct IpcConfig {
    root: PathBuf,
    exe: Option<PathBuf>,
    cache: bool,
    staging_capacity: u64,
    chunk_size: u64,
    writer_threads: usize,
    queue_depth: u32,
    copy_threads: Option<usize>,
    backend: BackendKind,
    direct_io: bool,
    keep_last: Option<usize>,
    rank: u32,
    world_size: u32,
    max_inflight_saves: u32,
    connect_timeout: Duration,
    shutdown_timeout: Duration,
}

impl IpcConfig {
    /// A writer for checkpoints under `root` (an existing, writable directory that no
    /// other engine of the same rank uses), with all defaults.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        IpcConfig {
            root: root.into(),
            exe: None,
            cache: true,
            staging_capacity: config::DEFAULT_STAGING_CAPACITY,
            chunk_size: config::DEFAULT_CHUNK_SIZE,
            writer_threads: config::DEFAULT_WRITER_THREADS,
            queue_depth: config::DEFAULT_QUEUE_DEPTH,
            copy_threads: None,
            backend: BackendKind::Auto,
            direct_io: true,
            keep_last: None,
            rank: 0,
            world_size: 1,
            max_inflight_saves: config::DEFAULT_MAX_INFLIGHT_SAVES,
            connect_timeout: Duration::from_secs(300),
            shutdown_timeout: Duration::from_secs(120),
        }
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

    /// The writer engine's staging capacity ([`EngineConfig::with_staging_capacity`]).
    /// Default 2 GiB.
    pub fn with_staging_capacity(mut self, bytes: u64) -> Self {
        self.staging_capacity = bytes;
        self
    }

    /// [`EngineConfig::with_chunk_size`]. Default 8 MiB.
    pub fn with_chunk_size(mut self, bytes: u64) -> Self {
        self.chunk_size = bytes;
        self
    }

    /// [`EngineConfig::with_writer_threads`]. Default 2.
    pub fn with_writer_threads(mut self, n: usize) -> Self {
        self.writer_threads = n;
        self
    }

    /// [`EngineConfig::with_queue_depth`]. Default 8.
    pub fn with_queue_depth(mut self, depth: u32) -> Self {
        self.queue_depth = depth;
        self
    }

    /// [`EngineConfig::with_copy_threads`]. Default: the engine's.
    pub fn with_copy_threads(mut self, n: usize) -> Self {
        self.copy_threads = Some(n);
        self
    }

    /// [`EngineConfig::with_backend`]. Default [`BackendKind::Auto`].
    pub fn with_backend(mut self, kind: BackendKind) -> Self {
        self.backend = kind;
        self
    }

    /// [`EngineConfig::with_direct_io`]. Default true.
    pub fn with_direct_io(mut self, on: bool) -> Self {
        self.direct_io = on;
        self
    }

    /// [`EngineConfig::with_keep_last`]. Default `None`.
    pub fn with_keep_last(mut self, n: Option<usize>) -> Self {
        self.keep_last = n;
        self
    }

    /// [`EngineConfig::with_rank`]. Default 0 of 1.
    pub fn with_rank(mut self, rank: u32, world_size: u32) -> Self {
        self.rank = rank;
        self.world_size = world_size;
        self
    }

    /// [`EngineConfig::with_max_inflight_saves`]. Default 4.
    pub fn with_max_inflight_saves(mut self, n: u32) -> Self {
        self.max_inflight_saves = n;
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

    /// The checkpoint root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Whether handles are cached.
    pub fn cache(&self) -> bool {
        self.cache
    }

    /// Spawn the writer and connect to it.
    pub fn spawn(self) -> Result<IpcWriterClient> {
        IpcWriterClient::spawn(self)
    }

    fn exe(&self) -> PathBuf {
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
        let mut v: Vec<OsString> = vec![
            WRITER_SUBCOMMAND.into(),
            "--socket".into(),
            socket.into(),
            "--dir".into(),
            self.root.clone().into(),
            "--parent-pid".into(),
            parent_pid.to_string().into(),
            "--staging-capacity".into(),
            self.staging_capacity.to_string().into(),
            "--chunk-size".into(),
            self.chunk_size.to_string().into(),
            "--writer-threads".into(),
            self.writer_threads.to_string().into(),
            "--queue-depth".into(),
            self.queue_depth.to_string().into(),
            "--backend".into(),
            match self.backend {
                BackendKind::Auto => "auto",
                BackendKind::IoUring => "io_uring",
                BackendKind::Pwrite => "pwrite",
            }
            .into(),
            "--max-inflight-saves".into(),
            self.max_inflight_saves.to_string().into(),
            "--rank".into(),
            self.rank.to_string().into(),
            "--world-size".into(),
            self.world_size.to_string().into(),
        ];
        if let Some(n) = self.copy_threads {
            v.extend(["--copy-threads".into(), n.to_string().into()]);
        }
        if let Some(n) = self.keep_last {
            v.extend(["--keep-last".into(), n.to_string().into()]);
        }
        if !self.direct_io {
            v.push("--no-direct-io".into());
        }
        v
    }
}

// ---------------------------------------------------------------------------------------
// Trainer side
// ---------------------------------------------------------------------------------------

/// What is known when [`IpcWriterClient::save`] returns.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct IpcStaged {
    /// Step.
    pub step: u64,
    /// File bytes staged by the writer.
    pub bytes: u64,
    /// The trainer's stall: from the `save` call until it returned.
    pub stall: Duration,
    /// Part of it spent synchronizing the trainer's devices.
    pub sync: Duration,
    /// Part of it spent exporting handles (`cuMemGetAddressRange` + `cuIpcGetMemHandle`).
    pub export: Duration,
    /// Allocations exported (one handle each).
    pub allocations: usize,
    /// Writer: time in `cuIpcOpenMemHandle` for the handles it had not cached.
    pub open: Duration,
    /// Writer: handles opened by this save.
    pub opened: usize,
    /// Writer: handles reused from its cache.
    pub reused: usize,
    /// Writer: resolving devices and creating contexts (first use of a device).
    pub setup: Duration,
    /// Writer: time in its engine's `save` (device-to-host copies into its staging).
    pub writer_staging: Duration,
    /// Trainer: from sending the request to receiving the reply (the writer's work plus
    /// encoding, transfer and decoding of both messages).
    pub request: Duration,
    /// Writer: from the request's bytes received to the reply sent (decoding, opening,
    /// staging). `request - writer_handle` is the messaging cost.
    pub writer_handle: Duration,
    /// Part of `writer_staging` spent waiting for staging space.
    pub backpressure: Duration,
    /// Part of `writer_staging` spent registering the writer's arena with CUDA.
    pub registration: Duration,
}

/// A committed IPC save.
#[derive(Debug, Clone, PartialEq)]
pub struct IpcSaveReport {
    /// Step.
    pub step: u64,
    /// Committed directory (`None` while other ranks are still writing).
    pub dir: Option<PathBuf>,
    /// This rank's file.
    pub file: PathBuf,
    /// File bytes.
    pub bytes: u64,
    /// Tensors saved.
    pub tensors: usize,
    /// Backend the writer used.
    pub backend: String,
    /// Whether the file was written with O_DIRECT.
    pub direct_io: bool,
    /// Steps deleted by retention after this commit.
    pub retired: Vec<u64>,
    /// The writer engine's timings, from its `save` call.
    pub writer: SaveTimings,
    /// Time to durable on the trainer's clock, from its `save` call: the trainer's time
    /// before the writer's engine started (stall minus the writer's staging) plus the
    /// writer's time to durable.
    pub durable: Duration,
    /// Time to committed, on the same clock.
    pub committed: Duration,
    /// The staging facts.
    pub staged: IpcStaged,
}

impl IpcSaveReport {
    /// The report as the engine's [`SaveReport`] (timings on the trainer's clock).
    pub fn to_save_report(&self) -> SaveReport {
        SaveReport {
            step: self.step,
            dir: self.dir.clone(),
            file: self.file.clone(),
            bytes: self.bytes,
            tensors: self.tensors,
            timings: SaveTimings {
                staging: self.staged.stall,
                backpressure: self.staged.backpressure,
                durable: self.durable,
                committed: self.committed,
            },
            backend: match self.backend.as_str() {
                "io_uring" => "io_uring",
                "pwrite" => "pwrite",
                _ => "unknown",
            },
            direct_io: self.direct_io,
            retired: self.retired.clone(),
        }
    }
}

/// What [`IpcWriterClient::prepare`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct IpcPrepared {
    /// Device ordinals in the writer.
    pub devices: Vec<i32>,
    /// Time the writer took to register its staging arena, when this call registered it.
    pub registration: Option<Duration>,
    /// Round trip of the request (context creation included).
    pub took: Duration,
}

/// What [`IpcWriterClient::release`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IpcReleased {
    /// Mappings closed.
    pub closed: usize,
    /// Bytes of trainer allocations they kept alive.
    pub bytes: u64,
    /// Time the writer spent closing them.
    pub writer_took: Duration,
    /// Round trip of the request as the trainer saw it.
    pub took: Duration,
}

/// A tensor already exported by the caller, for [`IpcWriterClient::save_exported`].
#[derive(Debug, Clone)]
pub struct IpcTensor {
    /// Name.
    pub name: String,
    /// Dtype.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Bytes.
    pub len: u64,
    /// Index into the allocations; `None` for a zero-length tensor.
    pub alloc: Option<usize>,
    /// Offset of the first byte inside the allocation.
    pub offset: u64,
}

/// An allocation already exported by the caller, for [`IpcWriterClient::save_exported`].
#[derive(Debug, Clone)]
pub struct IpcAllocation {
    /// Device ordinal in the caller's process.
    pub ordinal: i32,
    /// Device UUID ([`cuda::device_uuid`]).
    pub uuid: [u8; 16],
    /// The handle ([`cuda::ipc_export`] of the allocation base).
    pub handle: IpcMemHandle,
    /// Allocation size.
    pub size: u64,
}

impl IpcAllocation {
    fn wire(&self) -> WireAlloc {
        WireAlloc {
            ordinal: self.ordinal,
            uuid: hex(&self.uuid),
            handle: hex(&self.handle.0),
            size: self.size,
        }
    }
}

#[derive(Default)]
struct ClientState {
    replies: HashMap<u64, Reply>,
    durable: HashMap<u64, std::result::Result<WireReport, WireError>>,
    abandoned: HashSet<u64>,
    closed: Option<String>,
}

struct Inner {
    out: Mutex<UnixStream>,
    /// One request at a time (the writer answers in order).
    request: Mutex<()>,
    next_id: AtomicU64,
    state: Mutex<ClientState>,
    changed: Condvar,
    pid: u32,
}

impl Inner {
    fn gone(&self, why: &str) -> Error {
        Error::Ipc(format!("writer (pid {}) is gone: {why}", self.pid))
    }

    /// Send a request and wait for its reply (until `deadline`, if any). A `failed` reply
    /// becomes the error it carries.
    fn call(&self, make: impl FnOnce(u64) -> Request, deadline: Option<Instant>) -> Result<Reply> {
        let _one = lock(&self.request);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        if let Some(why) = &lock(&self.state).closed {
            return Err(self.gone(why));
        }
        let req = make(id);
        write_frame(&mut *lock(&self.out), &req)
            .map_err(|e| self.gone(&format!("cannot send a request: {e}")))?;
        let mut st = lock(&self.state);
        loop {
            if let Some(r) = st.replies.remove(&id) {
                return match r {
                    Reply::Failed { error, .. } => Err(from_wire(error, self.pid)),
                    other => Ok(other),
                };
            }
            if let Some(why) = &st.closed {
                return Err(self.gone(why));
            }
            st = match deadline {
                None => self.changed.wait(st).unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Err(Error::Ipc(format!(
                            "writer (pid {}) did not answer in time",
                            self.pid
                        )));
                    }
                    self.changed
                        .wait_timeout(st, d - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
        }
    }

    fn read_loop(self: Arc<Self>, stream: UnixStream) {
        let mut r = BufReader::new(stream);
        let why = loop {
            match read_frame::<Reply>(&mut r) {
                Ok(Some(reply)) => {
                    let mut st = lock(&self.state);
                    match reply {
                        Reply::Durable { id, report } => {
                            if !st.abandoned.remove(&id) {
                                st.durable.insert(id, Ok(report));
                            }
                        }
                        Reply::DurableFailed { id, error } => {
                            if !st.abandoned.remove(&id) {
                                st.durable.insert(id, Err(error));
                            }
                        }
                        other => {
                            st.replies.insert(other.id(), other);
                        }
                    }
                    drop(st);
                    self.changed.notify_all();
                }
                Ok(None) => break "the writer closed the connection".to_owned(),
                Err(e) => break format!("connection to the writer broken: {e}"),
            }
        };
        lock(&self.state).closed = Some(why);
        self.changed.notify_all();
    }
}

/// The trainer's side of the IPC baseline: owns the writer process (see the
/// [module documentation](self)). `Send + Sync`; requests are serialized.
pub struct IpcWriterClient {
    inner: Arc<Inner>,
    cfg: IpcConfig,
    child: Mutex<Option<Child>>,
    keeper: Option<(mpsc::Sender<()>, JoinHandle<()>)>,
    reader: Option<JoinHandle<()>>,
    stream: UnixStream,
    shm_name: String,
    staging_bytes: u64,
    backend: String,
    contexts: Mutex<BTreeMap<i32, DeviceCtx>>,
}

impl std::fmt::Debug for IpcWriterClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcWriterClient")
            .field("pid", &self.inner.pid)
            .field("root", &self.cfg.root)
            .field("cache", &self.cfg.cache)
            .finish()
    }
}

/// A device's primary context in the trainer and its UUID.
type DeviceCtx = (Arc<Context>, [u8; 16]);

static SOCKET_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A private directory for the listening socket (short path: `sun_path` is 108 bytes).
fn socket_dir() -> Result<PathBuf> {
    let name = format!(
        "shmckpt-ipc-{}-{}-{}",
        std::process::id(),
        SOCKET_COUNTER.fetch_add(1, Ordering::Relaxed),
        crate::util::unix_ms() % 1_000_000
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
        if !cfg.root.is_dir() {
            return Err(Error::RootMissing {
                path: cfg.root.clone(),
            });
        }
        let dir = socket_dir()?;
        let res = Self::spawn_in(cfg, &dir);
        let _ = std::fs::remove_dir_all(&dir);
        res
    }

    fn spawn_in(cfg: IpcConfig, dir: &Path) -> Result<IpcWriterClient> {
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
        tracing::info!(pid, shm = %shm_name, root = %cfg.root.display(), "IPC writer ready");
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

    /// The writer's pid.
    pub fn pid(&self) -> u32 {
        self.inner.pid
    }

    /// The writer's staging segment in `/dev/shm`.
    pub fn shm_name(&self) -> &str {
        &self.shm_name
    }

    /// Bytes of the writer's staging arena.
    pub fn staging_bytes(&self) -> u64 {
        self.staging_bytes
    }

    /// The writer's write backend (`io_uring` or `pwrite`).
    pub fn backend(&self) -> &str {
        &self.backend
    }

    /// The settings.
    pub fn config(&self) -> &IpcConfig {
        &self.cfg
    }

    /// Peak resident set size (`VmHWM`) of the writer process, read from `/proc` (0 once
    /// it exited).
    pub fn writer_peak_rss(&self) -> u64 {
        process_memory(self.inner.pid).0
    }

    /// The writer's statistics (memory, cached mappings, open/close times).
    pub fn stats(&self) -> Result<WriterStats> {
        match self.inner.call(|id| Request::Stats { id }, None)? {
            Reply::Stats { stats, .. } => Ok(stats),
            other => Err(self.unexpected(&other)),
        }
    }

    fn unexpected(&self, r: &Reply) -> Error {
        Error::Ipc(format!(
            "writer (pid {}) sent an unexpected {r:?}",
            self.inner.pid
        ))
    }

    fn context(&self, device: i32) -> Result<DeviceCtx> {
        let mut m = lock(&self.contexts);
        if let Some(c) = m.get(&device) {
            return Ok(c.clone());
        }
        let ctx = Context::new(device)?;
        let uuid = cuda::device_uuid(device)?;
        m.insert(device, (Arc::clone(&ctx), uuid));
        Ok((ctx, uuid))
    }

    /// Set up the writer for `devices` now (its CUDA context on each, and the
    /// registration of its staging arena) instead of at the first save.
    pub fn prepare(&self, devices: &[i32]) -> Result<IpcPrepared> {
        let t = Instant::now();
        let mut allocs = Vec::new();
        for &d in devices {
            let (_, uuid) = self.context(d)?;
            allocs.push(WireAlloc {
                ordinal: d,
                uuid: hex(&uuid),
                handle: String::new(),
                size: 0,
            });
        }
        match self
            .inner
            .call(|id| Request::Prepare { id, allocs }, None)?
        {
            Reply::Prepared {
                devices,
                registration_s,
                ..
            } => Ok(IpcPrepared {
                devices,
                registration: registration_s.map(dur),
                took: t.elapsed(),
            }),
            other => Err(self.unexpected(&other)),
        }
    }

    /// Save `tensors` (device memory of this process) as checkpoint `step` through the
    /// writer, with the configured cache setting. Returns when the writer has copied every
    /// byte to its host staging: the caller may then overwrite or free its tensors.
    ///
    /// Synchronizes every device the tensors are on first (see the module's *Ordering*).
    /// Host tensors are refused unless empty: the IPC design moves device memory only.
    pub fn save(
        &self,
        step: u64,
        tensors: &[Tensor<'_>],
        metadata: &Metadata,
    ) -> Result<IpcSaveHandle> {
        self.save_with_cache(step, tensors, metadata, self.cfg.cache)
    }

    /// [`IpcWriterClient::save`] with the handle cache on or off for this save. Turning it
    /// off closes every cached mapping before the save opens its own.
    pub fn save_with_cache(
        &self,
        step: u64,
        tensors: &[Tensor<'_>],
        metadata: &Metadata,
        cache: bool,
    ) -> Result<IpcSaveHandle> {
        let started = Instant::now();
        for t in tensors {
            if let Source::Host(b) = t.source
                && !b.is_empty()
            {
                return Err(Error::Config(format!(
                    "tensor {:?} is in host memory: IPC mode saves device tensors only",
                    t.name
                )));
            }
        }
        let devices: std::collections::BTreeSet<i32> = tensors
            .iter()
            .filter_map(|t| match t.source {
                Source::Cuda(d) if !d.is_empty() => Some(d.device()),
                _ => None,
            })
            .collect();
        let mut sync = Duration::ZERO;
        let mut export = Duration::ZERO;
        let mut allocs: Vec<IpcAllocation> = Vec::new();
        let mut wire: Vec<IpcTensor> = Vec::with_capacity(tensors.len());
        if !devices.is_empty() {
            cuda::init()?;
            // Leave the caller's current context as it was.
            let _guard = CtxGuard::save()?;
            let mut ctxs = BTreeMap::new();
            for &d in &devices {
                ctxs.insert(d, self.context(d)?);
            }
            // Ordering: every write the trainer queued must be complete before the writer
            // (another process, another context) copies.
            let t = Instant::now();
            for (ctx, _) in ctxs.values() {
                ctx.synchronize()?;
            }
            sync = t.elapsed();
            let t = Instant::now();
            let mut by_base: HashMap<(i32, u64), usize> = HashMap::new();
            for tensor in tensors {
                let (alloc, offset, len) = match tensor.source {
                    Source::Cuda(d) if !d.is_empty() => {
                        let (ctx, uuid) = &ctxs[&d.device()];
                        let (base, size) = cuda::allocation_range(ctx, d.ptr())?;
                        let offset = d.ptr().saturating_sub(base);
                        if offset + d.len() as u64 > size as u64 {
                            return Err(Error::Config(format!(
                                "tensor {:?} ({} bytes at {:#x}) extends past the end of its \
                                 allocation ({size} bytes at {base:#x})",
                                tensor.name,
                                d.len(),
                                d.ptr()
                            )));
                        }
                        let idx = match by_base.get(&(d.device(), base)) {
                            Some(&i) => i,
                            None => {
                                let handle = cuda::ipc_export(ctx, base)?;
                                allocs.push(IpcAllocation {
                                    ordinal: d.device(),
                                    uuid: *uuid,
                                    handle,
                                    size: size as u64,
                                });
                                by_base.insert((d.device(), base), allocs.len() - 1);
                                allocs.len() - 1
                            }
                        };
                        (Some(idx), offset, d.len() as u64)
                    }
                    _ => (None, 0, 0),
                };
                wire.push(IpcTensor {
                    name: tensor.name.to_string(),
                    dtype: tensor.dtype,
                    shape: tensor.shape.clone(),
                    len,
                    alloc,
                    offset,
                });
            }
            export = t.elapsed();
        } else {
            wire.extend(tensors.iter().map(|t| IpcTensor {
                name: t.name.to_string(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                len: 0,
                alloc: None,
                offset: 0,
            }));
        }
        let mut h = self.send_save(step, &allocs, &wire, metadata, cache, started)?;
        h.staged.sync = sync;
        h.staged.export = export;
        Ok(h)
    }

    /// Save tensors whose allocations the caller exported itself (for example a PyTorch
    /// trainer's `storage._share_cuda_()` handles). The caller must have completed every
    /// write to them (synchronized) before calling, and must not write them until this
    /// returns.
    pub fn save_exported(
        &self,
        step: u64,
        allocations: &[IpcAllocation],
        tensors: &[IpcTensor],
        metadata: &Metadata,
    ) -> Result<IpcSaveHandle> {
        self.send_save(
            step,
            allocations,
            tensors,
            metadata,
            self.cfg.cache,
            Instant::now(),
        )
    }

    fn send_save(
        &self,
        step: u64,
        allocations: &[IpcAllocation],
        tensors: &[IpcTensor],
        metadata: &Metadata,
        cache: bool,
        started: Instant,
    ) -> Result<IpcSaveHandle> {
        let allocs: Vec<WireAlloc> = allocations.iter().map(IpcAllocation::wire).collect();
        let tensors: Vec<WireTensor> = tensors
            .iter()
            .map(|t| WireTensor {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                len: t.len,
                alloc: t.alloc,
                offset: t.offset,
            })
            .collect();
        let t_request = Instant::now();
        let reply = self.inner.call(
            |id| Request::Save {
                id,
                step,
                cache,
                allocs,
                tensors,
                metadata: metadata.clone(),
            },
            None,
        )?;
        match reply {
            Reply::Staged {
                id,
                step,
                bytes,
                writer_staging_s,
                backpressure_s,
                registration_s,
                setup_s,
                open_s,
                opened,
                reused,
                handle_s,
            } => Ok(IpcSaveHandle {
                inner: Arc::clone(&self.inner),
                id,
                staged: Box::new(IpcStaged {
                    step,
                    bytes,
                    stall: started.elapsed(),
                    sync: Duration::ZERO,
                    export: Duration::ZERO,
                    allocations: allocations.len(),
                    open: dur(open_s),
                    opened,
                    reused,
                    setup: dur(setup_s),
                    writer_staging: dur(writer_staging_s),
                    request: t_request.elapsed(),
                    writer_handle: dur(handle_s),
                    backpressure: dur(backpressure_s),
                    registration: dur(registration_s),
                }),
                taken: false,
            }),
            other => Err(self.unexpected(&other)),
        }
    }

    /// Make the writer close every cached mapping (the IPC equivalent of finalizing the
    /// async queue and emptying the cache): the trainer's freed allocations come back.
    pub fn release(&self) -> Result<IpcReleased> {
        let t = Instant::now();
        match self.inner.call(|id| Request::Release { id }, None)? {
            Reply::Released {
                closed,
                bytes,
                took_s,
                ..
            } => Ok(IpcReleased {
                closed,
                bytes,
                writer_took: dur(took_s),
                took: t.elapsed(),
            }),
            other => Err(self.unexpected(&other)),
        }
    }

    /// Finish the saves in flight, stop the writer and reap it. An error says the writer
    /// did not stop on request and was killed, or exited with a failure. Dropping the
    /// client does the same and logs instead.
    pub fn shutdown(mut self) -> Result<()> {
        self.stop()
    }

    fn stop(&mut self) -> Result<()> {
        let Some(mut child) = lock(&self.child).take() else {
            return Ok(());
        };
        let pid = self.inner.pid;
        let deadline = Instant::now() + self.cfg.shutdown_timeout;
        let asked = self
            .inner
            .call(|id| Request::Shutdown { id }, Some(deadline));
        let mut result = match &asked {
            Ok(Reply::Bye { .. }) => Ok(()),
            Ok(other) => Err(self.unexpected(other)),
            Err(e) => Err(Error::Ipc(format!(
                "writer (pid {pid}) did not shut down: {e}"
            ))),
        };
        // Wait for the exit, then kill.
        let status: Option<ExitStatus> = loop {
            match child.try_wait() {
                Ok(Some(s)) => break Some(s),
                Ok(None) if Instant::now() < deadline && asked.is_ok() => {
                    std::thread::sleep(Duration::from_millis(2))
                }
                Ok(None) => {
                    tracing::warn!(pid, "IPC writer did not exit; killing it");
                    let _ = child.kill();
                    break child.wait().ok();
                }
                Err(e) => {
                    tracing::warn!(pid, error = %e, "cannot wait for the IPC writer");
                    let _ = child.kill();
                    break child.wait().ok();
                }
            }
        };
        if let (Ok(()), Some(s)) = (&result, status)
            && !s.success()
        {
            result = Err(Error::Ipc(format!("writer (pid {pid}) exited with {s}")));
        }
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        if let Some((tx, h)) = self.keeper.take() {
            drop(tx);
            let _ = h.join();
        }
        result
    }
}

impl Drop for IpcWriterClient {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            tracing::warn!(error = %e, "IPC writer shutdown");
        }
    }
}

/// An IPC save in flight. Dropping it does not cancel the save.
pub struct IpcSaveHandle {
    inner: Arc<Inner>,
    id: u64,
    staged: Box<IpcStaged>,
    taken: bool,
}

impl std::fmt::Debug for IpcSaveHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcSaveHandle")
            .field("step", &self.staged.step)
            .field("id", &self.id)
            .finish()
    }
}

impl IpcSaveHandle {
    /// The step.
    pub fn step(&self) -> u64 {
        self.staged.step
    }

    /// Staging facts (the trainer's stall and its parts).
    pub fn staged(&self) -> IpcStaged {
        *self.staged
    }

    /// True once the writer reported the save committed or failed.
    pub fn is_done(&self) -> bool {
        let st = lock(&self.inner.state);
        st.durable.contains_key(&self.id) || st.closed.is_some()
    }

    /// Block until the writer reports the checkpoint committed (or failed).
    pub fn wait(self) -> Result<IpcSaveReport> {
        match self.wait_until(None) {
            Ok(r) => r,
            Err(_) => unreachable!("no deadline"),
        }
    }

    /// Like [`IpcSaveHandle::wait`], giving up after `timeout` (returns the handle back).
    pub fn wait_timeout(
        self,
        timeout: Duration,
    ) -> std::result::Result<Result<IpcSaveReport>, IpcSaveHandle> {
        self.wait_until(Some(Instant::now() + timeout))
    }

    fn wait_until(
        mut self,
        deadline: Option<Instant>,
    ) -> std::result::Result<Result<IpcSaveReport>, IpcSaveHandle> {
        let inner = Arc::clone(&self.inner);
        let mut st = lock(&inner.state);
        loop {
            if let Some(r) = st.durable.remove(&self.id) {
                drop(st);
                self.taken = true;
                return Ok(self.finish(r));
            }
            if let Some(why) = &st.closed {
                let e = Error::Ipc(format!(
                    "writer (pid {}) is gone before step {} was committed: {why}",
                    inner.pid, self.staged.step
                ));
                drop(st);
                self.taken = true;
                return Ok(Err(e));
            }
            st = match deadline {
                None => inner.changed.wait(st).unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        drop(st);
                        return Err(self);
                    }
                    inner
                        .changed
                        .wait_timeout(st, d - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
        }
    }

    fn finish(&self, r: std::result::Result<WireReport, WireError>) -> Result<IpcSaveReport> {
        let w = r.map_err(|e| from_wire(e, self.inner.pid))?;
        let s = *self.staged;
        // The trainer's time before the writer's engine started, on the writer's clock.
        let lead = s.stall.saturating_sub(s.writer_staging);
        Ok(IpcSaveReport {
            step: w.step,
            dir: w.dir,
            file: w.file,
            bytes: w.bytes,
            tensors: w.tensors,
            backend: w.backend,
            direct_io: w.direct_io,
            retired: w.retired,
            writer: SaveTimings {
                staging: dur(w.staging_s),
                backpressure: dur(w.backpressure_s),
                durable: dur(w.durable_s),
                committed: dur(w.committed_s),
            },
            durable: lead + dur(w.durable_s),
            committed: lead + dur(w.committed_s),
            staged: s,
        })
    }
}

impl Drop for IpcSaveHandle {
    fn drop(&mut self) {
        if self.taken {
            return;
        }
        let mut st = lock(&self.inner.state);
        if st.durable.remove(&self.id).is_none() && st.closed.is_none() {
            st.abandoned.insert(self.id);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Writer side
// ---------------------------------------------------------------------------------------

/// How the writer process runs (built by the `ipc-writer` subcommand from
/// [`IpcConfig::writer_args`]).
#[derive(Debug, Clone)]
pub struct WriterOptions {
    /// The trainer's listening socket.
    pub socket: PathBuf,
    /// The trainer's pid: the writer dies with it (`PR_SET_PDEATHSIG`), and exits at once
    /// if it is not its parent any more. `None` skips both (manual runs).
    pub parent_pid: Option<u32>,
    /// The writer's engine.
    pub engine: EngineConfig,
}

struct Cached {
    mapping: IpcMapping,
    size: u64,
    /// Sequence number of the last save that used it.
    used: u64,
}

struct Writer {
    engine: Engine,
    contexts: BTreeMap<i32, Arc<Context>>,
    /// Trainer device UUID (hex) → ordinal here.
    devices: HashMap<String, i32>,
    cache: HashMap<(i32, IpcMemHandle), Cached>,
    seq: u64,
    stats: WriterStats,
}

impl Writer {
    fn device(&mut self, a: &WireAlloc) -> Result<i32> {
        if let Some(&d) = self.devices.get(&a.uuid) {
            return Ok(d);
        }
        let uuid: [u8; 16] = unhex(&a.uuid)
            .ok_or_else(|| Error::Ipc(format!("malformed device UUID {:?}", a.uuid)))?;
        // The trainer's ordinal is right unless the two processes see different devices.
        let d = match cuda::device_uuid(a.ordinal) {
            Ok(u) if u == uuid => a.ordinal,
            _ => cuda::ordinal_of_uuid(&uuid)?,
        };
        if let std::collections::btree_map::Entry::Vacant(e) = self.contexts.entry(d) {
            e.insert(Context::new(d)?);
        }
        self.devices.insert(a.uuid.clone(), d);
        Ok(d)
    }

    fn close_where(&mut self, stale: impl Fn(&Cached) -> bool) -> (usize, u64, Duration) {
        let t = Instant::now();
        let keys: Vec<_> = self
            .cache
            .iter()
            .filter(|(_, c)| stale(c))
            .map(|(k, _)| *k)
            .collect();
        let mut bytes = 0;
        for k in &keys {
            if let Some(c) = self.cache.remove(k) {
                bytes += c.size;
                drop(c.mapping);
            }
        }
        let took = t.elapsed();
        self.stats.closes += keys.len() as u64;
        self.stats.close_total_s += secs(took);
        (keys.len(), bytes, took)
    }

    fn close_all(&mut self) -> (usize, u64, Duration) {
        self.close_where(|_| true)
    }

    fn prepare(&mut self, allocs: &[WireAlloc]) -> Result<Reply> {
        cuda::init()?;
        let mut devs = Vec::new();
        for a in allocs {
            devs.push(self.device(a)?);
        }
        devs.sort_unstable();
        devs.dedup();
        let reg = self.engine.prepare_cuda(&devs)?;
        Ok(Reply::Prepared {
            id: 0,
            devices: devs,
            registration_s: reg.map(secs),
        })
    }

    fn save(
        &mut self,
        step: u64,
        cache: bool,
        allocs: &[WireAlloc],
        tensors: &[WireTensor],
        metadata: &Metadata,
    ) -> Result<(Reply, SaveHandle)> {
        self.seq += 1;
        let seq = self.seq;
        if !cache && !self.cache.is_empty() {
            // A handle can be open only once per context: start uncached saves clean.
            self.close_all();
        }
        // Devices and contexts (first use only), then the handles.
        let t = Instant::now();
        let mut keys = Vec::with_capacity(allocs.len());
        if !allocs.is_empty() {
            cuda::init()?;
        }
        for a in allocs {
            let d = self.device(a)?;
            let h: [u8; 64] =
                unhex(&a.handle).ok_or_else(|| Error::Ipc("malformed IPC handle".into()))?;
            keys.push((d, IpcMemHandle(h)));
        }
        let setup = t.elapsed();
        let t = Instant::now();
        let (mut opened, mut reused) = (0, 0);
        for (k, a) in keys.iter().zip(allocs) {
            if let Some(c) = self.cache.get_mut(k) {
                if c.used != seq {
                    reused += 1;
                }
                c.used = seq;
                continue;
            }
            let ctx = &self.contexts[&k.0];
            let mapping = IpcMapping::open(ctx, &k.1)?;
            if let Some(s) = mapping.size()
                && (s as u64) < a.size
            {
                return Err(Error::Cuda(format!(
                    "IPC mapping is {s} bytes but the trainer's allocation is {} bytes",
                    a.size
                )));
            }
            opened += 1;
            self.cache.insert(
                *k,
                Cached {
                    mapping,
                    size: a.size,
                    used: seq,
                },
            );
        }
        let open = t.elapsed();
        self.stats.opens += opened as u64;
        self.stats.open_total_s += secs(open);

        let mut list = Vec::with_capacity(tensors.len());
        for t in tensors {
            let source = match t.alloc {
                None if t.len == 0 => None,
                None => {
                    return Err(Error::Ipc(format!(
                        "tensor {:?} has {} bytes but no allocation",
                        t.name, t.len
                    )));
                }
                Some(i) => {
                    let k = keys.get(i).ok_or_else(|| {
                        Error::Ipc(format!(
                            "tensor {:?} names allocation {i} of {}",
                            t.name,
                            keys.len()
                        ))
                    })?;
                    let c = &self.cache[k];
                    let len = usize::try_from(t.len)
                        .map_err(|_| Error::Ipc(format!("tensor {:?} is too large", t.name)))?;
                    Some(c.mapping.slice(t.offset, len, c.size as usize)?)
                }
            };
            list.push(match source {
                Some(s) => Tensor::cuda(t.name.as_str(), t.dtype, t.shape.clone(), s),
                None => Tensor::host(t.name.as_str(), t.dtype, t.shape.clone(), &[]),
            });
        }
        let h = self.engine.save(step, &list, metadata)?;
        let s = h
            .staged()
            .ok_or_else(|| Error::Internal("save returned before staging".into()))?;
        Ok((
            Reply::Staged {
                id: 0,
                step,
                bytes: s.bytes,
                writer_staging_s: secs(s.staging),
                backpressure_s: secs(s.backpressure),
                registration_s: secs(s.registration),
                setup_s: secs(setup),
                open_s: secs(open),
                opened,
                reused,
                handle_s: 0.0,
            },
            h,
        ))
    }

    /// After a save was staged (and answered): with the cache off close everything, with
    /// it on close what this save did not use (the trainer's allocations changed).
    fn after_save(&mut self, cache: bool) {
        let seq = self.seq;
        let (n, _, took) = if cache {
            self.close_where(|c| c.used != seq)
        } else {
            self.close_all()
        };
        self.stats.last_closed = n;
        self.stats.last_close_s = secs(took);
    }

    fn stats(&self) -> WriterStats {
        let mut s = self.stats.clone();
        let (hwm, rss, shm) = process_memory(std::process::id());
        s.vm_hwm_bytes = hwm;
        s.vm_rss_bytes = rss;
        s.rss_shmem_bytes = shm;
        s.cached_mappings = self.cache.len();
        s.cached_bytes = self.cache.values().map(|c| c.size).sum();
        s
    }
}

fn with_id(mut r: Reply, new: u64) -> Reply {
    match &mut r {
        Reply::Ready { .. } => {}
        Reply::Prepared { id, .. }
        | Reply::Staged { id, .. }
        | Reply::Durable { id, .. }
        | Reply::DurableFailed { id, .. }
        | Reply::Released { id, .. }
        | Reply::Stats { id, .. }
        | Reply::Failed { id, .. }
        | Reply::Bye { id } => *id = new,
    }
    r
}

fn wire_report(r: &SaveReport) -> WireReport {
    WireReport {
        step: r.step,
        dir: r.dir.clone(),
        file: r.file.clone(),
        bytes: r.bytes,
        tensors: r.tensors,
        staging_s: secs(r.timings.staging),
        backpressure_s: secs(r.timings.backpressure),
        durable_s: secs(r.timings.durable),
        committed_s: secs(r.timings.committed),
        backend: r.backend.to_owned(),
        direct_io: r.direct_io,
        retired: r.retired.clone(),
    }
}

/// Run the writer process: connect to the trainer, open the engine, serve requests until
/// `shutdown` or until the socket closes. Used by the hidden `ipc-writer` subcommand.
///
/// No CUDA call is made before a request needs one, and every such request first checks
/// the driver ([`cuda::init`]), so a machine without CUDA gets an error reply.
pub fn run_writer(opts: WriterOptions) -> Result<()> {
    // 1. Die with the trainer. The check after prctl closes the race with a trainer that
    //    died before it (we would have been reparented already).
    if let Some(ppid) = opts.parent_pid {
        rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))
            .map_err(|e| Error::Ipc(format!("prctl(PR_SET_PDEATHSIG): {e}")))?;
        let now = rustix::process::Pid::as_raw(rustix::process::getppid());
        if i64::from(now) != i64::from(ppid) {
            return Err(Error::Ipc(format!(
                "the trainer (pid {ppid}) exited before the writer started"
            )));
        }
    }
    // 2. Connect.
    let stream =
        UnixStream::connect(&opts.socket).map_err(|e| Error::io("connect", &opts.socket, e))?;
    let out = Arc::new(Mutex::new(
        stream
            .try_clone()
            .map_err(|e| Error::io("dup", &opts.socket, e))?,
    ));
    let send =
        |out: &Mutex<UnixStream>, r: &Reply| -> io::Result<()> { write_frame(&mut *lock(out), r) };
    // 3. The engine.
    let engine = match Engine::open(opts.engine) {
        Ok(e) => e,
        Err(e) => {
            let _ = send(
                &out,
                &Reply::Failed {
                    id: 0,
                    error: to_wire(&e),
                },
            );
            return Err(e);
        }
    };
    let pid = std::process::id();
    let ready = Reply::Ready {
        version: PROTOCOL_VERSION,
        pid,
        shm_name: engine.shm_name().to_owned(),
        staging_bytes: engine.staging_capacity(),
        backend: engine.backend().to_owned(),
    };
    if let Err(e) = send(&out, &ready) {
        return Err(Error::Ipc(format!("cannot greet the trainer: {e}")));
    }
    let mut w = Writer {
        stats: WriterStats {
            pid,
            shm_name: engine.shm_name().to_owned(),
            staging_bytes: engine.staging_capacity(),
            ..WriterStats::default()
        },
        engine,
        contexts: BTreeMap::new(),
        devices: HashMap::new(),
        cache: HashMap::new(),
        seq: 0,
    };

    // 4. Durable replies, in commit order, from their own thread.
    let (dtx, drx) = crossbeam_channel::unbounded::<(u64, SaveHandle)>();
    let durable = {
        let out = Arc::clone(&out);
        std::thread::Builder::new()
            .name("shmckpt-ipc-durable".into())
            .spawn(move || {
                for (id, h) in drx {
                    let msg = match h.wait() {
                        Ok(r) => Reply::Durable {
                            id,
                            report: wire_report(&r),
                        },
                        Err(e) => Reply::DurableFailed {
                            id,
                            error: to_wire(&e),
                        },
                    };
                    if let Err(e) = send(&out, &msg) {
                        tracing::debug!(error = %e, "cannot report a durable save");
                    }
                }
            })
            .map_err(|e| Error::Ipc(format!("cannot start the durable thread: {e}")))?
    };

    // 5. Serve.
    let mut input = BufReader::new(stream);
    let mut bye = None;
    loop {
        let raw = match read_frame_bytes(&mut input) {
            Ok(Some(r)) => r,
            Ok(None) => {
                tracing::info!("trainer closed the socket; IPC writer exits");
                break;
            }
            Err(e) => {
                tracing::warn!(error = %e, "IPC socket broken; IPC writer exits");
                break;
            }
        };
        let got = Instant::now();
        let req: Request = match decode(&raw) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "malformed request; IPC writer exits");
                break;
            }
        };
        let fail = |id: u64, e: &Error| Reply::Failed {
            id,
            error: to_wire(e),
        };
        let sent = match req {
            Request::Prepare { id, allocs } => {
                let r = w
                    .prepare(&allocs)
                    .map_or_else(|e| fail(id, &e), |r| with_id(r, id));
                send(&out, &r)
            }
            Request::Save {
                id,
                step,
                cache,
                allocs,
                tensors,
                metadata,
            } => match w.save(step, cache, &allocs, &tensors, &metadata) {
                Ok((mut staged, h)) => {
                    if let Reply::Staged { handle_s, .. } = &mut staged {
                        *handle_s = secs(got.elapsed());
                    }
                    let r = send(&out, &with_id(staged, id));
                    let _ = dtx.send((id, h));
                    w.after_save(cache);
                    r
                }
                Err(e) => {
                    if !cache {
                        w.close_all();
                    }
                    send(&out, &fail(id, &e))
                }
            },
            Request::Release { id } => {
                let (closed, bytes, took) = w.close_all();
                send(
                    &out,
                    &Reply::Released {
                        id,
                        closed,
                        bytes,
                        took_s: secs(took),
                    },
                )
            }
            Request::Stats { id } => send(
                &out,
                &Reply::Stats {
                    id,
                    stats: w.stats(),
                },
            ),
            Request::Shutdown { id } => {
                bye = Some(id);
                break;
            }
        };
        if let Err(e) = sent {
            tracing::warn!(error = %e, "cannot answer the trainer; IPC writer exits");
            break;
        }
    }
    // 6. Stop: unmap the trainer's memory first (its device memory comes back at once),
    //    then let the saves in flight commit (their bytes are in staging already), report
    //    them, and say goodbye.
    w.close_all();
    // Each save's failure is reported to the trainer by the durable thread.
    if let Err(e) = w.engine.flush() {
        tracing::warn!(error = %e, "a save in flight failed");
    }
    drop(dtx);
    if durable.join().is_err() {
        tracing::error!("IPC durable thread panicked");
    }
    if let Some(id) = bye {
        let _ = send(&out, &Reply::Bye { id });
    }
    drop(w);
    Ok(())
}
