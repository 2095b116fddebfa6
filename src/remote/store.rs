//! The bucket as a commit store ([`CommitStore`]): listed by the one listing rule
//! ([`crate::manifest::list_steps`]), retired and collected by the one retention and `gc`
//! (`crate::commit::store`), as a local directory is.

use std::time::Duration;

use object_store::ObjectStoreExt;
use object_store::path::Path as ObjPath;

use super::{GcReport, Remote};
use crate::commit::store::CommitStore;
use crate::error::Result;
use crate::manifest::{MANIFEST, ManifestBytes, StepListing};

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
