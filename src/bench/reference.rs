//! Physical limits measured in the same run as a benchmark: raw O_DIRECT sequential writes
//! and reads of the same number of bytes on the same disk, with no staging, no checksums
//! and no commit. This is what `shmckpt bench` divides by.
//!
//! Each limit is the better of two ways to drive the disk, measured back to back: one
//! stream of 16 MiB `pwrite`/`pread` calls (`dd bs=16M oflag=direct` equivalent), and
//! io_uring with [`URING_DEPTH`] requests of [`URING_BLOCK`] bytes in flight (`fio
//! iodepth=16`). Some devices reach their limit only with many requests queued, others
//! with few large ones: the reference is the disk's real limit, not the easier one.

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::io::file::FileTarget;
use crate::io::queue::{LeaseQueue, Request};
use crate::io::{BackendKind, BackendOptions, OpKind, align_up, open_backend};
use crate::staging::{Arena, ArenaSpec};

/// Block size of the single-stream reference: large enough that the block layer splits
/// each call into many device requests in flight.
pub const REFERENCE_BLOCK: u64 = 16 << 20;

/// Requests in flight of the io_uring reference.
pub const URING_DEPTH: u32 = 16;

/// Size of each io_uring reference request.
pub const URING_BLOCK: u64 = 4 << 20;

/// Both measurements of one raw limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawTimes {
    /// One stream of [`REFERENCE_BLOCK`] calls.
    pub single: Duration,
    /// io_uring with [`URING_DEPTH`] requests in flight (`None` when io_uring is
    /// unavailable here).
    pub uring: Option<Duration>,
}

impl RawTimes {
    /// The better (shorter) of the two.
    pub fn best(&self) -> Duration {
        self.uring.map_or(self.single, |u| u.min(self.single))
    }
}

fn buffers(chunk: u64, count: u64) -> Result<Arc<Arena>> {
    let arena = Arena::create(&ArenaSpec {
        name: None,
        capacity: chunk * count,
        chunk_size: chunk,
        slots: 1,
        rank: 0,
        world_size: 1,
        root: PathBuf::new(),
    })?;
    Ok(arena)
}

fn scratch_path(dir: &Path, what: &str) -> PathBuf {
    dir.join(format!(
        ".shmckpt-reference-{what}-{}.bin",
        std::process::id()
    ))
}

/// Both raw writes of `bytes` to `dir`, single stream first.
pub fn raw_direct_writes(dir: &Path, bytes: u64) -> Result<RawTimes> {
    let single = raw_direct_write(dir, bytes)?;
    let uring = raw_direct_write_uring(dir, bytes, URING_DEPTH)?;
    Ok(RawTimes { single, uring })
}

/// Both raw reads of the whole file `path`, single stream first.
pub fn raw_direct_reads(path: &Path) -> Result<RawTimes> {
    let single = raw_direct_read(path)?;
    let uring = raw_direct_read_uring(path, URING_DEPTH)?;
    Ok(RawTimes { single, uring })
}

/// Write `bytes` of pseudo-random data sequentially to a new file in `dir` with O_DIRECT
/// (`dd oflag=direct bs=16M` equivalent), `fdatasync` it, delete it, and return the time
/// from open to the end of `fdatasync`.
pub fn raw_direct_write(dir: &Path, bytes: u64) -> Result<Duration> {
    let arena = buffers(REFERENCE_BLOCK, 1)?;
    let (mut buf, _) = arena.acquire();
    crate::bench::synthetic::fill(buf.as_mut_slice(), 0xAB, 7, 0);
    let path = scratch_path(dir, "write");
    let _ = std::fs::remove_file(&path);
    let t = Instant::now();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .map_err(|e| Error::io("open(O_DIRECT)", &path, e))?;
    let padded = align_up(bytes);
    let mut off = 0u64;
    let res = (|| {
        while off < padded {
            let n = (padded - off).min(REFERENCE_BLOCK) as usize;
            f.write_all_at(&buf.as_slice()[..n], off)
                .map_err(|e| Error::io_at("write", &path, off, e))?;
            off += n as u64;
        }
        f.sync_data().map_err(|e| Error::io("fdatasync", &path, e))
    })();
    let elapsed = t.elapsed();
    drop(f);
    let _ = std::fs::remove_file(&path);
    res.map(|()| elapsed)
}

/// One request of the io_uring references.
#[derive(Debug, Clone, Copy)]
struct Piece {
    offset: u64,
    want: usize,
    got: usize,
}

/// Drive `[0, len)` of `target` through io_uring with `depth` requests of [`URING_BLOCK`]
/// in flight (reads stop at end of file). `None` when io_uring is unavailable.
fn uring_pass(
    target: &Arc<FileTarget>,
    path: &Path,
    kind: OpKind,
    len: u64,
    depth: u32,
) -> Result<Option<()>> {
    let backend = match open_backend(&BackendOptions {
        kind: BackendKind::IoUring,
        queue_depth: depth,
        fixed: None,
        #[cfg(feature = "fault-injection")]
        faults: None,
    }) {
        Ok(b) => b,
        Err(e) => {
            tracing::info!(error = %e, "io_uring unavailable: no io_uring reference");
            return Ok(None);
        }
    };
    let arena = buffers(URING_BLOCK, u64::from(depth))?;
    if kind == OpKind::Write {
        // Hold every buffer while filling it, so each is filled once.
        let mut all = Vec::new();
        while let Some(mut l) = arena.try_acquire() {
            let k = u64::from(l.index());
            crate::bench::synthetic::fill(l.as_mut_slice(), 0xAB + k, 7, 0);
            all.push(l);
        }
    }
    let mut q: LeaseQueue<Piece> = LeaseQueue::new(backend);
    let op = if kind == OpKind::Write {
        "write"
    } else {
        "read"
    };
    let mut next = 0u64;
    let mut error = None;
    loop {
        while error.is_none() && next < len && q.has_room() {
            let Some(lease) = arena.try_acquire() else {
                break;
            };
            let want = (len - next).min(URING_BLOCK) as usize;
            let p = Piece {
                offset: next,
                want,
                got: 0,
            };
            let req = Request {
                kind,
                at: 0,
                len: want,
                offset: next,
            };
            if let Err((_, _, e)) = q.push(lease, p, target, req) {
                error = Some(Error::io_at(op, path, next, e));
                break;
            }
            next += want as u64;
        }
        if q.in_flight() == 0 {
            break;
        }
        let done = q.wait(1).map_err(|b| Error::io("io wait", path, b.error))?;
        for d in done {
            let mut p = d.tag;
            let at = p.offset + p.got as u64;
            if d.result == -libc::EINTR || d.result == -libc::EAGAIN {
            } else if d.result < 0 {
                let e = std::io::Error::from_raw_os_error(-d.result);
                error.get_or_insert(Error::io_at(op, path, at, e));
                continue;
            } else if d.result == 0 {
                // End of file (reads): the rest of this request is past it.
                continue;
            } else {
                p.got += d.result as usize;
                if p.got >= p.want {
                    continue;
                }
            }
            let req = Request {
                kind,
                at: p.got,
                len: align_up((p.want - p.got) as u64) as usize,
                offset: p.offset + p.got as u64,
            };
            if let Err((_, _, e)) = q.push(d.lease, p, target, req) {
                error.get_or_insert(Error::io_at(op, path, at, e));
            }
        }
    }
    match error {
        Some(e) => Err(e),
        None => Ok(Some(())),
    }
}

/// [`raw_direct_write`] through io_uring with `depth` requests in flight. `None` when
/// io_uring is unavailable.
pub fn raw_direct_write_uring(dir: &Path, bytes: u64, depth: u32) -> Result<Option<Duration>> {
    let path = scratch_path(dir, "write-uring");
    let _ = std::fs::remove_file(&path);
    let t = Instant::now();
    let target = Arc::new(FileTarget::create(&path, true)?);
    let padded = align_up(bytes);
    let res = uring_pass(&target, &path, OpKind::Write, padded, depth)
        .and_then(|r| r.map(|()| target.finish(padded)).transpose());
    let elapsed = t.elapsed();
    drop(target);
    let _ = std::fs::remove_file(&path);
    res.map(|r| r.map(|()| elapsed))
}

/// Read the whole file `path` with O_DIRECT in one stream of [`REFERENCE_BLOCK`] calls
/// into one reused buffer, and return the time from open to the last byte.
pub fn raw_direct_read(path: &Path) -> Result<Duration> {
    let arena = buffers(REFERENCE_BLOCK, 1)?;
    let (mut buf, _) = arena.acquire();
    let t = Instant::now();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(|e| Error::io("open(O_DIRECT)", path, e))?;
    let mut off = 0u64;
    loop {
        let n = f
            .read_at(buf.as_mut_slice(), off)
            .map_err(|e| Error::io_at("read", path, off, e))?;
        if n == 0 {
            break;
        }
        off += n as u64;
        if !(n as u64).is_multiple_of(crate::io::DIRECT_ALIGN) {
            break; // the unaligned tail: end of file
        }
    }
    Ok(t.elapsed())
}

/// [`raw_direct_read`] through io_uring with `depth` requests in flight. `None` when
/// io_uring is unavailable.
pub fn raw_direct_read_uring(path: &Path, depth: u32) -> Result<Option<Duration>> {
    let t = Instant::now();
    let target = Arc::new(FileTarget::open_read(path, true)?);
    let len = align_up(target.len()?);
    let res = uring_pass(&target, path, OpKind::Read, len, depth)?;
    Ok(res.map(|()| t.elapsed()))
}
