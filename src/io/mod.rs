//! Disk I/O: one [`IoBackend`] trait with an io_uring and a `pwrite`/`pread` implementation
//! side by side, the writer pool that drives it, and file helpers (O_DIRECT with a buffered
//! fallback).
//!
//! `unsafe` is confined to the backend contract ([`IoBackend::push`]), its
//! implementations (`uring.rs`, `pwrite.rs`, `fault.rs`, `record.rs`) and [`queue::LeaseQueue`], the
//! safe wrapper the rest of the crate uses: those files alone allow `unsafe_code`.
#![deny(unsafe_code)]

pub mod file;
pub mod pool;
pub mod pwrite;
pub mod queue;
pub mod uring;

#[cfg(feature = "fault-injection")]
pub mod fault;
#[cfg(feature = "fs-observer")]
pub mod record;

use std::io;
use std::os::fd::RawFd;

/// Alignment of address, offset and length for O_DIRECT (the page size; some devices
/// report 512 but 4096 is always accepted).
pub const DIRECT_ALIGN: u64 = 4096;

/// Which write backend an engine uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendKind {
    /// io_uring when it can be set up, else `pwrite` (with a logged warning).
    #[default]
    Auto,
    /// io_uring only; fail if it cannot be set up.
    IoUring,
    /// Plain `pwrite`/`pread` system calls.
    Pwrite,
}

impl std::str::FromStr for BackendKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(BackendKind::Auto),
            "io_uring" | "io-uring" | "uring" => Ok(BackendKind::IoUring),
            "pwrite" => Ok(BackendKind::Pwrite),
            _ => Err(format!("unknown backend {s:?} (auto, io_uring, pwrite)")),
        }
    }
}

/// The write backend an engine runs on (what [`BackendKind::Auto`] resolved to).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Backend {
    /// io_uring.
    #[serde(rename = "io_uring")]
    IoUring,
    /// Blocking `pwrite`/`pread`.
    #[serde(rename = "pwrite")]
    Pwrite,
}

impl Backend {
    /// `io_uring` or `pwrite`.
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::IoUring => "io_uring",
            Backend::Pwrite => "pwrite",
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Read or write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    /// `pwrite` semantics.
    Write,
    /// `pread` semantics.
    Read,
}

/// One I/O request. The buffer is a raw pointer because it usually lives in the staging
/// arena and is owned by a chunk lease that the caller keeps until the completion arrives.
#[derive(Debug, Clone, Copy)]
pub struct IoOp {
    /// Read or write.
    pub kind: OpKind,
    /// File descriptor.
    pub fd: RawFd,
    /// Buffer.
    pub buf: *mut u8,
    /// Length in bytes.
    pub len: u32,
    /// File offset.
    pub offset: u64,
    /// Returned unchanged in the completion.
    pub user_data: u64,
}

/// A finished request: bytes transferred (`>= 0`) or `-errno`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The request's `user_data`.
    pub user_data: u64,
    /// Bytes transferred, or a negated errno.
    pub result: i32,
}

/// A queue of asynchronous reads and writes.
///
/// Completions may arrive in any order; callers track requests by `user_data`. Every
/// request pushed produces exactly one completion.
pub(crate) trait IoBackend: Send {
    /// Which backend this is (for logs and reports).
    fn backend(&self) -> Backend;

    /// Maximum requests in flight.
    fn queue_depth(&self) -> usize;

    /// Queue a request. Fails only when the queue is full or the backend is broken.
    ///
    /// # Safety
    /// - `op.buf` must be valid for `op.len` bytes: readable for writes, writable for reads;
    /// - those bytes must stay valid, and must not be written (for writes) or accessed at all
    ///   (for reads) by anyone else, until the completion carrying `op.user_data` has been
    ///   returned by [`IoBackend::wait`] — also when the caller hits an error or shuts down;
    /// - `op.fd` must stay open until then.
    #[allow(unsafe_code)]
    unsafe fn push(&mut self, op: IoOp) -> io::Result<()>;

    /// Submit what was pushed, wait until at least `min` completions are available, and
    /// append all available completions to `out`.
    fn wait(&mut self, min: usize, out: &mut Vec<Completion>) -> io::Result<()>;

    /// Requests pushed whose completion has not been returned yet (the fault-injection
    /// wrapper needs it; the queue keeps its own count).
    #[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
    fn in_flight(&self) -> usize;

    /// Set-up left for an idle moment (nothing in flight): the io_uring backend registers
    /// the staging arena as fixed buffers once the arena is wholly allocated. Returns
    /// whether some is still left (then it is called again later).
    fn idle_setup(&mut self) -> bool {
        false
    }
}

/// What `open_backend` builds a backend with.
#[derive(Debug, Clone)]
pub struct BackendOptions {
    /// Which backend.
    pub kind: BackendKind,
    /// Requests in flight.
    pub queue_depth: u32,
    /// Arena whose data region is registered as io_uring fixed buffers; the backend keeps
    /// it alive for as long as the registration exists.
    pub fixed: Option<std::sync::Arc<crate::staging::Arena>>,
    /// Fault-injection plan wrapped around the backend.
    #[cfg(feature = "fault-injection")]
    pub faults: Option<std::sync::Arc<fault::FaultPlan>>,
}

/// Build a backend. With [`BackendKind::Auto`], an io_uring that cannot be set up (old
/// kernel, seccomp, `io_uring_disabled` sysctl) falls back to `pwrite` with a warning.
pub(crate) fn open_backend(opts: &BackendOptions) -> io::Result<Box<dyn IoBackend>> {
    let base: Box<dyn IoBackend> = match opts.kind {
        BackendKind::Pwrite => Box::new(pwrite::PwriteBackend::new(opts.queue_depth as usize)),
        BackendKind::IoUring => Box::new(uring::UringBackend::new(
            opts.queue_depth,
            opts.fixed.clone(),
        )?),
        BackendKind::Auto => match uring::UringBackend::new(opts.queue_depth, opts.fixed.clone()) {
            Ok(u) => Box::new(u),
            Err(e) => {
                tracing::warn!(error = %e, "io_uring unavailable; falling back to pwrite");
                Box::new(pwrite::PwriteBackend::new(opts.queue_depth as usize))
            }
        },
    };
    // The observer sees what reaches the file: faults wrap it (an injected error never does).
    #[cfg(feature = "fs-observer")]
    let base: Box<dyn IoBackend> = Box::new(record::RecordingBackend::new(base));
    #[cfg(feature = "fault-injection")]
    if let Some(plan) = &opts.faults {
        return Ok(Box::new(fault::FaultyBackend::new(base, plan.clone())));
    }
    Ok(base)
}

/// Round `n` up to a multiple of [`DIRECT_ALIGN`].
pub fn align_up(n: u64) -> u64 {
    n.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN
}
