//! Uploading one rank's object: parts from the staging arena ([`Feed`]) or the local file,
//! `concurrency` parts in flight, and the journal of open multipart uploads that lets
//! `gc` abort the uploads a killed process left open.
//!
//! object_store cannot list a bucket's multipart uploads, so before the first part of an
//! upload its id is recorded in a small journal object,
//! `prefix/.shmckpt/uploads/<session>-<rank>-<step>-<ms>.json` (the object's key and the
//! upload id), removed once the upload is completed or aborted. [`Remote::gc`] aborts the
//! uploads of the journals older than its `min_age` (through object_store's
//! [`MultipartStore::abort_multipart`]) and removes those journals. Only a store that
//! implements [`MultipartStore`] (S3, GCS, Azure, `InMemory`) has upload ids; other stores
//! upload through `put_multipart` with no journal.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use object_store::multipart::{MultipartStore, PartId};
use object_store::path::Path as ObjPath;
use object_store::{MultipartId, MultipartUpload, ObjectStoreExt, PutPayload};
use tokio::task::JoinSet;

use super::Remote;
use super::feed::{Feed, Local, Next};
use super::journal::Journal;
use crate::error::{Error, Result};
use crate::manifest::{self, FileEntry, MANIFEST};

/// Where the journals of open multipart uploads live, under the prefix.
pub(crate) const JOURNAL_DIR: &str = ".shmckpt/uploads";

/// An upload in progress, with its parts in flight; `sent` counts the bytes of the parts
/// the server accepted.
pub(super) struct Upload {
    kind: UploadKind,
    sent: Arc<AtomicU64>,
}

enum UploadKind {
    /// Through [`MultipartStore`]: the upload id is journaled.
    Ids {
        mp: Arc<dyn MultipartStore>,
        path: ObjPath,
        id: MultipartId,
        journal: ObjPath,
        tasks: JoinSet<(usize, object_store::Result<PartId>)>,
        parts: Vec<Option<PartId>>,
    },
    /// Through `put_multipart` (stores without upload ids): nothing journaled.
    Plain {
        up: Box<dyn MultipartUpload>,
        tasks: JoinSet<object_store::Result<()>>,
        parts: usize,
    },
}

impl Upload {
    pub(super) fn put_part(&mut self, payload: PutPayload) {
        let n = payload.content_length() as u64;
        let sent = Arc::clone(&self.sent);
        match &mut self.kind {
            UploadKind::Ids {
                mp,
                path,
                id,
                tasks,
                parts,
                ..
            } => {
                let idx = parts.len();
                parts.push(None);
                let (mp, path, id) = (Arc::clone(mp), path.clone(), id.clone());
                tasks.spawn(async move {
                    let r = mp.put_part(&path, &id, idx, payload).await;
                    if r.is_ok() {
                        sent.fetch_add(n, Ordering::Relaxed);
                    }
                    (idx, r)
                });
            }
            UploadKind::Plain { up, tasks, parts } => {
                *parts += 1;
                let part = up.put_part(payload);
                tasks.spawn(async move {
                    part.await?;
                    sent.fetch_add(n, Ordering::Relaxed);
                    Ok(())
                });
            }
        }
    }

    /// Wait until fewer than `n` parts are in flight (`0`: none).
    pub(super) async fn wait_for_capacity(&mut self, n: usize) -> object_store::Result<()> {
        match &mut self.kind {
            UploadKind::Ids { tasks, parts, .. } => {
                while !tasks.is_empty() && tasks.len() >= n.max(1) {
                    if let Some(j) = tasks.join_next().await {
                        let (idx, r) = j.map_err(join_err)?;
                        parts[idx] = Some(r?);
                    }
                }
            }
            UploadKind::Plain { tasks, .. } => {
                while !tasks.is_empty() && tasks.len() >= n.max(1) {
                    if let Some(j) = tasks.join_next().await {
                        j.map_err(join_err)??;
                    }
                }
            }
        }
        Ok(())
    }

    /// The upload id (uploads through [`MultipartStore`]).
    #[cfg(test)]
    pub(super) fn id(&self) -> Option<MultipartId> {
        match &self.kind {
            UploadKind::Ids { id, .. } => Some(id.clone()),
            UploadKind::Plain { .. } => None,
        }
    }

    fn parts(&self) -> usize {
        match &self.kind {
            UploadKind::Ids { parts, .. } => parts.len(),
            UploadKind::Plain { parts, .. } => *parts,
        }
    }
}

fn join_err(e: tokio::task::JoinError) -> object_store::Error {
    object_store::Error::Generic {
        store: "shmckpt",
        source: format!("upload task: {e}").into(),
    }
}

/// Builds `part_size` parts from pieces (arena chunks or file reads) without copying.
struct Parts {
    size: usize,
    cur: Vec<Bytes>,
    len: usize,
}

impl Parts {
    /// Add `piece`; returns the parts it completed.
    fn push(&mut self, mut piece: Bytes) -> Vec<PutPayload> {
        let mut out = Vec::new();
        while !piece.is_empty() {
            let room = self.size - self.len;
            if piece.len() < room {
                self.len += piece.len();
                self.cur.push(piece);
                break;
            }
            self.cur.push(piece.split_to(room));
            self.len = 0;
            out.push(self.cur.drain(..).collect());
        }
        out
    }

    /// Copy the part being filled out of its pieces (their arena chunks go back).
    fn detach(&mut self) {
        for p in &mut self.cur {
            *p = Bytes::copy_from_slice(p);
        }
    }

    fn rest(&mut self) -> Option<PutPayload> {
        if self.cur.is_empty() {
            return None;
        }
        self.len = 0;
        Some(self.cur.drain(..).collect())
    }
}

/// The object name of one upload of the rank file `file` (`rank-R-of-W.safetensors`):
/// `rank-R-of-W.<upload id>.safetensors`, the id 32 hex digits drawn afresh for each
/// upload, so that no two uploads (two writers of one step) ever complete the same object.
pub(super) fn object_name(file: &str) -> String {
    use std::hash::{BuildHasher, Hasher};
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let word = |salt: u64| {
        // `RandomState::new` is seeded from the OS's randomness once per thread, then
        // varied per call: with the time, pid and a counter mixed in, two uploads never
        // draw the same id but by a 2^-64 chance.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(crate::util::unix_ms());
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        h.write_u32(std::process::id());
        h.write_u64(COUNT.fetch_add(1, Ordering::Relaxed));
        h.write_u64(salt);
        h.finish()
    };
    let stem = file.strip_suffix(".safetensors").unwrap_or(file);
    format!("{stem}.{:016x}{:016x}.safetensors", word(1), word(2))
}

/// Whether `object` names an upload of rank file `file` ([`object_name`]), or is `file`
/// itself (buckets written before uploads were named apart).
pub(super) fn is_object_of(object: &str, file: &str) -> bool {
    if object == file {
        return true;
    }
    let stem = file.strip_suffix(".safetensors").unwrap_or(file);
    object
        .strip_prefix(stem)
        .and_then(|r| r.strip_prefix('.'))
        .and_then(|r| r.strip_suffix(".safetensors"))
        .is_some_and(|id| id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()))
}

impl Remote {
    pub(super) fn journal_prefix(&self) -> ObjPath {
        let mut p = self.prefix.clone();
        for seg in JOURNAL_DIR.split('/') {
            p = p.join(seg);
        }
        p
    }

    pub(super) async fn begin(
        &self,
        key: &ObjPath,
        step: u64,
        rank: u32,
        session: Option<&str>,
        sent: Arc<AtomicU64>,
    ) -> Result<Upload> {
        let Some(mp) = &self.mp else {
            let up = self
                .store
                .put_multipart(key)
                .await
                .map_err(|e| self.err("create multipart upload", &e))?;
            return Ok(Upload {
                kind: UploadKind::Plain {
                    up,
                    tasks: JoinSet::new(),
                    parts: 0,
                },
                sent,
            });
        };
        let id = mp
            .create_multipart(key)
            .await
            .map_err(|e| self.err("create multipart upload", &e))?;
        let now = crate::util::unix_ms();
        let j = Journal {
            object: key.to_string(),
            upload_id: id.clone(),
            step,
            rank,
            session: session.map(str::to_owned),
            created_unix_ms: now,
        };
        let name = format!(
            "{}-{rank}-{step}-{now}.json",
            session.unwrap_or("nosession")
        );
        let journal = self.journal_prefix().join(name);
        let body = serde_json::to_vec(&j).expect("journals serialize");
        if let Err(e) = self.store.put(&journal, PutPayload::from(body)).await {
            // Nothing uploaded yet: abort at once rather than leave an unjournaled upload.
            let _ = mp.abort_multipart(key, &id).await;
            return Err(self.err("put upload journal", &e));
        }
        Ok(Upload {
            kind: UploadKind::Ids {
                mp: Arc::clone(mp),
                path: key.clone(),
                id,
                journal,
                tasks: JoinSet::new(),
                parts: Vec::new(),
            },
            sent,
        })
    }

    /// Wait for the parts in flight and complete the upload; on any failure, abort it.
    async fn complete(&self, up: Upload) -> Result<()> {
        let mut up = up;
        if let Err(e) = up.wait_for_capacity(0).await {
            self.abort(up).await;
            return Err(self.err("upload part", &e));
        }
        let sent = Arc::clone(&up.sent);
        match up.kind {
            UploadKind::Ids {
                mp,
                path,
                id,
                journal,
                parts,
                tasks,
            } => {
                let ids: Vec<PartId> = parts.iter().flatten().cloned().collect();
                // The completion's own timeout (a large object takes the server long).
                let completer = self.completer.as_ref().unwrap_or(&mp);
                match completer.complete_multipart(&path, &id, ids).await {
                    Ok(_) => self.drop_journal(&journal).await,
                    Err(e) => {
                        let up = Upload {
                            kind: UploadKind::Ids {
                                mp,
                                path,
                                id,
                                journal,
                                parts,
                                tasks,
                            },
                            sent,
                        };
                        self.abort(up).await;
                        return Err(self.err("complete multipart upload", &e));
                    }
                }
            }
            UploadKind::Plain {
                mut up,
                tasks,
                parts,
            } => {
                if let Err(e) = up.complete().await {
                    let up = Upload {
                        kind: UploadKind::Plain { up, tasks, parts },
                        sent,
                    };
                    self.abort(up).await;
                    return Err(self.err("complete multipart upload", &e));
                }
            }
        }
        Ok(())
    }

    async fn abort(&self, up: Upload) {
        let (r, journal) = match up.kind {
            UploadKind::Ids {
                mp,
                path,
                id,
                journal,
                mut tasks,
                ..
            } => {
                tasks.shutdown().await;
                (mp.abort_multipart(&path, &id).await, Some(journal))
            }
            UploadKind::Plain {
                mut up, mut tasks, ..
            } => {
                tasks.shutdown().await;
                (up.abort().await, None)
            }
        };
        match r {
            Ok(()) => {
                if let Some(j) = journal {
                    self.drop_journal(&j).await;
                }
            }
            Err(a) => {
                tracing::warn!(error = %a, url = %self.url, "could not abort a failed multipart upload; `shmckpt gc` (or a bucket lifecycle rule) removes it")
            }
        }
    }

    async fn drop_journal(&self, journal: &ObjPath) {
        if let Err(e) = self.store.delete(journal).await {
            tracing::warn!(error = %e, journal = %journal, "could not remove an upload journal; `shmckpt gc` removes it");
        }
    }

    /// Upload one rank's committed file (`len` bytes of `file`) as
    /// `step-N/<entry.file>` (a multipart upload, `part_size` parts, `concurrency` in
    /// flight; aborted on failure), then its manifest part. Returns the bytes uploaded.
    ///
    /// A step already committed in the bucket is never written to
    /// ([`Error::StepExists`]): its objects would no longer match its manifest.
    ///
    /// `session` (shared by the ranks of one run, [`crate::EngineConfig::with_session`])
    /// is recorded in the manifest part.
    pub fn upload_rank(
        &self,
        step: u64,
        file: &std::fs::File,
        entry: &FileEntry,
        session: Option<&str>,
    ) -> Result<u64> {
        self.upload_from(step, file, entry, session, &Arc::default())
            .map(|e| e.bytes)
    }

    /// [`Remote::upload_rank`] returning the entry its manifest part records (with the
    /// upload's object name, [`FileEntry::object`]).
    pub fn upload_rank_entry(
        &self,
        step: u64,
        file: &std::fs::File,
        entry: &FileEntry,
        session: Option<&str>,
    ) -> Result<FileEntry> {
        self.upload_from(step, file, entry, session, &Arc::default())
    }

    /// [`Remote::upload_rank`] counting in `sent` the bytes of the parts the server has
    /// accepted so far (for progress displays).
    pub fn upload_rank_counted(
        &self,
        step: u64,
        file: &std::fs::File,
        entry: &FileEntry,
        session: Option<&str>,
        sent: &Arc<AtomicU64>,
    ) -> Result<u64> {
        self.upload_from(step, file, entry, session, sent)
            .map(|e| e.bytes)
    }

    /// [`Remote::upload_rank`] from `file` alone.
    fn upload_from(
        &self,
        step: u64,
        file: &std::fs::File,
        entry: &FileEntry,
        session: Option<&str>,
        sent: &Arc<AtomicU64>,
    ) -> Result<FileEntry> {
        let mut entry = entry.clone();
        entry.object = Some(object_name(&entry.file));
        entry.session = session.map(str::to_owned);
        let key = self.key(step, entry.object_name());
        self.block(async {
            self.upload_object(
                step,
                &key,
                entry.rank,
                entry.bytes,
                Some(file),
                None,
                session,
                sent,
            )
            .await?;
            self.put_part_manifest(step, &entry).await?;
            Ok(entry)
        })
    }

    /// A save's upload streamed from its [`Feed`] while the save is written locally: the
    /// parts start as its chunks are staged and written; the object is completed, and its
    /// manifest part written, only once the save is committed locally (a save that fails
    /// locally aborts the upload: [`Error::SaveFailed`]). `name`, `rank` and `total`: the
    /// rank file's name, rank and size. Returns the committed save's entry.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn upload_streamed(
        &self,
        step: u64,
        feed: &Feed,
        rank: u32,
        name: &str,
        total: u64,
        session: Option<&str>,
        sent: &Arc<AtomicU64>,
    ) -> Result<FileEntry> {
        let object = object_name(name);
        let key = self.key(step, &object);
        self.block(async {
            let mut entry = self
                .upload_object(step, &key, rank, total, None, Some(feed), session, sent)
                .await?
                .ok_or_else(|| Error::Internal("a streamed upload without its entry".into()))?;
            entry.object = Some(object);
            entry.session = session.map(str::to_owned);
            self.put_part_manifest(step, &entry).await?;
            Ok(entry)
        })
    }

    /// The rank's manifest part: its entry, with the upload's session
    /// ([`FileEntry::session`]).
    async fn put_part_manifest(&self, step: u64, entry: &FileEntry) -> Result<()> {
        let part_json = serde_json::to_vec(entry).expect("manifest parts serialize");
        let pkey = self.key(step, &manifest::rank_manifest_name(entry.rank));
        self.store
            .put(&pkey, PutPayload::from(part_json))
            .await
            .map_err(|e| self.err("put manifest part", &e))?;
        Ok(())
    }

    /// One rank object as a multipart upload (aborted on any failure). With a feed, the
    /// upload completes only after the save's local commit, and returns its entry.
    #[allow(clippy::too_many_arguments)]
    async fn upload_object(
        &self,
        step: u64,
        key: &ObjPath,
        rank: u32,
        total: u64,
        file: Option<&std::fs::File>,
        feed: Option<&Feed>,
        session: Option<&str>,
        sent: &Arc<AtomicU64>,
    ) -> Result<Option<FileEntry>> {
        let local_failed = |e: Arc<Error>| Error::SaveFailed { step, source: e };
        if let Some(Local::Failed(e)) = feed.and_then(Feed::local) {
            return Err(local_failed(e));
        }
        match self.store.head(&self.key(step, MANIFEST)).await {
            Ok(_) => {
                return Err(Error::StepExists {
                    step,
                    root: std::path::PathBuf::from(&self.url),
                });
            }
            Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(self.err("head manifest", &e)),
        }
        let mut up = self
            .begin(key, step, rank, session, Arc::clone(sent))
            .await?;
        if let Err(e) = self.send(&mut up, key, step, total, file, feed).await {
            self.abort(up).await;
            return Err(e);
        }
        // The bytes are all in parts: the object is completed only for a save committed
        // locally.
        let entry = match feed {
            None => None,
            Some(f) => match f.wait_local().await {
                Local::Committed(_, entry) if entry.bytes == total => Some(entry),
                Local::Committed(_, entry) => {
                    self.abort(up).await;
                    return Err(Error::Internal(format!(
                        "the committed file holds {} bytes, the upload {total}",
                        entry.bytes
                    )));
                }
                Local::Failed(e) => {
                    self.abort(up).await;
                    return Err(local_failed(e));
                }
            },
        };
        self.complete(up).await?;
        Ok(entry)
    }

    /// `n` bytes at `at` of `file`, read once a part can be sent (bounded memory).
    async fn read_piece(
        &self,
        up: &mut Upload,
        key: &ObjPath,
        file: &std::fs::File,
        at: u64,
        n: u64,
    ) -> Result<Bytes> {
        up.wait_for_capacity(self.opts.concurrency)
            .await
            .map_err(|e| self.err("upload part", &e))?;
        let mut buf = vec![0u8; n as usize];
        std::os::unix::fs::FileExt::read_exact_at(file, &mut buf, at)
            .map_err(|e| Error::io_at("read", self.display(key), at, e))?;
        Ok(Bytes::from(buf))
    }

    /// Every byte of the object, in order, into parts: from the feed's chunks as they are
    /// staged (from the file for the chunks it gave back), else `part_size` reads of
    /// `file`.
    async fn send(
        &self,
        up: &mut Upload,
        key: &ObjPath,
        step: u64,
        total: u64,
        file: Option<&std::fs::File>,
        feed: Option<&Feed>,
    ) -> Result<()> {
        let step_len = feed.map_or(self.opts.part_size as u64, Feed::chunk_size);
        let mut parts = Parts {
            size: self.opts.part_size,
            cur: Vec::new(),
            len: 0,
        };
        let mut pressure = 0u64;
        let mut at = 0u64;
        while at < total {
            let n = (total - at).min(step_len);
            let piece = match feed {
                Some(f) => loop {
                    match f.next(at / f.chunk_size(), &mut pressure).await {
                        Next::Held(b) if b.len() as u64 == n => break b,
                        Next::Held(b) => {
                            return Err(Error::Internal(format!(
                                "staged chunk at {at} holds {} bytes, the file {n}",
                                b.len()
                            )));
                        }
                        Next::File(file) => break self.read_piece(up, key, &file, at, n).await?,
                        // Staging is short: the part being filled lets go of its chunks.
                        Next::Pressure => parts.detach(),
                        Next::Stop(e) => {
                            return Err(match &*e {
                                Error::Shutdown(m) => Error::Shutdown(m.clone()),
                                _ => Error::SaveFailed { step, source: e },
                            });
                        }
                    }
                },
                None => {
                    let Some(file) = file else {
                        return Err(Error::Internal(
                            "an upload with neither file nor feed".into(),
                        ));
                    };
                    self.read_piece(up, key, file, at, n).await?
                }
            };
            for p in parts.push(piece) {
                up.wait_for_capacity(self.opts.concurrency)
                    .await
                    .map_err(|e| self.err("upload part", &e))?;
                up.put_part(p);
            }
            at += n;
        }
        if let Some(p) = parts.rest() {
            up.put_part(p);
        }
        if up.parts() == 0 {
            return Err(Error::Internal("an upload of no bytes".into()));
        }
        Ok(())
    }
}
