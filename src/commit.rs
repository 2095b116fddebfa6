//! Making checkpoints visible, atomically, and removing old ones safely.
//!
//! Protocol for one rank (world size 1):
//! 1. write `step-N.partial/<rank file>` (O_DIRECT), `ftruncate` + `fdatasync` it;
//! 2. write `step-N.partial/manifest.json`, `fsync` it, `fsync` the partial directory;
//! 3. `rename(step-N.partial, step-N)`, `fsync` the root.
//!
//! Only `step-N` directories holding a manifest are ever listed or loaded, so a crash at any
//! point leaves either the previous set of checkpoints or the previous set plus step N.
//!
//! With several ranks, each writes its file and a manifest part
//! (`rank-K.manifest.json`); the rank that finds every part present merges them into
//! `manifest.json` and renames the directory (two ranks racing both succeed: the rename is
//! atomic and the loser sees the committed directory).
//!
//! When each rank's engine writes in a root of its own (the DCP backend), each rank's
//! save writes its part only (`write_part`, `SaveOptions::part_only`), and one caller
//! that has every rank's durable part ([`find_parts`]) assembles them instead
//! ([`assemble_ranks`]) and publishes the directory under its user's name
//! ([`publish_dir`]).
//!
//! Node-local roots (a root per machine, peer replicas): the ranks move their parts through
//! their process group and one rank of each machine commits its root with every part
//! ([`commit_with_parts`]); a replaced machine adopts a peer's manifest ([`adopt_manifest`]).
//!
//! Retention renames `step-M` to `step-M.trash` (atomic: the checkpoint disappears from
//! listings at once), fsyncs the root, then deletes the trash.

mod assemble;
mod group;
pub mod store;
pub use assemble::{assemble_ranks, find_parts, publish_dir, publish_dir_replacing, publish_into};
pub use group::{adopt_manifest, commit_with_parts, own_part, pending_steps, set_aside};
pub use store::{CommitStore, LocalDir, apply_retention, commit, retire_old};

use std::fs::File;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::io::file::{fsync_dir, write_durable};
use crate::manifest::{
    self, FileEntry, MANIFEST, Manifest, partial_dir_name, rank_manifest_name, step_dir_name,
    trash_dir_name,
};
use crate::{fsops, fsx};

/// Lock file name for a rank.
pub(crate) fn lock_name(rank: u32) -> String {
    format!(".shmckpt-rank-{rank}.lock")
}

/// An exclusive `flock` on `root/.shmckpt-rank-K.lock`, held for an engine's lifetime: two
/// engines of the same rank cannot share a root, and cleanup knows who is alive.
#[derive(Debug)]
pub(crate) struct RootLock {
    _file: File,
}

/// Create `root` and its missing parents (`mkdir -p`, mode 0o777 less the umask) unless it
/// is a directory already. Ranks racing to create it all succeed. The root is the caller's
/// setting, not untrusted input: links in the components that exist are followed, as the
/// root itself is everywhere else.
pub fn create_root(root: &Path) -> Result<()> {
    if root.is_dir() {
        return Ok(());
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .create(root)
        .map_err(|source| Error::RootCreateFailed {
            path: root.to_owned(),
            source,
        })
}

/// Check that `root` exists, is a directory, and is writable.
///
/// The probe file is created with `O_CREAT | O_EXCL | O_NOFOLLOW` relative to the root, so
/// a link or file planted under the probe's name is never followed, truncated or removed
/// (another name is tried instead).
pub(crate) fn check_root(root: &Path) -> Result<()> {
    if !root.is_dir() {
        return Err(Error::RootMissing {
            path: root.to_owned(),
        });
    }
    let dir = fsx::open_dir(root)?;
    let mut last = None;
    for attempt in 0..16u32 {
        let name = format!(
            ".shmckpt-probe-{}-{}-{attempt}",
            std::process::id(),
            crate::util::unix_ms()
        );
        match fsx::open_file(dir.as_fd(), root, &name, true, fsx::Create::New, None) {
            Ok(f) => {
                drop(f);
                fsx::unlink_in(dir.as_fd(), root, &name)?;
                return Ok(());
            }
            Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::AlreadyExists => {
                last = Some(source);
            }
            Err(Error::Io { source, .. }) => {
                return Err(Error::RootNotWritable {
                    path: root.to_owned(),
                    source,
                });
            }
            Err(e) => return Err(e),
        }
    }
    Err(Error::RootNotWritable {
        path: root.to_owned(),
        source: last.unwrap_or_else(|| std::io::Error::other("no free probe name")),
    })
}

/// How long [`lock_root`] retries a lock held by someone else before it reports
/// [`Error::RootLocked`]: probes ([`probe_rank_lock`], [`other_engine_alive`]) hold a shared
/// lock for microseconds, an engine for its whole life.
const LOCK_PATIENCE: std::time::Duration = std::time::Duration::from_millis(200);

/// Take rank `rank`'s lock on `root`.
///
/// The lock file is opened relative to the root without following a link and without
/// blocking, and must be a regular file: a planted `.shmckpt-rank-K.lock -> elsewhere`
/// is refused ([`Error::UnsafePath`]), never created or locked through. A lock held by
/// another is retried for 200 ms (`LOCK_PATIENCE`; a probe's shared lock is let go
/// within it).
pub(crate) fn lock_root(root: &Path, rank: u32) -> Result<RootLock> {
    let name = lock_name(rank);
    let path = root.join(&name);
    let dir = fsx::open_dir(root)?;
    let file = fsx::open_file(dir.as_fd(), root, &name, true, fsx::Create::IfMissing, None)?;
    let start = std::time::Instant::now();
    loop {
        match rustix::fs::flock(
            file.as_fd(),
            rustix::fs::FlockOperation::NonBlockingLockExclusive,
        ) {
            Ok(()) => return Ok(RootLock { _file: file }),
            Err(e) if e == rustix::io::Errno::WOULDBLOCK => {
                if start.elapsed() >= LOCK_PATIENCE {
                    return Err(Error::RootLocked {
                        path: root.to_owned(),
                        rank,
                    });
                }
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            Err(e) => return Err(Error::io("flock", &path, e.into())),
        }
    }
}

/// What [`probe_rank_lock`] found.
#[derive(Debug)]
pub(crate) enum LockProbe {
    /// An engine of this root and rank is open: it holds the lock.
    Held,
    /// No engine holds it. The shared lock taken to tell is held until this is dropped: an
    /// engine of this root and rank cannot open meanwhile ([`lock_root`] waits, and fails
    /// with [`Error::RootLocked`] after [`LOCK_PATIENCE`]), so what the caller does now
    /// cannot race one. Hold it only for a moment.
    Free(#[allow(dead_code)] File),
    /// The root or its lock file does not exist: no engine of this rank holds the root.
    Missing,
    /// The root or the lock file cannot be opened or probed: why.
    Unknown(String),
}

/// Whether an engine holds rank `rank`'s lock on `root`, probed without blocking, without
/// creating anything and without following a link to the lock file (`root` is followed as
/// given).
pub(crate) fn probe_rank_lock(root: &Path, rank: u32) -> LockProbe {
    let missing = |e: &Error| matches!(e, Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound);
    let dir = match fsx::open_dir(root) {
        Ok(d) => d,
        Err(e) if missing(&e) => return LockProbe::Missing,
        Err(e) => return LockProbe::Unknown(e.to_string()),
    };
    let name = lock_name(rank);
    let file = match fsx::open_file(dir.as_fd(), root, &name, false, fsx::Create::No, None) {
        Ok(f) => f,
        Err(e) if missing(&e) => return LockProbe::Missing,
        Err(e) => return LockProbe::Unknown(e.to_string()),
    };
    match rustix::fs::flock(
        file.as_fd(),
        rustix::fs::FlockOperation::NonBlockingLockShared,
    ) {
        Ok(()) => LockProbe::Free(file),
        Err(e) if e == rustix::io::Errno::WOULDBLOCK => LockProbe::Held,
        Err(e) => LockProbe::Unknown(Error::io("flock", root.join(&name), e.into()).to_string()),
    }
}

/// Whether an engine of a rank other than `own_rank` holds a lock on `root`.
fn other_engine_alive(root: &Path, own_rank: u32) -> bool {
    let own = lock_name(own_rank);
    let Ok(dir) = fsx::open_dir(root) else {
        return false;
    };
    let Ok(rd) = std::fs::read_dir(root) else {
        return false;
    };
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with(".shmckpt-rank-") || !name.ends_with(".lock") || name == own {
            continue;
        }
        let Ok(f) = fsx::open_file(dir.as_fd(), root, name, false, fsx::Create::No, None) else {
            continue;
        };
        match rustix::fs::flock(f.as_fd(), rustix::fs::FlockOperation::NonBlockingLockShared) {
            Ok(()) => {
                let _ = rustix::fs::flock(f.as_fd(), rustix::fs::FlockOperation::Unlock);
            }
            Err(_) => return true,
        }
    }
    false
}

/// A `flock` on the root directory itself. Cleaning stale partial directories holds it
/// exclusively and creating a partial directory holds it shared, so the decision "no other
/// engine is alive, clean" and the removal are atomic against another rank creating its
/// partial directory meanwhile: a rank whose engine opens while another rank's engine is
/// cleaning cannot lose the directory of its first save.
struct RootDirLock {
    _dir: std::os::fd::OwnedFd,
}

/// Whether the committed directory `final_dir` holds a manifest naming `entry` (a rank's
/// part committed by whichever rank merged the parts).
fn committed_naming(final_dir: &Path, entry: &FileEntry) -> bool {
    Manifest::read(final_dir).is_ok_and(|m| m.files.iter().any(|f| f == entry))
}

fn lock_root_dir(root: &Path, exclusive: bool) -> Result<RootDirLock> {
    let dir = fsx::open_dir(root)?;
    let op = if exclusive {
        rustix::fs::FlockOperation::LockExclusive
    } else {
        rustix::fs::FlockOperation::LockShared
    };
    rustix::fs::flock(dir.as_fd(), op).map_err(|e| Error::io("flock", root, e.into()))?;
    Ok(RootDirLock { _dir: dir })
}

/// Who asks [`clean_stale_with`] to clean, which decides what a partial directory holding
/// durable work may lose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sweep {
    /// An engine opening the root: the partial-part rule (docs/guarantees.md). A partial
    /// directory holding a durable part (`manifest.json` or a rank's
    /// `rank-K.manifest.json`: written only after its rank file was made durable) is
    /// another rank's work in progress or a crashed save awaiting its other ranks; it is
    /// removed only when provably stale: its step or a newer one is committed in the root.
    Open,
    /// An explicit `shmckpt gc`: partial directories holding durable parts are removed
    /// too.
    Gc,
}

/// Why [`clean_stale_with`] keeps a partial directory, if it does.
fn keep_partial(
    dir: &Path,
    step: u64,
    newest_committed: Option<u64>,
    staged: &std::collections::BTreeSet<u64>,
    sweep: Sweep,
) -> Option<&'static str> {
    if newest_committed.is_some_and(|c| c >= step) {
        return None; // provably stale: the step or a newer one is committed
    }
    if staged.contains(&step) {
        // A staging arena of this root still holds the save: its partial file holds the
        // chunks already written, which recovery needs.
        return Some("a staging arena of this root holds the save (`shmckpt recover`)");
    }
    if sweep == Sweep::Gc {
        return None;
    }
    let durable = std::fs::read_dir(dir).ok().is_some_and(|rd| {
        rd.flatten().any(|e| {
            let name = e.file_name();
            let Some(name) = name.to_str() else {
                return false;
            };
            let part = name == MANIFEST
                || name
                    .strip_prefix("rank-")
                    .and_then(|r| r.strip_suffix(".manifest.json"))
                    .is_some_and(|r| !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit()));
            part && e.file_type().is_ok_and(|t| t.is_file())
        })
    });
    durable.then_some("it holds a durable part awaiting its other ranks (`shmckpt gc` removes it)")
}

/// Remove leftovers of interrupted saves (`*.partial`) and retention (`*.trash`), unless
/// another engine is working on this root, by the partial-part rule ([`Sweep::Open`]).
/// Returns what was removed.
pub fn clean_stale(root: &Path, own_rank: u32) -> Result<Vec<PathBuf>> {
    clean_stale_with(root, own_rank, Sweep::Open)
}

/// [`clean_stale`] for `sweep`. Whatever the sweep, a partial directory whose save a
/// staging arena of this root still holds (recoverable: `shmckpt recover`) is kept unless
/// its step or a newer one is committed.
pub fn clean_stale_with(root: &Path, own_rank: u32, sweep: Sweep) -> Result<Vec<PathBuf>> {
    let (_cleaning, doomed) = stale_dirs(root, own_rank, sweep)?;
    let mut removed = Vec::new();
    for dir in doomed {
        if remove_stale_dir(&dir)? {
            removed.push(dir);
        }
    }
    if !removed.is_empty() {
        fsync_dir(root)?;
    }
    drop(_cleaning);
    // What an earlier sweep moved out of the way and did not finish removing.
    for dir in moved_aside(root) {
        remove_moved(&dir);
    }
    Ok(removed)
}

/// Remove the stale directory `dir`; `false` when it is gone already (an engine that
/// started after the sweep's check aborted its save, its publishing rename waiting for the
/// sweep's lock, or another rank removed it).
fn remove_stale_dir(dir: &Path) -> Result<bool> {
    match fsops::remove_dir_all(dir) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(err) => Err(Error::io("remove", dir, err)),
    }
}

/// [`clean_stale`] for an opening engine, its removals behind it: every stale directory is
/// renamed out of the step namespace (a hidden `.shmckpt-removing.*` name, never listed,
/// loaded or committed; the renames made durable) under the sweep's lock, and a thread
/// removes the hidden directories (those an earlier sweep left too) after the open has
/// returned (removing a 4 GiB rank file took 2.3 s of an H200 host's open). A crash
/// before the removal ends leaves hidden directories the next sweep removes. Returns the
/// removing thread (`None`: nothing to remove, or removed inline when no thread could be
/// started).
pub(crate) fn clean_stale_behind(
    root: &Path,
    own_rank: u32,
) -> Result<Option<std::thread::JoinHandle<()>>> {
    let (cleaning, doomed) = stale_dirs(root, own_rank, Sweep::Open)?;
    let mut cleaned = false;
    for dir in doomed {
        let Some(name) = dir.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let aside = root.join(manifest::removing_dir_name(name));
        cleaned |= match fsops::rename(&dir, &aside) {
            Ok(()) => true,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
            // The hidden name is taken (an earlier process's, same pid and time): removed
            // here instead.
            Err(_) => remove_stale_dir(&dir)?,
        };
    }
    if cleaned {
        fsync_dir(root)?;
    }
    drop(cleaning);
    // The directories just moved and those an earlier sweep left.
    let moved = moved_aside(root);
    if moved.is_empty() {
        return Ok(None);
    }
    let work = moved.clone();
    match std::thread::Builder::new()
        .name("shmckpt-clean".into())
        .spawn(move || work.iter().for_each(|d| remove_moved(d)))
    {
        Ok(h) => Ok(Some(h)),
        Err(_) => {
            moved.iter().for_each(|d| remove_moved(d));
            Ok(None)
        }
    }
}

/// Remove a directory a sweep moved out of the way; another rank's sweep may be removing
/// it too (what it took first is not found here).
fn remove_moved(dir: &Path) {
    match fsops::remove_dir_all(dir) {
        Ok(()) => tracing::debug!(dir = %dir.display(), "removed a stale directory"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "could not remove a stale directory (the next open tries again)");
        }
    }
}

/// The hidden directories of `root` a sweep moved out of the way
/// ([`manifest::is_removing_dir_name`]): real directories only (a link under such a name
/// is never followed or removed).
fn moved_aside(root: &Path) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    rd.flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(manifest::is_removing_dir_name)
        })
        .map(|e| e.path())
        .collect()
}

/// The directories [`clean_stale_with`] removes for `sweep`: the trash of interrupted
/// retentions and the stale partial directories, decided under the root's sweep lock,
/// returned held: they must leave their names before it is released (a rank creating its
/// partial directory meanwhile would lose it); nothing while another engine is active on
/// the root.
fn stale_dirs(root: &Path, own_rank: u32, sweep: Sweep) -> Result<(RootDirLock, Vec<PathBuf>)> {
    let cleaning = lock_root_dir(root, true)?;
    if other_engine_alive(root, own_rank) {
        tracing::info!(root = %root.display(), "another engine is active; not cleaning partial checkpoints");
        return Ok((cleaning, Vec::new()));
    }
    let mut doomed = Vec::new();
    for step in manifest::list_trash(root)? {
        let dir = root.join(manifest::trash_dir_name(step));
        tracing::warn!(dir = %dir.display(), "removing the leftover of an interrupted retention");
        doomed.push(dir);
    }
    let partials: Vec<(u64, PathBuf)> = manifest::list_partial(root)?
        .into_iter()
        .map(|step| (step, root.join(partial_dir_name(step))))
        .collect();
    if !partials.is_empty() {
        let newest = manifest::list_committed(root)
            .ok()
            .and_then(|c| c.last().map(|c| c.step));
        let staged = crate::staging::attach::staged_steps(root);
        for (step, dir) in partials {
            if let Some(why) = keep_partial(&dir, step, newest, &staged, sweep) {
                tracing::info!(dir = %dir.display(), reason = why, "keeping the partial directory of an uncommitted save");
                continue;
            }
            tracing::warn!(dir = %dir.display(), "removing stale directory of an interrupted save");
            doomed.push(dir);
        }
    }
    Ok((cleaning, doomed))
}

/// Prepare `root/step-N.partial/` for `rank`'s file `file_name`. Fails if step N is
/// committed. Returns the partial directory.
///
/// With several ranks, the directory may hold this rank's file and durable part of step N
/// from a dead incarnation (the partial-part rule keeps them for the other ranks). Both are
/// removed, the part first and durably, under the directory's lock: another rank merging
/// the parts ([`commit`], which holds that lock from reading the parts to the rename) must
/// never find one naming a file this save is about to replace, or it commits a step whose
/// file for this rank is missing (this save fails) or torn (this save is being written).
/// A merge that took the old part first has committed the step: [`Error::StepExists`].
pub fn prepare_partial(
    root: &Path,
    step: u64,
    rank: u32,
    file_name: &str,
    world_size: u32,
) -> Result<PathBuf> {
    // Never while another engine's `clean_stale` is deciding what is stale.
    let _creating = lock_root_dir(root, false)?;
    let final_dir = root.join(step_dir_name(step));
    let exists = || Error::StepExists {
        step,
        root: root.to_owned(),
    };
    if final_dir.exists() {
        return Err(exists());
    }
    let partial = root.join(partial_dir_name(step));
    match fsops::create_dir(&partial) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            if world_size == 1 {
                // We hold the only rank lock: this is a leftover of an interrupted save.
                tracing::warn!(dir = %partial.display(), "replacing stale partial directory");
                fsops::remove_dir_all(&partial).map_err(|e| Error::io("remove", &partial, e))?;
                fsops::create_dir(&partial).map_err(|e| Error::io("mkdir", &partial, e))?;
            } else {
                let _merging = match lock_root_dir(&partial, true) {
                    Ok(l) => l,
                    Err(_) if final_dir.exists() => return Err(exists()),
                    Err(e) => return Err(e),
                };
                if final_dir.exists() {
                    return Err(exists());
                }
                remove_rank(&partial, rank, file_name)?;
            }
        }
        Err(e) => return Err(Error::io("mkdir", &partial, e)),
    }
    Ok(partial)
}

/// Remove this rank's traces of a failed save: its file, and the partial directory if that
/// leaves it empty (other ranks' files keep it).
pub(crate) fn abort_partial(partial: &Path, rank: u32, file_name: &str) {
    withdraw_rank(partial, rank, file_name);
    let _ = fsops::remove_dir(partial);
}

/// Take `rank`'s failed save out of the partial directory `partial`: its durable part
/// (`rank-K.manifest.json`, written when the failure came after it, e.g. in the merge)
/// first and durably, then its file `file_name`, under the directory's lock, which a rank
/// merging the parts holds from reading them to the rename ([`commit`]). Otherwise a part
/// naming a removed file stays, and the next rank (or recovery) to find every part commits
/// the step without this rank's file. Best effort: a directory already gone (renamed by a
/// commit, removed by a sweep) is left alone.
pub(crate) fn withdraw_rank(partial: &Path, rank: u32, file_name: &str) {
    let _merging = lock_root_dir(partial, true).ok();
    if let Err(e) = remove_rank(partial, rank, file_name) {
        tracing::warn!(dir = %partial.display(), rank, error = %e, "a failed save's traces stay");
    }
}

/// Remove `rank`'s durable part (`rank-K.manifest.json`) from `partial`, durably (the
/// directory `fsync`ed), then its file `file_name`: the one order [`prepare_partial`] and
/// [`withdraw_rank`] share, so no part ever names a removed file. Either one missing is no
/// error; when the part cannot be removed the file stays. The caller holds the directory's
/// lock.
fn remove_rank(partial: &Path, rank: u32, file_name: &str) -> Result<()> {
    let part = partial.join(rank_manifest_name(rank));
    match fsops::remove_file(&part) {
        Ok(()) => fsync_dir(partial)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io("remove", &part, e)),
    }
    let file = partial.join(file_name);
    match fsops::remove_file(&file) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io("remove", &file, e)),
    }
}

/// Write this rank's manifest part (`rank-K.manifest.json`, durably: a temporary name,
/// `fsync`, `rename`, the partial directory `fsync`ed) into `partial`, next to its
/// durable file: the first half of [`commit`] with several ranks, and all of a part-only
/// save (`SaveOptions::part_only`). Returns the committed directory when writing failed
/// because another rank committed the step with exactly this entry meanwhile, else
/// `None`.
pub(crate) fn write_part(
    root: &Path,
    step: u64,
    partial: &Path,
    entry: &FileEntry,
) -> Result<Option<PathBuf>> {
    let final_dir = root.join(step_dir_name(step));
    let part = partial.join(rank_manifest_name(entry.rank));
    let bytes = serde_json::to_vec(entry).expect("manifest parts serialize");
    // Written under a temporary name and renamed into place: another rank reading the
    // parts must never see a half-written one.
    let part_tmp = partial.join(format!(
        "{}.tmp-{}",
        rank_manifest_name(entry.rank),
        std::process::id()
    ));
    let _ = fsops::remove_file(&part_tmp);
    // Never while another engine's `clean_stale` decides what is stale (it could be
    // removing this partial directory).
    let _writing = lock_root_dir(root, false)?;
    let written = write_durable(&part_tmp, &bytes).and_then(|()| {
        fsops::rename(&part_tmp, &part).map_err(|e| Error::io("rename", &part_tmp, e))
    });
    if let Err(e) = written {
        // A half-written part (e.g. ENOSPC) must not keep the partial directory alive.
        let _ = fsops::remove_file(&part_tmp);
        // This rank's part was there already (a recovery re-committing a save whose
        // part an earlier run wrote) and another rank merged every part and renamed
        // the directory meanwhile: committed with exactly this entry, once that
        // rename is durable.
        if committed_naming(&final_dir, entry) {
            fsync_dir(root)?;
            return Ok(Some(final_dir));
        }
        return Err(e);
    }
    if let Err(e) = fsync_dir(partial) {
        // Another rank may have merged every part and renamed the directory already:
        // committed, once that rename is durable (the other rank may not have synced
        // the root yet).
        if final_dir.join(MANIFEST).is_file() {
            fsync_dir(root)?;
            return Ok(Some(final_dir));
        }
        return Err(e);
    }
    Ok(None)
}

/// Delete the committed checkpoint `step` of `root`, as retention does: its directory is
/// renamed to its trash name and the root `fsync`ed (from then on it is not listed or
/// loadable, even after a crash: the next engine of the root removes the trash at open),
/// then its files are deleted. [`Error::NotFound`] when `step` is not a committed
/// checkpoint (a link or a file under its name is never touched); [`Error::UnsafePath`]
/// when its trash name is taken.
pub(crate) fn remove_step(root: &Path, step: u64) -> Result<()> {
    let all = manifest::list_committed(root)?;
    let Some(c) = all.into_iter().find(|c| c.step == step) else {
        return Err(Error::NotFound {
            what: format!("step {step}"),
            step: Some(step),
            root: root.to_owned(),
        });
    };
    let trash = root.join(trash_dir_name(step));
    if std::fs::symlink_metadata(&trash).is_ok() {
        return Err(Error::UnsafePath {
            path: trash,
            reason: "the trash name of the checkpoint to remove is taken; nothing was removed"
                .into(),
        });
    }
    match std::fs::rename(&c.dir, &trash) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::NotFound {
                what: format!("step {step}"),
                step: Some(step),
                root: root.to_owned(),
            });
        }
        Err(e) => return Err(Error::io("rename", &c.dir, e)),
    }
    fsync_dir(root)?;
    Retired {
        steps: vec![step],
        trash: vec![trash],
    }
    .remove()
}

/// Checkpoints taken out of the root by [`retire_old`], whose files are still to be
/// deleted ([`Retired::remove`]).
#[derive(Debug, Default)]
#[must_use = "the retired checkpoints' files stay on disk until `remove` is called"]
pub struct Retired {
    /// The retired steps, oldest first.
    pub steps: Vec<u64>,
    trash: Vec<PathBuf>,
}

impl Retired {
    /// Delete the retired checkpoints' files. Deleting large files can take seconds (a
    /// filesystem mounted with `discard` trims them as it frees them): the engine does it
    /// after the save that retired them is reported committed.
    pub fn remove(self) -> Result<()> {
        for trash in &self.trash {
            fsops::remove_dir_all(trash).map_err(|e| Error::io("remove", trash, e))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::Metadata;

    fn entry(rank: u32) -> FileEntry {
        FileEntry {
            rank,
            file: manifest::rank_file_name(rank, 2),
            bytes: 4096,
            data_start: 4096,
            header_crc32c: None,
            object: None,
            session: None,
            tensors: Vec::new(),
        }
    }

    /// A liveness probe's shared lock never fails an engine's open: the open waits for it
    /// (a probe holds it for a moment), while an engine's lock still refuses a second one.
    #[test]
    fn a_probe_never_fails_an_open_and_an_engine_lock_still_refuses() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_owned();
        assert!(matches!(probe_rank_lock(&root, 0), LockProbe::Missing));
        drop(lock_root(&root, 0).unwrap());
        let LockProbe::Free(probe) = probe_rank_lock(&root, 0) else {
            panic!("a free lock")
        };
        let t = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(20));
            drop(probe);
        });
        let engine = lock_root(&root, 0).expect("the open waits for the probe");
        t.join().unwrap();
        assert!(matches!(probe_rank_lock(&root, 0), LockProbe::Held));
        let start = std::time::Instant::now();
        assert!(matches!(
            lock_root(&root, 0),
            Err(Error::RootLocked { rank: 0, .. })
        ));
        assert!(start.elapsed() >= LOCK_PATIENCE);
        drop(engine);
        assert!(matches!(probe_rank_lock(&root, 0), LockProbe::Free(_)));
        assert!(matches!(
            probe_rank_lock(&root.join("gone"), 0),
            LockProbe::Missing
        ));
    }

    /// A partial directory is never created while a cleaning holds the root: the cleaning
    /// engine's "nobody else is alive" decision cannot be overtaken by another rank.
    #[test]
    fn partial_directories_wait_for_a_cleaning_in_progress() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_owned();
        let cleaning = lock_root_dir(&root, true).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let r = root.clone();
        let t = std::thread::spawn(move || {
            let p = prepare_partial(&r, 7, 1, &manifest::rank_file_name(1, 2), 2);
            tx.send(()).unwrap();
            p
        });
        // Still blocked while the cleaning holds the root (if it were not, the channel
        // would have a message and the directory would exist).
        assert!(
            rx.recv_timeout(std::time::Duration::from_millis(300))
                .is_err()
        );
        assert!(!root.join(partial_dir_name(7)).exists());
        drop(cleaning);
        let partial = t.join().unwrap().unwrap();
        assert!(partial.is_dir());
        // And a cleaning waits for nothing once creation is over: another engine's lock is
        // absent here, so the (now stale-looking) directory is removed.
        assert_eq!(clean_stale(&root, 0).unwrap(), vec![partial]);
    }

    /// A rank re-saving a step whose part a dead incarnation of it left waits for a merge
    /// holding the partial directory (which may have read that part): once the merge has
    /// renamed the directory, the re-save finds the step committed and removes nothing
    /// of it; with no merge, it removes its old part before its old file.
    #[test]
    fn a_resave_waits_for_a_merge_that_may_use_its_old_part() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_owned();
        let file = entry(0).file;
        let partial = prepare_partial(&root, 7, 0, &file, 2).unwrap();
        std::fs::write(partial.join(&file), b"0123456789").unwrap();
        write_part(&root, 7, &partial, &entry(0)).unwrap();
        let merging = lock_root_dir(&partial, true).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let (r, f) = (root.clone(), file.clone());
        let t = std::thread::spawn(move || {
            let p = prepare_partial(&r, 7, 0, &f, 2);
            tx.send(()).unwrap();
            p
        });
        assert!(
            rx.recv_timeout(std::time::Duration::from_millis(300))
                .is_err()
        );
        assert!(partial.join(rank_manifest_name(0)).is_file());
        let final_dir = root.join(step_dir_name(7));
        std::fs::rename(&partial, &final_dir).unwrap();
        drop(merging);
        assert!(matches!(
            t.join().unwrap(),
            Err(Error::StepExists { step: 7, .. })
        ));
        assert_eq!(std::fs::read(final_dir.join(&file)).unwrap(), b"0123456789");
        assert!(final_dir.join(rank_manifest_name(0)).is_file());

        // No merge: the old part and file are removed.
        let partial = prepare_partial(&root, 8, 0, &file, 2).unwrap();
        std::fs::write(partial.join(&file), b"0123456789").unwrap();
        write_part(&root, 8, &partial, &entry(0)).unwrap();
        assert_eq!(prepare_partial(&root, 8, 0, &file, 2).unwrap(), partial);
        assert!(!partial.join(rank_manifest_name(0)).exists());
        assert!(!partial.join(&file).exists());
    }

    /// Two ranks that finish together both see every part and both merge: the one that
    /// loses the rename race must report the commit, not an error about the vanished
    /// partial directory (a flaky `open step-N.partial: ENOENT` from multi-rank saves).
    #[test]
    fn racing_ranks_both_report_the_commit() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let meta = Metadata::new();
        for step in 1..=200u64 {
            let partial = prepare_partial(root, step, 0, &entry(0).file, 2).unwrap();
            let barrier = std::sync::Barrier::new(2);
            let results: Vec<Result<Option<PathBuf>>> = std::thread::scope(|s| {
                let hs: Vec<_> = (0..2u32)
                    .map(|r| {
                        let (partial, barrier, meta) = (&partial, &barrier, &meta);
                        s.spawn(move || {
                            barrier.wait();
                            commit(root, step, 2, partial, entry(r), meta)
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let final_dir = root.join(step_dir_name(step));
            let committed: Vec<_> = results
                .into_iter()
                .map(|r| r.unwrap_or_else(|e| panic!("step {step}: {e}")))
                .collect();
            // At least the last rank to write its part sees both parts and commits.
            assert!(committed.iter().any(|c| c.as_deref() == Some(&final_dir)));
            assert!(
                !partial.exists(),
                "step {step}: partial directory left behind"
            );
            let m = Manifest::read(&final_dir).unwrap();
            assert_eq!(m.step, step);
            assert_eq!(
                m.files.iter().map(|f| f.rank).collect::<Vec<_>>(),
                vec![0, 1]
            );
            let stray: Vec<_> = std::fs::read_dir(&final_dir)
                .unwrap()
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().contains(".tmp-"))
                .collect();
            assert!(stray.is_empty(), "step {step}: {stray:?}");
        }
    }
}
