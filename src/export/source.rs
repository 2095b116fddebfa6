//! Where an export reads a checkpoint: [`open`] picks the implementation of the one
//! abstraction the engine reads through ([`RankFiles`], in `rank_files.rs`) for a source:
//! a local directory (the restore path's ranged reads, here), the arenas flash restore
//! keeps in `/dev/shm` ([`super::kept`]) and, with the `s3` feature, a bucket
//! (`crate::remote`).

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::manifest::{FileEntry, MANIFEST, Manifest, Metadata};
use crate::restore::{RangedOptions, ReadOptions, ReadSink};

use super::rank_files::{MEMORY_PREFIX, RankFiles};

/// The checkpoint `src` names and its manifest: `s3://bucket/prefix[/step-N]` (a bucket),
/// `memory:ROOT` (the kept arenas of ROOT's latest committed step), or a local root, step
/// directory or DCP checkpoint.
pub(super) fn open(src: &Path, read: &ReadOptions) -> Result<(Box<dyn RankFiles>, Manifest)> {
    if let Some(s) = src.to_str() {
        if s.starts_with("s3://") {
            return bucket(s);
        }
        if let Some(root) = s.strip_prefix(MEMORY_PREFIX) {
            let (dir, manifest) = resolve_local(Path::new(root))?;
            let kept = super::kept::KeptArenas::open(&dir, &manifest)?;
            return Ok((Box::new(kept), manifest));
        }
    }
    let (dir, manifest) = resolve_local(src)?;
    let local = LocalDir {
        dir,
        opts: RangedOptions {
            read: read.clone(),
            ..RangedOptions::default()
        },
    };
    Ok((Box::new(local), manifest))
}

/// A bucket's step (`crate::remote`; an error without the `s3` feature).
fn bucket(url: &str) -> Result<(Box<dyn RankFiles>, Manifest)> {
    crate::remote::export_source(url)
}

/// The checkpoint directory `src` names: itself when it holds a manifest (a `step-N`
/// directory, or a DCP checkpoint of any name), else the latest committed step of the root
/// `src`.
pub(super) fn resolve_local(src: &Path) -> Result<(PathBuf, Manifest)> {
    let m = src.join(MANIFEST);
    if std::fs::symlink_metadata(&m).is_ok() {
        let named_step = src
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(crate::manifest::parse_step_dir)
            .is_some();
        let manifest = if named_step {
            Manifest::read(src)?
        } else {
            Manifest::read_any_name(src)?
        };
        return Ok((src.to_owned(), manifest));
    }
    let md = std::fs::symlink_metadata(src).map_err(|_| Error::RootMissing {
        path: src.to_owned(),
    })?;
    if !md.is_dir() {
        return Err(Error::RootMissing {
            path: src.to_owned(),
        });
    }
    let latest = crate::manifest::list_committed(src)?
        .into_iter()
        .max_by_key(|c| c.step)
        .ok_or_else(|| Error::NotFound {
            what: "latest".into(),
            step: None,
            root: src.to_owned(),
        })?;
    let manifest = Manifest::read(&latest.dir)?;
    Ok((latest.dir, manifest))
}

/// A checkpoint directory on a local file system.
struct LocalDir {
    dir: PathBuf,
    opts: RangedOptions,
}

impl RankFiles for LocalDir {
    fn source(&self) -> PathBuf {
        self.dir.clone()
    }
    fn path_of(&self, f: &FileEntry) -> PathBuf {
        self.dir.join(&f.file)
    }
    fn local_dir(&self) -> Option<&Path> {
        Some(&self.dir)
    }
    fn metadata(&self, f: &FileEntry) -> Result<Metadata> {
        crate::restore::read_file_metadata(&self.path_of(f), f)
    }
    fn read_wanted(&self, f: &FileEntry, wanted: &[bool], sink: &mut dyn ReadSink) -> Result<u64> {
        Ok(crate::restore::read_wanted(&self.path_of(f), f, wanted, &self.opts, sink)?.bytes)
    }
}
