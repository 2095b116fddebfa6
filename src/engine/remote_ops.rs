//! The engine's side of the tier beyond the disk (`crate::tier`, the bucket of
//! `EngineConfig::with_remote`): listing it, loading from it, and whether it may replace a
//! damaged disk copy. Without such a tier (or without the `s3` feature) each of these is
//! an [`Error::Config`] or finds nothing.

use std::sync::Arc;

use super::{Engine, LoadReport, LoadSource, StepSel};
use crate::error::{Error, Result};
use crate::manifest::{CheckpointInfo, Manifest};
use crate::restore::Checkpoint;
use crate::tier::{RemoteLoad, RemoteTier, Target};

impl Engine {
    /// The tier beyond memory and disk, if the engine has one (its public API,
    /// `crate::remote`, asks it for its own type).
    pub(crate) fn remote_tier(&self) -> Option<&Arc<dyn RemoteTier>> {
        self.shared.remote.as_ref()
    }

    fn remote_or_err(&self) -> Result<&Arc<dyn RemoteTier>> {
        self.remote_tier()
            .ok_or_else(|| Error::Config("this engine has no remote tier (with_remote)".into()))
    }

    /// Committed steps in the bucket, oldest first.
    pub(crate) fn tier_list(&self) -> Result<Vec<u64>> {
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

    /// The `__metadata__` of this rank's object of a step committed in the bucket, from
    /// its header (checked against the manifest, as a load checks it).
    pub(crate) fn tier_file_metadata(&self, which: StepSel) -> Result<crate::manifest::Metadata> {
        let step = self.resolve_remote(which)?;
        self.remote_or_err()?
            .file_metadata(step, self.shared.cfg.rank)
    }

    /// Source 3, the bucket: this rank's object of `step` into `target`, every checksum
    /// verified.
    pub(super) fn read_bucket(
        &self,
        step: u64,
        target: &mut Target<'_>,
    ) -> Result<(Option<Checkpoint>, RemoteLoad)> {
        self.remote_or_err()?
            .read(step, self.shared.cfg.rank, target, &|| self.device_ring())
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
        let Some(remote) = self.remote_tier().filter(|_| damage) else {
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
