//! The export's shard writer: the bytes of the shards are written on a thread of their own
//! (`shmckpt-export-writer`) while the reader (the rank files' ranged reads, their
//! CRC-32C checks, the casts) goes on, and the disk writes the shards while they are being
//! read, not after.
//!
//! * **Overlap**: the reader fills a buffer from a fixed pool ([`POOL`] buffers of a few
//!   MiB) with the bytes of one piece and the places they go ([`Job`]), and sends it
//!   through a bounded channel; the writer `pwrite`s it through the page cache and gives
//!   the buffer back. Memory is the pool, whatever the tensor sizes: a reader that is ahead
//!   waits for a free buffer.
//! * **Write-back as it goes**: after every [`KICK`] bytes written to a shard, the writer
//!   starts the write-back of the span written since the last one
//!   (`sync_file_range(SYNC_FILE_RANGE_WRITE)`), and once more than [`IN_FLIGHT`] spans
//!   are under write-back it waits for the oldest (`SYNC_FILE_RANGE_WAIT_BEFORE`). The disk
//!   writes while the rank files are read, dirty pages stay bounded, and the final `fsync`
//!   (still what makes the shards durable) finds little left to write. These calls are
//!   hints: their errors are left to the `fsync` to report.

#![allow(unsafe_code)]

use std::collections::VecDeque;
use std::fs::File;
use std::path::PathBuf;
use std::thread::{Scope, ScopedJoinHandle};

use crossbeam_channel::{Receiver, Sender, bounded};

use crate::error::{Error, Result};

/// Buffers in the pool.
pub(super) const POOL: usize = 8;
/// Bytes a buffer is made with, and the most bytes of a rank file one job carries (its
/// buffer grows to twice that for a cast that doubles them, BF16 to F32).
pub(super) const BUF_BYTES: usize = 4 << 20;
/// Bytes written to a shard between two starts of its write-back.
const KICK: u64 = 32 << 20;
/// Spans of a shard under write-back before the writer waits for the oldest.
const IN_FLIGHT: usize = 4;

/// Bytes for one shard and where they go.
#[derive(Debug, Default)]
pub(super) struct Job {
    /// The shard (index into the writer's files).
    shard: usize,
    /// The bytes.
    buf: Vec<u8>,
    /// `(file offset, start in buf, len)`, in order; adjacent runs merged.
    runs: Vec<(u64, usize, usize)>,
}

impl Job {
    /// Append the bytes `make` adds to the buffer, to be written at `at` of the shard.
    pub(super) fn push_with(&mut self, at: u64, make: impl FnOnce(&mut Vec<u8>)) {
        let start = self.buf.len();
        make(&mut self.buf);
        let len = self.buf.len() - start;
        if len == 0 {
            return;
        }
        match self.runs.last_mut() {
            Some((o, s, l)) if *s + *l == start && o.checked_add(*l as u64) == Some(at) => {
                *l += len;
            }
            _ => self.runs.push((at, start, len)),
        }
    }

    /// Append `bytes`, to be written at `at`.
    pub(super) fn push(&mut self, at: u64, bytes: &[u8]) {
        self.push_with(at, |b| b.extend_from_slice(bytes));
    }

    fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }
}

/// The reader's side of the writer: buffers from the pool, jobs to the writer thread.
pub(super) struct ShardWriter {
    jobs: Sender<Job>,
    free: Receiver<Job>,
    /// A buffer taken from the pool and given back unused (reused before the pool's).
    spare: Option<Job>,
}

/// Why the reader stopped: the writer thread is gone (its own error says why).
const WRITER_GONE: &str = "the export's writer thread stopped";

impl ShardWriter {
    /// Start the writer thread in `scope`, writing to `files` (named `paths` in errors).
    /// [`ShardWriter::finish`] ends it.
    pub(super) fn start<'scope, 'env>(
        scope: &'scope Scope<'scope, 'env>,
        files: &'env [File],
        paths: &'env [PathBuf],
    ) -> Result<(ShardWriter, ScopedJoinHandle<'scope, Result<()>>)> {
        let (jobs_tx, jobs_rx) = bounded::<Job>(POOL);
        let (free_tx, free_rx) = bounded::<Job>(POOL);
        for _ in 0..POOL {
            let job = Job {
                shard: 0,
                buf: Vec::with_capacity(BUF_BYTES),
                runs: Vec::new(),
            };
            free_tx
                .send(job)
                .map_err(|_| Error::Internal("export writer pool".into()))?;
        }
        let handle = std::thread::Builder::new()
            .name("shmckpt-export-writer".into())
            .spawn_scoped(scope, move || write_loop(&jobs_rx, free_tx, files, paths))
            .map_err(|e| Error::Internal(format!("spawning the export's writer thread: {e}")))?;
        Ok((
            ShardWriter {
                jobs: jobs_tx,
                free: free_rx,
                spare: None,
            },
            handle,
        ))
    }

    /// An empty job for `shard`, once a buffer of the pool is free.
    pub(super) fn job(&mut self, shard: usize) -> Result<Job> {
        let mut job = match self.spare.take() {
            Some(j) => j,
            None => self
                .free
                .recv()
                .map_err(|_| Error::Internal(WRITER_GONE.into()))?,
        };
        job.shard = shard;
        job.buf.clear();
        job.runs.clear();
        Ok(job)
    }

    /// Hand `job` to the writer thread (an empty one goes back to the pool).
    pub(super) fn send(&mut self, job: Job) -> Result<()> {
        if job.is_empty() {
            // Kept for the next job: only the writer thread holds the pool's sender (so
            // that the pool's channel disconnects when it stops).
            self.spare = Some(job);
            return Ok(());
        }
        self.jobs
            .send(job)
            .map_err(|_| Error::Internal(WRITER_GONE.into()))
    }

    /// End the writer thread once it wrote every job sent, and combine its result with the
    /// reader's: the writer's error first (a reader that stopped because the writer was
    /// gone says nothing more).
    pub(super) fn finish<T>(
        self,
        handle: ScopedJoinHandle<'_, Result<()>>,
        reader: Result<T>,
    ) -> Result<T> {
        drop(self);
        let written = handle.join().unwrap_or_else(|_| {
            Err(Error::Internal(
                "the export's writer thread panicked".into(),
            ))
        });
        match (reader, written) {
            (_, Err(e)) => Err(e),
            (r, Ok(())) => r,
        }
    }
}

/// Per shard: the span written since its write-back last started, and the spans under
/// write-back, oldest first.
#[derive(Debug, Default)]
struct Progress {
    dirty: Option<(u64, u64)>,
    written: u64,
    started: VecDeque<(u64, u64)>,
}

fn write_loop(
    jobs: &Receiver<Job>,
    free: Sender<Job>,
    files: &[File],
    paths: &[PathBuf],
) -> Result<()> {
    let mut progress: Vec<Progress> = (0..files.len()).map(|_| Progress::default()).collect();
    for job in jobs.iter() {
        let (file, path) = files
            .get(job.shard)
            .zip(paths.get(job.shard))
            .ok_or_else(|| Error::Internal(format!("export job for shard {}", job.shard)))?;
        let p = &mut progress[job.shard];
        for &(at, start, len) in &job.runs {
            crate::fsops::write_all_at(file, &job.buf[start..start + len], at)
                .map_err(|e| Error::io_at("write", path, at, e))?;
            let end = at.saturating_add(len as u64);
            p.dirty = Some(match p.dirty {
                Some((b, e)) => (b.min(at), e.max(end)),
                None => (at, end),
            });
            p.written += len as u64;
        }
        if p.written >= KICK {
            start_writeback(file, p);
        }
        // The reader may have stopped (an error): the buffer is then no longer needed.
        let _ = free.send(job);
    }
    for (file, p) in files.iter().zip(&mut progress) {
        start_writeback(file, p);
    }
    Ok(())
}

/// Start the write-back of what `p` wrote since the last call; wait for the oldest span
/// under write-back when more than [`IN_FLIGHT`] are.
fn start_writeback(file: &File, p: &mut Progress) {
    let Some(span) = p.dirty.take() else {
        return;
    };
    p.written = 0;
    sync_file_range(file, span, libc::SYNC_FILE_RANGE_WRITE);
    p.started.push_back(span);
    while p.started.len() > IN_FLIGHT {
        let old = p.started.pop_front().expect("more than IN_FLIGHT spans");
        sync_file_range(file, old, libc::SYNC_FILE_RANGE_WAIT_BEFORE);
    }
}

/// `sync_file_range(file, begin, end - begin, flags)`, a hint: its error is left to the
/// `fsync` that makes the file durable.
fn sync_file_range(file: &File, (begin, end): (u64, u64), flags: libc::c_uint) {
    let _ = crate::util::sync_file_range(file, begin, end.saturating_sub(begin), flags);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adjacent_runs_merge_and_others_do_not() {
        let mut j = Job::default();
        j.push(100, &[1, 2]);
        j.push(102, &[3]);
        j.push(200, &[4]);
        j.push_with(201, |b| b.extend_from_slice(&[5, 6]));
        j.push(300, &[]);
        assert_eq!(j.buf, vec![1, 2, 3, 4, 5, 6]);
        assert_eq!(j.runs, vec![(100, 0, 3), (200, 3, 3)]);
    }

    /// The reader can hold at most [`POOL`] buffers: the next one waits for the writer.
    #[test]
    fn the_pool_holds_pool_buffers() {
        let dir = tempfile::tempdir().unwrap();
        let paths = vec![dir.path().join("s")];
        let files = vec![File::create(&paths[0]).unwrap()];
        std::thread::scope(|s| {
            let (mut w, h) = ShardWriter::start(s, &files, &paths).unwrap();
            let held: Vec<Job> = (0..POOL).map(|_| w.job(0).unwrap()).collect();
            assert!(w.free.try_recv().is_err(), "a buffer beyond the pool");
            // An empty job goes back to the reader's spare, not to the writer.
            let mut held = held.into_iter();
            w.send(held.next().unwrap()).unwrap();
            assert!(w.spare.is_some());
            let mut j = w.job(0).unwrap();
            assert!(w.spare.is_none());
            j.push(0, b"z");
            w.send(j).unwrap();
            // Written, then given back: one buffer free again.
            let back = w.free.recv().unwrap();
            assert!(back.runs.len() == 1 && back.buf == b"z");
            drop(held);
            w.finish(h, Ok(())).unwrap();
        });
        assert_eq!(std::fs::read(&paths[0]).unwrap(), b"z");
    }

    #[test]
    fn jobs_land_at_their_offsets() {
        let dir = tempfile::tempdir().unwrap();
        let paths: Vec<PathBuf> = (0..2).map(|i| dir.path().join(format!("s{i}"))).collect();
        let files: Vec<File> = paths.iter().map(|p| File::create(p).unwrap()).collect();
        let n = 3 * POOL;
        let out = std::thread::scope(|s| {
            let (mut w, h) = ShardWriter::start(s, &files, &paths).unwrap();
            let r = (|| -> Result<()> {
                for i in 0..n {
                    let mut j = w.job(i % 2)?;
                    j.push((i / 2) as u64 * 4, &(i as u32).to_le_bytes());
                    w.send(j)?;
                }
                Ok(())
            })();
            w.finish(h, r)
        });
        out.unwrap();
        for (k, p) in paths.iter().enumerate() {
            let got = std::fs::read(p).unwrap();
            let want: Vec<u8> = (0..n)
                .filter(|i| i % 2 == k)
                .flat_map(|i| (i as u32).to_le_bytes())
                .collect();
            assert_eq!(got, want);
        }
    }

    #[test]
    fn a_failed_write_is_the_error_and_stops_the_reader() {
        let dir = tempfile::tempdir().unwrap();
        let paths = vec![dir.path().join("ro")];
        std::fs::write(&paths[0], b"x").unwrap();
        // Open read-only: every pwrite fails with EBADF.
        let files = vec![File::open(&paths[0]).unwrap()];
        let err = std::thread::scope(|s| {
            let (mut w, h) = ShardWriter::start(s, &files, &paths).unwrap();
            let r = (|| -> Result<()> {
                for _ in 0..4 * POOL {
                    let mut j = w.job(0)?;
                    j.push(0, b"abc");
                    w.send(j)?;
                }
                Ok(())
            })();
            w.finish(h, r)
        })
        .unwrap_err();
        match err {
            Error::Io { op, path, .. } => {
                assert_eq!(op, "write");
                assert_eq!(path, paths[0]);
            }
            other => panic!("expected the write's error, got {other:?}"),
        }
    }
}
