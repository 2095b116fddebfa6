//! What a caller holds while a save runs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

use super::lock;
use super::report::{SaveReport, StagedReport};
use super::state::{Progress, SaveState};

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
        self.watch().is_staged()
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

    /// Order `stream`'s later work after this save's copies, on the device, instead of
    /// waiting for them on the host; see [`SaveWatch::hold_stream`].
    pub fn hold_stream(&self, stream: crate::cuda::StreamRef<'_>) -> Result<()> {
        self.watch().hold_stream(stream)
    }

    /// A [`SaveWatch`] of this save: it looks at the save's progress and holds streams
    /// without the handle, so a caller that keeps the handle behind a lock can release the
    /// lock before it blocks.
    pub fn watch(&self) -> SaveWatch {
        SaveWatch {
            state: Arc::clone(&self.state),
        }
    }

    /// Ask a save started with [`SaveOptions::snapshot_on_request`](crate::SaveOptions::snapshot_on_request)
    /// for its device snapshot: the bytes not yet queued for copying are copied
    /// device-to-device into a transient buffer, after which
    /// [`hold_stream`](Self::hold_stream) orders a stream after those copies only.
    /// Returns at once (the staging thread takes the snapshot before its next chunk); has
    /// no effect on other saves, nor once every copy is queued.
    pub fn request_snapshot(&self) {
        self.state.snapshot.request();
    }

    /// Device bytes of the save's snapshot (0 when none was taken yet, or none at all).
    /// Known once [`hold_stream`](Self::hold_stream) returned after
    /// [`request_snapshot`](Self::request_snapshot).
    pub fn snapshot_bytes(&self) -> u64 {
        self.state.snapshot.bytes()
    }

    /// The save's copy to the tier beyond the disk, when that tier takes it (its public
    /// API, `SaveHandle::remote`, is the tier's: `crate::remote`).
    #[allow(
        dead_code,
        reason = "called by the tiers' public API: none in a build without `s3`"
    )]
    pub(crate) fn tier_save(&self) -> Option<&Arc<dyn crate::tier::TierSave>> {
        self.state.upload.as_ref()
    }

    /// Where the save's committed image, held in its staging chunks for replication
    /// ([`EngineConfig::with_replica_hold`](crate::EngineConfig::with_replica_hold)), is
    /// put at commit (before [`SaveHandle::wait`] returns), when it is whole in the arena.
    /// Keep it to take the image after `wait` consumed the handle; the image's chunks are
    /// given back when it drops (or under staging pressure).
    pub fn held_image(&self) -> Arc<crate::staging::held::HeldCell> {
        Arc::clone(&self.state.held)
    }

    /// A save started with [`SaveOptions::confirm_commit`](crate::SaveOptions::confirm_commit):
    /// its tensors' manifest entries with their CRC-32Cs once its file is durable (the
    /// commit then waits for [`confirm_commit`](Self::confirm_commit)); `None` while not
    /// known yet; the save's error when it failed before (or [`Error::Config`] for a save
    /// not started so).
    pub fn checksums(&self) -> Option<Result<Vec<crate::manifest::TensorEntry>>> {
        let p = lock(&self.state.progress);
        self.checksums_in(&p)
    }

    fn checksums_in(
        &self,
        p: &super::state::Progress,
    ) -> Option<Result<Vec<crate::manifest::TensorEntry>>> {
        if !self.state.confirm {
            return Some(Err(Error::Config(
                "checksums before the commit need a save started with confirm_commit".into(),
            )));
        }
        if let Some(c) = &p.checksums {
            return Some(Ok(c.clone()));
        }
        if !p.done {
            return None;
        }
        let source = match (&p.result, &p.error) {
            (Some(Err(e)), _) | (None, Some(e)) => Arc::clone(e),
            _ => Arc::new(Error::Internal("save ended without its checksums".into())),
        };
        Some(Err(Error::SaveFailed {
            step: self.state.step,
            source,
        }))
    }

    /// [`checksums`](Self::checksums), blocking until they are known or the save failed.
    pub fn wait_checksums(&self) -> Result<Vec<crate::manifest::TensorEntry>> {
        let mut p = lock(&self.state.progress);
        loop {
            if let Some(r) = self.checksums_in(&p) {
                return r;
            }
            p = self
                .state
                .changed
                .wait(p)
                .unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Decide the commit of a save started with
    /// [`SaveOptions::confirm_commit`](crate::SaveOptions::confirm_commit): `Ok(())`
    /// commits it, `Err(reason)` refuses it (the save fails with [`Error::CommitRefused`]
    /// carrying `reason`, its file removed). The first decision counts; no effect on other
    /// saves. May be given before the checksums are known.
    pub fn confirm_commit(&self, decision: std::result::Result<(), String>) {
        super::provisional::decide(&self.state, decision);
    }

    /// True once the save is committed or has failed (`wait` then returns at once).
    pub fn is_done(&self) -> bool {
        self.watch().is_done()
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

impl Drop for SaveHandle {
    /// A commit still waiting for its caller's decision is refused: nobody is left to give it.
    fn drop(&mut self) {
        if self.state.confirm || self.state.provisional {
            super::provisional::decide(
                &self.state,
                Err("the save's handle was dropped before its commit was confirmed".into()),
            );
        }
    }
}

/// A view of a save in flight that looks at its progress and orders streams after its
/// copies, shared with the [`SaveHandle`] it came from ([`SaveHandle::watch`]). It cannot
/// wait for the result (the handle does), and it keeps the save's bookkeeping alive while
/// it exists: drop it once done with it.
#[derive(Clone)]
pub struct SaveWatch {
    state: Arc<SaveState>,
}

impl std::fmt::Debug for SaveWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SaveWatch")
            .field("step", &self.state.step)
            .finish()
    }
}

impl SaveWatch {
    /// Make `stream` wait on the device for this save's latch on its device (taken now if
    /// none yet; the progress lock held, so staging cannot take the latches meanwhile).
    /// False where the driver refuses (no latch is used for this save's device from then).
    fn latch(&self, p: &mut Progress, stream: crate::cuda::StreamRef<'_>) -> Result<bool> {
        // The caller's thread (the trainer's) keeps its current context.
        let _restore = crate::device::cuda::CtxGuard::save()?;
        let d = stream.device();
        let res = match p.latches.iter().position(|(dev, _)| *dev == d) {
            Some(i) => p.latches[i].1.hold(stream),
            None => self
                .state
                .shared
                .cuda()
                .device(d)
                .and_then(|st| st.latch())
                .and_then(|mut l| {
                    let r = l.hold(stream);
                    // Held or not, the latch goes with the others: opened behind the copies.
                    p.latches.push((d, l));
                    r
                }),
        };
        match res {
            Ok(()) => Ok(true),
            Err(e) => {
                tracing::warn!(error = %e, device = d, "stream latch refused; waiting on the host");
                p.latchable.retain(|dev| *dev != d);
                Ok(false)
            }
        }
    }

    /// True once every byte is staged (or staging failed); as [`SaveHandle::is_staged`].
    pub fn is_staged(&self) -> bool {
        lock(&self.state.progress).staging_done
    }

    /// True once the save is committed or has failed; as [`SaveHandle::is_done`].
    pub fn is_done(&self) -> bool {
        lock(&self.state.progress).done
    }

    /// Order `stream`'s later work after this save's copies, on the device, instead of
    /// waiting for them on the host. Where the save's copies on `stream`'s device are
    /// ordered after an event recorded at the call
    /// ([`SaveOptions::after_event`](crate::SaveOptions::after_event)) and
    /// [`EngineConfig::with_stream_latches`](crate::EngineConfig::with_stream_latches) is on,
    /// returns at once: `stream` waits on the device for a latch the engine
    /// opens behind the save's last copies (or from the host if staging ends without).
    /// Otherwise blocks until every host byte of the save is copied and every device copy
    /// is queued (up to [`EngineConfig::with_copy_ahead`](crate::EngineConfig::with_copy_ahead)
    /// bytes before the copies' end; longer when the save waits for staging chunks), then
    /// makes `stream` wait for the copies of its device (`cuStreamWaitEvent`). Work queued
    /// on `stream` afterwards may then overwrite the tensors; work on other streams and
    /// host code must still [`SaveHandle::wait_staged`]. Returns at once when the save is
    /// staged already; raises the save's error when staging failed.
    pub fn hold_stream(&self, stream: crate::cuda::StreamRef<'_>) -> Result<()> {
        let mut p = lock(&self.state.progress);
        loop {
            match &p.staged {
                Some(Ok(_)) => return Ok(()),
                Some(Err(e)) => {
                    return Err(Error::SaveFailed {
                        step: self.state.step,
                        source: Arc::clone(e),
                    });
                }
                None if p.queued => break,
                None => {}
            }
            if p.latchable.contains(&stream.device()) && self.latch(&mut p, stream)? {
                return Ok(());
            }
            p = self
                .state
                .changed
                .wait(p)
                .unwrap_or_else(|e| e.into_inner());
        }
        for (d, e) in &p.marks {
            if *d == stream.device() {
                e.hold(stream)?;
            }
        }
        Ok(())
    }
}
