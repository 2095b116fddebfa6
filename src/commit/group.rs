//! Commit through a process group, for node-local roots (each machine its own root, no
//! shared filesystem; `docs/replicas.md`): every rank's file and manifest part are
//! durable in its machine's partial directory ([`super::commit`] found the other
//! machines' parts missing); the caller moves every rank's part ([`own_part`]) through
//! the group, and one rank of each machine then writes the parts of the other machines'
//! ranks into its partial directory and commits it ([`commit_with_parts`]): the one commit
//! protocol ([`store::commit_parts`]) with the group as its barrier, the same merge,
//! manifest and renames as a shared root. A machine that lost its root gets the committed
//! manifest from a peer ([`adopt_manifest`]).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::store::{self, Committer, PartBarrier, SharedRoot};
use crate::error::{Error, Result};
use crate::fsops;
use crate::io::file::{fsync_dir, write_durable};
use crate::manifest::{
    self, FileEntry, MANIFEST, Manifest, Metadata, aside_dir_name, partial_dir_name,
    rank_manifest_name, step_dir_name,
};

/// This rank's manifest part of `step` under `root` (JSON): the part its save wrote in the
/// partial directory, or its entry of the committed manifest when the step is committed.
pub fn own_part(root: &Path, step: u64, rank: u32) -> Result<Vec<u8>> {
    let part = root
        .join(partial_dir_name(step))
        .join(rank_manifest_name(rank));
    match manifest::read_manifest_bytes(&part) {
        Ok(b) => return Ok(b),
        Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let m = Manifest::read(&root.join(step_dir_name(step)))?;
    let entry = m.files.iter().find(|f| f.rank == rank).ok_or_else(|| {
        Error::corrupt(
            &part,
            None,
            format!("step {step} has no file of rank {rank}"),
        )
    })?;
    Ok(serde_json::to_vec(entry).expect("manifest entries serialize"))
}

/// The steps under `root` not committed whose partial directory holds `rank`'s durable
/// part, valid and of that rank, and the file it names: a regular file of this user (no
/// link followed) of exactly the part's size. A save recovered from this rank's arena after its trainer
/// died, awaiting the other ranks' parts (a load may complete the step's commit from
/// their replicas). Anything else in the root is passed over; ascending.
pub fn pending_steps(root: &Path, rank: u32) -> Result<Vec<u64>> {
    let committed: std::collections::BTreeSet<u64> = manifest::list_committed(root)?
        .iter()
        .map(|c| c.step)
        .collect();
    let mut out = Vec::new();
    for step in manifest::list_partial(root)? {
        if committed.contains(&step) {
            continue;
        }
        let partial = root.join(partial_dir_name(step));
        let part = partial.join(rank_manifest_name(rank));
        let entry = manifest::read_manifest_bytes(&part).and_then(|b| {
            serde_json::from_slice::<FileEntry>(&b)
                .map_err(|e| Error::corrupt(&part, None, format!("not a manifest part: {e}")))
        });
        let Ok(entry) = entry else { continue };
        if entry.rank != rank || entry.validate(&part).is_err() {
            continue;
        }
        let me = rustix::process::geteuid().as_raw();
        let file = std::fs::symlink_metadata(partial.join(&entry.file));
        if file.is_ok_and(|m| m.file_type().is_file() && m.uid() == me && m.len() == entry.bytes) {
            out.push(step);
        }
    }
    Ok(out)
}

/// Parse every rank's part (`parts[r]`: rank r's), refusing one that is not valid or not
/// that rank's.
fn parse_parts(root: &Path, step: u64, parts: &[&[u8]]) -> Result<Vec<FileEntry>> {
    let at = root.join(partial_dir_name(step));
    parts
        .iter()
        .enumerate()
        .map(|(r, b)| {
            let e: FileEntry = serde_json::from_slice(b).map_err(|e| {
                Error::corrupt(
                    &at,
                    None,
                    format!("rank {r}'s manifest part is not valid: {e}"),
                )
            })?;
            if usize::try_from(e.rank).ok() != Some(r) {
                return Err(Error::corrupt(
                    &at,
                    None,
                    format!("part {r} is rank {}'s, not rank {r}'s", e.rank),
                ));
            }
            Ok(e)
        })
        .collect()
}

/// Whether `step` is committed under `root` with exactly `entries`.
fn committed_with(root: &Path, step: u64, entries: &[FileEntry]) -> bool {
    Manifest::read(&root.join(step_dir_name(step))).is_ok_and(|m| m.files == entries)
}

/// Commit `step` in this machine's `root` from every rank's part (`parts[r]`: rank r's, as
/// [`own_part`] returned it on its machine): the one commit protocol
/// (`store::commit_parts`) with the process group as its barrier (`GroupParts`): the
/// parts this root lacks are written (durably, under a temporary name, renamed), then
/// merged with `rank`'s own (which its save wrote here) and `step-N` published as on a
/// shared root. Returns the committed directory; a step already committed here with
/// exactly these parts is success.
pub fn commit_with_parts(
    root: &Path,
    step: u64,
    rank: u32,
    parts: &[&[u8]],
    metadata: &Metadata,
) -> Result<PathBuf> {
    let world_size = u32::try_from(parts.len())
        .map_err(|_| Error::Internal(format!("{} manifest parts", parts.len())))?;
    let entries = parse_parts(root, step, parts)?;
    let own = entries
        .get(rank as usize)
        .cloned()
        .ok_or_else(|| Error::Internal(format!("rank {rank} of {world_size}")))?;
    let partial = root.join(partial_dir_name(step));
    let barrier = GroupParts {
        shared: SharedRoot::new(root, &partial),
        entries: &entries,
        parts,
    };
    match store::commit_parts(&barrier, step, world_size, metadata, Committer::Rank(&own)) {
        Ok(Some(d)) => Ok(d),
        Ok(None) => Err(Error::Internal(format!(
            "step {step}: a manifest part is missing in {}, or of another session, after every part was written",
            partial.display()
        ))),
        // Another rank of this machine committed it meanwhile.
        Err(_) if committed_with(root, step, &entries) => {
            fsync_dir(root)?;
            Ok(root.join(step_dir_name(step)))
        }
        Err(e) => Err(e),
    }
}

/// A node-local root's partial directory as the barrier of the one commit protocol, the
/// parts having met through the process group (`parts[r]`, parsed: `entries[r]`): the
/// other machines' parts are written into the partial directory beside this machine's,
/// which are read back and published there as on a shared root ([`SharedRoot`]).
struct GroupParts<'a> {
    shared: SharedRoot<'a>,
    entries: &'a [FileEntry],
    parts: &'a [&'a [u8]],
}

impl PartBarrier for GroupParts<'_> {
    /// The committed directory.
    type Committed = PathBuf;

    fn manifest_location(&self, step: u64) -> PathBuf {
        self.shared.manifest_location(step)
    }

    /// Committed here with exactly these parts already: that directory (the root
    /// `fsync`ed). Else every part but `mine` written durably (a temporary name,
    /// `fsync`, `rename`), the partial directory `fsync`ed, then `mine` as a shared root
    /// writes it.
    fn put_part(
        &self,
        step: u64,
        world_size: u32,
        mine: Option<&FileEntry>,
    ) -> Result<Option<PathBuf>> {
        let (root, partial) = (self.shared.root, self.shared.partial);
        if committed_with(root, step, self.entries) {
            fsync_dir(root)?;
            return Ok(Some(root.join(step_dir_name(step))));
        }
        let own_rank = mine.map(|m| m.rank);
        for (e, bytes) in self.entries.iter().zip(self.parts) {
            if Some(e.rank) == own_rank {
                continue;
            }
            let part = partial.join(rank_manifest_name(e.rank));
            let tmp = partial.join(format!(
                "{}.tmp-{}-peer",
                rank_manifest_name(e.rank),
                std::process::id()
            ));
            write_durable(&tmp, bytes).inspect_err(|_| {
                let _ = fsops::remove_file(&tmp);
            })?;
            fsops::rename(&tmp, &part).map_err(|err| Error::io("rename", &tmp, err))?;
        }
        fsync_dir(partial)?;
        self.shared.put_part(step, world_size, mine)
    }

    fn get_part(
        &self,
        step: u64,
        world_size: u32,
        rank: u32,
        mine: Option<&FileEntry>,
    ) -> Result<Option<FileEntry>> {
        self.shared.get_part(step, world_size, rank, mine)
    }

    fn publish_if_absent(&self, manifest: Manifest, mine: Option<&FileEntry>) -> Result<PathBuf> {
        self.shared.publish_if_absent(manifest, mine)
    }
}

/// Publish a peer's committed manifest of `step` (`bytes`) in this machine's `root`, which
/// holds no checkpoint of that step (the machine was replaced): `step-N/` with the manifest
/// alone (the rank's file comes from its partner's replica). A step already committed here
/// with the same manifest is success; any other is refused, as is a manifest of another
/// step. Returns the step directory.
pub fn adopt_manifest(root: &Path, step: u64, bytes: &[u8]) -> Result<PathBuf> {
    let final_dir = root.join(step_dir_name(step));
    // The checks every manifest read makes (size, fields, names).
    let m = Manifest::parse(bytes, &final_dir.join(MANIFEST))?;
    if m.step != step {
        return Err(Error::corrupt(
            &final_dir,
            None,
            format!(
                "the peer's manifest is step {}'s, not step {step}'s",
                m.step
            ),
        ));
    }
    if let Ok(here) = Manifest::read(&final_dir) {
        if here == m {
            return Ok(final_dir);
        }
        return Err(Error::StepExists {
            step,
            root: root.to_owned(),
        });
    }
    let partial = root.join(partial_dir_name(step));
    {
        // Never while another engine's `clean_stale` is deciding what is stale.
        let _creating = super::lock_root_dir(root, false)?;
        // A partial save of this step here (this machine was not replaced) is left alone.
        fsops::create_dir(&partial).map_err(|e| Error::io("mkdir", &partial, e))?;
    }
    super::publish_dir(&partial, &[(MANIFEST, bytes)], &final_dir).inspect_err(|_| {
        let _ = fsops::remove_file(&partial.join(MANIFEST));
        let _ = fsops::remove_dir(&partial);
    })?;
    Ok(final_dir)
}

/// Set the committed checkpoint `step` of `root` aside: its directory is renamed to
/// `step-<N>.aside-<unix ms>` and the root `fsync`ed. From then on the step is not listed
/// or loaded and its number can be saved again, but nothing is deleted (no engine cleans
/// that name: inspect it, or remove it by hand). For a step some rank can no longer load
/// at all (a load with replicas passed over it: a machine was lost before the step's
/// replicas were stored), whose number the resumed run will save again. `Ok(None)` when
/// `step` is not committed in `root` (a link or a file under its name is never touched);
/// [`Error::UnsafePath`] when the new name is taken.
pub fn set_aside(root: &Path, step: u64) -> Result<Option<PathBuf>> {
    let Some(c) = manifest::list_committed(root)?
        .into_iter()
        .find(|c| c.step == step)
    else {
        return Ok(None);
    };
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let aside = root.join(aside_dir_name(step, ms));
    if std::fs::symlink_metadata(&aside).is_ok() {
        return Err(Error::UnsafePath {
            path: aside,
            reason: "the name to set the step aside under is taken; nothing was moved".into(),
        });
    }
    match fsops::rename(&c.dir, &aside) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io("rename", &c.dir, e)),
    }
    fsync_dir(root)?;
    tracing::warn!(step, dir = %aside.display(), "committed step set aside: some rank cannot load it");
    Ok(Some(aside))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::rank_file_name;

    fn entry(rank: u32) -> FileEntry {
        FileEntry {
            rank,
            file: rank_file_name(rank, 4),
            bytes: 10,
            data_start: 10,
            header_crc32c: None,
            object: None,
            session: None,
            tensors: Vec::new(),
        }
    }

    /// A machine of ranks 0-1 (of 4) whose saves are durable: their files and parts.
    fn machine0(root: &Path, step: u64) -> Vec<Vec<u8>> {
        let mut parts = Vec::new();
        for r in 0..4 {
            let e = entry(r);
            if r < 2 {
                let partial = super::super::prepare_partial(root, step, r, &e.file, 4).unwrap();
                std::fs::write(partial.join(&e.file), b"0123456789").unwrap();
                let done =
                    super::super::commit(root, step, 4, &partial, e.clone(), &Metadata::new());
                assert_eq!(done.unwrap(), None); // ranks 2-3's parts are on the other machine
            }
            parts.push(serde_json::to_vec(&e).unwrap());
        }
        parts
    }

    /// `pending_steps` lists exactly the uncommitted steps whose partial directory holds
    /// this rank's part and its file of the part's size: not a committed step, a file of
    /// another size, a link in the file's place, another rank's part under this rank's
    /// name, a part that is not JSON, nor a foreign name.
    #[test]
    fn pending_steps_are_the_partials_holding_this_ranks_part_and_file() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        machine0(root, 3); // ranks 0-1 durable, the step not committed
        machine0(root, 5);
        for r in 0..4 {
            let e = entry(r);
            let partial = root.join(partial_dir_name(5));
            if r >= 2 {
                std::fs::write(partial.join(&e.file), b"0123456789").unwrap();
                let done = super::super::commit(root, 5, 4, &partial, e, &Metadata::new());
                assert_eq!(done.unwrap().is_some(), r == 3); // the last part commits it
            }
        }
        let e = entry(0);
        // Step 6: rank 0's file one byte short. Step 7: a link in its place.
        for (step, how) in [(6, "short"), (7, "link"), (8, "other"), (9, "junk")] {
            let partial = root.join(partial_dir_name(step));
            std::fs::create_dir(&partial).unwrap();
            let part = partial.join(rank_manifest_name(0));
            match how {
                "short" => {
                    std::fs::write(partial.join(&e.file), b"012345678").unwrap();
                    std::fs::write(&part, serde_json::to_vec(&e).unwrap()).unwrap();
                }
                "link" => {
                    std::fs::write(root.join("elsewhere"), b"0123456789").unwrap();
                    std::os::unix::fs::symlink(root.join("elsewhere"), partial.join(&e.file))
                        .unwrap();
                    std::fs::write(&part, serde_json::to_vec(&e).unwrap()).unwrap();
                }
                "other" => {
                    let o = entry(1);
                    std::fs::write(partial.join(&o.file), b"0123456789").unwrap();
                    std::fs::write(&part, serde_json::to_vec(&o).unwrap()).unwrap();
                }
                _ => {
                    std::fs::write(partial.join(&e.file), b"0123456789").unwrap();
                    std::fs::write(&part, b"{not json").unwrap();
                }
            }
        }
        std::fs::create_dir(root.join("step-x.partial")).unwrap();
        assert!(root.join(step_dir_name(5)).exists());
        assert_eq!(pending_steps(root, 0).unwrap(), vec![3]);
        assert_eq!(pending_steps(root, 1).unwrap(), vec![3]);
        assert_eq!(pending_steps(root, 2).unwrap(), Vec::<u64>::new());
    }

    #[test]
    fn a_machine_commits_with_every_part_and_adopts_a_peer_manifest() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let parts = machine0(root, 7);
        assert_eq!(own_part(root, 7, 1).unwrap(), parts[1]);
        let borrowed: Vec<&[u8]> = parts.iter().map(|p| &p[..]).collect();
        let meta: Metadata = [("k".to_owned(), "v".to_owned())].into();
        let d = commit_with_parts(root, 7, 0, &borrowed, &meta).unwrap();
        assert_eq!(d, root.join("step-7"));
        let m = Manifest::read(&d).unwrap();
        assert_eq!(m.files, (0..4).map(entry).collect::<Vec<_>>());
        assert_eq!(m.metadata, meta);
        assert!(!root.join(partial_dir_name(7)).exists());
        // Again (another rank of the machine): success, nothing changes.
        assert_eq!(commit_with_parts(root, 7, 1, &borrowed, &meta).unwrap(), d);
        // Committed: its part comes from the manifest.
        assert_eq!(own_part(root, 7, 1).unwrap(), parts[1]);

        // A replaced machine adopts it: step-7/ holding the manifest alone.
        let other = tempfile::tempdir().unwrap();
        let bytes = std::fs::read(d.join(MANIFEST)).unwrap();
        let a = adopt_manifest(other.path(), 7, &bytes).unwrap();
        assert_eq!(Manifest::read(&a).unwrap(), m);
        let names: Vec<_> = std::fs::read_dir(&a)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from(MANIFEST)]);
        assert_eq!(adopt_manifest(other.path(), 7, &bytes).unwrap(), a); // same: success
        // Another step's manifest, or damaged bytes, are refused; nothing is published.
        let empty = tempfile::tempdir().unwrap();
        assert!(matches!(
            adopt_manifest(empty.path(), 8, &bytes),
            Err(Error::Corrupt { .. })
        ));
        assert!(adopt_manifest(empty.path(), 7, &bytes[..bytes.len() - 2]).is_err());
        assert_eq!(std::fs::read_dir(empty.path()).unwrap().count(), 0);
    }

    /// A committed step set aside is no longer listed, keeps its files under its new name
    /// (never cleaned at open), and its number can be committed again; a link under a
    /// step's name, and a step not committed, are left alone.
    #[test]
    fn a_step_set_aside_keeps_its_files_and_frees_its_number() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let parts = machine0(root, 7);
        let borrowed: Vec<&[u8]> = parts.iter().map(|p| &p[..]).collect();
        let d = commit_with_parts(root, 7, 0, &borrowed, &Metadata::new()).unwrap();
        let before = std::fs::read(d.join(MANIFEST)).unwrap();
        let aside = set_aside(root, 7).unwrap().unwrap();
        let name = aside.file_name().unwrap().to_str().unwrap().to_owned();
        assert!(name.starts_with("step-7.aside-"), "{name}");
        assert_eq!(std::fs::read(aside.join(MANIFEST)).unwrap(), before);
        assert_eq!(
            std::fs::read(aside.join(entry(0).file)).unwrap(),
            b"0123456789"
        );
        assert!(manifest::list_committed(root).unwrap().is_empty());
        assert_eq!(set_aside(root, 7).unwrap(), None); // not committed any more
        super::super::clean_stale(root, 0).unwrap();
        assert!(aside.is_dir(), "never cleaned");
        // The number is free: step 7 commits again.
        let parts = machine0(root, 7);
        let borrowed: Vec<&[u8]> = parts.iter().map(|p| &p[..]).collect();
        commit_with_parts(root, 7, 0, &borrowed, &Metadata::new()).unwrap();
        assert_eq!(manifest::list_committed(root).unwrap().len(), 1);
        // A link under a step's name is not a committed step: untouched.
        let other = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(root.join("step-7"), other.path().join("step-7")).unwrap();
        assert_eq!(set_aside(other.path(), 7).unwrap(), None);
        assert!(other.path().join("step-7").is_symlink());
    }

    #[test]
    fn parts_that_are_not_every_ranks_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let mut parts = machine0(root, 3);
        parts.swap(2, 3);
        let borrowed: Vec<&[u8]> = parts.iter().map(|p| &p[..]).collect();
        let e = commit_with_parts(root, 3, 0, &borrowed, &Metadata::new()).unwrap_err();
        assert!(e.to_string().contains("part 2 is rank 3's"), "{e}");
        parts[2] = b"{not json".to_vec();
        let borrowed: Vec<&[u8]> = parts.iter().map(|p| &p[..]).collect();
        let e = commit_with_parts(root, 3, 0, &borrowed, &Metadata::new()).unwrap_err();
        assert!(matches!(e, Error::Corrupt { .. }), "{e}");
        assert!(!root.join("step-3").exists());
    }
}
