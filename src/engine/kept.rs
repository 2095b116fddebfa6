//! The arenas flash restore keeps in `/dev/shm`, as `shmckpt shm list|rm` sees them:
//! listing (with whether each one's engine is running) and removal, which refuses a live
//! or unknown one unless forced.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::error::{Error, Result};
use crate::staging::AttachedArena;
use crate::staging::descriptor::slot_state;
use crate::staging::shm::SHM_MOUNT;

/// Whether the engine that owns a kept arena, the engine of the root and rank its header
/// records, is running. The root's rank lock tells (`ROOT/.shmckpt-rank-N.lock`, held by an
/// engine for its whole life, whatever process it is in).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ArenaOwner {
    /// An engine of the arena's root and rank holds the rank lock: the arena is in use.
    Alive,
    /// No engine holds that lock (or the root or its lock file no longer exist).
    Gone,
    /// The arena's header cannot be read, or the lock cannot be probed.
    Unknown,
}

impl ArenaOwner {
    /// `"alive"`, `"gone"` or `"unknown"`.
    pub fn as_str(self) -> &'static str {
        match self {
            ArenaOwner::Alive => "alive",
            ArenaOwner::Gone => "gone",
            ArenaOwner::Unknown => "unknown",
        }
    }
}

/// Whether `root`'s engine of `rank` runs (the lock probe is released at once).
fn owner_state(root: &Path, rank: u32) -> ArenaOwner {
    match crate::commit::probe_rank_lock(root, rank) {
        crate::commit::LockProbe::Held => ArenaOwner::Alive,
        crate::commit::LockProbe::Free(_) | crate::commit::LockProbe::Missing => ArenaOwner::Gone,
        crate::commit::LockProbe::Unknown(_) => ArenaOwner::Unknown,
    }
}

/// Kept arenas in `/dev/shm`: name, size, owner uid, and (when it can be read: this user's
/// and well formed) root, rank, kept step and whether its owning engine is running.
pub fn list_kept() -> Vec<KeptArenaInfo> {
    let mut out = Vec::new();
    for name in crate::staging::shm::list_segments(crate::staging::KEEP_PREFIX) {
        let path = Path::new(SHM_MOUNT).join(&name);
        let Ok(m) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        let mut info = KeptArenaInfo {
            name: name.clone(),
            bytes: m.len(),
            owner_uid: m.uid(),
            root: None,
            rank: None,
            step: None,
            owner: ArenaOwner::Unknown,
            problem: None,
        };
        match AttachedArena::open(&name) {
            Ok(att) => {
                let h = att.header();
                info.root = Some(h.root.clone());
                info.rank = Some(h.rank);
                info.step = (0..att.slot_count())
                    .filter_map(|s| att.try_slot(s).ok())
                    .filter(|v| v.state == slot_state::KEPT)
                    .map(|v| v.step)
                    .max();
                info.owner = owner_state(&h.root, h.rank);
            }
            Err(e) => info.problem = Some(e.to_string()),
        }
        out.push(info);
    }
    out
}

/// Remove the kept arena `name` (this user's only; never following a link), unless its
/// owner may be running: [`Error::ArenaInUse`] when an engine of the root and rank its
/// header records holds the root's rank lock, or when that cannot be told (the header
/// cannot be read, the lock cannot be probed). The lock is held (shared) from the probe
/// until the name is removed, so an engine of that root and rank cannot start using the
/// arena in between (one opening in that instant waits for the removal).
/// [`remove_kept_forced`] removes it whatever its owner.
pub fn remove_kept(name: &str) -> Result<()> {
    let path = own_kept_path(name)?;
    let in_use = |reason: String| Error::ArenaInUse {
        name: name.to_owned(),
        reason: format!("{reason} (a kept arena: --force removes it anyway)"),
    };
    let att = AttachedArena::open(name).map_err(|e| {
        in_use(format!(
            "whether its engine is running cannot be told (its header cannot be read: {e})"
        ))
    })?;
    let h = att.header();
    let lock_path = h.root.join(crate::commit::lock_name(h.rank));
    let _probe = match crate::commit::probe_rank_lock(&h.root, h.rank) {
        crate::commit::LockProbe::Held => {
            return Err(in_use(format!(
                "its engine (root {}, rank {}) is running: it holds {}",
                h.root.display(),
                h.rank,
                lock_path.display()
            )));
        }
        crate::commit::LockProbe::Unknown(why) => {
            return Err(in_use(format!(
                "whether its engine (root {}, rank {}) is running cannot be told: {why}",
                h.root.display(),
                h.rank
            )));
        }
        crate::commit::LockProbe::Missing => None,
        crate::commit::LockProbe::Free(lock) => Some(lock),
    };
    std::fs::remove_file(&path).map_err(|e| Error::io("remove", &path, e))
}

/// Remove the kept arena `name` (this user's only; never following a link) even when the
/// engine that owns it is running ([`remove_kept`] refuses that). That engine keeps its
/// memory (its mapping stays) and saves on, but nothing is kept under the name for the next
/// engine's flash restore.
pub fn remove_kept_forced(name: &str) -> Result<()> {
    let path = own_kept_path(name)?;
    std::fs::remove_file(&path).map_err(|e| Error::io("remove", &path, e))
}

/// `/dev/shm/name` when `name` is a kept arena's name and a regular file of this user.
fn own_kept_path(name: &str) -> Result<std::path::PathBuf> {
    if !crate::staging::is_kept_name(name) || name.contains('/') {
        return Err(Error::Config(format!(
            "{name:?} is not a kept arena's name"
        )));
    }
    let path = Path::new(SHM_MOUNT).join(name);
    let m = std::fs::symlink_metadata(&path).map_err(|e| Error::io("stat", &path, e))?;
    if !m.file_type().is_file() || m.uid() != rustix::process::geteuid().as_raw() {
        return Err(Error::UnsafePath {
            path,
            reason: "not a regular file of this user".into(),
        });
    }
    Ok(path)
}

/// A kept arena, as `shmckpt shm list` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeptArenaInfo {
    /// Name in `/dev/shm`.
    pub name: String,
    /// Size in bytes.
    pub bytes: u64,
    /// Owner uid.
    pub owner_uid: u32,
    /// Checkpoint root, when readable.
    pub root: Option<std::path::PathBuf>,
    /// Rank, when readable.
    pub rank: Option<u32>,
    /// Step of the kept image, if it holds one.
    pub step: Option<u64>,
    /// Whether the engine that owns it is running ([`remove_kept`] refuses it then).
    pub owner: ArenaOwner,
    /// Why it could not be read.
    pub problem: Option<String>,
}
