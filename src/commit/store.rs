//! The commit protocol's store: what a checkpoint root offers so that its committed steps
//! are listed, retired and collected by one rule, whether it is a local directory
//! ([`LocalDir`]) or a bucket prefix (`crate::remote::Remote`, with the `s3` feature).
//!
//! A store lists by the one listing rule ([`manifest::list_steps`], through its
//! [`StepListing`] half), takes a committed step out of the listing atomically
//! ([`CommitStore::unpublish`]: a directory renamed to its trash name, a bucket's manifest
//! deleted), deletes what is left of it, and sweeps what interrupted saves left.
//! Retention (`retire`, [`retain`]) and `gc` ([`gc`]) are written once, over the trait.
//!
//! A commit is one protocol too (`commit_parts`): every rank's part present, one
//! manifest built from them ([`Manifest::from_parts`]), published if absent. Where the
//! parts meet is its barrier ([`PartBarrier`]): a shared root's partial directory
//! (`SharedRoot`), a node-local root's whose peers' parts came through the process
//! group (`super::commit_with_parts`), part-only saves' roots (`super::assemble_ranks`) or
//! a bucket prefix (`crate::remote`).

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::fsops;
use crate::io::file::{fsync_dir, write_durable};
use crate::manifest::{
    self, FileEntry, MANIFEST, Manifest, Metadata, StepListing, rank_manifest_name, step_dir_name,
    trash_dir_name,
};

pub use crate::manifest::LocalDir;

/// A checkpoint root the commit protocol runs over.
pub trait CommitStore: StepListing {
    /// How [`CommitStore::sweep`] sweeps (which leftovers may go).
    type Sweep;
    /// What [`CommitStore::sweep`] removed and left.
    type Swept;

    /// Take committed `step` out of the listing, atomically: from then on
    /// [`manifest::list_steps`] does not list it and it cannot be loaded, while its data
    /// may remain until [`CommitStore::delete_unpublished`]. `Ok(false)` when it was not
    /// taken out: it went meanwhile (another rank retired it), or it cannot be now (kept
    /// for a later retention).
    fn unpublish(&self, step: u64) -> Result<bool>;

    /// Make the [`CommitStore::unpublish`] calls so far durable (a directory's root is
    /// `fsync`ed; a bucket's delete is durable when it returns).
    fn sync_listing(&self) -> Result<()>;

    /// Delete what is left of `step`, which [`CommitStore::unpublish`] took out.
    fn delete_unpublished(&self, step: u64) -> Result<()>;

    /// Remove what interrupted or failed saves left (never a committed step's data that
    /// its manifest names, never what cannot be proven a leftover), as `how` allows.
    fn sweep(&self, how: &Self::Sweep) -> Result<Self::Swept>;
}

/// Retention's quick half: take the committed steps beyond the newest `keep` (at least 1)
/// out of the listing, oldest first, and make that durable. Never the newest committed
/// step. Returns the steps taken out, whose data [`delete_retired`] deletes.
pub(crate) fn retire<S: CommitStore + ?Sized>(store: &S, keep: usize) -> Result<Vec<u64>> {
    let keep = keep.max(1);
    let committed = manifest::list_steps(store)?.committed;
    if committed.len() <= keep {
        return Ok(Vec::new());
    }
    let mut retired = Vec::new();
    for &step in &committed[..committed.len() - keep] {
        if store.unpublish(step)? {
            retired.push(step);
        }
    }
    store.sync_listing()?;
    Ok(retired)
}

/// Delete the data of steps [`retire`] took out.
pub(crate) fn delete_retired<S: CommitStore + ?Sized>(store: &S, steps: &[u64]) -> Result<()> {
    for &step in steps {
        store.delete_unpublished(step)?;
    }
    Ok(())
}

/// Keep the newest `keep` committed steps; delete the rest (oldest first): `retire`,
/// then `delete_retired`. Returns the deleted steps.
pub fn retain<S: CommitStore + ?Sized>(store: &S, keep: usize) -> Result<Vec<u64>> {
    let retired = retire(store, keep)?;
    delete_retired(store, &retired)?;
    Ok(retired)
}

/// `gc`: sweep the leftovers of interrupted saves ([`CommitStore::sweep`]), then keep the
/// newest `keep` committed steps ([`retain`]). Returns what the sweep reported and the
/// deleted steps.
pub fn gc<S: CommitStore + ?Sized>(
    store: &S,
    how: &S::Sweep,
    keep: usize,
) -> Result<(S::Swept, Vec<u64>)> {
    let swept = store.sweep(how)?;
    let removed = retain(store, keep)?;
    Ok((swept, removed))
}

/// Where the parts of one step's commit meet, and its manifest is published: the
/// barrier that makes the one commit protocol (`commit_parts`) a shared root's
/// (`SharedRoot`), a node-local group's (`super::commit_with_parts`), part-only saves'
/// (`super::assemble_ranks`) or a bucket's (`crate::remote`).
pub trait PartBarrier {
    /// What a committed step is to the caller (a directory, a bucket's manifest).
    type Committed;

    /// Where the manifest of `step` is published, for errors.
    fn manifest_location(&self, step: u64) -> PathBuf;

    /// Make the committing rank's part (`mine`) present where the other ranks find it.
    /// `Some` when the step is committed already (by another rank, with `mine`).
    fn put_part(
        &self,
        step: u64,
        world_size: u32,
        mine: Option<&FileEntry>,
    ) -> Result<Option<Self::Committed>>;

    /// Rank `rank`'s part of `step`, checked as the barrier can (it names the rank and its
    /// file, its data is there); `None` while it is missing (another rank will commit).
    fn get_part(
        &self,
        step: u64,
        world_size: u32,
        rank: u32,
        mine: Option<&FileEntry>,
    ) -> Result<Option<FileEntry>>;

    /// Publish `manifest` unless a manifest of its step is there already (a conditional
    /// create: a rename of the partial directory, `If-None-Match: *`); when one is, the
    /// committed step as the winner published it.
    fn publish_if_absent(
        &self,
        manifest: Manifest,
        mine: Option<&FileEntry>,
    ) -> Result<Self::Committed>;
}

/// Who commits a step (`commit_parts`): the session its parts must carry.
#[derive(Debug, Clone, Copy)]
pub enum Committer<'a> {
    /// A rank, whose part is this entry: every part must carry its session
    /// ([`FileEntry::session`]; none: parts without one).
    Rank(&'a FileEntry),
    /// A bystander (`shmckpt push`, the assembly of part-only saves): every part must
    /// carry this session, or with `None`, one session they share.
    Bystander(Option<&'a str>),
}

impl<'a> Committer<'a> {
    /// The committing rank's entry, if a rank commits.
    pub fn mine(self) -> Option<&'a FileEntry> {
        match self {
            Committer::Rank(e) => Some(e),
            Committer::Bystander(_) => None,
        }
    }

    /// The session every part must carry: `None` when the parts decide (a bystander
    /// without one: the first rank's).
    fn session(self) -> Option<Option<&'a str>> {
        match self {
            Committer::Rank(e) => Some(e.session.as_deref()),
            Committer::Bystander(s) => s.map(Some),
        }
    }
}

/// The one commit protocol: this rank's part present ([`PartBarrier::put_part`]), every
/// rank's part read ([`PartBarrier::get_part`]; one missing: `Ok(None)`, another rank
/// commits), the manifest built by the one builder ([`Manifest::from_parts`]) and
/// published if absent ([`PartBarrier::publish_if_absent`]).
///
/// A part counts only when it carries the committer's session ([`FileEntry::session`],
/// [`Committer`]): a part of another session is a dead run's (a rank's save of a step
/// number its run never committed, still kept for a recovery) and counts as missing, so a
/// step is never committed with files of two runs; the rank whose part it is replaces it
/// when it saves the step ([`super::prepare_partial`]) and commits then.
pub(crate) fn commit_parts<B: PartBarrier + ?Sized>(
    barrier: &B,
    step: u64,
    world_size: u32,
    metadata: &Metadata,
    by: Committer<'_>,
) -> Result<Option<B::Committed>> {
    let mine = by.mine();
    if let Some(done) = barrier.put_part(step, world_size, mine)? {
        return Ok(Some(done));
    }
    let mut files = Vec::with_capacity(world_size as usize);
    for rank in 0..world_size {
        match barrier.get_part(step, world_size, rank, mine)? {
            Some(f) => files.push(f),
            None => return Ok(None),
        }
    }
    let want = by
        .session()
        .unwrap_or_else(|| files.first().and_then(|f| f.session.as_deref()));
    if let Some(f) = files.iter().find(|f| f.session.as_deref() != want) {
        tracing::info!(
            step,
            rank = f.rank,
            part = ?f.session,
            commit = ?want,
            "a manifest part of another session (a dead run's) does not count toward this commit"
        );
        return Ok(None);
    }
    let at = barrier.manifest_location(step);
    let manifest = Manifest::from_parts(step, world_size, files, metadata, &at)?;
    barrier.publish_if_absent(manifest, mine).map(Some)
}

/// A shared root's partial directory `partial` of a step (`root/step-N.partial`) as the
/// barrier: with several ranks each writes its part there (`rank-K.manifest.json`), the
/// rank that finds every part merges them into `manifest.json` and renames the directory
/// to `step-N` (two ranks racing both succeed: the rename is atomic and the loser sees
/// the committed directory).
pub(crate) struct SharedRoot<'a> {
    /// The root.
    pub root: &'a Path,
    /// The step's partial directory.
    pub partial: &'a Path,
    /// The partial directory's exclusive lock, taken once this rank's part is written and
    /// held from reading the parts to the rename: a rank replacing its dead incarnation's
    /// part (`super::prepare_partial`) never removes a part, or the file it names, that
    /// this merge is using. `None` (with several ranks) when the directory went meanwhile.
    merging: std::cell::RefCell<Option<super::RootDirLock>>,
}

impl<'a> SharedRoot<'a> {
    /// The barrier of `root`'s partial directory `partial`.
    pub fn new(root: &'a Path, partial: &'a Path) -> Self {
        Self {
            root,
            partial,
            merging: std::cell::RefCell::new(None),
        }
    }

    fn mine(mine: Option<&FileEntry>) -> Result<&FileEntry> {
        mine.ok_or_else(|| Error::Internal("a shared root's commit is by a rank".into()))
    }
}

impl PartBarrier for SharedRoot<'_> {
    /// The committed directory.
    type Committed = PathBuf;

    fn manifest_location(&self, _step: u64) -> PathBuf {
        self.partial.join(MANIFEST)
    }

    /// With one rank, nothing (its entry is the manifest's only file); with several,
    /// [`super::write_part`].
    fn put_part(
        &self,
        step: u64,
        world_size: u32,
        mine: Option<&FileEntry>,
    ) -> Result<Option<PathBuf>> {
        let mine = Self::mine(mine)?;
        if world_size == 1 {
            return Ok(None);
        }
        if let Some(committed) = super::write_part(self.root, step, self.partial, mine)? {
            return Ok(Some(committed));
        }
        // Another rank may have merged and renamed the directory meanwhile: committed with
        // this rank's entry, once the rename is durable.
        let final_dir = self.root.join(step_dir_name(step));
        let merging = super::lock_root_dir(self.partial, true);
        if super::committed_naming(&final_dir, mine) {
            fsync_dir(self.root)?;
            return Ok(Some(final_dir));
        }
        match merging {
            Ok(lock) => *self.merging.borrow_mut() = Some(lock),
            // Gone without this rank's entry committed: `get_part` reports parts missing.
            Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        Ok(None)
    }

    /// Read without following a link or blocking on a FIFO, size-capped.
    fn get_part(
        &self,
        _step: u64,
        world_size: u32,
        rank: u32,
        mine: Option<&FileEntry>,
    ) -> Result<Option<FileEntry>> {
        if world_size == 1 {
            return Self::mine(mine).cloned().map(Some);
        }
        if mine.is_some() && self.merging.borrow().is_none() {
            return Ok(None); // the partial directory went: another rank will commit
        }
        let p = self.partial.join(rank_manifest_name(rank));
        match manifest::read_manifest_bytes(&p) {
            Ok(b) => serde_json::from_slice(&b)
                .map(Some)
                .map_err(|e| Error::corrupt(&p, None, format!("manifest part is not valid: {e}"))),
            Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                Ok(None) // another rank will finish the commit
            }
            Err(e) => Err(e),
        }
    }

    /// `manifest.json` written durably into the partial directory (temporary name,
    /// `fsync`, `rename`, directory `fsync`), the directory renamed to `step-N`, the root
    /// `fsync`ed.
    fn publish_if_absent(&self, manifest: Manifest, mine: Option<&FileEntry>) -> Result<PathBuf> {
        let (root, partial) = (self.root, self.partial);
        let own_rank = Self::mine(mine)?.rank;
        let world_size = manifest.world_size;
        let final_dir = root.join(step_dir_name(manifest.step));
        let bytes = serde_json::to_vec_pretty(&manifest).expect("manifest serializes");
        let tmp_name = format!("{MANIFEST}.tmp-{}-{own_rank}", std::process::id());
        let tmp = partial.join(&tmp_name);
        let merged = (|| {
            // Never while another engine's `clean_stale` decides what is stale: it could
            // be removing this partial directory (through its descriptor, whatever its
            // name) as this rename publishes it.
            let _publishing = super::lock_root_dir(root, false)?;
            let _ = fsops::remove_file(&tmp);
            write_durable(&tmp, &bytes).inspect_err(|_| {
                // A half-written manifest (e.g. ENOSPC) must not keep the partial directory alive.
                let _ = fsops::remove_file(&tmp);
            })?;
            let target = partial.join(MANIFEST);
            fsops::rename(&tmp, &target).map_err(|e| Error::io("rename", &tmp, e))?;
            fsync_dir(partial)?;
            fsops::rename(partial, &final_dir).map_err(|e| Error::io("rename", partial, e))
        })();
        if let Err(e) = merged {
            // With several ranks, every rank that sees all parts merges them, and all but
            // one lose the race to rename the directory: any step above can then fail
            // because the partial directory is gone. That is success if the step is
            // committed.
            if world_size > 1 && final_dir.join(MANIFEST).is_file() {
                // A manifest written by this rank may have been carried into the committed
                // directory by the winner's rename.
                let _ = fsops::remove_file(&final_dir.join(&tmp_name));
                // The winner's rename is durable only once the root is synced, which the
                // winner may not have done yet: never report a commit a power loss can undo.
                fsync_dir(root)?;
                return Ok(final_dir);
            }
            return Err(e);
        }
        fsync_dir(root)?;
        Ok(final_dir)
    }
}

impl CommitStore for LocalDir {
    /// The engine's rank (`u32::MAX`: none, as `shmckpt gc`) and who sweeps
    /// ([`super::clean_stale_with`]).
    type Sweep = (u32, super::Sweep);
    /// The partial and trash directories removed.
    type Swept = Vec<PathBuf>;

    /// `step-N` renamed to `step-N.trash`. A trash name already taken (a leftover of an
    /// interrupted retention, or a planted name) keeps the checkpoint this time: moving
    /// it onto that name could fail half-way.
    fn unpublish(&self, step: u64) -> Result<bool> {
        let dir = self.root().join(step_dir_name(step));
        let trash = self.root().join(trash_dir_name(step));
        if std::fs::symlink_metadata(&trash).is_ok() {
            tracing::warn!(dir = %trash.display(), "trash name is taken; keeping this checkpoint for now");
            return Ok(false);
        }
        match fsops::rename(&dir, &trash) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false), // another rank did it
            Err(e) => Err(Error::io("rename", &dir, e)),
        }
    }

    fn sync_listing(&self) -> Result<()> {
        fsync_dir(self.root())
    }

    fn delete_unpublished(&self, step: u64) -> Result<()> {
        let trash = self.root().join(trash_dir_name(step));
        fsops::remove_dir_all(&trash).map_err(|e| Error::io("remove", &trash, e))
    }

    fn sweep(&self, how: &Self::Sweep) -> Result<Self::Swept> {
        super::clean_stale_with(self.root(), how.0, how.1)
    }
}

/// Commit this rank's file (already durable) for `step`. Returns the committed directory
/// when this call (or another rank) completed the commit, `None` when other ranks are
/// still missing. The one commit protocol (`commit_parts`) with the root's
/// partial directory as its barrier (`SharedRoot`).
pub fn commit(
    root: &Path,
    step: u64,
    world_size: u32,
    partial: &Path,
    entry: FileEntry,
    metadata: &Metadata,
) -> Result<Option<PathBuf>> {
    commit_parts(
        &SharedRoot::new(root, partial),
        step,
        world_size,
        metadata,
        Committer::Rank(&entry),
    )
}

/// Keep the newest `keep` committed checkpoints; delete the rest (oldest first). Never
/// deletes the newest one. Returns the deleted steps. The one retention
/// ([`retain`]) over the root's directory.
pub fn apply_retention(root: &Path, keep: usize) -> Result<Vec<u64>> {
    retain(&LocalDir::new(root), keep)
}

/// Retention's quick half: move the committed checkpoints beyond the newest `keep` to
/// trash names (a metadata operation, made durable), so that they are no longer listed
/// or loadable. Their files are deleted by [`Retired::remove`](super::Retired::remove); a crash in between leaves
/// trash directories, which the next engine of the root removes at open.
pub fn retire_old(root: &Path, keep: usize) -> Result<super::Retired> {
    let steps = retire(&LocalDir::new(root), keep)?;
    let trash = steps
        .iter()
        .map(|&s| root.join(trash_dir_name(s)))
        .collect();
    Ok(super::Retired { steps, trash })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::partial_dir_name;

    /// A step directory holding a manifest of `step` (the listing reads the step only).
    fn committed(root: &std::path::Path, name: &str, step: u64) {
        let d = root.join(name);
        std::fs::create_dir(&d).unwrap();
        std::fs::write(d.join(MANIFEST), format!(r#"{{"step": {step}}}"#)).unwrap();
    }

    /// Retention and gc over a directory: the listing's rule decides what is committed,
    /// the newest `keep` stay, a taken trash name keeps its step, foreign and uncommitted
    /// names are never touched; the sweep removes a partial directory without parts.
    #[test]
    fn retention_and_gc_over_a_directory() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        for s in [1, 2, 3, 5] {
            committed(root, &step_dir_name(s), s);
        }
        committed(root, "step-04", 4); // not canonical
        committed(root, "step-6", 7); // a manifest of another step
        std::fs::create_dir(root.join(trash_dir_name(2))).unwrap(); // taken
        std::fs::create_dir(root.join(partial_dir_name(9))).unwrap();
        let store = LocalDir::new(root);
        let listing = manifest::list_steps(&store).unwrap();
        assert_eq!(listing.committed, vec![1, 2, 3, 5]);
        assert_eq!(
            listing.ignored.into_iter().collect::<Vec<_>>(),
            vec![(6, "its manifest is of step 7".to_owned())]
        );
        assert_eq!(retire(&store, 2).unwrap(), vec![1]);
        assert!(!root.join("step-1").exists() && root.join("step-1.trash").is_dir());
        delete_retired(&store, &[1]).unwrap();
        assert!(!root.join("step-1.trash").exists());
        // gc: the sweep removes the trash and the partial directory, then retention.
        let (swept, removed) = gc(&store, &(u32::MAX, super::super::Sweep::Gc), 1).unwrap();
        let mut swept: Vec<String> = swept
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        swept.sort();
        assert_eq!(swept, ["step-2.trash", "step-9.partial"]);
        assert_eq!(removed, vec![2, 3]);
        assert_eq!(manifest::list_steps(&store).unwrap().committed, vec![5]);
        assert!(root.join("step-04").is_dir() && root.join("step-6").is_dir());
    }

    /// A barrier in memory: the parts present, what `put_part` finds committed, and the
    /// manifests published (what a conditional publish would see).
    #[derive(Default)]
    struct Memory {
        parts: Vec<Option<FileEntry>>,
        committed: Option<u64>,
        published: std::cell::RefCell<Vec<Manifest>>,
    }

    impl PartBarrier for Memory {
        type Committed = u64;
        fn manifest_location(&self, step: u64) -> PathBuf {
            PathBuf::from(format!("mem/{}/{MANIFEST}", step_dir_name(step)))
        }
        fn put_part(&self, _: u64, _: u32, _: Option<&FileEntry>) -> Result<Option<u64>> {
            Ok(self.committed)
        }
        fn get_part(
            &self,
            _: u64,
            _: u32,
            r: u32,
            _: Option<&FileEntry>,
        ) -> Result<Option<FileEntry>> {
            Ok(self.parts[r as usize].clone())
        }
        fn publish_if_absent(&self, m: Manifest, _: Option<&FileEntry>) -> Result<u64> {
            let step = m.step;
            self.published.borrow_mut().push(m);
            Ok(step)
        }
    }

    fn part(rank: u32, file_of: u32) -> FileEntry {
        FileEntry {
            rank,
            file: manifest::rank_file_name(file_of, 2),
            bytes: 10,
            data_start: 10,
            header_crc32c: None,
            object: None,
            session: None,
            tensors: Vec::new(),
        }
    }

    /// The protocol over any barrier: committed already is that commit, unread parts are
    /// not read; a missing part publishes nothing (`None`); a part the builder refuses (two
    /// ranks naming one file) is `Corrupt` and publishes nothing; every part present
    /// publishes exactly the manifest the builder made of them.
    #[test]
    fn commit_parts_publishes_only_what_the_builder_accepts() {
        let md = Metadata::new();
        let done = Memory {
            committed: Some(4),
            ..Memory::default()
        };
        assert_eq!(
            commit_parts(&done, 4, 2, &md, Committer::Bystander(None)).unwrap(),
            Some(4)
        );
        assert!(done.published.borrow().is_empty());

        let missing = Memory {
            parts: vec![Some(part(0, 0)), None],
            ..Memory::default()
        };
        assert_eq!(
            commit_parts(&missing, 4, 2, &md, Committer::Bystander(None)).unwrap(),
            None
        );
        assert!(missing.published.borrow().is_empty());

        let lying = Memory {
            parts: vec![Some(part(0, 0)), Some(part(1, 0))],
            ..Memory::default()
        };
        let e = commit_parts(&lying, 4, 2, &md, Committer::Bystander(None)).unwrap_err();
        assert!(matches!(e, Error::Corrupt { .. }), "{e}");
        assert!(lying.published.borrow().is_empty());

        let every = Memory {
            parts: vec![Some(part(0, 0)), Some(part(1, 1))],
            ..Memory::default()
        };
        assert_eq!(
            commit_parts(&every, 4, 2, &md, Committer::Bystander(None)).unwrap(),
            Some(4)
        );
        let published = every.published.borrow();
        assert_eq!(published.len(), 1);
        let m = &published[0];
        assert_eq!((m.step, m.world_size, m.total_bytes), (4, 2, 20));
        assert_eq!(m.files, vec![part(0, 0), part(1, 1)]);
    }

    /// A part of another session counts as missing, whoever commits: a rank (its own
    /// entry's session, none included), a bystander with a session, a bystander without
    /// one (the parts must share theirs). Parts of the committer's session publish.
    #[test]
    fn a_part_of_another_session_counts_as_missing() {
        let md = Metadata::new();
        let of = |rank: u32, session: Option<&str>| FileEntry {
            session: session.map(str::to_owned),
            ..part(rank, rank)
        };
        let parts = |a: Option<&str>, b: Option<&str>| Memory {
            parts: vec![Some(of(0, a)), Some(of(1, b))],
            ..Memory::default()
        };
        let new = of(0, Some("new"));
        let none = of(0, None);
        for (barrier, by) in [
            (parts(Some("new"), Some("dead")), Committer::Rank(&new)),
            (parts(Some("new"), None), Committer::Rank(&new)),
            (parts(None, Some("dead")), Committer::Rank(&none)),
            (
                parts(Some("new"), Some("dead")),
                Committer::Bystander(Some("new")),
            ),
            (
                parts(Some("new"), Some("new")),
                Committer::Bystander(Some("dead")),
            ),
            (parts(Some("new"), Some("dead")), Committer::Bystander(None)),
            (parts(None, Some("dead")), Committer::Bystander(None)),
        ] {
            assert_eq!(
                commit_parts(&barrier, 4, 2, &md, by).unwrap(),
                None,
                "{by:?}"
            );
            assert!(barrier.published.borrow().is_empty(), "{by:?}");
        }
        for (barrier, by) in [
            (parts(Some("new"), Some("new")), Committer::Rank(&new)),
            (parts(None, None), Committer::Rank(&none)),
            (
                parts(Some("new"), Some("new")),
                Committer::Bystander(Some("new")),
            ),
            (parts(Some("new"), Some("new")), Committer::Bystander(None)),
            (parts(None, None), Committer::Bystander(None)),
        ] {
            assert_eq!(
                commit_parts(&barrier, 4, 2, &md, by).unwrap(),
                Some(4),
                "{by:?}"
            );
            let published = barrier.published.borrow();
            assert_eq!(
                published[0].files,
                barrier.parts.iter().flatten().cloned().collect::<Vec<_>>()
            );
        }
    }
}
