//! The socket protocol: framed JSON messages, their types, and error transport.

use std::io::{self, Read, Write};
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::Error;
use shmckpt::Dtype;
use shmckpt::Metadata;

use super::MAX_FRAME;

/// One exported allocation.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct WireAlloc {
    /// Device ordinal in the trainer (a hint; the UUID decides).
    pub(super) ordinal: i32,
    /// Device UUID, hex.
    pub(super) uuid: String,
    /// `CUipcMemHandle`, hex (128 characters).
    pub(super) handle: String,
    /// Allocation size the trainer's driver reports.
    pub(super) size: u64,
}

/// One tensor: a range of an exported allocation (or no bytes at all).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct WireTensor {
    pub(super) name: String,
    pub(super) dtype: Dtype,
    pub(super) shape: Vec<usize>,
    pub(super) len: u64,
    /// Index into the save's allocations; `None` for a zero-length tensor.
    pub(super) alloc: Option<usize>,
    /// Offset of the tensor's first byte inside its allocation.
    pub(super) offset: u64,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub(super) enum Request {
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
pub(super) struct WireError {
    pub(super) kind: String,
    pub(super) message: String,
    #[serde(default)]
    pub(super) step: Option<u64>,
    #[serde(default)]
    pub(super) root: Option<PathBuf>,
    #[serde(default)]
    pub(super) needed: Option<u64>,
    #[serde(default)]
    pub(super) capacity: Option<u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct WireReport {
    pub(super) step: u64,
    pub(super) dir: Option<PathBuf>,
    pub(super) file: PathBuf,
    pub(super) bytes: u64,
    pub(super) tensors: usize,
    pub(super) staging_s: f64,
    pub(super) backpressure_s: f64,
    pub(super) durable_s: f64,
    pub(super) committed_s: Option<f64>,
    pub(super) backend: shmckpt::Backend,
    pub(super) direct_io: bool,
    pub(super) retired: Vec<u64>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub(super) enum Reply {
    Ready {
        version: u32,
        pid: u32,
        shm_name: String,
        staging_bytes: u64,
        backend: shmckpt::Backend,
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
    pub(super) fn id(&self) -> u64 {
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

/// The writer process's own view of itself ([`IpcWriterClient::stats`](crate::IpcWriterClient::stats)).
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

pub(super) fn write_frame<T: Serialize>(w: &mut impl Write, msg: &T) -> io::Result<()> {
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
pub(super) fn read_frame<T: for<'de> Deserialize<'de>>(r: &mut impl Read) -> io::Result<Option<T>> {
    read_frame_bytes(r)?.map(|b| decode(&b)).transpose()
}

pub(super) fn decode<T: for<'de> Deserialize<'de>>(body: &[u8]) -> io::Result<T> {
    serde_json::from_slice(body).map_err(|e| io::Error::other(format!("malformed message: {e}")))
}

/// The body of one message; `Ok(None)` on a clean end of stream between messages.
pub(super) fn read_frame_bytes(r: &mut impl Read) -> io::Result<Option<Vec<u8>>> {
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

pub(super) fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(2 * bytes.len());
    for &b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

pub(super) fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
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

pub(super) fn to_wire(e: &Error) -> WireError {
    let mut w = WireError {
        kind: "other".into(),
        message: e.to_string(),
        step: None,
        root: None,
        needed: None,
        capacity: None,
    };
    match e.as_shmckpt() {
        Some(shmckpt::Error::Cuda { .. }) => {
            w.kind = "cuda".into();
            w.message = e.to_string();
        }
        Some(shmckpt::Error::Config(m)) => {
            w.kind = "config".into();
            w.message = m.clone();
        }
        Some(shmckpt::Error::StepExists { step, root }) => {
            w.kind = "step_exists".into();
            w.step = Some(*step);
            w.root = Some(root.clone());
        }
        Some(shmckpt::Error::TooLarge { needed, capacity }) => {
            w.kind = "too_large".into();
            w.needed = Some(*needed);
            w.capacity = Some(*capacity);
        }
        _ => {}
    }
    w
}

pub(super) fn from_wire(w: WireError, pid: u32) -> Error {
    match (w.kind.as_str(), w.step, w.root, w.needed, w.capacity) {
        ("cuda", ..) => Error::cuda(format!("IPC writer (pid {pid})"), w.message),
        ("config", ..) => Error::config(w.message),
        ("step_exists", Some(step), Some(root), ..) => {
            shmckpt::Error::StepExists { step, root }.into()
        }
        ("too_large", _, _, Some(needed), Some(capacity)) => {
            shmckpt::Error::TooLarge { needed, capacity }.into()
        }
        _ => Error::Ipc(format!("writer (pid {pid}): {}", w.message)),
    }
}

pub(super) fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

pub(super) fn dur(s: f64) -> Duration {
    Duration::try_from_secs_f64(s).unwrap_or_default()
}

/// Lock `m`, ignoring poisoning (a panicked holder left plain data behind).
pub(super) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
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
