//! The journal of open multipart uploads: what is open ([`Remote::open_uploads`]) and
//! `gc`'s abort of the uploads a killed process left open (see `upload.rs` for when a
//! journal is written and removed).

use std::time::Duration;

use bytes::Bytes;
use futures::TryStreamExt;
use object_store::path::Path as ObjPath;
use object_store::{ObjectMeta, ObjectStoreExt};

use super::Remote;
use crate::error::Result;

/// Largest journal object read back (it is untrusted).
const MAX_JOURNAL_LEN: u64 = 64 << 10;

/// One open multipart upload, as its journal records it.
#[derive(serde::Serialize, serde::Deserialize)]
pub(super) struct Journal {
    /// The object's key.
    pub(super) object: String,
    /// The multipart upload id.
    pub(super) upload_id: String,
    pub(super) step: u64,
    pub(super) rank: u32,
    #[serde(default)]
    pub(super) session: Option<String>,
    pub(super) created_unix_ms: u64,
}

/// A multipart upload in progress, or left open by a stopped process, as its journal
/// records it ([`Remote::open_uploads`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenUpload {
    /// Step.
    pub step: u64,
    /// Rank.
    pub rank: u32,
    /// Session of the run that opened it.
    pub session: Option<String>,
    /// Time since its journal was written.
    pub age: Duration,
}

impl Remote {
    /// Every journal object under the prefix.
    async fn journals(&self) -> Result<Vec<ObjectMeta>> {
        self.store
            .list(Some(&self.journal_prefix()))
            .try_collect()
            .await
            .map_err(|e| self.err("list upload journals", &e))
    }

    /// A journal's bytes (capped: it is untrusted); `None` when it is gone meanwhile (its
    /// upload completed or was aborted).
    async fn journal_bytes(&self, o: &ObjectMeta) -> Result<Option<Bytes>> {
        match self.get_capped(&o.location, MAX_JOURNAL_LEN).await {
            Ok(b) => Ok(Some(b)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.err("get upload journal", &e)),
        }
    }

    /// The journaled multipart uploads: in progress, or left open by a stopped process
    /// (`gc` aborts those), oldest first. Unreadable journals are left out.
    pub fn open_uploads(&self) -> Result<Vec<OpenUpload>> {
        self.block(async {
            let now_ms = crate::util::unix_ms() as i64;
            let mut out = Vec::new();
            for o in self.journals().await? {
                let Some(bytes) = self.journal_bytes(&o).await? else {
                    continue;
                };
                if let Ok(j) = serde_json::from_slice::<Journal>(&bytes) {
                    let age = now_ms.saturating_sub(o.last_modified.timestamp_millis());
                    out.push(OpenUpload {
                        step: j.step,
                        rank: j.rank,
                        session: j.session,
                        age: Duration::from_millis(u64::try_from(age).unwrap_or(0)),
                    });
                }
            }
            out.sort_by_key(|u| std::cmp::Reverse(u.age));
            Ok(out)
        })
    }

    /// Abort the multipart uploads whose journal is at least `min_age` old (what a killed
    /// process left open) and remove their journals. Returns how many were aborted.
    pub(crate) async fn gc_uploads(&self, min_age: Duration) -> Result<usize> {
        let Some(mp) = &self.mp else {
            return Ok(0);
        };
        let now_ms = crate::util::unix_ms() as i64;
        let min_ms = i64::try_from(min_age.as_millis()).unwrap_or(i64::MAX);
        let mut aborted = 0;
        for o in self.journals().await? {
            if now_ms.saturating_sub(o.last_modified.timestamp_millis()) < min_ms {
                continue; // may be an upload in progress
            }
            let Some(bytes) = self.journal_bytes(&o).await? else {
                continue;
            };
            let j: Option<(ObjPath, String)> = serde_json::from_slice::<Journal>(&bytes)
                .ok()
                .and_then(|j| Some((ObjPath::parse(&j.object).ok()?, j.upload_id)))
                // Only uploads under this prefix: the journal is untrusted.
                .filter(|(p, _)| p.prefix_match(&self.prefix).is_some() && *p != self.prefix);
            match j {
                Some((path, id)) => match mp.abort_multipart(&path, &id).await {
                    Ok(()) => aborted += 1,
                    // Already completed or aborted.
                    Err(object_store::Error::NotFound { .. }) => {}
                    Err(e) if e.to_string().contains("NoSuchUpload") => {}
                    Err(e) => return Err(self.err("abort multipart upload", &e)),
                },
                None => tracing::warn!(journal = %o.location, "unreadable upload journal removed"),
            }
            match self.store.delete(&o.location).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(self.err("delete upload journal", &e)),
            }
        }
        Ok(aborted)
    }
}
