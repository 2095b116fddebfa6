//! The export's bucket source (`crate::export`): a committed step of `s3://bucket/prefix` ([`crate::remote::Remote`]'s
//! listing rule picks the latest, or `s3://bucket/prefix/step-N` names one), read with
//! ranged GETs of the chosen tensors only, every object's size and header and every
//! tensor's CRC-32C checked by the remote tier's reader.

use std::path::PathBuf;

use super::{Remote, RemoteOptions};
use crate::error::{Error, Result};
use crate::manifest::{FileEntry, Manifest, Metadata};
use crate::restore::ReadSink;
use crate::tier::RankFiles;

/// One committed step of a bucket prefix.
pub(crate) struct BucketStep {
    remote: Remote,
    step: u64,
}

impl BucketStep {
    /// Open `url`: `s3://bucket/prefix` (its latest committed step) or
    /// `s3://bucket/prefix/step-N` (step N, which must be committed).
    pub(crate) fn open(url: &str) -> Result<(BucketStep, Manifest)> {
        let trimmed = url.trim_end_matches('/');
        let named = trimmed
            .rsplit_once('/')
            .and_then(|(base, last)| Some((base, crate::manifest::parse_step_dir(last)?)))
            .filter(|(base, _)| base.len() > "s3://".len());
        let (base, want) = match named {
            Some((base, step)) => (base, Some(step)),
            None => (trimmed, None),
        };
        let remote = Remote::open(base, RemoteOptions::default())?;
        let committed = remote.list()?;
        let step = match want {
            Some(s) if committed.contains(&s) => s,
            Some(s) => {
                return Err(Error::NotFound {
                    what: format!("step {s}"),
                    step: Some(s),
                    root: PathBuf::from(base),
                });
            }
            None => *committed.last().ok_or_else(|| Error::NotFound {
                what: "latest".into(),
                step: None,
                root: PathBuf::from(base),
            })?,
        };
        let manifest = remote.manifest(step)?;
        Ok((BucketStep { remote, step }, manifest))
    }
}

impl RankFiles for BucketStep {
    fn source(&self) -> PathBuf {
        PathBuf::from(format!(
            "{}/{}",
            self.remote.url().trim_end_matches('/'),
            crate::manifest::step_dir_name(self.step)
        ))
    }
    fn path_of(&self, f: &FileEntry) -> PathBuf {
        self.source().join(f.object_name())
    }
    fn metadata(&self, f: &FileEntry) -> Result<Metadata> {
        self.remote.entry_metadata(self.step, f)
    }
    fn read_wanted(&self, f: &FileEntry, wanted: &[bool], sink: &mut dyn ReadSink) -> Result<u64> {
        Ok(self
            .remote
            .read_entry_wanted(self.step, f, Some(wanted), sink)?
            .0)
    }
}
