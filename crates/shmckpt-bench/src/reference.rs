//! Physical limits measured in the same run as a benchmark: raw O_DIRECT sequential writes
//! and reads of the same number of bytes on the same disk, with no staging, no checksums
//! and no commit. This is what `shmckpt bench` divides by.
//!
//! Each limit is the better of two ways to drive the disk, measured back to back: one
//! stream of 16 MiB `pwrite`/`pread` calls (`dd bs=16M oflag=direct` equivalent), and
//! io_uring with [`URING_DEPTH`] requests of [`URING_BLOCK`] bytes in flight (`fio
//! iodepth=16`). Some devices reach their limit only with many requests queued, others
//! with few large ones: the reference is the disk's real limit, not the easier one.
//!
//! None of the library's I/O code runs here: the reference drives the disk with `std`
//! and the `io-uring` crate directly, from 4096-aligned heap buffers, so that it measures
//! the disk and not the library.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use io_uring::{IoUring, opcode, types};
use shmckpt::{Error, Result};

/// Alignment of O_DIRECT offsets, lengths and buffers.
pub const DIRECT_ALIGN: u64 = 4096;

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

/// `n` rounded up to [`DIRECT_ALIGN`].
fn align_up(n: u64) -> u64 {
    n.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN
}

/// The library's error for an OS error of `op` on `path` (at `offset` for reads and writes).
fn io_error(op: &'static str, path: &Path, offset: Option<u64>, source: io::Error) -> Error {
    Error::Io {
        op,
        path: path.to_owned(),
        offset,
        source,
    }
}

/// A 4096-aligned buffer of `len` bytes on the heap (a `Vec` over-allocated by one
/// alignment and used from its first aligned byte), filled with pseudo-random bytes so
/// that every page is allocated before a measurement.
struct Aligned {
    v: Vec<u8>,
    off: usize,
    len: usize,
}

impl Aligned {
    fn new(len: u64, seed: u64) -> Aligned {
        let len = len as usize;
        let v = vec![0u8; len + DIRECT_ALIGN as usize];
        let off = v.as_ptr().align_offset(DIRECT_ALIGN as usize);
        let mut b = Aligned { v, off, len };
        crate::synthetic::fill(b.as_mut_slice(), seed, 7, 0);
        b
    }

    fn as_slice(&self) -> &[u8] {
        &self.v[self.off..self.off + self.len]
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.v[self.off..self.off + self.len]
    }
}

/// Open `path` with O_DIRECT, or, where the filesystem refuses it (tmpfs), buffered
/// (logged), as the engine does.
fn open_direct(opts: &mut std::fs::OpenOptions, path: &Path) -> Result<File> {
    match opts.clone().custom_flags(libc::O_DIRECT).open(path) {
        Ok(f) => Ok(f),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            tracing::warn!(path = %path.display(), "filesystem refuses O_DIRECT; using buffered I/O");
            opts.open(path).map_err(|e| io_error("open", path, None, e))
        }
        Err(e) => Err(io_error("open(O_DIRECT)", path, None, e)),
    }
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
    let buf = Aligned::new(REFERENCE_BLOCK, 0xAB);
    let path = scratch_path(dir, "write");
    let _ = std::fs::remove_file(&path);
    let t = Instant::now();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .map_err(|e| io_error("open(O_DIRECT)", &path, None, e))?;
    let padded = align_up(bytes);
    let mut off = 0u64;
    let res = (|| {
        while off < padded {
            let n = (padded - off).min(REFERENCE_BLOCK) as usize;
            f.write_all_at(&buf.as_slice()[..n], off)
                .map_err(|e| io_error("write", &path, Some(off), e))?;
            off += n as u64;
        }
        f.sync_data()
            .map_err(|e| io_error("fdatasync", &path, None, e))
    })();
    let elapsed = t.elapsed();
    drop(f);
    let _ = std::fs::remove_file(&path);
    res.map(|()| elapsed)
}

/// One request of the io_uring references: the file range of one buffer, and how much of
/// it is done.
#[derive(Debug, Clone, Copy)]
struct Piece {
    offset: u64,
    want: usize,
    got: usize,
}

/// Queue a read or write of `buf[at..at + len]` at file `offset`, tagged `tag`.
///
/// # Safety
/// `buf` must stay allocated and untouched until the request's completion is reaped.
unsafe fn submit(
    ring: &mut IoUring,
    file: &File,
    write: bool,
    buf: &mut Aligned,
    (at, len, offset): (usize, usize, u64),
    tag: u64,
) -> io::Result<()> {
    let fd = types::Fd(file.as_raw_fd());
    let ptr = buf.as_mut_slice()[at..at + len].as_mut_ptr();
    let entry = if write {
        opcode::Write::new(fd, ptr, len as u32)
            .offset(offset)
            .build()
    } else {
        opcode::Read::new(fd, ptr, len as u32)
            .offset(offset)
            .build()
    }
    .user_data(tag);
    // The ring has `depth.next_power_of_two()` slots and at most `depth` requests are in
    // flight, so the submission queue cannot be full after a submit.
    if ring.submission().is_full() {
        ring.submit()?;
    }
    // SAFETY: the entry points into `buf[at..at + len]` (in bounds: sliced above), which
    // the caller keeps allocated and untouched until the completion is reaped; `file`
    // outlives the ring's requests (every pass waits for all of them or leaks the buffers).
    unsafe { ring.submission().push(&entry) }
        .map_err(|_| io::Error::other("io_uring submission queue full"))
}

/// Drive `[0, len)` of `file` through io_uring with `depth` requests of [`URING_BLOCK`]
/// in flight (reads stop at end of file). `None` when io_uring is unavailable.
fn uring_pass(file: &File, path: &Path, write: bool, len: u64, depth: u32) -> Result<Option<()>> {
    let depth = depth.max(1);
    let ring = IoUring::builder()
        .build(depth.next_power_of_two())
        .and_then(|r| r.submit().map(|_| r)); // a ring can exist where io_uring_enter is denied
    let mut ring = match ring {
        Ok(r) => r,
        Err(e) => {
            tracing::info!(error = %e, "io_uring unavailable: no io_uring reference");
            return Ok(None);
        }
    };
    let mut bufs: Vec<Aligned> = (0..u64::from(depth))
        .map(|k| Aligned::new(URING_BLOCK, 0xAB + k))
        .collect();
    let mut pieces: Vec<Option<Piece>> = vec![None; bufs.len()];
    let mut free: Vec<usize> = (0..bufs.len()).rev().collect();
    let op = if write { "write" } else { "read" };
    let (mut next, mut in_flight) = (0u64, 0usize);
    let mut error = None;
    loop {
        while error.is_none() && next < len {
            let Some(i) = free.pop() else {
                break;
            };
            let want = (len - next).min(URING_BLOCK) as usize;
            // SAFETY: buffer `i` is free (no request of it in flight) and stays in `bufs`
            // until its completion is reaped below.
            match unsafe {
                submit(
                    &mut ring,
                    file,
                    write,
                    &mut bufs[i],
                    (0, want, next),
                    i as u64,
                )
            } {
                Ok(()) => {
                    pieces[i] = Some(Piece {
                        offset: next,
                        want,
                        got: 0,
                    });
                    in_flight += 1;
                    next += want as u64;
                }
                Err(e) => {
                    error = Some(io_error(op, path, Some(next), e));
                    free.push(i);
                }
            }
        }
        if in_flight == 0 {
            break;
        }
        if let Err(e) = loop {
            match ring.submit_and_wait(1) {
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                r => break r,
            }
        } {
            // Requests are still in flight into `bufs`: never free memory the kernel may
            // still write.
            std::mem::forget(bufs);
            return Err(io_error("io_uring wait", path, None, e));
        }
        let done: Vec<(u64, i32)> = ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (tag, result) in done {
            in_flight -= 1;
            let i = tag as usize;
            let Some(mut p) = pieces[i].take() else {
                continue;
            };
            let at = p.offset + p.got as u64;
            if result == -libc::EINTR || result == -libc::EAGAIN {
            } else if result < 0 {
                let e = io::Error::from_raw_os_error(-result);
                error.get_or_insert(io_error(op, path, Some(at), e));
                free.push(i);
                continue;
            } else if result == 0 {
                // End of file (reads): the rest of this request is past it.
                free.push(i);
                continue;
            } else {
                p.got += result as usize;
                // A read that stops off the alignment reached the unaligned end of file.
                if p.got >= p.want || (!write && !(p.got as u64).is_multiple_of(DIRECT_ALIGN)) {
                    free.push(i);
                    continue;
                }
            }
            // The rest of a short or interrupted request, from where it stopped.
            let rest =
                (align_up((p.want - p.got) as u64) as usize).min(URING_BLOCK as usize - p.got);
            // SAFETY: buffer `i`'s previous request was just reaped; it stays in `bufs`
            // until this one is.
            match unsafe { submit(&mut ring, file, write, &mut bufs[i], (p.got, rest, at), tag) } {
                Ok(()) => {
                    pieces[i] = Some(p);
                    in_flight += 1;
                }
                Err(e) => {
                    error.get_or_insert(io_error(op, path, Some(at), e));
                    free.push(i);
                }
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
    let file = open_direct(
        std::fs::OpenOptions::new().write(true).create_new(true),
        &path,
    )?;
    let padded = align_up(bytes);
    let res = uring_pass(&file, &path, true, padded, depth).and_then(|r| {
        r.map(|()| {
            file.set_len(padded)
                .and_then(|()| file.sync_data())
                .map_err(|e| io_error("fdatasync", &path, None, e))
        })
        .transpose()
    });
    let elapsed = t.elapsed();
    drop(file);
    let _ = std::fs::remove_file(&path);
    res.map(|r| r.map(|()| elapsed))
}

/// Read the whole file `path` with O_DIRECT in one stream of [`REFERENCE_BLOCK`] calls
/// into one reused buffer, and return the time from open to the last byte.
pub fn raw_direct_read(path: &Path) -> Result<Duration> {
    let mut buf = Aligned::new(REFERENCE_BLOCK, 0xAB);
    let t = Instant::now();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(|e| io_error("open(O_DIRECT)", path, None, e))?;
    let mut off = 0u64;
    loop {
        let n = f
            .read_at(buf.as_mut_slice(), off)
            .map_err(|e| io_error("read", path, Some(off), e))?;
        if n == 0 {
            break;
        }
        off += n as u64;
        if !(n as u64).is_multiple_of(DIRECT_ALIGN) {
            break; // the unaligned tail: end of file
        }
    }
    Ok(t.elapsed())
}

/// [`raw_direct_read`] through io_uring with `depth` requests in flight. `None` when
/// io_uring is unavailable.
pub fn raw_direct_read_uring(path: &Path, depth: u32) -> Result<Option<Duration>> {
    let t = Instant::now();
    let file = open_direct(std::fs::OpenOptions::new().read(true), path)?;
    let len = file
        .metadata()
        .map_err(|e| io_error("fstat", path, None, e))?
        .len();
    let res = uring_pass(&file, path, false, align_up(len), depth)?;
    Ok(res.map(|()| t.elapsed()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_buffers_are_aligned_and_filled() {
        let b = Aligned::new(3 * DIRECT_ALIGN, 1);
        assert_eq!(b.as_slice().as_ptr() as usize % DIRECT_ALIGN as usize, 0);
        assert_eq!(b.as_slice().len(), 3 * DIRECT_ALIGN as usize);
        let mut want = vec![0u8; 3 * DIRECT_ALIGN as usize];
        crate::synthetic::fill(&mut want, 1, 7, 0);
        assert_eq!(b.as_slice(), &want[..]);
    }
}
