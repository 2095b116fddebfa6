//! The engine's side of the remote tier: listing, loading and verifying the bucket's
//! steps (`EngineConfig::with_remote`).

use std::sync::Arc;

use super::{Engine, LoadReport, LoadSource, StepSel};
use crate::error::{Error, Result};
use crate::manifest::{CheckpointInfo, Manifest};
use crate::remote::{Remote, RemoteLoad};
use crate::restore::Checkpoint;
use crate::tensor::DeviceSlice;

impl Engine {
    /// The bucket of the remote tier, if the engine has one.
    pub fn remote(&self) -> Option<&Arc<Remote>> {
        self.shared.remote.as_ref().map(|t| t.remote())
    }

    fn remote_or_err(&self) -> Result<&Arc<Remote>> {
        self.remote()
            .ok_or_else(|| Error::Config("this engine has no remote tier (with_remote)".into()))
    }

    /// Committed steps in the bucket, oldest first.
    pub fn list_remote(&self) -> Result<Vec<u64>> {
        self.remote_or_err()?.list()
    }

    pub(super) fn resolve_remote(&self, which: StepSel) -> Result<u64> {
        let r = self.remote_or_err()?;
        match which {
            StepSel::Step(s) => Ok(s),
            StepSel::Latest => r.latest()?.ok_or_else(|| Error::NotFound {
                what: "(latest)".into(),
                step: None,
                root: r.url().into(),
            }),
        }
    }

    /// Load this rank's tensors of a step committed in the bucket (ranged GETs in
    /// parallel, every checksum verified), whatever the local disk holds.
    pub fn load_remote(&self, which: impl Into<StepSel>) -> Result<(Checkpoint, RemoteLoad)> {
        let step = self.resolve_remote(which.into())?;
        self.remote_or_err()?.load(step, self.shared.cfg.rank)
    }

    /// [`Engine::load_remote`] into caller buffers by name (each exactly its tensor's size).
    pub fn load_into_remote(
        &self,
        which: impl Into<StepSel>,
        dest: &mut [(&str, &mut [u8])],
    ) -> Result<RemoteLoad> {
        let step = self.resolve_remote(which.into())?;
        self.remote_or_err()?
            .load_into(step, self.shared.cfg.rank, dest)
    }

    /// The `__metadata__` of this rank's object of a step committed in the bucket, from
    /// its header (checked against the manifest, as a load checks it).
    pub fn remote_file_metadata(
        &self,
        which: impl Into<StepSel>,
    ) -> Result<crate::manifest::Metadata> {
        let step = self.resolve_remote(which.into())?;
        self.remote_or_err()?
            .file_metadata(step, self.shared.cfg.rank)
    }

    /// [`Engine::load_remote`] into device ranges by name (each exactly its tensor's
    /// size): ranged GETs in parallel, each body copied into the engine's CUDA-registered
    /// device-read buffers (`EngineConfig::with_device_read`; two of them, one filled
    /// while the other is copied to the device), every checksum verified on the host. No
    /// host copy of the whole object is made ([`RemoteLoad::staged`] and
    /// [`RemoteLoad::staging`] say what went through the registered buffers).
    ///
    /// # Safety
    /// As [`Engine::load_into_device_raw`]: every range device memory of its device, valid
    /// for writes of its length and not accessed by anyone else until this call returns.
    #[allow(unsafe_code)]
    pub unsafe fn load_into_device_remote_raw(
        &self,
        which: impl Into<StepSel>,
        dest: &[(&str, DeviceSlice<'_>)],
    ) -> Result<RemoteLoad> {
        let step = self.resolve_remote(which.into())?;
        let remote = self.remote_or_err()?;
        let ring = self.device_ring()?;
        // SAFETY: forwarded from this function's contract.
        unsafe { remote.load_into_device(step, self.shared.cfg.rank, &ring, dest) }
    }

    /// Whether the bucket may serve `info`'s step after this rank's file of it on the disk
    /// failed to load with `local`: the error is damage (a file missing, short, malformed,
    /// a link, failing a checksum, or an I/O error reading it), the engine has a remote
    /// tier, and the bucket's committed manifest of that step lists this rank's file
    /// exactly as the disk's manifest does (name, size, tensors, every CRC-32C: the same
    /// bytes, whatever run wrote the bucket). Says why in the log either way; never another
    /// step, never for an error of the caller's (a destination that does not fit).
    pub(super) fn bucket_replaces(&self, info: &CheckpointInfo, local: &Error) -> bool {
        let damage = matches!(
            local,
            Error::Io { .. }
                | Error::Truncated { .. }
                | Error::Corrupt { .. }
                | Error::Checksum { .. }
                | Error::UnsafePath { .. }
        );
        let Some(remote) = self.remote().filter(|_| damage) else {
            return false;
        };
        let rank = self.shared.cfg.rank;
        let same = Manifest::read(&info.dir).and_then(|disk| {
            let bucket = remote.manifest(info.step)?;
            let mine = disk.files.iter().find(|f| f.rank == rank);
            // The bucket names its object apart (`object`); the file is the same.
            let theirs = bucket.files.iter().find(|f| f.rank == rank).map(|f| {
                let mut f = f.clone();
                f.object = None;
                f
            });
            Ok(mine.is_some() && mine == theirs.as_ref())
        });
        match same {
            Ok(true) => {
                tracing::warn!(step = info.step, rank, error = %local,
                    "this rank's file on the disk is damaged: loading the bucket's copy");
                true
            }
            Ok(false) => {
                tracing::warn!(step = info.step, rank, error = %local,
                    "this rank's file on the disk is damaged, and the bucket's step of that number holds other bytes");
                false
            }
            Err(e) => {
                tracing::warn!(step = info.step, rank, error = %local, bucket = %e,
                    "this rank's file on the disk is damaged, and the bucket cannot serve the step");
                false
            }
        }
    }

    /// `info`'s step from the bucket after the disk's copy failed with `local`
    /// ([`Engine::bucket_replaces`] said yes): the bucket's copy, or `local` if that fails
    /// too (the bucket's error is logged).
    pub(super) fn load_damaged_from_bucket(
        &self,
        info: &CheckpointInfo,
        local: Error,
    ) -> Result<(Checkpoint, LoadReport)> {
        let report = LoadReport::from_bucket(info.step, Some(&local));
        let (ck, _) = bucket_or(info.step, local, self.load_remote(StepSel::Step(info.step)))?;
        Ok((ck, report))
    }

    /// The load fallback: a step the disk does not hold (`disk`: the disk's error), from
    /// the bucket ([`Engine::resolve_in`] chose it).
    pub(super) fn load_fallback_remote(
        &self,
        step: u64,
        disk: Option<Error>,
    ) -> Result<(Checkpoint, LoadReport)> {
        let (ck, _) = self.load_remote(step)?;
        tracing::info!(
            step = ck.step,
            "load served from the bucket (not on the local disk)"
        );
        let report = LoadReport::from_bucket(ck.step, disk.as_ref());
        Ok((ck, report))
    }
}

/// What the bucket gave (`got`) in place of the disk's copy of `step`, which failed with
/// `local`: its result, or `local` when the bucket's copy failed too (its error logged).
pub(super) fn bucket_or<T>(step: u64, local: Error, got: Result<T>) -> Result<T> {
    got.map_err(|r| {
        tracing::warn!(step, error = %r, "the bucket's copy failed to load too");
        local
    })
}

impl LoadReport {
    /// The report of `step` served by the bucket because the disk could not (`disk`).
    pub(super) fn from_bucket(step: u64, disk: Option<&Error>) -> Self {
        LoadReport {
            step,
            source: LoadSource::Remote,
            fallback_reason: disk.map(|e| e.to_string()),
            disk_problem: None,
        }
    }
}
