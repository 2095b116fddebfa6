//! The engine's remote tier: one uploader thread per engine that takes saves in order as
//! they start, streams this rank's file to the bucket from the staging arena while the
//! save is written locally, completes it once the save is committed locally, commits the
//! step in the bucket when every rank's object is there, and applies the bucket's
//! retention.
//!
//! Backpressure: at most `max_pending` saves wait for the uploader (besides the one it
//! uploads). When a further save starts while the queue is full, the oldest waiting save's
//! remote copy is skipped (its [`RemoteProgress`] reports [`Error::RemoteSkipped`]) and
//! its held chunks go back to the arena: memory stays bounded (a waiting save holds only
//! the chunks staging has not needed back, see `feed.rs`) and the newest steps reach the
//! bucket first. The local tier never waits for the remote one beyond the staging memory
//! of the parts in flight.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::Remote;
use super::feed::{Feed, Feeds, Local};
use crate::commit::store::Committer;
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
    /// Time of this rank's upload (object and manifest part), from when the uploader took
    /// the save (at its start, or once earlier uploads were done): it includes the wait for
    /// the local commit before the object is completed.
    pub upload: Duration,
    /// From `save` to the step committed in the bucket (as seen by this rank).
    pub remote_durable: Duration,
    /// Whether this rank wrote the bucket's manifest (else another rank did).
    pub committed_here: bool,
    /// Steps removed from the bucket by this commit's retention (`remote_keep_last`).
    pub retired: Vec<u64>,
    /// Bytes of this rank's object read from the local file rather than the staging
    /// arena (chunks given back to staging under pressure; 0 normally).
    pub read_from_file: u64,
    /// An earlier step whose upload had failed, uploaded again by this save before its
    /// own (from the local disk), as `(step, outcome)`: `Ok(())` when this rank's object
    /// of it is in the bucket now, else why it was not re-uploaded or failed again.
    pub retried: Option<(u64, std::result::Result<(), String>)>,
}

#[derive(Debug)]
struct Ticket {
    step: u64,
    started: Instant,
    world_size: u32,
    remote: Arc<Remote>,
    /// Bytes of this rank's object the server has accepted so far.
    sent: Arc<std::sync::atomic::AtomicU64>,
    result: Mutex<Option<std::result::Result<RemoteReport, Arc<Error>>>>,
    changed: Condvar,
    /// This rank's uploaded entry (with its object's name), once uploaded: the manifest
    /// another rank commits must name it.
    mine: Mutex<Option<FileEntry>>,
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

    /// Bytes of this rank's object uploaded so far (parts the server accepted; bytes
    /// uploaded again after a retried part count once).
    pub fn uploaded_bytes(&self) -> u64 {
        self.t.sent.load(std::sync::atomic::Ordering::Relaxed)
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
    /// the manifest to appear, up to `COMMIT_WAIT` (600 s). Errors: [`Error::RemoteFailed`] (its
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
            Error::RemoteConflict { step, url, reason } => Error::RemoteConflict {
                step: *step,
                url: url.clone(),
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
                Ok(m) => {
                    // Committed by another rank: of this run only if it names this
                    // rank's object (not another writer's upload of the step).
                    if let Some(mine) = lock(&self.t.mine).as_ref() {
                        let theirs = m.files.get(mine.rank as usize).map(FileEntry::object_name);
                        if theirs != Some(mine.object_name()) {
                            return Some(Err(Error::RemoteConflict {
                                step,
                                url: self.t.remote.url().to_owned(),
                                reason: format!(
                                    "its committed manifest names object {theirs:?} for rank {}, this upload's is {:?}",
                                    mine.rank,
                                    mine.object_name()
                                ),
                            }));
                        }
                    }
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
    metadata: Metadata,
    /// The save's chunks as they are staged, and its local outcome.
    feed: Arc<Feed>,
    /// This rank's file: rank, name and size.
    rank: u32,
    name: String,
    total: u64,
}

/// A step whose upload failed, for the next save to retry.
struct Failed {
    step: u64,
    entry: FileEntry,
    metadata: Metadata,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    closed: bool,
}

/// The uploader of one engine: the engine's [`crate::tier::RemoteTier`] (`engine.rs`).
pub(crate) struct BucketTier {
    remote: Arc<Remote>,
    feeds: Arc<Feeds>,
    world_size: u32,
    max_pending: usize,
    /// No local file: the bucket holds every save's only copy.
    remote_only: bool,
    queue: Arc<(Mutex<Queue>, Condvar)>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for BucketTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BucketTier")
            .field("remote", &self.remote)
            .finish()
    }
}

impl BucketTier {
    /// Start the uploader thread. `root`: the local checkpoint root, where a failed
    /// step's file is read again by the next save (`None`: remote only, nothing to retry).
    pub(crate) fn start(
        remote: Arc<Remote>,
        world_size: u32,
        keep_last: Option<usize>,
        max_pending: usize,
        session: Option<String>,
        root: Option<std::path::PathBuf>,
    ) -> Result<BucketTier> {
        let remote_only = root.is_none();
        let queue: Arc<(Mutex<Queue>, Condvar)> = Arc::default();
        let q = Arc::clone(&queue);
        let r = Arc::clone(&remote);
        let ctx = Ctx {
            world_size,
            keep_last,
            session,
            root,
        };
        let mut failed: Option<Failed> = None;
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
                    let retried = failed
                        .take()
                        .filter(|f| f.step < job.progress.step())
                        .map(|f| (f.step, retry(&r, &ctx, &f)));
                    let res = run(&r, &job, &ctx);
                    job.feed.close();
                    let res = res.map(|mut rep| {
                        rep.retried = retried;
                        rep
                    });
                    if let Err(e) = &res {
                        tracing::error!(step = job.progress.step(), error = %e, "remote copy failed; nothing of this step is visible in the bucket");
                        // Retried by the next save: an upload that failed after the save
                        // was committed locally (not a local failure, nor a shutdown).
                        if let (Some(Local::Committed(_, entry)), false) = (
                            job.feed.local(),
                            matches!(
                                e,
                                Error::StepExists { .. }
                                    | Error::SaveFailed { .. }
                                    | Error::Shutdown(_)
                            ),
                        ) {
                            failed = Some(Failed {
                                step: job.progress.step(),
                                entry,
                                metadata: job.metadata.clone(),
                            });
                        }
                    }
                    job.progress.finish(res.map_err(Arc::new));
                }
            })
            .map_err(|e| Error::Config(format!("cannot spawn the remote uploader: {e}")))?;
        Ok(BucketTier {
            remote,
            feeds: Arc::default(),
            world_size,
            max_pending: max_pending.max(1),
            remote_only,
            queue,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// The remote.
    pub(crate) fn remote(&self) -> &Arc<Remote> {
        &self.remote
    }

    /// The feeds of this engine's saves (the arena's reclaim hook spills them).
    pub(crate) fn feeds(&self) -> &Arc<Feeds> {
        &self.feeds
    }

    /// Whether the bucket holds every save's only copy (no local file).
    pub(crate) fn remote_only(&self) -> bool {
        self.remote_only
    }

    /// A new save's upload: its feed (its staged chunks held for the upload; with a
    /// local file they may be given back under staging pressure and read from the file
    /// instead) and its remote progress (reported when the uploader is done with it).
    pub(crate) fn begin(&self, step: u64, n_chunks: u64, chunk_size: u64) -> Upload {
        Upload {
            queue: Arc::clone(&self.queue),
            max_pending: self.max_pending,
            feed: self.feeds.feed(n_chunks, chunk_size, !self.remote_only),
            progress: RemoteProgress {
                t: Arc::new(Ticket {
                    step,
                    started: Instant::now(),
                    world_size: self.world_size,
                    remote: Arc::clone(&self.remote),
                    sent: Arc::default(),
                    result: Mutex::new(None),
                    changed: Condvar::new(),
                    mine: Mutex::new(None),
                }),
            },
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

impl Drop for BucketTier {
    /// An engine whose open failed after the tier started never calls `close`.
    fn drop(&mut self) {
        self.close();
    }
}

/// One save's upload (the engine's [`crate::tier::TierSave`], `engine.rs`).
pub(crate) struct Upload {
    queue: Arc<(Mutex<Queue>, Condvar)>,
    max_pending: usize,
    /// The save's chunks as they are staged, and its local outcome.
    pub(crate) feed: Arc<Feed>,
    /// What the save's handle reports.
    pub(crate) progress: RemoteProgress,
}

impl Upload {
    /// Queue the upload when the save starts (skipping the oldest waiting one when
    /// `max_pending` are waiting): its parts go out as the feed gets its chunks, its
    /// completion waits for the local commit ([`Feed::local_committed`]).
    pub(crate) fn submit(&self, metadata: Metadata, rank: u32, name: String, total: u64) {
        let (progress, feed) = (self.progress.clone(), Arc::clone(&self.feed));
        let (m, cv) = &*self.queue;
        let mut g = lock(m);
        if g.closed {
            drop(g);
            feed.close();
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
            metadata,
            feed,
            rank,
            name,
            total,
        });
        drop(g);
        cv.notify_all();
        for old in skipped {
            let step = old.progress.step();
            old.feed.close(); // its staged chunks go back to the arena at once
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
}

/// What the uploader thread knows of its engine.
struct Ctx {
    world_size: u32,
    keep_last: Option<usize>,
    session: Option<String>,
    root: Option<std::path::PathBuf>,
}

/// Commit `step` in the bucket if every rank's object is there; with retention when this
/// rank committed it.
fn commit(
    remote: &Remote,
    step: u64,
    metadata: &Metadata,
    ctx: &Ctx,
    mine: &FileEntry,
) -> Result<(bool, Vec<u64>)> {
    Ok(
        match remote.commit_step(step, ctx.world_size, metadata, Committer::Rank(mine))? {
            Some((_, true)) => {
                let retired = match ctx.keep_last {
                    Some(k) => remote.apply_retention(k).unwrap_or_else(|e| {
                        tracing::warn!(error = %e, "bucket retention failed; older steps kept");
                        Vec::new()
                    }),
                    None => Vec::new(),
                };
                (true, retired)
            }
            Some((_, false)) | None => (false, Vec::new()),
        },
    )
}

fn run(remote: &Remote, job: &Job, ctx: &Ctx) -> Result<RemoteReport> {
    let step = job.progress.step();
    let t = Instant::now();
    let entry = remote.upload_streamed(
        step,
        &job.feed,
        job.rank,
        &job.name,
        job.total,
        ctx.session.as_deref(),
        &job.progress.t.sent,
    )?;
    let upload = t.elapsed();
    *lock(&job.progress.t.mine) = Some(entry.clone());
    let bytes = entry.bytes;
    let read_from_file = (job.feed.spilled() * job.feed.chunk_size()).min(bytes);
    let (committed_here, retired) = commit(remote, step, &job.metadata, ctx, &entry)?;
    Ok(RemoteReport {
        step,
        bytes,
        upload,
        remote_durable: job.progress.t.started.elapsed(),
        committed_here,
        retired,
        read_from_file,
        retried: None,
    })
}

/// Upload again, from the local disk, a step whose upload failed, when it is still newer
/// than the bucket's newest committed step and still on the local disk.
fn retry(remote: &Remote, ctx: &Ctx, f: &Failed) -> std::result::Result<(), String> {
    let step = f.step;
    let Some(root) = &ctx.root else {
        return Err("remote only: no local copy to upload again".into());
    };
    match remote.latest() {
        Ok(Some(l)) if l >= step => {
            return Err(format!(
                "step {l} is committed in the bucket already: not uploaded again"
            ));
        }
        Ok(_) => {}
        Err(e) => return Err(format!("the bucket cannot be listed: {e}")),
    }
    let path = root
        .join(crate::manifest::step_dir_name(step))
        .join(&f.entry.file);
    let file = crate::fsx::open_path(&path, false)
        .map_err(|e| format!("no longer on the local disk ({e})"))?;
    tracing::info!(step, "uploading again a step whose upload failed");
    let mine = match remote.upload_rank_entry(step, &file, &f.entry, ctx.session.as_deref()) {
        Ok(entry) => entry,
        Err(Error::StepExists { .. }) => return Ok(()),
        Err(e) => return Err(format!("failed again: {e}")),
    };
    commit(remote, step, &f.metadata, ctx, &mine)
        .map(|_| ())
        .map_err(|e| format!("uploaded, but the commit failed: {e}"))
}
