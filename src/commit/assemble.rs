//! Committing ranks whose engines each wrote their part in a root of their own (the
//! DCP backend: one engine root per rank process, so no engine ever sees another rank's
//! part), and publishing the result under a name its user chose.
//!
//! [`assemble_ranks`] is the multi-rank half of [`super::commit`], done once by one
//! caller that has every rank's durable part: it moves each rank's file into one
//! directory and writes the merged `manifest.json` (temporary name, `fsync`, `rename`,
//! directory `fsync`). [`publish_dir`] adds the caller's own files (DCP's `.metadata`)
//! the same way and makes the directory appear under its final name with one `rename`,
//! then `fsync`s the parents: before it nothing is at the target, after it the target is
//! complete and durable.

use std::path::{Path, PathBuf};

use super::store::{self, Committer, PartBarrier};
use crate::error::{Error, Result};
use crate::io::file::{fsync_dir, write_durable};
use crate::manifest::{
    self, FileEntry, MANIFEST, Manifest, Metadata, partial_dir_name, rank_file_name,
    rank_manifest_name,
};

/// The manifest entry of rank `rank` in `source`, a part-only save's partial directory
/// ([`crate::SaveOptions::part_only`]): its manifest part (`rank-K.manifest.json`), read
/// without following a link, size-capped; it must name the rank and its file.
fn rank_part(source: &Path, rank: u32, world_size: u32) -> Result<FileEntry> {
    let p = source.join(rank_manifest_name(rank));
    let bytes = manifest::read_manifest_bytes(&p)?;
    let entry = serde_json::from_slice::<FileEntry>(&bytes)
        .map_err(|e| Error::corrupt(&p, None, format!("manifest part is not valid: {e}")))?;
    let expected = rank_file_name(rank, world_size);
    if entry.rank != rank || entry.file != expected {
        return Err(Error::corrupt(
            source,
            None,
            format!(
                "the manifest part of rank {rank} names rank {} and file {:?}, not {expected:?}",
                entry.rank, entry.file
            ),
        ));
    }
    Ok(entry)
}

/// The partial directories of `step` left by part-only saves in the engine roots directly
/// under `dir` (one engine root per process of a rank), sorted. Links are neither followed
/// nor listed; a missing `dir` has none.
pub fn find_parts(dir: &Path, step: u64) -> Result<Vec<PathBuf>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io("list", dir, e)),
    };
    let name = partial_dir_name(step);
    let is_dir = |p: &Path| std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_dir());
    let mut found = Vec::new();
    for e in entries {
        let e = e.map_err(|err| Error::io("list", dir, err))?;
        let candidate = e.path().join(&name);
        if is_dir(&e.path()) && is_dir(&candidate) {
            found.push(candidate);
        }
    }
    found.sort();
    Ok(found)
}

/// Gather every rank's durable file into the new directory `out` and write its
/// `manifest.json`: `sources[K]` is where rank K's engine left its part (the partial
/// directory of a part-only save, [`find_parts`] finds it). The manifest is
/// of step `step`, or of step N when `name_from` (the directory it will be published as)
/// is named `step-N`, so that it passes [`Manifest::read`] there. A leftover `out` of an
/// attempt that failed is removed first. Returns the manifest.
pub fn assemble_ranks(
    sources: &[PathBuf],
    out: &Path,
    step: u64,
    name_from: Option<&Path>,
    metadata: &Metadata,
) -> Result<Manifest> {
    let world_size = u32::try_from(sources.len())
        .ok()
        .filter(|&w| w > 0)
        .ok_or_else(|| Error::Internal(format!("{} sources for one checkpoint", sources.len())))?;
    let step = name_from
        .and_then(|p| p.file_name())
        .and_then(|n| n.to_str())
        .and_then(manifest::parse_step_dir)
        .unwrap_or(step);
    // Every part is read and checked before anything moves: the one commit protocol
    // builds the manifest (every check of `Manifest::from_parts`: a lying part fails
    // here) before it assembles anything.
    let barrier = Assembly { sources, out };
    store::commit_parts(&barrier, step, world_size, metadata, Committer::Bystander(None))?
        .ok_or_else(|| {
            Error::Internal(format!(
                "step {step}: a part went missing while assembling, or the parts are of different sessions (runs)"
            ))
        })
}

/// Part-only saves' partial directories (`sources[K]`: rank K's) as the barrier of the one
/// commit protocol ([`store::commit_parts`]): the caller has every rank's durable part;
/// the manifest is written with the rank files into the new directory `out`, which the
/// caller then makes visible ([`publish_dir`], [`publish_dir_replacing`], [`publish_into`]).
struct Assembly<'a> {
    sources: &'a [PathBuf],
    out: &'a Path,
}

impl PartBarrier for Assembly<'_> {
    /// The manifest assembled in `out`.
    type Committed = Manifest;

    fn manifest_location(&self, _step: u64) -> PathBuf {
        self.out.join(MANIFEST)
    }

    /// Each rank's part-only save wrote its part.
    fn put_part(&self, _: u64, _: u32, _: Option<&FileEntry>) -> Result<Option<Manifest>> {
        Ok(None)
    }

    /// The part must name the rank and its file, a regular file of the size it records.
    fn get_part(
        &self,
        _step: u64,
        world_size: u32,
        rank: u32,
        _mine: Option<&FileEntry>,
    ) -> Result<Option<FileEntry>> {
        let source = usize::try_from(rank)
            .ok()
            .and_then(|r| self.sources.get(r))
            .ok_or_else(|| Error::Internal(format!("no source of rank {rank}")))?;
        let entry = rank_part(source, rank, world_size)?;
        let file = source.join(&entry.file);
        let meta = std::fs::symlink_metadata(&file).map_err(|e| Error::io("stat", &file, e))?;
        if !meta.file_type().is_file() || meta.len() != entry.bytes {
            return Err(Error::corrupt(
                &file,
                None,
                format!(
                    "not a regular file of the {} bytes its manifest part records",
                    entry.bytes
                ),
            ));
        }
        Ok(Some(entry))
    }

    /// A leftover `out` of an attempt that failed is removed; every rank's file is moved
    /// into a new `out`, then `manifest.json` written durably (compact: the engine's own
    /// manifests are pretty-printed; both parse alike).
    fn publish_if_absent(&self, manifest: Manifest, _: Option<&FileEntry>) -> Result<Manifest> {
        let out = self.out;
        match std::fs::symlink_metadata(out) {
            Ok(m) if m.file_type().is_dir() => {
                std::fs::remove_dir_all(out).map_err(|e| Error::io("remove", out, e))?
            }
            Ok(_) => {
                return Err(Error::UnsafePath {
                    path: out.to_owned(),
                    reason: "not a directory where a checkpoint is assembled".into(),
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io("stat", out, e)),
        }
        std::fs::create_dir(out).map_err(|e| Error::io("mkdir", out, e))?;
        for (source, entry) in self.sources.iter().zip(&manifest.files) {
            let from = source.join(&entry.file);
            std::fs::rename(&from, out.join(&entry.file))
                .map_err(|e| Error::io("rename", &from, e))?;
        }
        let bytes = serde_json::to_vec(&manifest).expect("manifest serializes");
        write_file(out, MANIFEST, &bytes)?;
        fsync_dir(out)?;
        Ok(manifest)
    }
}

/// Write `dir/name` durably: a temporary name, `fsync`, `rename`.
fn write_file(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    let tmp = dir.join(format!("{name}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    write_durable(&tmp, bytes).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })?;
    let target = dir.join(name);
    std::fs::rename(&tmp, &target).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::io("rename", &tmp, e)
    })
}

/// Every name of `files` is a plain file name (no `/`, not `.` or `..`, not empty).
fn check_plain_names(files: &[(&str, &[u8])]) -> Result<()> {
    match files
        .iter()
        .find(|(n, _)| n.is_empty() || n.contains('/') || *n == "." || *n == "..")
    {
        Some((name, _)) => Err(Error::Internal(format!(
            "{name:?} is not a plain file name"
        ))),
        None => Ok(()),
    }
}

/// Add `files` (`(name, bytes)`, plain names) to the assembled directory `dir`, durably,
/// then publish it as `target` with one `rename` and `fsync` the parents. `target` must
/// not exist or be an empty directory (the rename replaces it); anything else is refused
/// and nothing is published.
pub fn publish_dir(dir: &Path, files: &[(&str, &[u8])], target: &Path) -> Result<()> {
    publish_dir_replacing(dir, files, target, None)
}

/// [`publish_dir`], and when `replace` names a marker file (DCP's `.metadata`), a
/// non-empty directory `target` that holds a regular file of that name (a previous
/// checkpoint) is replaced atomically: the new directory is complete and durable first,
/// then one `renameat2(RENAME_EXCHANGE)` swaps the two (at every instant `target` is
/// either the old checkpoint or the new one), the parents are synced, and the old tree
/// (now at `dir`) is removed. A crash before the exchange leaves the old checkpoint in
/// place (the new one waits at `dir`, cleaned up as a leftover); after it, the new one.
/// A directory without the marker, a link or any other file at `target` is refused as by
/// [`publish_dir`]; a filesystem without `RENAME_EXCHANGE` is an error (never a
/// remove-then-rename that could leave neither).
pub fn publish_dir_replacing(
    dir: &Path,
    files: &[(&str, &[u8])],
    target: &Path,
    replace: Option<&str>,
) -> Result<()> {
    check_plain_names(files)?;
    if let Some(marker) = replace {
        check_plain_names(&[(marker, &[][..])])?;
    }
    for (name, bytes) in files {
        write_file(dir, name, bytes)?;
    }
    fsync_dir(dir)?;
    let parent = match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(|e| Error::io("mkdir", &parent, e))?;
    let mut exchange = false;
    match std::fs::symlink_metadata(target) {
        Ok(m) if m.file_type().is_dir() => {
            let empty = std::fs::read_dir(target)
                .map_err(|e| Error::io("read_dir", target, e))?
                .next()
                .is_none();
            if !empty {
                let replaceable = replace.is_some_and(|marker| {
                    std::fs::symlink_metadata(target.join(marker))
                        .is_ok_and(|m| m.file_type().is_file())
                });
                if !replaceable {
                    return Err(Error::io(
                        "publish",
                        target,
                        std::io::Error::from(std::io::ErrorKind::DirectoryNotEmpty),
                    ));
                }
                exchange = true;
            }
        }
        Ok(_) => {
            return Err(Error::UnsafePath {
                path: target.to_owned(),
                reason: "exists and is not a directory; a checkpoint is never published over it"
                    .into(),
            });
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io("stat", target, e)),
    }
    if exchange {
        rustix::fs::renameat_with(
            rustix::fs::CWD,
            dir,
            rustix::fs::CWD,
            target,
            rustix::fs::RenameFlags::EXCHANGE,
        )
        .map_err(|e| Error::io("rename(RENAME_EXCHANGE)", dir, e.into()))?;
    } else {
        // rename(2) replaces an empty directory and fails with ENOTEMPTY on any other: a
        // checkpoint that appeared meanwhile is never overwritten.
        std::fs::rename(dir, target).map_err(|e| Error::io("rename", dir, e))?;
    }
    fsync_dir(&parent)?;
    if let Some(from) = dir.parent()
        && from != parent
        && !from.as_os_str().is_empty()
    {
        fsync_dir(from)?;
    }
    if exchange {
        // The old checkpoint, now at `dir` (ours: the caller's assembly directory). The new
        // one is published and durable; a failure here leaves a leftover, not an error.
        if let Err(e) = std::fs::remove_dir_all(dir) {
            tracing::warn!(dir = %dir.display(), error = %e, "could not remove the replaced checkpoint");
        }
    }
    Ok(())
}

/// Whether `name` is a rank file's name (`rank-RRRRR-of-WWWWW.safetensors`).
fn is_rank_file_name(name: &str) -> bool {
    let Some(rest) = name
        .strip_prefix("rank-")
        .and_then(|r| r.strip_suffix(".safetensors"))
    else {
        return false;
    };
    let mut parts = rest.split("-of-");
    matches!(
        (parts.next(), parts.next(), parts.next()),
        (Some(r), Some(w), None)
            if r.len() == 5 && w.len() == 5
                && r.bytes().chain(w.bytes()).all(|b| b.is_ascii_digit())
    )
}

/// Publish the assembled directory `dir` into `target`, an existing directory that already
/// holds other files of the checkpoint (Megatron's: `common.pt`, later `metadata.json`):
/// `files` (`(name, bytes)`, plain names: DCP's `.metadata`) are written into `dir`
/// durably, then every rank file and `manifest.json` of `dir` is renamed into `target`,
/// then `files` in their order (DCP readers look for `.metadata`: it comes last); rank
/// files of an earlier attempt in `target` that this one does not have are removed;
/// `target` is `fsync`ed and the emptied `dir` removed. `target` must be a directory (no
/// link followed); anything else in `dir` is refused before anything moves.
pub fn publish_into(dir: &Path, files: &[(&str, &[u8])], target: &Path) -> Result<()> {
    check_plain_names(files)?;
    match std::fs::symlink_metadata(target) {
        Ok(m) if m.file_type().is_dir() => {}
        Ok(_) => {
            return Err(Error::UnsafePath {
                path: target.to_owned(),
                reason: "is not a directory (or is a link); nothing is published into it".into(),
            });
        }
        Err(e) => return Err(Error::io("stat", target, e)),
    }
    let mut first = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io("read_dir", dir, e))? {
        let entry = entry.map_err(|e| Error::io("read_dir", dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let ft = entry
            .file_type()
            .map_err(|e| Error::io("stat", entry.path(), e))?;
        if !ft.is_file() || !(is_rank_file_name(&name) || name == MANIFEST) {
            return Err(Error::UnsafePath {
                path: entry.path(),
                reason: "not a rank file or manifest of the assembled checkpoint".into(),
            });
        }
        first.push(name);
    }
    first.sort();
    // The manifest after the rank files it describes.
    first.sort_by_key(|n| n == MANIFEST);
    for (name, bytes) in files {
        write_file(dir, name, bytes)?;
    }
    fsync_dir(dir)?;
    let names: Vec<&str> = first
        .iter()
        .map(String::as_str)
        .chain(files.iter().map(|(n, _)| *n))
        .collect();
    for name in &names {
        let (from, to) = (dir.join(name), target.join(name));
        std::fs::rename(&from, &to).map_err(|e| Error::io("rename", &from, e))?;
    }
    for entry in std::fs::read_dir(target).map_err(|e| Error::io("read_dir", target, e))? {
        let entry = entry.map_err(|e| Error::io("read_dir", target, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let is_file = entry.file_type().is_ok_and(|t| t.is_file());
        if is_file && is_rank_file_name(&name) && !names.contains(&name.as_str()) {
            std::fs::remove_file(entry.path()).map_err(|e| Error::io("unlink", entry.path(), e))?;
        }
    }
    fsync_dir(target)?;
    std::fs::remove_dir(dir).map_err(|e| Error::io("rmdir", dir, e))?;
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        fsync_dir(parent)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::partial_dir_name;

    #[test]
    fn publish_replacing_swaps_a_checkpoint_and_refuses_anything_else() {
        let t = tempfile::tempdir().unwrap();
        let target = t.path().join("ck");
        let make = |name: &str, byte: u8| {
            let d = t.path().join(name);
            std::fs::create_dir(&d).unwrap();
            std::fs::write(d.join("data"), [byte; 4]).unwrap();
            d
        };
        let first = make("a", 1);
        publish_dir_replacing(&first, &[(".metadata", b"m1")], &target, Some(".metadata")).unwrap();
        let second = make("b", 2);
        publish_dir_replacing(&second, &[(".metadata", b"m2")], &target, Some(".metadata"))
            .unwrap();
        assert_eq!(std::fs::read(target.join("data")).unwrap(), [2; 4]);
        assert_eq!(std::fs::read(target.join(".metadata")).unwrap(), b"m2");
        assert!(!second.exists(), "the replaced checkpoint is removed");
        // Without `replace`, or without the marker, a non-empty directory is refused and
        // kept as it was.
        let third = make("c", 3);
        let e = publish_dir(&third, &[], &target).unwrap_err();
        assert!(e.to_string().contains("not empty"), "{e}");
        let other = t.path().join("other");
        std::fs::create_dir(&other).unwrap();
        std::fs::write(other.join("x"), b"1").unwrap();
        let e = publish_dir_replacing(&third, &[], &other, Some(".metadata")).unwrap_err();
        assert!(e.to_string().contains("not empty"), "{e}");
        assert_eq!(std::fs::read(other.join("x")).unwrap(), b"1");
        // A marker that is a link does not make a directory replaceable.
        std::os::unix::fs::symlink(target.join(".metadata"), other.join(".metadata")).unwrap();
        assert!(publish_dir_replacing(&third, &[], &other, Some(".metadata")).is_err());
        assert_eq!(std::fs::read(target.join("data")).unwrap(), [2; 4]);
        assert!(third.join("data").exists());
    }

    /// Two ranks' parts in roots of their own: assembled, published under a trainer's
    /// name, readable by name; a `step-N` name gives the manifest step N.
    #[test]
    fn parts_of_two_roots_are_assembled_and_published() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path();
        let mut sources = Vec::new();
        for rank in 0..2u32 {
            let src = base.join(format!("root{rank}")).join(partial_dir_name(9));
            std::fs::create_dir_all(&src).unwrap();
            let file = rank_file_name(rank, 2);
            std::fs::write(src.join(&file), vec![rank as u8; 8]).unwrap();
            let part = FileEntry {
                rank,
                file,
                bytes: 8,
                data_start: 8,
                header_crc32c: None,
                object: None,
                session: None,
                tensors: Vec::new(),
            };
            std::fs::write(
                src.join(rank_manifest_name(rank)),
                serde_json::to_vec(&part).unwrap(),
            )
            .unwrap();
            sources.push(src);
        }
        for (name, want_step) in [("step-100", 100), ("checkpoint-500", 9)] {
            let out = base.join("spool-step-9");
            let target = base.join("ckpt").join(name);
            let m = assemble_ranks(&sources, &out, 9, Some(&target), &Metadata::new()).unwrap();
            assert_eq!((m.step, m.world_size, m.total_bytes), (want_step, 2, 16));
            publish_dir(&out, &[(".metadata", b"md")], &target).unwrap();
            assert!(!out.exists());
            assert_eq!(std::fs::read(target.join(".metadata")).unwrap(), b"md");
            assert_eq!(Manifest::read(&target).unwrap(), m);
            assert_eq!(
                std::fs::read(target.join(rank_file_name(1, 2))).unwrap(),
                vec![1u8; 8]
            );
            // The same parts again (for the second name): put the files back.
            for (rank, src) in (0..2u32).zip(&sources) {
                let f = rank_file_name(rank, 2);
                std::fs::copy(target.join(&f), src.join(&f)).unwrap();
            }
        }
        // A non-empty target is refused, and nothing is published there.
        let out = base.join("spool-step-9");
        let taken = base.join("ckpt").join("step-100");
        assemble_ranks(&sources, &out, 9, Some(&taken), &Metadata::new()).unwrap();
        let e = publish_dir(&out, &[], &taken).unwrap_err();
        assert!(e.to_string().contains("step-100"), "{e}");
        assert!(out.join(MANIFEST).is_file());
    }

    /// Published into an existing directory (Megatron's, with `common.pt`): rank files and
    /// manifest, then `.metadata`; a stale rank file of an earlier attempt goes, other
    /// files stay; anything unexpected in the assembled directory moves nothing.
    #[test]
    fn publish_into_an_existing_directory() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("spool-step-3");
        let target = dir.path().join("iter_0000003");
        std::fs::create_dir(&out).unwrap();
        std::fs::create_dir(&target).unwrap();
        std::fs::write(out.join(rank_file_name(0, 1)), b"r0").unwrap();
        std::fs::write(out.join(MANIFEST), b"{}").unwrap();
        std::fs::write(target.join("common.pt"), b"c").unwrap();
        std::fs::write(target.join(rank_file_name(0, 2)), b"old").unwrap();
        publish_into(&out, &[(".metadata", b"md")], &target).unwrap();
        assert!(!out.exists());
        let mut names: Vec<String> = std::fs::read_dir(&target)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                ".metadata",
                "common.pt",
                "manifest.json",
                "rank-00000-of-00001.safetensors"
            ]
        );
        assert_eq!(std::fs::read(target.join(".metadata")).unwrap(), b"md");
        assert_eq!(
            std::fs::read(target.join(rank_file_name(0, 1))).unwrap(),
            b"r0"
        );
        // Something else in the assembled directory: refused, nothing moved.
        std::fs::create_dir(&out).unwrap();
        std::fs::write(out.join(rank_file_name(0, 1)), b"r1").unwrap();
        std::fs::write(out.join("stray"), b"x").unwrap();
        let e = publish_into(&out, &[], &target).unwrap_err();
        assert!(e.to_string().contains("stray"), "{e}");
        assert_eq!(
            std::fs::read(target.join(rank_file_name(0, 1))).unwrap(),
            b"r0"
        );
        assert!(!is_rank_file_name("rank-0-of-1.safetensors"));
        assert!(is_rank_file_name("rank-00001-of-00002.safetensors"));
    }

    /// A part that names another rank or file, a file of another size or a link fails
    /// before anything moves.
    #[test]
    fn a_lying_part_moves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("p");
        std::fs::create_dir(&src).unwrap();
        std::fs::write(src.join(rank_file_name(0, 2)), [0u8; 4]).unwrap();
        let mut part = FileEntry {
            rank: 1,
            file: rank_file_name(0, 2),
            bytes: 4,
            data_start: 4,
            header_crc32c: None,
            object: None,
            session: None,
            tensors: Vec::new(),
        };
        let out = dir.path().join("out");
        for lie in 0..2 {
            std::fs::write(
                src.join(rank_manifest_name(0)),
                serde_json::to_vec(&part).unwrap(),
            )
            .unwrap();
            let e = assemble_ranks(&[src.clone(), src.clone()], &out, 1, None, &Metadata::new())
                .unwrap_err();
            assert!(matches!(e, Error::Corrupt { .. }), "{lie}: {e}");
            assert!(src.join(rank_file_name(0, 2)).is_file() && !out.exists());
            part.rank = 0;
            part.bytes = 5;
        }
        // A link where the rank file belongs is never moved into a checkpoint.
        let file = src.join(rank_file_name(0, 2));
        std::fs::rename(&file, dir.path().join("real")).unwrap();
        std::os::unix::fs::symlink(dir.path().join("real"), &file).unwrap();
        part.bytes = 4;
        std::fs::write(
            src.join(rank_manifest_name(0)),
            serde_json::to_vec(&part).unwrap(),
        )
        .unwrap();
        let e = assemble_ranks(&[src.clone(), src.clone()], &out, 1, None, &Metadata::new())
            .unwrap_err();
        assert!(matches!(e, Error::Corrupt { .. }), "{e}");
        assert!(file.is_symlink() && !out.exists());
    }
}
