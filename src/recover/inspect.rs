//! Reading arenas without changing them: what `recover --list` shows, and whether an
//! arena's owner may still use it.
#![forbid(unsafe_code)]

use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::staging::descriptor::{SlotView, chunk_state, slot_state};
use crate::staging::shm::SHM_MOUNT;
use crate::staging::{self, AttachedArena, NAME_PREFIX};

/// Whether the process that created an arena may still be using it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    /// The owner runs and maps the arena.
    Alive,
    /// A process with the owner's pid runs, but whether it maps the arena cannot be
    /// checked (no access to its `/proc/<pid>/maps`); treated as alive.
    Unverifiable,
    /// No such process (or only a zombie is left).
    Dead,
    /// A process with the owner's pid runs but does not map the arena: the pid was reused.
    PidReused,
}

impl Owner {
    /// Whether the owner must be assumed alive.
    pub fn is_alive(self) -> bool {
        matches!(self, Owner::Alive | Owner::Unverifiable)
    }
}

impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Owner::Alive => "alive",
            Owner::Unverifiable => "alive (cannot check that it maps the arena)",
            Owner::Dead => "dead",
            Owner::PidReused => "dead (pid reused by another process)",
        })
    }
}

/// State of a save slot as read from the descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    /// The save was still copying into staging.
    Staging,
    /// `save` had returned: every chunk was staged (or already written).
    Staged,
    /// A value this version does not know.
    Unknown(u32),
}

impl SlotState {
    pub(super) fn from_raw(v: u32) -> SlotState {
        match v {
            slot_state::STAGING => SlotState::Staging,
            slot_state::STAGED => SlotState::Staged,
            other => SlotState::Unknown(other),
        }
    }
}

impl std::fmt::Display for SlotState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SlotState::Staging => f.write_str("STAGING"),
            SlotState::Staged => f.write_str("STAGED"),
            SlotState::Unknown(v) => write!(f, "UNKNOWN({v})"),
        }
    }
}

/// One save slot in use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotInfo {
    /// Slot number.
    pub slot: u32,
    /// Step of the save.
    pub step: u64,
    /// Its state.
    pub state: SlotState,
    /// Length of the file being saved.
    pub file_len: u64,
    /// File chunks of the save.
    pub chunks: u64,
    /// Chunks whose bytes are only in staging.
    pub staged: u64,
    /// Chunks already written to the partial file.
    pub written: u64,
    /// Chunks in neither place (not copied yet, or their write failed).
    pub missing: u64,
}

impl SlotInfo {
    pub(super) fn from_view(v: &SlotView) -> SlotInfo {
        let count = |s: u32| v.chunks.iter().filter(|c| c.0 == s).count() as u64;
        let staged = count(chunk_state::STAGED);
        let written = count(chunk_state::WRITTEN);
        let chunks = v.chunks.len() as u64;
        SlotInfo {
            slot: v.slot,
            step: v.step,
            state: SlotState::from_raw(v.state),
            file_len: v.file_len,
            chunks,
            staged,
            written,
            missing: chunks - staged - written,
        }
    }

    /// Whether the descriptor says the save can be rebuilt (every chunk staged or
    /// written). Recovery still checks the partial file and the bytes.
    pub fn recoverable(&self) -> bool {
        self.state == SlotState::Staged && self.missing == 0
    }
}

/// What the descriptor of a readable arena says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArenaDetails {
    /// Process that created the arena.
    pub owner_pid: u32,
    /// Whether it may still use it.
    pub owner: Owner,
    /// The owner shut its engine down cleanly (a leftover, not a crash).
    pub closed: bool,
    /// Checkpoint root recorded by the engine.
    pub root: PathBuf,
    /// Rank of the engine.
    pub rank: u32,
    /// World size of the engine.
    pub world_size: u32,
    /// Creation time, ms since the Unix epoch.
    pub created_unix_ms: u64,
    /// Bytes per chunk.
    pub chunk_size: u64,
    /// Data chunks of the arena.
    pub chunks: u64,
    /// Slots in use (not `FREE`), by slot number.
    pub slots: Vec<SlotInfo>,
}

impl ArenaDetails {
    /// Whether the owner may still write to the arena (alive and not closed).
    pub fn in_use(&self) -> bool {
        self.owner.is_alive() && !self.closed
    }
}

/// A segment in `/dev/shm` whose name starts with `shmckpt.`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArenaInfo {
    /// Segment name (without slash).
    pub name: String,
    /// Segment size in bytes.
    pub bytes: u64,
    /// Owning user of the segment.
    pub uid: Option<u32>,
    /// Owned by another user than the caller's effective uid: never attached (its
    /// descriptor is not read) and never recovered unless explicitly allowed
    /// ([`super::RecoverOptions::allow_foreign`]).
    pub foreign: bool,
    /// The descriptor, or why it cannot be read (foreign, a link or not a regular file,
    /// damaged segment, no access).
    pub details: std::result::Result<ArenaDetails, String>,
}

/// Every segment in `/dev/shm` whose name starts with `shmckpt.`, by name. Nothing is
/// written or removed; links, non-regular files and other users' segments are listed with
/// the reason and never opened.
pub fn list_arenas() -> Vec<ArenaInfo> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(SHM_MOUNT) else {
        return out;
    };
    for e in rd.flatten() {
        let raw = e.file_name();
        let lossy = raw.to_string_lossy().into_owned();
        if !lossy.starts_with(NAME_PREFIX) {
            continue;
        }
        let info = match raw.to_str() {
            Some(name) => inspect_arena(name),
            None => ArenaInfo {
                name: lossy,
                bytes: 0,
                uid: None,
                foreign: false,
                details: Err("name is not valid UTF-8".into()),
            },
        };
        out.push(info);
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// Read the arena `/dev/shm/<name>` without changing it. A link, a non-regular file or a
/// segment of another user is reported (with `lstat`'s owner and size) and not opened.
pub fn inspect_arena(name: &str) -> ArenaInfo {
    let path = Path::new(SHM_MOUNT).join(name);
    let meta = std::fs::symlink_metadata(&path).ok();
    let (bytes, uid) = meta
        .as_ref()
        .map_or((0, None), |m| (m.len(), Some(m.uid())));
    let me = rustix::process::geteuid().as_raw();
    let foreign = uid.is_some_and(|u| u != me);
    let details = match &meta {
        Some(m) if m.file_type().is_symlink() => Err(format!(
            "{} is a symbolic link; arenas are never opened through links",
            path.display()
        )),
        Some(m) if !m.file_type().is_file() => {
            Err(format!("{} is not a regular file", path.display()))
        }
        Some(m) if foreign => Err(format!(
            "foreign arena: {} belongs to uid {}, not to uid {me}; not read (recover it as \
             that user, or with --allow-foreign)",
            path.display(),
            m.uid()
        )),
        _ => AttachedArena::open(name)
            .map(|a| details_of(&a))
            .map_err(|e| e.to_string()),
    };
    ArenaInfo {
        name: name.to_owned(),
        bytes,
        uid,
        foreign,
        details,
    }
}

pub(super) fn details_of(a: &AttachedArena) -> ArenaDetails {
    let h = a.header();
    ArenaDetails {
        owner_pid: h.owner_pid,
        owner: owner_status(h.owner_pid, a.name()),
        closed: h.closed,
        root: h.root.clone(),
        rank: h.rank,
        world_size: h.world_size,
        created_unix_ms: h.created_unix_ms,
        chunk_size: h.geometry.chunk_size,
        chunks: h.geometry.n_chunks,
        slots: used_slots(a).iter().map(SlotInfo::from_view).collect(),
    }
}

pub(super) fn used_slots(a: &AttachedArena) -> Vec<SlotView> {
    (0..a.slot_count())
        .map(|s| a.slot(s))
        .filter(|v| v.state != slot_state::FREE && v.state != slot_state::KEPT)
        .collect()
}

/// Whether process `pid`, recorded as the owner of arena `name`, may still use it.
pub(super) fn owner_status(pid: u32, name: &str) -> Owner {
    if pid == std::process::id() {
        // Our own pid: the arena is ours only if we created it (else a predecessor with
        // the same pid, e.g. a restarted container's pid 1, left it).
        return if staging::created_here(name) {
            Owner::Alive
        } else {
            Owner::PidReused
        };
    }
    let Some(p) = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    else {
        return Owner::Dead;
    };
    if let Err(e) = rustix::process::test_kill_process(p)
        && e == rustix::io::Errno::SRCH
    {
        return Owner::Dead;
    }
    // A zombie (killed, not reaped yet) maps nothing and will never run again.
    if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        && let Some((_, rest)) = stat.rsplit_once(')')
        && rest.trim_start().starts_with('Z')
    {
        return Owner::Dead;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/maps")) {
        Ok(maps) => {
            let path = format!("{SHM_MOUNT}/{name}");
            let deleted = format!("{path} (deleted)");
            if maps
                .lines()
                .any(|l| l.ends_with(&path) || l.ends_with(&deleted))
            {
                Owner::Alive
            } else {
                Owner::PidReused
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Owner::Dead,
        Err(_) => Owner::Unverifiable,
    }
}
