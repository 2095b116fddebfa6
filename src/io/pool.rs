//! The writer pool: N named threads (`shmckpt-writer-{i}`), each owning one backend, fed by
//! one channel. A disconnected channel means shut down once in-flight writes end.
//!
//! Every job's chunk lease stays in the [`LeaseQueue`] until the job's last completion is
//! reaped: a buffer in flight belongs to the kernel, also on error and on shutdown.
//! Completions are handled in whatever order they arrive; short writes are resubmitted for
//! the remainder.
#![deny(unsafe_code)]

use std::io;
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};

use super::file::FileTarget;
use super::queue::{LeaseQueue, Request};
use super::{BackendOptions, OpKind, open_backend};
use crate::error::{Error, Result};
use crate::staging::ChunkLease;

/// The party that owns a write: a save in flight.
pub trait WriteSink: Send + Sync {
    /// The file written, waiting until it is open; `None` when opening it failed (the
    /// save has failed then) or the save has ended.
    fn target(&self) -> Option<Arc<FileTarget>>;
    /// Path of the file (for errors).
    fn path(&self) -> &std::path::Path;
    /// True once the save has failed; later jobs are skipped.
    fn failed(&self) -> bool;
    /// The chunk's write ended. Runs on the writer thread; `bytes` is the staged chunk
    /// (still leased, so it can be checksummed), `None` when the buffer was lost with a
    /// broken backend.
    fn finished(&self, chunk: &ChunkInfo, bytes: Option<&[u8]>, outcome: Outcome);
    /// [`WriteSink::finished`] with the chunk's lease, which the sink may keep (the
    /// remote tier uploads from it) or drop (the chunk returns to the arena). Runs on the
    /// writer thread. By default: `finished` with the lease's bytes, then the lease drops.
    fn finished_lease(&self, chunk: &ChunkInfo, lease: ChunkLease, outcome: Outcome) {
        self.finished(chunk, Some(lease.as_slice()), outcome);
    }
    /// True when the save writes no file (remote only: the bucket is its only copy): the
    /// writers hand each chunk straight to [`WriteSink::finished_lease`] as written.
    fn no_file(&self) -> bool {
        false
    }
}

/// How a job ended.
#[derive(Debug)]
pub enum Outcome {
    /// Every byte was written.
    Written,
    /// The write failed.
    Failed(Error),
    /// Not attempted: the save had already failed.
    Skipped,
}

/// Where a chunk goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkInfo {
    /// File chunk index.
    pub chunk: u64,
    /// File offset of the chunk.
    pub offset: u64,
    /// Bytes of the chunk that belong to the file.
    pub len: usize,
    /// `len` rounded up to 4096: the staged chunk is zero-padded to here. With O_DIRECT
    /// the padding is written too (and cut off by the final `ftruncate`); buffered files
    /// get exactly `len` bytes.
    pub write_len: usize,
}

/// One chunk to write.
pub struct WriteJob {
    /// The save it belongs to.
    pub sink: Arc<dyn WriteSink>,
    /// The staged bytes.
    pub lease: ChunkLease,
    /// Where they go.
    pub info: ChunkInfo,
}

impl std::fmt::Debug for WriteJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteJob")
            .field("info", &self.info)
            .finish()
    }
}

/// The running pool.
#[derive(Debug)]
pub struct WriterPool {
    tx: Option<Sender<WriteJob>>,
    threads: Vec<JoinHandle<()>>,
    backend: super::Backend,
}

impl WriterPool {
    /// Start `threads` writers, each with its own backend built from `opts`. Backends are
    /// built here, so a setup failure is returned instead of killing a thread.
    pub fn start(threads: usize, opts: &BackendOptions) -> Result<WriterPool> {
        let threads = threads.max(1);
        let mut queues = Vec::with_capacity(threads);
        for _ in 0..threads {
            let b = open_backend(opts).map_err(|e| {
                Error::Config(format!(
                    "cannot set up the {:?} write backend: {e}",
                    opts.kind
                ))
            })?;
            queues.push(LeaseQueue::<Tag>::new(b));
        }
        let backend = queues[0].backend();
        // Unbounded: the staging arena already bounds the work outstanding (every job holds
        // a chunk), and staging must never wait on the disk while chunks are free.
        let (tx, rx) = crossbeam_channel::unbounded::<WriteJob>();
        let mut handles = Vec::with_capacity(threads);
        for (i, q) in queues.into_iter().enumerate() {
            let rx = rx.clone();
            let h = std::thread::Builder::new()
                .name(format!("shmckpt-writer-{i}"))
                .spawn(move || writer_loop(q, rx))
                .map_err(|e| Error::Config(format!("cannot spawn writer thread: {e}")))?;
            handles.push(h);
        }
        Ok(WriterPool {
            tx: Some(tx),
            threads: handles,
            backend,
        })
    }

    /// Name of the backend in use.
    pub fn backend(&self) -> super::Backend {
        self.backend
    }

    /// A sender for jobs (staging threads hold one while they dispatch; the writers stop
    /// only after every sender is gone). `None` after shutdown.
    pub fn sender(&self) -> Option<Sender<WriteJob>> {
        self.tx.clone()
    }

    /// Stop accepting jobs, finish the queued and in-flight ones, join the threads.
    pub fn shutdown(&mut self) {
        self.tx = None;
        for h in self.threads.drain(..) {
            if h.join().is_err() {
                tracing::error!("a writer thread panicked");
            }
        }
    }
}

impl Drop for WriterPool {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// What travels with a lease through the kernel.
struct Tag {
    sink: Arc<dyn WriteSink>,
    info: ChunkInfo,
    /// Bytes to write (padded for O_DIRECT, exact otherwise).
    total: usize,
    /// Bytes written so far.
    done: usize,
}

/// How often an idle writer checks whether its backend's late set-up can run.
const SETUP_POLL: std::time::Duration = std::time::Duration::from_millis(20);

fn writer_loop(mut q: LeaseQueue<Tag>, rx: Receiver<WriteJob>) {
    let mut closed = false;
    let mut setup = true;
    loop {
        // Take new jobs while there is room; block only when nothing is in flight.
        while !closed && q.has_room() {
            let job = if q.in_flight() == 0 {
                if setup {
                    setup = q.idle_setup();
                }
                let got = if setup {
                    match rx.recv_timeout(SETUP_POLL) {
                        Ok(j) => Ok(j),
                        Err(RecvTimeoutError::Timeout) => continue,
                        Err(RecvTimeoutError::Disconnected) => Err(()),
                    }
                } else {
                    rx.recv().map_err(|_| ())
                };
                match got {
                    Ok(j) => j,
                    Err(()) => {
                        closed = true;
                        break;
                    }
                }
            } else {
                match rx.try_recv() {
                    Ok(j) => j,
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        closed = true;
                        break;
                    }
                }
            };
            if job.sink.failed() {
                job.sink
                    .finished_lease(&job.info, job.lease, Outcome::Skipped);
                continue; // the lease was never handed to the kernel
            }
            if job.sink.no_file() {
                job.sink
                    .finished_lease(&job.info, job.lease, Outcome::Written);
                continue;
            }
            let total = match job.sink.target() {
                Some(t) if t.is_direct() => job.info.write_len,
                Some(_) => job.info.len,
                None => {
                    // Opening the file failed: the save has its error already.
                    job.sink
                        .finished_lease(&job.info, job.lease, Outcome::Skipped);
                    continue;
                }
            };
            let tag = Tag {
                sink: job.sink,
                info: job.info,
                total,
                done: 0,
            };
            issue(&mut q, job.lease, tag);
        }
        if q.in_flight() == 0 {
            if closed {
                return;
            }
            continue;
        }
        let done = match q.wait(1) {
            Ok(d) => d,
            Err(broken) => {
                tracing::error!(error = %broken.error, "write backend failed; writer thread stops");
                for t in broken.tags {
                    let err = Error::io_at(
                        "io_uring_enter",
                        t.sink.path(),
                        t.info.offset + t.done as u64,
                        io::Error::new(broken.error.kind(), broken.error.to_string()),
                    );
                    t.sink.finished(&t.info, None, Outcome::Failed(err));
                }
                return;
            }
        };
        for d in done {
            let mut t = d.tag;
            let r = d.result;
            if r == -libc::EINTR || r == -libc::EAGAIN {
                issue(&mut q, d.lease, t);
            } else if r < 0 {
                fail(d.lease, t, io::Error::from_raw_os_error(-r));
            } else if r == 0 {
                let e = io::Error::new(io::ErrorKind::WriteZero, "write returned 0 bytes");
                fail(d.lease, t, e);
            } else {
                t.done = (t.done + r as usize).min(t.total);
                if t.done == t.total {
                    t.sink.finished_lease(&t.info, d.lease, Outcome::Written);
                } else {
                    issue(&mut q, d.lease, t); // short write: the rest
                }
            }
        }
    }
}

/// Queue the (remaining part of the) write; a refusal fails the job.
fn issue(q: &mut LeaseQueue<Tag>, lease: ChunkLease, t: Tag) {
    let sink = Arc::clone(&t.sink);
    let at = t.done;
    let len = t.total - t.done;
    let offset = t.info.offset + t.done as u64;
    let req = Request {
        kind: OpKind::Write,
        at,
        len,
        offset,
    };
    let Some(target) = sink.target() else {
        return fail(lease, t, std::io::Error::other("file not open"));
    };
    if let Err((lease, t, e)) = q.push(lease, t, &target, req) {
        fail(lease, t, e);
    }
}

fn fail(lease: ChunkLease, t: Tag, e: io::Error) {
    let err = Error::io_at("write", t.sink.path(), t.info.offset + t.done as u64, e);
    tracing::error!(error = %err, "write failed");
    t.sink.finished_lease(&t.info, lease, Outcome::Failed(err));
}
