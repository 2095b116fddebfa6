//! The kept-arena source (`memory:ROOT`): the committed image flash restore keeps in
//! `/dev/shm` for each rank of ROOT (`EngineConfig::with_keep_in_memory`), read while its
//! engine may still run. Nothing there is trusted: each arena is attached read-only
//! through [`AttachedArena`] (no link followed, this user's regular file, descriptor
//! parsed with checked arithmetic, never mapped: `pread`), must record ROOT and the rank,
//! and hold a kept image of the step read whose slot passes flash restore's checks against
//! the disk's manifest; its header is checked against the manifest like a file's, every
//! exported tensor's CRC-32C is checked, and the slot is read again at the end: a save
//! that reused the image's chunks meanwhile fails the export.

use std::path::{Path, PathBuf};

use super::rank_files::RankFiles;
use crate::error::{Error, Result};
use crate::manifest::{FileEntry, Manifest, Metadata};
use crate::restore::header::{check_header_json, header_len};
use crate::restore::{ReadSink, for_pieces};
use crate::staging::AttachedArena;
use crate::staging::descriptor::{SlotView, slot_state};
use crate::staging::shm::SHM_MOUNT;

/// Bytes read from an arena at a time.
const BUF: u64 = 4 << 20;

/// The kept image of one rank.
struct Image {
    att: AttachedArena,
    slot: SlotView,
    chunk_size: u64,
    path: PathBuf,
}

/// The kept arenas of every rank of one committed step.
pub(super) struct KeptArenas {
    dir: PathBuf,
    step: u64,
    /// By rank file, in manifest order.
    images: Vec<Image>,
}

impl KeptArenas {
    /// Attach the kept arena of each rank of `manifest`, the manifest of the committed
    /// directory `dir` (a `step-N` directory of its root).
    pub(super) fn open(dir: &Path, manifest: &Manifest) -> Result<KeptArenas> {
        let root = dir.parent().ok_or_else(|| Error::RootMissing {
            path: dir.to_owned(),
        })?;
        let root = std::fs::canonicalize(root).map_err(|e| Error::io("canonicalize", root, e))?;
        let mut images = Vec::with_capacity(manifest.files.len());
        for f in &manifest.files {
            let name = crate::staging::kept_name(&root, f.rank);
            let path = Path::new(SHM_MOUNT).join(&name);
            let refuse = |why: String| Error::NotFound {
                what: format!(
                    "a kept image of step {} for rank {} in {} ({why})",
                    manifest.step,
                    f.rank,
                    path.display()
                ),
                step: Some(manifest.step),
                root: root.clone(),
            };
            let att = AttachedArena::open(&name).map_err(|e| match e {
                e @ Error::UnsafePath { .. } => e,
                e => refuse(e.to_string()),
            })?;
            let h = att.header();
            if h.root != root || h.rank != f.rank {
                return Err(refuse(format!(
                    "the arena is of root {} rank {}",
                    h.root.display(),
                    h.rank
                )));
            }
            let chunk_size = h.geometry.chunk_size;
            let mut found = None;
            for s in 0..att.slot_count() {
                let v = att.try_slot(s)?;
                if v.state == slot_state::KEPT && v.step == manifest.step {
                    found = Some(v);
                }
            }
            let slot = found.ok_or_else(|| refuse("it holds no kept image of that step".into()))?;
            crate::engine::check_kept_slot(&slot, chunk_size, f)
                .map_err(|why| Error::corrupt(&path, None, format!("kept image refused: {why}")))?;
            images.push(Image {
                att,
                slot,
                chunk_size,
                path,
            });
        }
        Ok(KeptArenas {
            dir: dir.to_owned(),
            step: manifest.step,
            images,
        })
    }

    fn image(&self, f: &FileEntry) -> Result<&Image> {
        self.images
            .iter()
            .find(|i| i.att.header().rank == f.rank)
            .ok_or_else(|| Error::Internal(format!("no kept image of rank {}", f.rank)))
    }
}

impl Image {
    /// Copy the image's file bytes at `off` into `out` (across arena chunks).
    fn read(&self, mut off: u64, mut out: &mut [u8]) -> Result<()> {
        while !out.is_empty() {
            let k = off / self.chunk_size;
            let at = off % self.chunk_size;
            let n = ((self.chunk_size - at) as usize).min(out.len());
            let (now, rest) = std::mem::take(&mut out).split_at_mut(n);
            let &(_, index) = usize::try_from(k)
                .ok()
                .and_then(|k| self.slot.chunks.get(k))
                .ok_or_else(|| Error::corrupt(&self.path, None, "read past the kept image"))?;
            self.att.read_chunk(index, at, now).ok_or_else(|| {
                Error::corrupt(
                    &self.path,
                    None,
                    format!("arena chunk {index} cannot be read"),
                )
            })?;
            off += n as u64;
            out = rest;
        }
        Ok(())
    }

    /// The slot still holds the image read (no save took its chunks meanwhile).
    fn still_kept(&self) -> Result<()> {
        let now = self.att.try_slot(self.slot.slot)?;
        if now.state != slot_state::KEPT
            || now.step != self.slot.step
            || now.chunks != self.slot.chunks
        {
            return Err(Error::corrupt(
                &self.path,
                None,
                "the kept image was replaced while it was read (a save ran): export again, \
                 or from the disk",
            ));
        }
        Ok(())
    }
}

impl RankFiles for KeptArenas {
    fn source(&self) -> PathBuf {
        PathBuf::from(format!(
            "{}{}",
            super::rank_files::MEMORY_PREFIX,
            self.dir.display()
        ))
    }
    fn local_dir(&self) -> Option<&Path> {
        // The step's directory on disk (its manifest is the one read): never a destination.
        Some(&self.dir)
    }
    fn path_of(&self, f: &FileEntry) -> PathBuf {
        self.image(f)
            .map(|i| i.path.clone())
            .unwrap_or_else(|_| self.dir.join(&f.file))
    }
    fn metadata(&self, f: &FileEntry) -> Result<Metadata> {
        let img = self.image(f)?;
        let mut n8 = [0u8; 8];
        img.read(0, &mut n8)?;
        let n = header_len(n8, &img.path, f)?;
        let mut hdr = vec![0u8; n as usize];
        img.read(8, &mut hdr)?;
        let header = check_header_json(&hdr, &img.path, f)?;
        img.still_kept()?;
        Ok(header
            .metadata()
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect())
    }
    fn read_wanted(&self, f: &FileEntry, wanted: &[bool], sink: &mut dyn ReadSink) -> Result<u64> {
        let img = self.image(f)?;
        debug_assert_eq!(img.slot.step, self.step);
        let mut crcs: Vec<u32> = vec![0; f.tensors.len()];
        let mut buf = vec![0u8; BUF as usize];
        let mut read = 0u64;
        // `check_kept_slot` checked every tensor lies inside the data section.
        for (i, t) in f.tensors.iter().enumerate() {
            if !wanted.get(i).copied().unwrap_or(false) {
                continue;
            }
            let [b, e] = t.data_offsets;
            let mut at = b;
            while at < e {
                let n = (e - at).min(BUF) as usize;
                img.read(f.data_start + at, &mut buf[..n])?;
                crcs[i] = crc32c::crc32c_append(crcs[i], &buf[..n]);
                let r = for_pieces(&f.tensors, at, &buf[..n], |j, off, p| {
                    if j == i {
                        sink.piece(j, off, p)
                    } else {
                        Ok(())
                    }
                });
                if let Err(e) = r {
                    let _ = sink.chunk_end();
                    return Err(e);
                }
                sink.chunk_end()?;
                read += n as u64;
                at += n as u64;
            }
            if crcs[i] != t.crc32c {
                return Err(Error::Checksum {
                    path: img.path.clone(),
                    tensor: t.name.clone(),
                    expected: t.crc32c,
                    actual: crcs[i],
                });
            }
        }
        img.still_kept()?;
        Ok(read)
    }
}
