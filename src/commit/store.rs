//! The commit protocol's store: what a checkpoint root offers so that its committed steps
//! are listed, retired and collected by one rule, whether it is a local directory
//! ([`LocalDir`]) or a bucket prefix (`crate::remote::Remote`, with the `s3` feature).
//!
//! A store lists by the one listing rule ([`manifest::list_steps`], through its
//! [`StepListing`] half), takes a committed step out of the listing atomically
//! ([`CommitStore::unpublish`]: a directory renamed to its trash name, a bucket's manifest
//! deleted), deletes what is left of it, and sweeps what interrupted saves left.
//! Retention ([`retire`], [`retain`]) and `gc` ([`gc`]) are written once, over the trait.

use std::path::PathBuf;

use crate::error::{Error, Result};
use crate::fsops;
use crate::io::file::fsync_dir;
use crate::manifest::{self, StepListing, step_dir_name, trash_dir_name};

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
pub fn retire<S: CommitStore + ?Sized>(store: &S, keep: usize) -> Result<Vec<u64>> {
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
pub fn delete_retired<S: CommitStore + ?Sized>(store: &S, steps: &[u64]) -> Result<()> {
    for &step in steps {
        store.delete_unpublished(step)?;
    }
    Ok(())
}

/// Keep the newest `keep` committed steps; delete the rest (oldest first): [`retire`],
/// then [`delete_retired`]. Returns the deleted steps.
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::{MANIFEST, partial_dir_name};

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
}
