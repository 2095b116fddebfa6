//! What a caller holds while a save runs, and what it reports.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

use super::lock;
use super::state::SaveState;

/// Timings of a save, measured from the moment `save` was called.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SaveTimings {
    /// Until `save` returned: every byte staged (the trainer's stall).
    pub staging: Duration,
    /// Part of `staging` spent waiting for free staging chunks or save slots (backpressure
    /// from earlier saves still draining).
    pub backpressure: Duration,
    /// Until the file was written and `fdatasync`ed.
    pub durable: Duration,
    /// Until the checkpoint directory was renamed into place and the root fsynced.
    pub committed: Duration,
}

/// What a finished save did.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq)]
pub struct SaveReport {
    /// Step.
    pub step: u64,
    /// Committed directory (for multi-rank saves, set by whichever rank committed; `None`
    /// while other ranks are still writing).
    pub dir: Option<PathBuf>,
    /// This rank's file (its final path once committed).
    pub file: PathBuf,
    /// Bytes of this rank's file.
    pub bytes: u64,
    /// Tensors saved.
    pub tensors: usize,
    /// Timings.
    pub timings: SaveTimings,
    /// Backend that wrote (`io_uring`, `pwrite`).
    pub backend: crate::io::Backend,
    /// Whether the file was written with O_DIRECT.
    pub direct_io: bool,
    /// Steps retired by this commit's retention (`keep_last`): no longer listed or
    /// loadable when the save is reported committed; their files are deleted right after
    /// (by the time [`crate::Engine::close`] returns).
    pub retired: Vec<u64>,
}

impl SaveReport {
    /// Bytes over time-to-durable, in GB/s.
    pub fn persist_gbps(&self) -> f64 {
        crate::util::gbps(self.bytes, self.timings.durable)
    }
}

/// What is known as soon as `save` returns.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StagedReport {
    /// Step.
    pub step: u64,
    /// File bytes staged.
    pub bytes: u64,
    /// Time in `save` (stall).
    pub staging: Duration,
    /// Part of it spent waiting for staging space.
    pub backpressure: Duration,
    /// Part of it spent registering the staging arena with CUDA (the first device save of
    /// an engine not prepared with [`Engine::prepare_cuda`](crate::Engine::prepare_cuda)).
    pub registration: Duration,
}

/// A save in flight. Dropping it does not cancel the save.
pub struct SaveHandle {
    pub(super) state: Arc<SaveState>,
}

impl std::fmt::Debug for SaveHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SaveHandle")
            .field("step", &self.state.step)
            .field("done", &self.is_done())
            .finish()
    }
}

impl SaveHandle {
    /// The step.
    pub fn step(&self) -> u64 {
        self.state.step
    }

    /// Staging facts, once every byte is staged (`save` returns staged); `None` before,
    /// or when staging failed.
    pub fn staged(&self) -> Option<StagedReport> {
        match &lock(&self.state.progress).staged {
            Some(Ok(s)) => Some(*s),
            _ => None,
        }
    }

    /// True once every byte is staged (or staging failed): the caller's tensors are no
    /// longer read.
    pub fn is_staged(&self) -> bool {
        lock(&self.state.progress).staging_done
    }

    /// Block until every byte is staged: from then on the caller may reuse its tensors.
    pub fn wait_staged(&self) -> Result<StagedReport> {
        let mut p = lock(&self.state.progress);
        while !p.staging_done {
            p = self
                .state
                .changed
                .wait(p)
                .unwrap_or_else(|e| e.into_inner());
        }
        match &p.staged {
            Some(Ok(s)) => Ok(*s),
            Some(Err(e)) => Err(Error::SaveFailed {
                step: self.state.step,
                source: Arc::clone(e),
            }),
            None => Err(Error::Internal("staging ended without a report".into())),
        }
    }

    /// The save's remote copy (`None` without a remote tier): keep it to wait for the
    /// bucket after [`SaveHandle::wait`] consumed the handle.
    #[cfg(feature = "s3")]
    pub fn remote(&self) -> Option<crate::remote::RemoteProgress> {
        self.state.remote.clone()
    }

    /// Block until the step is committed in the bucket (after the local commit); returns
    /// the remote report, or [`Error::RemoteFailed`] / a config error without a remote
    /// tier.
    #[cfg(feature = "s3")]
    pub fn wait_remote(&self) -> Result<crate::remote::RemoteReport> {
        match &self.state.remote {
            Some(p) => p.wait(),
            None => Err(Error::Config(
                "this engine has no remote tier (with_remote)".into(),
            )),
        }
    }

    /// True once the save is committed or has failed (`wait` then returns at once).
    pub fn is_done(&self) -> bool {
        lock(&self.state.progress).done
    }

    /// Block until the checkpoint is durable and committed, or failed.
    pub fn wait(self) -> Result<SaveReport> {
        let mut p = lock(&self.state.progress);
        while !p.done {
            p = self
                .state
                .changed
                .wait(p)
                .unwrap_or_else(|e| e.into_inner());
        }
        let step = self.state.step;
        // The handle is consumed: its staging report (which may share the error) is no
        // longer needed, so the caller can get the original error back.
        if matches!(p.staged, Some(Err(_))) {
            p.staged = None;
        }
        match p.result.take() {
            Some(Ok(r)) => Ok(r),
            // The original error, unless `flush` handed out a share of it.
            Some(Err(e)) => {
                Err(Arc::try_unwrap(e).unwrap_or_else(|e| Error::SaveFailed { step, source: e }))
            }
            None => Err(Error::Internal("result already taken".into())),
        }
    }

    /// Like [`SaveHandle::wait`], giving up after `timeout` (returns the handle back).
    pub fn wait_timeout(
        self,
        timeout: Duration,
    ) -> std::result::Result<Result<SaveReport>, SaveHandle> {
        let deadline = Instant::now() + timeout;
        {
            let mut p = lock(&self.state.progress);
            while !p.done {
                let now = Instant::now();
                if now >= deadline {
                    drop(p);
                    return Err(self);
                }
                p = self
                    .state
                    .changed
                    .wait_timeout(p, deadline - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
        Ok(self.wait())
    }
}
