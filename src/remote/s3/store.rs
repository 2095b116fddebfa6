//! The bucket as a commit store ([`CommitStore`]): listed by the one listing rule
//! ([`crate::manifest::list_steps`]), retired and collected by the one retention and `gc`
//! (`crate::commit::store`), as a local directory is; and the barrier of the one commit
//! protocol ([`BucketParts`]).

use std::path::PathBuf;
use std::time::Duration;

use object_store::path::Path as ObjPath;
use object_store::{ObjectStoreExt, PutMode, PutOptions, PutPayload};

use super::{GcReport, Remote, upload};
use crate::commit::store::{CommitStore, PartBarrier};
use crate::error::{Error, Result};
use crate::manifest::{self, FileEntry, MANIFEST, Manifest, ManifestBytes, StepListing};

/// One listing of the prefix, for the listing's rule: the manifest paths it found, the
/// manifests read from the bucket ([`Remote::scan`], so that `gc` decides on one
/// listing).
pub(super) struct Listed<'a> {
    pub(super) remote: &'a Remote,
    pub(super) manifests: Vec<Vec<String>>,
}

impl StepListing for Listed<'_> {
    fn describe(&self) -> String {
        self.remote.describe()
    }

    fn manifest_paths(&self) -> Result<Vec<Vec<String>>> {
        Ok(self.manifests.clone())
    }

    fn manifest_bytes(&self, step: u64) -> Result<ManifestBytes> {
        self.remote.manifest_bytes(step)
    }
}

impl StepListing for Remote {
    fn describe(&self) -> String {
        super::options::redact(&self.url)
    }

    /// Every object named `step-*/.../manifest.json` under the prefix.
    fn manifest_paths(&self) -> Result<Vec<Vec<String>>> {
        Ok(self.block(self.objects())?.1)
    }

    /// `prefix/step-N/manifest.json`, size-capped ([`crate::manifest::MAX_MANIFEST_LEN`]).
    fn manifest_bytes(&self, step: u64) -> Result<ManifestBytes> {
        self.block(self.manifest_bytes_async(step))
    }
}

impl CommitStore for Remote {
    /// How old an uncommitted step's newest object, a stray object or an open upload's
    /// journal must be to be removed ([`Remote::gc`]).
    type Sweep = Duration;
    /// What [`Remote::gc`] removed and left.
    type Swept = GcReport;

    /// The step's `manifest.json` deleted: from then on it is not listed (a delete is
    /// durable when it returns). A manifest already gone is another rank's retention.
    fn unpublish(&self, step: u64) -> Result<bool> {
        let key = self.key(step, MANIFEST);
        self.block(async {
            match self.store.delete(&key).await {
                Ok(()) => Ok(true),
                Err(object_store::Error::NotFound { .. }) => Ok(false),
                Err(e) => Err(self.err("delete", &e)),
            }
        })
    }

    fn sync_listing(&self) -> Result<()> {
        Ok(())
    }

    /// Every object under `prefix/step-N/`, at any depth.
    fn delete_unpublished(&self, step: u64) -> Result<()> {
        let at: ObjPath = self.step_prefix(step);
        self.block(async {
            use futures::TryStreamExt;
            let objs: Vec<_> = self
                .store
                .list(Some(&at))
                .try_collect()
                .await
                .map_err(|e| self.err("list", &e))?;
            for o in objs {
                match self.store.delete(&o.location).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                    Err(e) => return Err(self.err("delete", &e)),
                }
            }
            Ok(())
        })
    }

    fn sweep(&self, min_age: &Duration) -> Result<GcReport> {
        self.gc(*min_age)
    }
}

/// A bucket prefix as the barrier of the one commit protocol
/// ([`crate::commit::store::commit_parts`], [`Remote::commit_step`]): each rank's upload
/// put its object and its part (`step-N/rank-K.manifest.json`) there; the manifest is
/// published with a conditional create ([`PutMode::Create`], `If-None-Match: *` on S3).
/// A part of another session (a rank's upload of an earlier run that used the same step
/// number) counts as missing, by the protocol's rule.
pub(super) struct BucketParts<'a> {
    pub(super) remote: &'a Remote,
}

impl BucketParts<'_> {
    fn conflict(&self, step: u64, reason: String) -> Error {
        Error::RemoteConflict {
            step,
            url: self.remote.url.clone(),
            reason,
        }
    }

    /// The committed manifest, if it is ours (names our object for our rank): else
    /// [`Error::RemoteConflict`].
    fn ours(
        &self,
        m: Manifest,
        created: bool,
        mine: Option<&FileEntry>,
    ) -> Result<(Manifest, bool)> {
        if let Some(mine) = mine {
            let theirs = m.files.get(mine.rank as usize).map(FileEntry::object_name);
            if theirs != Some(mine.object_name()) {
                return Err(self.conflict(
                    m.step,
                    format!(
                        "its committed manifest names object {theirs:?} for rank {}, this upload's is {:?}",
                        mine.rank,
                        mine.object_name()
                    ),
                ));
            }
        }
        Ok((m, created))
    }
}

impl PartBarrier for BucketParts<'_> {
    /// The committed manifest, and whether this call published it.
    type Committed = (Manifest, bool);

    fn manifest_location(&self, step: u64) -> PathBuf {
        self.remote.display(&self.remote.key(step, MANIFEST))
    }

    /// The upload put the part already: the step's manifest, if it is there (ours, or
    /// [`Error::RemoteConflict`]).
    fn put_part(
        &self,
        step: u64,
        _world_size: u32,
        mine: Option<&FileEntry>,
    ) -> Result<Option<(Manifest, bool)>> {
        match self.remote.block(self.remote.read_manifest_async(step))? {
            Some(m) => self.ours(m, false, mine).map(Some),
            None => Ok(None),
        }
    }

    /// The part must name rank `rank`, its file and an object of that file, whose size it
    /// records; this rank's part must be its own upload's ([`Error::RemoteConflict`]).
    fn get_part(
        &self,
        step: u64,
        world_size: u32,
        r: u32,
        mine: Option<&FileEntry>,
    ) -> Result<Option<FileEntry>> {
        let remote = self.remote;
        let pkey = remote.key(step, &manifest::rank_manifest_name(r));
        let mine = mine.filter(|m| m.rank == r);
        remote.block(async {
            let bytes = match remote.get_capped(&pkey, 1 << 30).await {
                Ok(b) => b,
                Err(object_store::Error::NotFound { .. }) if mine.is_none() => {
                    return Ok(None);
                }
                Err(object_store::Error::NotFound { .. }) => {
                    return Err(self.conflict(
                        step,
                        format!(
                            "this rank's manifest part {} is gone",
                            remote.display(&pkey).display()
                        ),
                    ));
                }
                Err(e) => return Err(remote.err("get manifest part", &e)),
            };
            let f: FileEntry = serde_json::from_slice(&bytes).map_err(|e| {
                Error::corrupt(remote.display(&pkey), None, format!("manifest part: {e}"))
            })?;
            if let Some(mine) = mine.filter(|m| m.object_name() != f.object_name()) {
                // Written after ours by another upload of this rank and step.
                return Err(self.conflict(
                    step,
                    format!(
                        "this rank's manifest part names object {:?} of another writer, this upload's is {:?}",
                        f.object_name(),
                        mine.object_name()
                    ),
                ));
            }
            let file = manifest::rank_file_name(r, world_size);
            if f.rank != r || f.file != file || !upload::is_object_of(f.object_name(), &file) {
                return Err(Error::corrupt(
                    remote.display(&pkey),
                    None,
                    format!(
                        "manifest part of rank {} for file {:?} (object {:?})",
                        f.rank,
                        f.file,
                        f.object_name()
                    ),
                ));
            }
            let okey = remote.key(step, f.object_name());
            match remote.store.head(&okey).await {
                Ok(meta) if meta.size == f.bytes => Ok(Some(f)),
                Ok(meta) => Err(Error::corrupt(
                    remote.display(&okey),
                    None,
                    format!("object holds {} bytes, its part says {}", meta.size, f.bytes),
                )),
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(remote.err("head", &e)),
            }
        })
    }

    /// A conditional create of `step-N/manifest.json`; another writer's manifest there
    /// already is read back (ours, or [`Error::RemoteConflict`]).
    fn publish_if_absent(&self, m: Manifest, mine: Option<&FileEntry>) -> Result<(Manifest, bool)> {
        let remote = self.remote;
        let step = m.step;
        let mkey = remote.key(step, MANIFEST);
        let bytes = serde_json::to_vec_pretty(&m).expect("manifest serializes");
        let put = PutOptions {
            mode: PutMode::Create,
            ..PutOptions::default()
        };
        remote.block(async {
            match remote.store.put_opts(&mkey, PutPayload::from(bytes), put).await {
                Ok(_) => self.ours(m, true, mine),
                Err(object_store::Error::AlreadyExists { .. })
                | Err(object_store::Error::Precondition { .. }) => {
                    // Another rank committed first (or another writer).
                    match remote.read_manifest_async(step).await? {
                        Some(m) => self.ours(m, false, mine),
                        None => Err(Error::Remote {
                            url: remote.url.clone(),
                            op: "commit",
                            reason: format!(
                                "the manifest of step {step} exists per the server but cannot be read"
                            ),
                        }),
                    }
                }
                Err(e) => Err(remote.err("put manifest (conditional create)", &e)),
            }
        })
    }
}
