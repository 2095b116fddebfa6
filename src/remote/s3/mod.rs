//! The object_store implementation of the object-storage tier (the face, `super`, says
//! what the tier is).

mod engine;
pub(crate) mod export;
mod extra;
mod feed;
mod journal;
mod options;
mod read;
mod staged;
mod store;
#[cfg(feature = "testing")]
#[doc(hidden)]
pub mod testing;
mod tier;
mod upload;

use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::aws::AmazonS3ConfigKey;
use object_store::multipart::MultipartStore;
use object_store::path::Path as ObjPath;
use object_store::{ClientConfigKey, ObjectStore, ObjectStoreExt, RetryConfig};

use crate::commit::store::Committer;
use crate::error::{Error, Result};
use crate::manifest::{self, FileEntry, MANIFEST, MAX_MANIFEST_LEN, Manifest, Metadata};

pub use journal::OpenUpload;
pub(crate) use options::RemoteTarget;
pub use options::{
    DEFAULT_CONCURRENCY, DEFAULT_PART_SIZE, DEFAULT_RETRIES, RemoteOptions, RemoteUrl, redact,
};
pub use tier::{RemoteProgress, RemoteReport};

/// Whether `root` names a bucket (`s3://...`) rather than a directory.
pub fn is_remote(root: &str) -> bool {
    root.starts_with("s3://")
}

/// A committed step in the bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteStep {
    /// The step.
    pub step: u64,
    /// Its manifest's total bytes (every rank's object).
    pub total_bytes: u64,
}

/// What [`Remote::gc`] removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Steps whose objects were all removed because they had no manifest (an interrupted
    /// or failed upload), oldest first.
    pub uncommitted_steps: Vec<u64>,
    /// Rank objects of committed steps that their manifest does not name (an upload that
    /// lost the commit to another writer, or one a crash left before a restarted run
    /// committed the step), removed; as URLs.
    pub stray_objects: Vec<String>,
    /// Objects removed.
    pub objects: usize,
    /// Multipart uploads aborted: those a killed process left open (their journal under
    /// `prefix/.shmckpt/uploads/` at least `min_age` old).
    pub aborted_uploads: usize,
    /// Bytes removed.
    pub bytes: u64,
    /// What was left because it cannot be proven an upload's leftover: `(URL, why)` of each
    /// object under an uncommitted step that the upload protocol does not name, and of
    /// each step whose `manifest.json` is present but not valid (left whole).
    pub ignored: Vec<(String, String)>,
}

/// One bucket prefix holding checkpoints: uploads, commits, listings, reads, retention.
/// Blocking methods (each runs on the remote's own small tokio runtime; never call them
/// from inside another tokio runtime).
pub struct Remote {
    store: Arc<dyn ObjectStore>,
    /// The same store's multipart API (upload ids, journaled), when it has one.
    mp: Option<Arc<dyn MultipartStore>>,
    /// The same bucket's multipart API with [`RemoteOptions::complete_timeout`] as its
    /// request timeout, for `CompleteMultipartUpload` alone (`mp` when none was made).
    completer: Option<Arc<dyn MultipartStore>>,
    prefix: ObjPath,
    url: String,
    opts: RemoteOptions,
    rt: tokio::runtime::Runtime,
}

impl std::fmt::Debug for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Remote")
            .field("url", &self.url)
            .field("opts", &self.opts)
            .finish()
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("shmckpt-remote-io")
        .enable_all()
        .build()
        .map_err(|e| Error::Config(format!("cannot start the remote tier's runtime: {e}")))
}

impl Remote {
    /// Open `s3://bucket/prefix` with credentials, region and endpoint from the standard
    /// AWS environment variables (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
    /// `AWS_SESSION_TOKEN`, `AWS_REGION`/`AWS_DEFAULT_REGION`, `AWS_ENDPOINT_URL`; an
    /// `http://` endpoint is accepted as boto3 accepts it, unless `AWS_ALLOW_HTTP=false`),
    /// and check that the bucket can be
    /// listed: a missing bucket or refused credentials fail here, with the server's answer.
    pub fn open(url: &str, opts: RemoteOptions) -> Result<Remote> {
        opts.validate()?;
        let parsed = RemoteUrl::parse(url)?;
        let retry = RetryConfig {
            max_retries: opts.retries,
            retry_timeout: opts.retry_timeout,
            ..RetryConfig::default()
        };
        let timeout = |d: std::time::Duration| format!("{}ms", d.as_millis().max(1));
        let timeout_key = AmazonS3ConfigKey::Client(ClientConfigKey::Timeout);
        let mut builder = object_store::aws::AmazonS3Builder::from_env()
            .with_bucket_name(&parsed.bucket)
            .with_retry(retry)
            .with_config(timeout_key, timeout(opts.request_timeout));
        // `AWS_REGION` is what the AWS CLI and SDKs read; object_store reads
        // `AWS_DEFAULT_REGION` and `AWS_REGION` alike, but be explicit.
        if let Ok(region) = std::env::var("AWS_REGION") {
            builder = builder.with_region(region);
        }
        for (k, v) in &opts.config {
            let key = k
                .parse::<AmazonS3ConfigKey>()
                .map_err(|e| Error::Config(format!("remote setting {k:?}: {e}")))?;
            builder = builder.with_config(key, v);
        }
        // boto3 and the AWS CLI take an `http://` endpoint as it is; object_store refuses
        // one ("builder error" at the first request) unless `allow_http` is set: set it
        // for an http endpoint, unless `AWS_ALLOW_HTTP` or `config` says otherwise.
        let allow_key = AmazonS3ConfigKey::Client(ClientConfigKey::AllowHttp);
        let allow_given = std::env::var_os("AWS_ALLOW_HTTP").is_some()
            || opts.config.iter().any(|(k, _)| {
                k.parse::<AmazonS3ConfigKey>().is_ok_and(|k| {
                    matches!(k, AmazonS3ConfigKey::Client(ClientConfigKey::AllowHttp))
                })
            });
        let http_endpoint = builder
            .get_config_value(&AmazonS3ConfigKey::Endpoint)
            .is_some_and(|e| {
                e.get(..7)
                    .is_some_and(|s| s.eq_ignore_ascii_case("http://"))
            });
        if http_endpoint && !allow_given {
            builder = builder.with_config(allow_key, "true");
        }
        let built = |b: object_store::aws::AmazonS3Builder| {
            b.build()
                .map(Arc::new)
                .map_err(|e| remote_err(&parsed.to_string(), "configure", &e))
        };
        // The same bucket, but with the completion's longer timeout (over any `timeout`
        // of `config`: the completion's own setting is `complete_timeout`).
        let completer = built(
            builder
                .clone()
                .with_config(timeout_key, timeout(opts.complete_timeout)),
        )?;
        let store = built(builder)?;
        let mut remote =
            Remote::with_multipart_store(store, &parsed.prefix, parsed.to_string(), opts)?;
        remote.completer = Some(completer);
        remote.check()?;
        Ok(remote)
    }

    /// A remote over any `object_store` store (tests use `InMemory`); `prefix` as in
    /// [`RemoteUrl`], `url` names it in messages.
    pub fn with_store(
        store: Arc<dyn ObjectStore>,
        prefix: &str,
        url: impl Into<String>,
        opts: RemoteOptions,
    ) -> Result<Remote> {
        Remote::build(store, None, prefix, url.into(), opts)
    }

    /// [`Remote::with_store`] over a store with upload ids (S3, GCS, Azure, `InMemory`):
    /// each multipart upload is journaled, so [`Remote::gc`] can abort the ones a killed
    /// process left open.
    pub fn with_multipart_store<S: ObjectStore + MultipartStore>(
        store: Arc<S>,
        prefix: &str,
        url: impl Into<String>,
        opts: RemoteOptions,
    ) -> Result<Remote> {
        let mp: Arc<dyn MultipartStore> = store.clone();
        Remote::build(store, Some(mp), prefix, url.into(), opts)
    }

    pub(crate) fn build(
        store: Arc<dyn ObjectStore>,
        mp: Option<Arc<dyn MultipartStore>>,
        prefix: &str,
        url: String,
        opts: RemoteOptions,
    ) -> Result<Remote> {
        opts.validate()?;
        let prefix = ObjPath::parse(prefix)
            .map_err(|e| Error::Config(format!("remote prefix {prefix:?}: {e}")))?;
        Ok(Remote {
            store,
            mp,
            completer: None,
            prefix,
            url,
            opts,
            rt: runtime()?,
        })
    }

    /// The URL, for messages.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The options.
    pub fn options(&self) -> &RemoteOptions {
        &self.opts
    }

    /// List the prefix once: a missing bucket, refused credentials or an unreachable
    /// endpoint become a [`Error::Remote`] naming the cause.
    pub fn check(&self) -> Result<()> {
        self.block(async {
            self.store
                .list_with_delimiter(Some(&self.prefix))
                .await
                .map(|_| ())
                .map_err(|e| self.err("list", &e))
        })
    }

    /// Run `f` on the remote's runtime, blocking this thread; inside another tokio
    /// runtime (where a nested `block_on` would panic) a [`Error::Config`] instead.
    fn block<T>(&self, f: impl std::future::Future<Output = Result<T>>) -> Result<T> {
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(Error::Config(format!(
                "{}: the remote tier's calls block; call them from a plain thread, not from inside a tokio runtime",
                self.url
            )));
        }
        self.rt.block_on(f)
    }

    fn step_prefix(&self, step: u64) -> ObjPath {
        self.prefix.clone().join(manifest::step_dir_name(step))
    }

    fn key(&self, step: u64, name: &str) -> ObjPath {
        self.step_prefix(step).join(name)
    }

    /// The object's URL, for messages and errors.
    fn display(&self, key: &ObjPath) -> PathBuf {
        let base = self.url.trim_end_matches('/');
        let rel = key
            .as_ref()
            .strip_prefix(self.prefix.as_ref())
            .unwrap_or(key.as_ref())
            .trim_start_matches('/');
        PathBuf::from(format!("{base}/{rel}"))
    }

    fn err(&self, op: &'static str, e: &object_store::Error) -> Error {
        remote_err(&self.url, op, e)
    }

    /// Commit `step` if every rank's part and object are present: write `manifest.json`
    /// with a conditional create. Returns the manifest when the step is committed (by this
    /// call or another rank's), `None` while a rank is missing. `created` is true when this
    /// call wrote the manifest. With a `session`, a part recorded by another session (a
    /// rank's upload of an earlier run that used the same step number) counts as missing.
    pub fn try_commit(
        &self,
        step: u64,
        world_size: u32,
        metadata: &Metadata,
        session: Option<&str>,
    ) -> Result<Option<(Manifest, bool)>> {
        self.commit_step(step, world_size, metadata, Committer::Bystander(session))
    }

    /// [`Remote::try_commit`] by `by`: a rank (`Committer::Rank`, its upload's manifest
    /// part), for which the step counts as committed only when the bucket's manifest names
    /// that part's object for its rank (when it names another writer's, or this rank's
    /// part in the bucket is another writer's, [`Error::RemoteConflict`]), or a bystander
    /// of a session. The one commit protocol ([`crate::commit::store::commit_parts`]) with
    /// the prefix as its barrier (`store::BucketParts`).
    pub(crate) fn commit_step(
        &self,
        step: u64,
        world_size: u32,
        metadata: &Metadata,
        by: Committer<'_>,
    ) -> Result<Option<(Manifest, bool)>> {
        crate::commit::store::commit_parts(
            &store::BucketParts { remote: self },
            step,
            world_size,
            metadata,
            by,
        )
    }

    async fn get_capped(&self, key: &ObjPath, cap: u64) -> object_store::Result<Bytes> {
        let r = self.store.get(key).await?;
        if r.meta.size > cap {
            return Err(object_store::Error::Generic {
                store: "shmckpt",
                source: format!("{} is {} bytes, more than {cap}", key, r.meta.size).into(),
            });
        }
        let mut out = Vec::with_capacity(r.meta.size as usize);
        let mut s = r.into_stream();
        while let Some(b) = s.next().await {
            let b = b?;
            if out.len() as u64 + b.len() as u64 > cap {
                return Err(object_store::Error::Generic {
                    store: "shmckpt",
                    source: format!("{key} is larger than {cap} bytes").into(),
                });
            }
            out.extend_from_slice(&b);
        }
        Ok(Bytes::from(out))
    }

    async fn read_manifest_async(&self, step: u64) -> Result<Option<Manifest>> {
        let key = self.key(step, MANIFEST);
        let bytes = match self.get_capped(&key, MAX_MANIFEST_LEN).await {
            Ok(b) => b,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(self.err("get manifest", &e)),
        };
        let m = Manifest::parse(&bytes, &self.display(&key))?;
        if m.step != step {
            return Err(Error::corrupt(
                self.display(&key),
                None,
                format!("manifest is of step {}, its prefix of step {step}", m.step),
            ));
        }
        Ok(Some(m))
    }

    /// The manifest of committed step `step`.
    pub fn manifest(&self, step: u64) -> Result<Manifest> {
        self.block(self.read_manifest_async(step))?
            .ok_or_else(|| Error::NotFound {
                what: format!("step {step}"),
                step: Some(step),
                root: PathBuf::from(&self.url),
            })
    }

    /// `location`'s path segments below the prefix, if it is under it.
    fn rel_parts<'a>(
        &self,
        location: &'a ObjPath,
    ) -> Option<Vec<object_store::path::PathPart<'a>>> {
        location.prefix_match(&self.prefix).map(Iterator::collect)
    }

    /// Every object under a canonical `step-N/` name (at any depth), grouped by step, and
    /// the path (below the prefix) of every object named `step-*/.../manifest.json`: one
    /// listing of the prefix.
    #[allow(clippy::type_complexity)]
    async fn objects(
        &self,
    ) -> Result<(
        std::collections::BTreeMap<u64, Vec<object_store::ObjectMeta>>,
        Vec<Vec<String>>,
    )> {
        let mut by = std::collections::BTreeMap::<u64, Vec<object_store::ObjectMeta>>::new();
        let mut manifests = Vec::new();
        let mut s = self.store.list(Some(&self.prefix));
        while let Some(o) = s.try_next().await.map_err(|e| self.err("list", &e))? {
            let Some(parts) = self.rel_parts(&o.location) else {
                continue;
            };
            let parts: Vec<String> = parts.iter().map(|p| p.as_ref().to_owned()).collect();
            if parts.first().is_some_and(|f| f.starts_with("step-"))
                && parts.last().is_some_and(|l| l == MANIFEST)
            {
                manifests.push(parts.clone());
            }
            if let Some(step) = parts.first().and_then(|f| manifest::parse_step_dir(f)) {
                by.entry(step).or_default().push(o);
            }
        }
        Ok((by, manifests))
    }

    /// What `step-<step>/manifest.json` holds, for the listing's rule.
    async fn manifest_bytes_async(&self, step: u64) -> Result<manifest::ManifestBytes> {
        let key = self.key(step, MANIFEST);
        Ok(match self.get_capped(&key, MAX_MANIFEST_LEN).await {
            Ok(bytes) => manifest::ManifestBytes::Bytes(bytes.to_vec()),
            Err(object_store::Error::NotFound { .. }) => manifest::ManifestBytes::Absent,
            Err(object_store::Error::Generic {
                store: "shmckpt",
                source,
            }) => manifest::ManifestBytes::Unreadable(source.to_string()),
            Err(e) => return Err(self.err("get manifest", &e)),
        })
    }

    /// The bucket's steps by the one listing rule ([`manifest::list_steps`], over one
    /// listing of the prefix): every object under a canonical `step-N/` name (at any
    /// depth), grouped by step; the steps committed by exactly
    /// `prefix/step-N/manifest.json` naming step N; and the steps whose manifest does not
    /// (never listed, loaded or deleted), with why. Every candidate manifest is read.
    fn scan(&self) -> Result<Scan> {
        let (by, manifests) = self.block(self.objects())?;
        let listing = manifest::list_steps(&store::Listed {
            remote: self,
            manifests,
        })?;
        Ok(Scan {
            by,
            committed: listing.committed.into_iter().collect(),
            invalid: listing.ignored,
        })
    }

    /// Committed steps, oldest first: those whose `prefix/step-N/manifest.json` is a
    /// manifest of step N (the one listing rule, [`manifest::list_steps`], as on disk).
    /// Anything else (a `manifest.json` deeper down, under a non-canonical name, of another
    /// step, not valid) is ignored with a warning: never listed, loaded or deleted.
    pub fn list(&self) -> Result<Vec<u64>> {
        Ok(manifest::list_steps(self)?.committed)
    }

    /// The newest committed step.
    pub fn latest(&self) -> Result<Option<u64>> {
        Ok(self.list()?.last().copied())
    }

    /// Keep the newest `keep` committed steps ([`Remote::list`]); delete older ones
    /// (manifest first, so a step disappears from listings before its objects go). Never
    /// deletes the newest committed step, nor any step not older than it (uploads in
    /// progress), nor anything of a step that is not committed by the listing's rule.
    /// Returns the deleted steps. The one retention ([`crate::commit::store::retain`]).
    pub fn apply_retention(&self, keep: usize) -> Result<Vec<u64>> {
        crate::commit::store::retain(self, keep)
    }

    /// Remove the objects of uncommitted steps (no `manifest.json`) whose newest object is
    /// older than `min_age`: what an interrupted or failed upload left; and the rank
    /// objects of committed steps that their manifest does not name
    /// ([`GcReport::stray_objects`]), as old. Only objects the
    /// upload protocol names are removed (`step-N/rank-*` objects and manifest parts);
    /// anything else, and every object of a step whose `manifest.json` is present but not
    /// valid, is left and reported ([`GcReport::ignored`]). A step younger than `min_age`
    /// may be an upload in progress and is kept. Then abort the multipart uploads whose
    /// journal is at least `min_age` old (uploads a killed process left open; object_store
    /// cannot list a bucket's uploads, so the uploader journals each one: `upload.rs`).
    pub fn gc(&self, min_age: Duration) -> Result<GcReport> {
        let now_ms = crate::util::unix_ms() as i64;
        let min_ms = i64::try_from(min_age.as_millis()).unwrap_or(i64::MAX);
        let scan = self.scan()?;
        self.block(async {
            let mut rep = GcReport::default();
            for (step, objs) in &scan.by {
                if scan.committed.contains(step) {
                    self.gc_stray(*step, objs, now_ms, min_ms, &mut rep).await?;
                    continue;
                }
                if let Some(why) = scan.invalid.get(step) {
                    rep.ignored.push((
                        self.display(&self.step_prefix(*step)).display().to_string(),
                        why.clone(),
                    ));
                    continue;
                }
                let newest = objs
                    .iter()
                    .map(|o| o.last_modified.timestamp_millis())
                    .max()
                    .unwrap_or(i64::MIN);
                if now_ms.saturating_sub(newest) < min_ms {
                    continue;
                }
                let mut removed = false;
                for o in objs {
                    let ours = self
                        .rel_parts(&o.location)
                        .is_some_and(|p| p.len() == 2 && is_upload_object_name(p[1].as_ref()));
                    if !ours {
                        rep.ignored.push((
                            self.display(&o.location).display().to_string(),
                            "not an object of shmckpt's uploads".into(),
                        ));
                        continue;
                    }
                    match self.store.delete(&o.location).await {
                        Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                        Err(e) => return Err(self.err("delete", &e)),
                    }
                    removed = true;
                    rep.objects += 1;
                    rep.bytes = rep.bytes.saturating_add(o.size);
                }
                if removed {
                    rep.uncommitted_steps.push(*step);
                }
            }
            rep.aborted_uploads = self.gc_uploads(min_age).await?;
            Ok(rep)
        })
    }

    /// In committed `step`: remove the rank objects its manifest does not name (another
    /// writer's upload that lost the commit, or one a crash left before a restarted run
    /// committed the step) that are at least `min_ms` old.
    async fn gc_stray(
        &self,
        step: u64,
        objs: &[object_store::ObjectMeta],
        now_ms: i64,
        min_ms: i64,
        rep: &mut GcReport,
    ) -> Result<()> {
        // Candidates: uploads' own rank objects (`rank-R-of-W.<id>.safetensors`, directly
        // under `step-N/`), old enough.
        let candidates: Vec<(&object_store::ObjectMeta, String)> = objs
            .iter()
            .filter(|o| now_ms.saturating_sub(o.last_modified.timestamp_millis()) >= min_ms)
            .filter_map(|o| {
                let parts = self.rel_parts(&o.location)?;
                let name = parts.get(1)?.as_ref().to_owned();
                let tagged = parts.len() == 2
                    && is_upload_object_name(&name)
                    && name.ends_with(".safetensors")
                    && name.matches('.').count() == 2;
                tagged.then_some((o, name))
            })
            .collect();
        if candidates.is_empty() {
            return Ok(());
        }
        let m = match self.read_manifest_async(step).await {
            Ok(Some(m)) => m,
            Ok(None) => return Ok(()), // deleted since
            Err(e @ Error::Remote { .. }) => return Err(e),
            Err(e) => {
                // Listed (it names its step) but not loadable: nothing of it is removed.
                rep.ignored.push((
                    self.display(&self.step_prefix(step)).display().to_string(),
                    format!("its manifest cannot be read: {e}"),
                ));
                return Ok(());
            }
        };
        let named: std::collections::BTreeSet<&str> =
            m.files.iter().map(FileEntry::object_name).collect();
        for (o, name) in candidates {
            if named.contains(name.as_str()) {
                continue;
            }
            match self.store.delete(&o.location).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(self.err("delete", &e)),
            }
            rep.objects += 1;
            rep.bytes = rep.bytes.saturating_add(o.size);
            rep.stray_objects
                .push(self.display(&o.location).display().to_string());
        }
        Ok(())
    }

    /// Ranged GETs of `key`, `concurrency` in flight, yielded in order. Each GET runs as
    /// its own task on the runtime's workers (its body is received while the caller
    /// handles earlier ranges), and checksums its range's pieces of `tensors` (whose
    /// offsets start at `data_start`) there: `(tensor, CRC-32C, length)` per piece, in
    /// order.
    fn ranges_checked<'a>(
        &'a self,
        key: &'a ObjPath,
        ranges: Vec<Range<u64>>,
        tensors: Arc<Vec<crate::manifest::TensorEntry>>,
        data_start: u64,
    ) -> impl futures::Stream<Item = (Range<u64>, object_store::Result<RangeRead>)> + 'a {
        futures::stream::iter(ranges)
            .map(move |r| {
                let (store, key, tensors) =
                    (Arc::clone(&self.store), key.clone(), Arc::clone(&tensors));
                let rr = r.clone();
                let task = self.rt.spawn(async move {
                    let bytes = store.get_range(&key, rr.clone()).await?;
                    let mut crcs = Vec::new();
                    if bytes.len() as u64 == rr.end - rr.start {
                        let _ = crate::restore::for_pieces(
                            &tensors,
                            rr.start - data_start,
                            &bytes,
                            |i, _, p| {
                                crcs.push((i, crc32c::crc32c(p), p.len()));
                                Ok::<_, ()>(())
                            },
                        );
                    }
                    Ok(RangeRead { bytes, crcs })
                });
                async move {
                    let got = match task.await {
                        Ok(g) => g,
                        Err(e) => Err(object_store::Error::Generic {
                            store: "shmckpt",
                            source: format!("ranged read task: {e}").into(),
                        }),
                    };
                    (r, got)
                }
            })
            .buffered(self.opts.concurrency)
    }
}

/// What [`Remote::scan`] found.
struct Scan {
    /// Every object under a canonical `step-N/` name, at any depth, by step.
    by: std::collections::BTreeMap<u64, Vec<object_store::ObjectMeta>>,
    /// Steps committed by the listing's rule.
    committed: std::collections::BTreeSet<u64>,
    /// Steps whose `manifest.json` is present but does not commit them, with why.
    invalid: std::collections::BTreeMap<u64, String>,
}

/// Whether `name`, directly under `step-N/`, is an object an upload writes before the
/// commit (a rank object or a rank's manifest part): what [`Remote::gc`] may remove.
fn is_upload_object_name(name: &str) -> bool {
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if let Some(r) = name
        .strip_prefix("rank-")
        .and_then(|n| n.strip_suffix(".manifest.json"))
    {
        return digits(r);
    }
    name.strip_prefix("rank-")
        .and_then(|n| n.strip_suffix(".safetensors"))
        .and_then(|n| n.split_once("-of-"))
        .is_some_and(|(r, w)| {
            digits(r)
                && (digits(w)
                    || w.get(..5).is_some_and(|w5| {
                        digits(w5)
                            && upload::is_object_of(name, &format!("rank-{r}-of-{w5}.safetensors"))
                    }))
        })
}

/// One ranged GET's body and the CRC-32C of its pieces (`(tensor, crc, len)`).
struct RangeRead {
    bytes: Bytes,
    crcs: Vec<(usize, u32, usize)>,
}

/// A typed error for an object-store failure, naming the likely cause.
fn remote_err(url: &str, op: &'static str, e: &object_store::Error) -> Error {
    // object_store's messages carry request URLs: the endpoint's userinfo, a presigned
    // query's signature.
    let text = options::redact(&e.to_string());
    let denied = matches!(
        e,
        object_store::Error::PermissionDenied { .. } | object_store::Error::Unauthenticated { .. }
    ) || [
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AccessDenied",
        "403 Forbidden",
    ]
    .iter()
    .any(|c| text.contains(c));
    let cause = if text.contains("NoSuchBucket") {
        "the bucket does not exist (check the URL and AWS_ENDPOINT_URL): "
    } else if text.contains("builder error") {
        "the request cannot be made (an http:// endpoint needs AWS_ALLOW_HTTP=true, or \
         aws_allow_http in the remote settings; else check AWS_ENDPOINT_URL): "
    } else if denied {
        "access refused (check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the bucket's policy): "
    } else {
        ""
    };
    Error::Remote {
        url: options::redact(url),
        op,
        reason: format!("{cause}{text}"),
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_damage;
#[cfg(test)]
mod tests_feed;
#[cfg(test)]
mod tests_load;
#[cfg(test)]
mod tests_more;
#[cfg(test)]
mod tests_tiers;
#[cfg(test)]
mod tests_writers;
