//! The object-storage tier as the engine's plug-in (`crate::tier`): its settings in an
//! [`EngineConfig`] (`with_remote` and the other `with_remote_*` setters), the opened tier
//! ([`BucketTier`]) and each save's upload ([`Upload`]) behind the engine's traits, and the
//! tier's public API on [`Engine`] and [`SaveHandle`]. The engine names none of these
//! types.

use std::any::Any;
use std::sync::Arc;

use super::tier::{BucketTier, DEFAULT_MAX_PENDING, Upload};
use super::{Remote, RemoteOptions, RemoteProgress, RemoteReport, RemoteTarget};
use crate::config::EngineConfig;
use crate::engine::{Engine, SaveHandle, StepSel};
use crate::error::{Error, Result};
use crate::manifest::{Manifest, Metadata};
use crate::restore::{Checkpoint, DeviceRing};
use crate::staging::ChunkLease;
use crate::tier::{LocalOutcome, RemoteLoad, RemoteTier, Target, TierContext, TierSave, TierSpec};

/// The tier's settings in an [`EngineConfig`].
#[derive(Debug, Clone)]
pub(crate) struct S3Spec {
    target: Option<RemoteTarget>,
    keep_last: Option<usize>,
    options: RemoteOptions,
    max_pending: usize,
    remote_only: bool,
}

impl Default for S3Spec {
    fn default() -> Self {
        S3Spec {
            target: None,
            keep_last: None,
            options: RemoteOptions::default(),
            max_pending: DEFAULT_MAX_PENDING,
            remote_only: false,
        }
    }
}

impl TierSpec for S3Spec {
    fn validate(&self) -> Result<()> {
        if self.remote_only && self.target.is_none() {
            return Err(Error::Config(
                "remote_only needs a remote (with_remote)".into(),
            ));
        }
        if self.target.is_some() {
            if self.keep_last == Some(0) {
                return Err(Error::Config(
                    "remote_keep_last must be at least 1 (None keeps all)".into(),
                ));
            }
            if self.max_pending == 0 {
                return Err(Error::Config(
                    "remote_max_pending must be at least 1".into(),
                ));
            }
            self.options.validate()?;
        }
        Ok(())
    }

    fn replaces_disk(&self) -> bool {
        self.remote_only
    }

    fn open(&self, ctx: &TierContext) -> Result<Option<Arc<dyn RemoteTier>>> {
        let Some(target) = &self.target else {
            return Ok(None);
        };
        let remote = Arc::new(target.open(self.options.clone())?);
        let tier = BucketTier::start(
            remote,
            ctx.world_size,
            self.keep_last,
            self.max_pending,
            ctx.session.clone(),
            (!self.remote_only).then(|| ctx.root.clone()),
        )?;
        Ok(Some(Arc::new(tier)))
    }

    fn clone_box(&self) -> Box<dyn TierSpec> {
        Box::new(self.clone())
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// The object-storage tier's settings (feature `s3`).
impl EngineConfig {
    /// This configuration's settings of the tier (the defaults until a setter is called).
    fn s3(&mut self) -> &mut S3Spec {
        if !self
            .remote
            .as_mut()
            .is_some_and(|t| t.as_any_mut().is::<S3Spec>())
        {
            self.remote = Some(Box::new(S3Spec::default()));
        }
        self.remote
            .as_mut()
            .and_then(|t| t.as_any_mut().downcast_mut::<S3Spec>())
            .expect("the tier's settings were just set")
    }

    /// Mirror every committed save to object storage at `url` (`s3://bucket/prefix`,
    /// feature `s3`): after the save is committed locally, this rank's file is uploaded to
    /// `prefix/step-N/` (a multipart upload), and the step is committed in the bucket by a
    /// conditionally created `manifest.json` once every rank's object is there
    /// ([`crate::remote`]). Credentials and endpoint come from the standard AWS
    /// environment variables; the engine checks the bucket when it opens. Loads fall back
    /// to the bucket for steps not on disk. Default: no remote tier.
    pub fn with_remote(mut self, url: impl Into<String>) -> Self {
        self.s3().target = Some(RemoteTarget::Url(url.into()));
        self
    }

    /// [`EngineConfig::with_remote`] on any `object_store` store (another cloud, a local
    /// directory, `InMemory` in tests), under key prefix `prefix` (may be empty); the
    /// store is not checked at open.
    pub fn with_remote_store(
        mut self,
        store: Arc<dyn object_store::ObjectStore>,
        prefix: impl Into<String>,
    ) -> Self {
        self.s3().target = Some(RemoteTarget::Store {
            store,
            mp: None,
            prefix: prefix.into(),
        });
        self
    }

    /// [`EngineConfig::with_remote_store`] on a store with multipart upload ids (S3,
    /// GCS, Azure, `InMemory`): each upload is journaled in the bucket so that `gc` can
    /// abort the ones a killed process left open (`with_remote` does this for S3).
    pub fn with_remote_multipart_store<S>(
        mut self,
        store: Arc<S>,
        prefix: impl Into<String>,
    ) -> Self
    where
        S: object_store::ObjectStore + object_store::multipart::MultipartStore,
    {
        let mp: Arc<dyn object_store::multipart::MultipartStore> = store.clone();
        self.s3().target = Some(RemoteTarget::Store {
            store,
            mp: Some(mp),
            prefix: prefix.into(),
        });
        self
    }

    /// Keep only the newest `n` committed steps in the bucket (`None`: keep all); a step
    /// not older than the newest committed one is never deleted. Default `None`.
    pub fn with_remote_keep_last(mut self, n: Option<usize>) -> Self {
        self.s3().keep_last = n;
        self
    }

    /// Part size, parallelism and retries of the remote tier's requests
    /// ([`RemoteOptions`]; default 16 MiB parts, 8 in flight, 3 retries).
    pub fn with_remote_options(mut self, opts: RemoteOptions) -> Self {
        self.s3().options = opts;
        self
    }

    /// Saves that may wait for the remote uploader besides the one it uploads; when a
    /// further save is committed locally, the oldest waiting one's remote copy is skipped
    /// (its [`RemoteProgress`] reports
    /// [`Error::RemoteSkipped`](crate::Error::RemoteSkipped)). At least 1.
    /// Default 2.
    pub fn with_remote_max_pending(mut self, n: usize) -> Self {
        self.s3().max_pending = n;
        self
    }

    /// Remote only: the root is this rank's private directory (it holds the engine's lock
    /// file), not a checkpoint tier. Saves write no file: each staged chunk is checksummed
    /// and uploaded from the staging arena, whose chunks the upload alone releases (a save
    /// waits for staging memory that earlier uploads still hold); loads come from the
    /// bucket. Needs [`EngineConfig::with_remote`]. Default false.
    pub fn with_remote_only(mut self, on: bool) -> Self {
        self.s3().remote_only = on;
        self
    }
}

impl RemoteTier for BucketTier {
    fn replaces_disk(&self) -> bool {
        self.remote_only()
    }

    fn begin_save(&self, step: u64, n_chunks: u64, chunk_size: u64) -> Arc<dyn TierSave> {
        Arc::new(self.begin(step, n_chunks, chunk_size))
    }

    fn reclaim(&self) {
        self.feeds().spill_all();
    }

    fn close(&self) {
        BucketTier::close(self);
    }

    fn url(&self) -> &str {
        self.remote().url()
    }

    fn list(&self) -> Result<Vec<u64>> {
        self.remote().list()
    }

    fn latest(&self) -> Result<Option<u64>> {
        self.remote().latest()
    }

    fn manifest(&self, step: u64) -> Result<Manifest> {
        self.remote().manifest(step)
    }

    fn file_metadata(&self, step: u64, rank: u32) -> Result<Metadata> {
        self.remote().file_metadata(step, rank)
    }

    /// Ranged GETs in parallel, every checksum verified; device destinations through the
    /// engine's CUDA-registered device-read buffers, no host copy of the whole object.
    #[allow(unsafe_code)]
    fn read(
        &self,
        step: u64,
        rank: u32,
        target: &mut Target<'_>,
        ring: &dyn Fn() -> Result<Arc<DeviceRing>>,
    ) -> Result<(Option<Checkpoint>, RemoteLoad)> {
        let remote = self.remote();
        match target {
            Target::Owned => remote.load(step, rank).map(|(ck, r)| (Some(ck), r)),
            Target::Host(dest) => remote.load_into(step, rank, dest).map(|r| (None, r)),
            Target::Device(dest) => {
                let ring = ring()?;
                // SAFETY: the ranges of a `Target::Device` are valid for writes and used by
                // nobody else during the load (`LoadInto::device` borrows whole
                // `DeviceBuffer`s mutably for the load, `LoadInto::device_raw`'s caller
                // promised it).
                unsafe { remote.load_into_device(step, rank, &ring, dest) }.map(|r| (None, r))
            }
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl TierSave for Upload {
    fn start(&self, metadata: &Metadata, rank: u32, file_name: &str, file_len: u64) {
        self.submit(metadata.clone(), rank, file_name.to_owned(), file_len);
    }

    fn offer(&self, chunk: u64, lease: ChunkLease, len: usize) {
        self.feed.offer(chunk, lease, len);
    }

    /// Tell the upload (started with the save, see `feed.rs`) how the save ended locally:
    /// committed (its file opened now, before retention or another rank can move it; the
    /// upload reads from it the chunks staging took back) or failed (the upload is
    /// aborted: nothing of the step reaches the bucket).
    fn local_outcome(&self, outcome: LocalOutcome) {
        match outcome {
            LocalOutcome::Failed(e) => self.feed.local_failed_arc(e),
            // No file: the feed gets every chunk.
            LocalOutcome::Committed { entry, file: None } => {
                self.feed.local_committed(None, entry);
            }
            LocalOutcome::Committed {
                entry,
                file: Some([first, then]),
            } => {
                let opened = crate::fsx::open_path(&first, false)
                    .or_else(|_| crate::fsx::open_path(&then, false));
                match opened {
                    Ok(f) => self.feed.local_committed(Some(f), entry),
                    Err(e) => {
                        // Committed locally, but the upload cannot read what staging took
                        // back: reported as this save's remote failure, the upload aborted.
                        self.progress.fail(e);
                        self.feed.close();
                    }
                }
            }
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The object-storage tier's API on the engine (feature `s3`).
impl Engine {
    /// The bucket of the remote tier, if the engine has one.
    pub fn remote(&self) -> Option<&Arc<Remote>> {
        self.remote_tier()
            .and_then(|t| t.as_any().downcast_ref::<BucketTier>())
            .map(BucketTier::remote)
    }

    /// Committed steps in the bucket, oldest first.
    pub fn list_remote(&self) -> Result<Vec<u64>> {
        self.tier_list()
    }

    /// The `__metadata__` of this rank's object of a step committed in the bucket, from
    /// its header (checked against the manifest, as a load checks it).
    pub fn remote_file_metadata(&self, which: impl Into<StepSel>) -> Result<Metadata> {
        self.tier_file_metadata(which.into())
    }
}

/// The object-storage tier's API on a save (feature `s3`).
impl SaveHandle {
    /// The save's remote copy (`None` without a remote tier): keep it to wait for the
    /// bucket after [`SaveHandle::wait`] consumed the handle.
    pub fn remote(&self) -> Option<RemoteProgress> {
        self.tier_save()
            .and_then(|u| u.as_any().downcast_ref::<Upload>())
            .map(|u| u.progress.clone())
    }

    /// Block until the step is committed in the bucket (after the local commit); returns
    /// the remote report, or [`Error::RemoteFailed`] / a config error without a remote
    /// tier.
    pub fn wait_remote(&self) -> Result<RemoteReport> {
        match self.remote() {
            Some(p) => p.wait(),
            None => Err(Error::Config(
                "this save has no remote copy: the engine has no remote tier (with_remote), or \
                 its cadence kept the save off the bucket (with_disk_cadence, with_remote_every)"
                    .into(),
            )),
        }
    }
}
