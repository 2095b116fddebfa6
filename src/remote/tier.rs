//! The engine's remote tier: one uploader thread per engine that takes committed saves in
//! order, uploads this rank's file, commits the step in the bucket when every rank's
//! object is there, and applies the bucket's retention.
//!
//! Backpressure: at most `max_pending` saves wait for the uploader (besides the one it
//! uploads). When a further save is committed locally while the queue is full, the oldest
//! waiting save's remote copy is skipped (its [`RemoteProgress`] reports
//! [`Error::RemoteSkipped`]): memory stays bounded (a waiting save holds an open file
//! descriptor and its manifest entry, no data) and the newest steps reach the bucket
//! first. The local tier never waits for the remote one.

use std::collections::VecDeque;
use std::fs::File;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::Remote;
use crate::error::{Error, Result};
use crate::manifest::{FileEntry, Metadata};
use crate::util::lock;

/// Default number of saves that may wait for the uploader: 2.
pub const DEFAULT_MAX_PENDING: usize = 2;

/// How long [`RemoteProgress::wait`] waits, after this rank's upload, for the other ranks
/// to complete the step in the bucket: 10 minutes.
pub const COMMIT_WAIT: Duration = Duration::from_secs(600);

/// What a save's remote copy did.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteReport {
    /// Step.
    pub step: u64,
    /// Bytes of this rank's object.
    pub bytes: u64,
    /// Time of this rank's upload (object and manifest part).
    pub upload: Duration,
    /// From `save` to the step committed in the bucket (as seen by this rank).
    pub remote_durable: Duration,
    /// Whether this rank wrote the bucket's manifest (else another rank did).
    pub committed_here: bool,
    /// Steps removed from the bucket by this commit's retention (`remote_keep_last`).
    pub retired: Vec<u64>,
}

#[derive(Debug)]
struct Ticket {
    step: u64,
    started: Instant,
    world_size: u32,
    remote: Arc<Remote>,
    result: Mutex<Option<std::result::Result<RemoteReport, Arc<Error>>>>,
    changed: Condvar,
}

/// A save's remote copy in flight: wait for it with [`RemoteProgress::wait`]. Cloning
/// shares it.
#[derive(Debug, Clone)]
pub struct RemoteProgress {
    t: Arc<Ticket>,
}

impl RemoteProgress {
    /// The step.
    pub fn step(&self) -> u64 {
        self.t.step
    }

    /// Whether this rank's part is over (uploaded, failed or skipped).
    pub fn is_done(&self) -> bool {
        lock(&self.t.result).is_some()
    }

    fn finish(&self, r: std::result::Result<RemoteReport, Arc<Error>>) {
        let mut g = lock(&self.t.result);
        if g.is_none() {
            *g = Some(r);
        }
        drop(g);
        self.t.changed.notify_all();
    }

    pub(crate) fn fail(&self, e: Error) {
        self.finish(Err(Arc::new(e)));
    }

    /// This rank's result, waiting up to `timeout` (`None`: not yet).
    fn own_result(
        &self,
        timeout: Option<Duration>,
    ) -> Option<std::result::Result<RemoteReport, Arc<Error>>> {
        let deadline = timeout.map(|d| Instant::now() + d);
        let mut g = lock(&self.t.result);
        loop {
            if let Some(r) = &*g {
                return Some(r.clone());
            }
            match deadline {
                None => g = self.t.changed.wait(g).unwrap_or_else(|e| e.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return None;
                    }
                    g = self
                        .t
                        .changed
                        .wait_timeout(g, d - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            }
        }
    }

    /// Block until the step is committed in the bucket (or this rank's upload failed or
    /// was skipped). With several ranks, a rank whose upload was not the last waits for
    /// the manifest to appear, up to [`COMMIT_WAIT`]. Errors: [`Error::RemoteFailed`] (its
    /// source says why), [`Error::RemoteSkipped`] (backpressure).
    pub fn wait(&self) -> Result<RemoteReport> {
        match self.wait_timeout(None) {
            Some(r) => r,
            None => Err(Error::Internal("wait without a deadline timed out".into())),
        }
    }

    /// [`RemoteProgress::wait`] giving up after `timeout` (`None` then).
    pub fn wait_timeout(&self, timeout: Option<Duration>) -> Option<Result<RemoteReport>> {
        let deadline = timeout.map(|d| Instant::now() + d);
        let step = self.t.step;
        // A skipped copy is reported as such; anything else as a failed copy.
        let fail = |source: Arc<Error>| match &*source {
            Error::RemoteSkipped { step, reason } => Error::RemoteSkipped {
                step: *step,
                reason: reason.clone(),
            },
            _ => Error::RemoteFailed { step, source },
        };
        let mut rep = match self.own_result(timeout)? {
            Ok(r) => r,
            Err(e) => return Some(Err(fail(e))),
        };
        if rep.committed_here || self.t.world_size == 1 {
            return Some(Ok(rep));
        }
        // Another rank commits: wait for the manifest.
        let commit_deadline = self.t.started + rep.remote_durable + COMMIT_WAIT;
        let mut nap = Duration::from_millis(20);
        loop {
            match self.t.remote.manifest(step) {
                Ok(_) => {
                    rep.remote_durable = self.t.started.elapsed();
                    return Some(Ok(rep));
                }
                Err(Error::NotFound { .. }) => {}
                Err(e) => return Some(Err(fail(Arc::new(e)))),
            }
            let now = Instant::now();
            if now >= commit_deadline {
                return Some(Err(fail(Arc::new(Error::Remote {
                    url: self.t.remote.url().to_owned(),
                    op: "commit",
                    reason: format!(
                        "this rank's object of step {step} is uploaded, but the other ranks' did not complete the step within {COMMIT_WAIT:?}"
                    ),
                }))));
            }
            if deadline.is_some_and(|d| now >= d) {
                return None;
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(500));
        }
    }
}

struct Job {
    progress: RemoteProgress,
    file: File,
    entry: FileEntry,
    metadata: Metadata,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    closed: bool,
}

/// The uploader of one engine.
pub(crate) struct RemoteTier {
    remote: Arc<Remote>,
    world_size: u32,
    max_pending: usize,
    queue: Arc<(Mutex<Queue>, Condvar)>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for RemoteTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteTier")
            .field("remote", &self.remote)
            .finish()
    }
}

impl RemoteTier {
    /// Start the uploader thread.
    pub(crate) fn start(
        remote: Arc<Remote>,
        world_size: u32,
        keep_last: Option<usize>,
        max_pending: usize,
        session: Option<String>,
    ) -> Result<RemoteTier> {
        let queue: Arc<(Mutex<Queue>, Condvar)> = Arc::default();
        let q = Arc::clone(&queue);
        let r = Arc::clone(&remote);
        let thread = std::thread::Builder::new()
            .name("shmckpt-remote".into())
            .spawn(move || {
                loop {
                    let job = {
                        let (m, cv) = &*q;
                        let mut g = lock(m);
                        loop {
                            if let Some(j) = g.jobs.pop_front() {
                                break Some(j);
                            }
                            if g.closed {
                                break None;
                            }
                            g = cv.wait(g).unwrap_or_else(|e| e.into_inner());
                        }
                    };
                    let Some(job) = job else { return };
                    let res = run(&r, &job, world_size, keep_last, session.as_deref());
                    if let Err(e) = &res {
                        tracing::error!(step = job.progress.step(), error = %e, "remote copy failed; nothing of this step is visible in the bucket");
                    }
                    job.progress.finish(res.map_err(Arc::new));
                }
            })
            .map_err(|e| Error::Config(format!("cannot spawn the remote uploader: {e}")))?;
        Ok(RemoteTier {
            remote,
            world_size,
            max_pending: max_pending.max(1),
            queue,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// The remote.
    pub(crate) fn remote(&self) -> &Arc<Remote> {
        &self.remote
    }

    /// A new save's remote progress (reported when the uploader is done with it).
    pub(crate) fn progress(&self, step: u64) -> RemoteProgress {
        RemoteProgress {
            t: Arc::new(Ticket {
                step,
                started: Instant::now(),
                world_size: self.world_size,
                remote: Arc::clone(&self.remote),
                result: Mutex::new(None),
                changed: Condvar::new(),
            }),
        }
    }

    /// Queue a locally committed save's upload (skipping the oldest waiting one when
    /// `max_pending` are waiting).
    pub(crate) fn submit(
        &self,
        progress: RemoteProgress,
        file: File,
        entry: FileEntry,
        metadata: Metadata,
    ) {
        let (m, cv) = &*self.queue;
        let mut g = lock(m);
        if g.closed {
            drop(g);
            progress.fail(Error::Shutdown("the remote uploader has stopped".into()));
            return;
        }
        let mut skipped = Vec::new();
        while g.jobs.len() >= self.max_pending {
            if let Some(old) = g.jobs.pop_front() {
                skipped.push(old);
            }
        }
        g.jobs.push_back(Job {
            progress,
            file,
            entry,
            metadata,
        });
        drop(g);
        cv.notify_all();
        for old in skipped {
            let step = old.progress.step();
            tracing::warn!(
                step,
                "remote tier behind: skipping the remote copy of an intermediate step"
            );
            old.progress.fail(Error::RemoteSkipped {
                step,
                reason: format!(
                    "{} newer saves were waiting for the uploader (remote_max_pending)",
                    self.max_pending
                ),
            });
        }
    }

    /// Finish the queued uploads and stop the thread.
    pub(crate) fn close(&self) {
        {
            let (m, cv) = &*self.queue;
            lock(m).closed = true;
            cv.notify_all();
        }
        if let Some(h) = lock(&self.thread).take()
            && h.join().is_err()
        {
            tracing::error!("remote uploader panicked");
        }
    }
}

impl Drop for RemoteTier {
    /// An engine whose open failed after the tier started never calls `close`.
    fn drop(&mut self) {
        self.close();
    }
}

fn run(
    remote: &Remote,
    job: &Job,
    world_size: u32,
    keep_last: Option<usize>,
    session: Option<&str>,
) -> Result<RemoteReport> {
    let step = job.progress.step();
    let t = Instant::now();
    let bytes = remote.upload_rank(step, &job.file, &job.entry, session)?;
    let upload = t.elapsed();
    let (committed_here, retired) =
        match remote.try_commit(step, world_size, &job.metadata, session)? {
            Some((_, true)) => {
                let retired = match keep_last {
                    Some(k) => remote.apply_retention(k).unwrap_or_else(|e| {
                        tracing::warn!(error = %e, "bucket retention failed; older steps kept");
                        Vec::new()
                    }),
                    None => Vec::new(),
                };
                (true, retired)
            }
            Some((_, false)) | None => (false, Vec::new()),
        };
    Ok(RemoteReport {
        step,
        bytes,
        upload,
        remote_durable: job.progress.t.started.elapsed(),
        committed_here,
        retired,
    })
}
