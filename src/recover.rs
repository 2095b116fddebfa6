//! Crash recovery from staging.
//!
//! When a trainer dies after `save` returned but before the checkpoint was committed, the
//! staged bytes are still in its named arena in `/dev/shm`, and the arena's descriptor
//! says which save each slot held and where every file chunk is: still in staging
//! (`STAGED`, with the arena chunk that holds it) or already in the partial file
//! (`WRITTEN`). This module finds such arenas, rebuilds the file of every fully staged save
//! in `root/step-N.partial/`, makes it durable and commits it with the engine's own
//! protocol ([`commit::commit`]), refuses what was not fully staged, and removes the arena
//! afterwards. Every arena it removes is reported first (in the returned report and in the
//! log).
//!
//! An arena is left alone while its owner may still use it: the owner process exists and
//! maps the arena (checked in `/proc/<pid>/maps`, so a reused pid is not mistaken for the
//! owner), unless the owner marked it closed. Recovery also takes the rank's lock on the
//! checkpoint root, so it never runs next to a live engine of that rank.
#![forbid(unsafe_code)]

use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

use crate::commit;
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::fsx;
use crate::manifest::{
    FORMAT_VERSION, FileEntry, MANIFEST, Manifest, Metadata, TensorEntry, partial_dir_name,
    rank_file_name, step_dir_name,
};
use crate::plan::{DATA_ALIGN, MAX_HEADER_LEN, META_RANK, META_STEP, META_WORLD, RESERVED_PREFIX};
use crate::staging::attach::AttachOptions;
use crate::staging::descriptor::{HeaderView, SlotView, chunk_state, slot_state};
use crate::staging::shm::SHM_MOUNT;
use crate::staging::{self, AttachedArena, NAME_PREFIX};

/// Bytes copied or read per call while rebuilding and checksumming a file.
const IO_PIECE: usize = 4 << 20;

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
    fn from_raw(v: u32) -> SlotState {
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
    fn from_view(v: &SlotView) -> SlotInfo {
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

/// A segment in `/dev/shm` whose name starts with [`NAME_PREFIX`].
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
    /// ([`RecoverOptions::allow_foreign`]).
    pub foreign: bool,
    /// The descriptor, or why it cannot be read (foreign, a link or not a regular file,
    /// damaged segment, no access).
    pub details: std::result::Result<ArenaDetails, String>,
}

/// Every segment in `/dev/shm` whose name starts with [`NAME_PREFIX`], by name. Nothing is
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

fn details_of(a: &AttachedArena) -> ArenaDetails {
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

fn used_slots(a: &AttachedArena) -> Vec<SlotView> {
    (0..a.slot_count())
        .map(|s| a.slot(s))
        .filter(|v| v.state != slot_state::FREE)
        .collect()
}

/// Whether process `pid`, recorded as the owner of arena `name`, may still use it.
fn owner_status(pid: u32, name: &str) -> Owner {
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

/// What recovery did with one slot.
#[derive(Debug)]
pub enum SlotOutcome {
    /// The save was rebuilt, made durable and committed.
    Committed {
        /// The committed directory.
        dir: PathBuf,
        /// Bytes of the file.
        bytes: u64,
        /// Chunks written from staging by recovery.
        from_staging: u64,
        /// Chunks that were already in the partial file.
        from_file: u64,
    },
    /// This rank's file is durable and its manifest part written, but other ranks of the
    /// checkpoint are missing, so it is not committed.
    AwaitingRanks {
        /// The partial directory.
        partial: PathBuf,
    },
    /// The step was already committed (the trainer died after the commit).
    AlreadyCommitted {
        /// The committed directory.
        dir: PathBuf,
    },
    /// The save cannot be restored (not fully staged, failed before the crash, bytes lost
    /// or inconsistent). Permanent: retrying does not help.
    Refused {
        /// Why.
        reason: String,
    },
    /// An I/O error, or an entry in the way that recovery never writes through (a link, a
    /// FIFO, a file where a directory belongs: [`Error::UnsafePath`]), stopped recovery of
    /// this save; the arena is kept so it can be retried once the cause is removed.
    Failed {
        /// The error.
        error: Error,
    },
}

/// One slot's recovery.
#[derive(Debug)]
pub struct SlotRecovery {
    /// Slot number.
    pub slot: u32,
    /// Step.
    pub step: u64,
    /// State the slot was in.
    pub state: SlotState,
    /// What happened.
    pub outcome: SlotOutcome,
}

/// What [`recover_arena`] did with one arena.
#[derive(Debug)]
pub struct RecoveryReport {
    /// Segment name.
    pub arena: String,
    /// Recorded owner.
    pub owner_pid: u32,
    /// Its status when recovery started.
    pub owner: Owner,
    /// The owner had shut down cleanly.
    pub closed: bool,
    /// Checkpoint root used.
    pub root: PathBuf,
    /// Rank.
    pub rank: u32,
    /// World size.
    pub world_size: u32,
    /// Every slot that was in use, oldest step first.
    pub slots: Vec<SlotRecovery>,
    /// Whether the arena was removed from `/dev/shm`.
    pub removed: bool,
    /// Why it was kept, when it was.
    pub kept: Option<String>,
}

impl RecoveryReport {
    /// Steps committed by this recovery.
    pub fn committed_steps(&self) -> Vec<u64> {
        self.slots
            .iter()
            .filter(|s| matches!(s.outcome, SlotOutcome::Committed { .. }))
            .map(|s| s.step)
            .collect()
    }

    /// Whether any slot failed with an I/O error (a retry may succeed).
    pub fn has_failures(&self) -> bool {
        self.slots
            .iter()
            .any(|s| matches!(s.outcome, SlotOutcome::Failed { .. }))
    }
}

/// Options of [`recover_arena_with`] and [`recover_root_with`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecoverOptions {
    /// Recover arenas owned by another uid too. Off by default: an arena in `/dev/shm` can
    /// be planted by any local user, and committing it would inject a checkpoint into a
    /// root the caller owns. Even with it, links and non-regular files are refused.
    pub allow_foreign: bool,
}

/// Whether recovery takes the rank's root lock itself or runs under an engine that holds
/// it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LockPolicy {
    Take,
    Held,
}

/// Recover the arena `/dev/shm/<name>`: commit every fully staged save into its checkpoint
/// root (`root_override`, else the root recorded in the arena), refuse the others, and
/// remove the arena, unless a save failed with an I/O error (then the arena is kept for a
/// retry and the report says so).
///
/// Refused as a whole, changing nothing: a segment that is not a shmckpt arena, an owner
/// that is still alive, a root held by a live engine of the same rank ([`Error::Recovery`]);
/// a link, a non-regular file, or a segment of another user, root included
/// ([`Error::UnsafePath`]; see [`recover_arena_with`]).
pub fn recover_arena(name: &str, root_override: Option<&Path>) -> Result<RecoveryReport> {
    recover_arena_with(name, root_override, RecoverOptions::default())
}

/// [`recover_arena`] with options.
pub fn recover_arena_with(
    name: &str,
    root_override: Option<&Path>,
    opts: RecoverOptions,
) -> Result<RecoveryReport> {
    recover_impl(name, root_override, LockPolicy::Take, opts)
}

/// Recover every arena recorded for checkpoint root `root` (and `rank`, when given) whose
/// owner is gone. Returns one result per such arena, by name; arenas still in use are
/// included as [`Error::Recovery`] results and left alone.
pub fn recover_root(root: &Path, rank: Option<u32>) -> Vec<(String, Result<RecoveryReport>)> {
    recover_root_with(root, rank, RecoverOptions::default())
}

/// [`recover_root`] with options. Foreign arenas are only considered with
/// [`RecoverOptions::allow_foreign`].
pub fn recover_root_with(
    root: &Path,
    rank: Option<u32>,
    opts: RecoverOptions,
) -> Vec<(String, Result<RecoveryReport>)> {
    arenas_of(root, rank, opts)
        .into_iter()
        .map(|(name, in_use)| {
            let r = if in_use {
                Err(Error::Recovery {
                    arena: name.clone(),
                    reason: "its owner is alive and uses it".into(),
                })
            } else {
                recover_impl(&name, Some(root), LockPolicy::Take, opts)
            };
            (name, r)
        })
        .collect()
}

/// Arenas recorded for `root` (and `rank`), newest first: (name, in use). Newest first so
/// that when two dead trainers staged the same step, the later attempt is the one committed
/// and the earlier finds it committed.
fn arenas_of(root: &Path, rank: Option<u32>, opts: RecoverOptions) -> Vec<(String, bool)> {
    let want = std::fs::canonicalize(root).unwrap_or_else(|_| root.to_owned());
    let mut found: Vec<(u64, String, bool)> = list_arenas()
        .into_iter()
        .map(|a| {
            if a.foreign && opts.allow_foreign && a.details.is_err() {
                // Read the foreign arena's descriptor only now that it is allowed.
                let details = AttachedArena::open_with(
                    &a.name,
                    AttachOptions {
                        write: false,
                        allow_foreign: true,
                    },
                )
                .map(|x| details_of(&x))
                .map_err(|e| e.to_string());
                ArenaInfo { details, ..a }
            } else {
                a
            }
        })
        .filter_map(|a| {
            let d = a.details.as_ref().ok()?;
            let same = d.root == want || d.root == root;
            (same && rank.is_none_or(|r| r == d.rank))
                .then(|| (d.created_unix_ms, a.name.clone(), d.in_use()))
        })
        .collect();
    found.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    found.into_iter().map(|(_, n, u)| (n, u)).collect()
}

/// Run by [`crate::Engine::open`] (with the rank's root lock held) before stale partial
/// directories are cleaned: recover the arenas of dead engines of this root and rank, and
/// log what happened.
pub(crate) fn recover_on_open(root: &Path, rank: u32) -> Vec<RecoveryReport> {
    let mut out = Vec::new();
    for (name, in_use) in arenas_of(root, Some(rank), RecoverOptions::default()) {
        if in_use {
            tracing::debug!(arena = %name, "staging arena of this root is in use; not recovering");
            continue;
        }
        match recover_impl(
            &name,
            Some(root),
            LockPolicy::Held,
            RecoverOptions::default(),
        ) {
            Ok(r) => out.push(r),
            Err(e) => tracing::warn!(arena = %name, error = %e, "staging arena not recovered"),
        }
    }
    out
}

fn refuse(name: &str, reason: impl Into<String>) -> Error {
    Error::Recovery {
        arena: name.to_owned(),
        reason: reason.into(),
    }
}

fn recover_impl(
    name: &str,
    root_override: Option<&Path>,
    lock: LockPolicy,
    opts: RecoverOptions,
) -> Result<RecoveryReport> {
    let att = AttachedArena::open_with(
        name,
        AttachOptions {
            write: true,
            allow_foreign: opts.allow_foreign,
        },
    )?;
    let h = att.header();
    let owner = owner_status(h.owner_pid, name);
    if owner.is_alive() && !h.closed {
        return Err(refuse(
            name,
            format!("its owner, pid {}, is {owner}", h.owner_pid),
        ));
    }
    let root = root_override.map_or_else(|| h.root.clone(), Path::to_owned);
    let mut slots = used_slots(&att);
    slots.sort_by_key(|v| (v.step, v.slot));
    let mut report = RecoveryReport {
        arena: name.to_owned(),
        owner_pid: h.owner_pid,
        owner,
        closed: h.closed,
        root: root.clone(),
        rank: h.rank,
        world_size: h.world_size,
        slots: Vec::new(),
        removed: false,
        kept: None,
    };
    if !slots.is_empty() {
        if root.as_os_str().is_empty() || !root.is_dir() {
            return Err(refuse(
                name,
                format!(
                    "checkpoint root {:?} is not a directory; give the root explicitly",
                    root.display()
                ),
            ));
        }
        let _lock = match lock {
            LockPolicy::Held => None,
            LockPolicy::Take => match commit::lock_root(&root, h.rank) {
                Ok(l) => Some(l),
                Err(Error::RootLocked { .. }) => {
                    return Err(refuse(
                        name,
                        format!(
                            "an engine of rank {} holds {}; stop it, or recover from it with \
                             EngineConfig::with_recover_on_open",
                            h.rank,
                            root.display()
                        ),
                    ));
                }
                Err(e) => return Err(e),
            },
        };
        for v in &slots {
            let outcome = recover_slot(&att, &h, &root, v);
            log_outcome(name, v.step, &outcome);
            if matches!(
                outcome,
                SlotOutcome::Committed { .. }
                    | SlotOutcome::AlreadyCommitted { .. }
                    | SlotOutcome::AwaitingRanks { .. }
            ) {
                // A retry of this arena skips the slot.
                if let Err(e) = att.release_slot(v.slot) {
                    tracing::warn!(arena = %name, slot = v.slot, error = %e, "could not mark the slot free");
                }
            }
            report.slots.push(SlotRecovery {
                slot: v.slot,
                step: v.step,
                state: SlotState::from_raw(v.state),
                outcome,
            });
        }
    }
    let failed = report
        .slots
        .iter()
        .filter(|s| matches!(s.outcome, SlotOutcome::Failed { .. }))
        .count();
    if failed > 0 {
        let why = format!(
            "{failed} save(s) failed (I/O errors or unsafe entries in the way); the arena is kept: \
             fix the cause and run \
             `shmckpt recover --shm {name}` again"
        );
        tracing::warn!(arena = %name, "{why}");
        report.kept = Some(why);
    } else {
        match att.unlink() {
            Ok(()) => {
                report.removed = true;
                tracing::warn!(
                    arena = %name,
                    owner_pid = h.owner_pid,
                    owner = %owner,
                    closed = h.closed,
                    saves = report.slots.len(),
                    committed = ?report.committed_steps(),
                    "removed stale staging arena"
                );
            }
            Err(e) => {
                let why = format!("could not remove it: {e}");
                tracing::warn!(arena = %name, "{why}");
                report.kept = Some(why);
            }
        }
    }
    Ok(report)
}

fn log_outcome(arena: &str, step: u64, o: &SlotOutcome) {
    match o {
        SlotOutcome::Committed {
            dir,
            from_staging,
            from_file,
            ..
        } => {
            tracing::warn!(arena, step, dir = %dir.display(), from_staging, from_file, "recovered and committed a staged save")
        }
        SlotOutcome::AwaitingRanks { partial } => {
            tracing::warn!(arena, step, partial = %partial.display(), "recovered this rank's file; other ranks are missing")
        }
        SlotOutcome::AlreadyCommitted { dir } => {
            tracing::info!(arena, step, dir = %dir.display(), "step was already committed")
        }
        SlotOutcome::Refused { reason } => {
            tracing::warn!(arena, step, reason = %reason, "staged save cannot be recovered")
        }
        SlotOutcome::Failed { error } => {
            tracing::error!(arena, step, error = %error, "recovery of a staged save failed")
        }
    }
}

fn refused(reason: impl Into<String>) -> SlotOutcome {
    SlotOutcome::Refused {
        reason: reason.into(),
    }
}

fn is_not_found(e: &Error) -> bool {
    matches!(e, Error::Io { source, .. } if source.kind() == io::ErrorKind::NotFound)
}

/// A link, FIFO or other unexpected entry where recovery would write: nothing is written
/// through it, and the arena is kept (like for an I/O error), so that recovery can be run
/// again once the entry is removed; a planted link must not cost the user the staged save.
fn unsafe_path(path: &Path, reason: &str) -> SlotOutcome {
    SlotOutcome::Failed {
        error: Error::UnsafePath {
            path: path.to_owned(),
            reason: reason.to_owned(),
        },
    }
}

/// Errors from the OS, and entries in the way that are not what shmckpt creates, are worth
/// a retry; anything else is about the bytes themselves.
fn classify(e: Error) -> SlotOutcome {
    match e {
        Error::Io { .. } | Error::UnsafePath { .. } => SlotOutcome::Failed { error: e },
        other => refused(other.to_string()),
    }
}

fn recover_slot(att: &AttachedArena, h: &HeaderView, root: &Path, v: &SlotView) -> SlotOutcome {
    let info = SlotInfo::from_view(v);
    match info.state {
        SlotState::Staged => {}
        SlotState::Staging => {
            return refused(format!(
                "not fully staged: the trainer died inside `save` ({} of {} chunks staged)",
                info.staged + info.written,
                info.chunks
            ));
        }
        SlotState::Unknown(s) => return refused(format!("unknown slot state {s}")),
    }
    let cs = h.geometry.chunk_size;
    let file_name = rank_file_name(h.rank, h.world_size);
    if h.world_size == 0
        || h.rank >= h.world_size
        || v.partial_dir != partial_dir_name(v.step)
        || v.file_name != file_name
        || v.chunks.len() as u64 != v.file_len.div_ceil(cs)
        || v.data_start < 8
        || v.data_start > v.file_len
        || !v.data_start.is_multiple_of(DATA_ALIGN)
    {
        return refused(format!(
            "the descriptor is inconsistent (step {}, {:?}/{:?}, {} bytes, data at {}, {} chunk entries)",
            v.step,
            v.partial_dir,
            v.file_name,
            v.file_len,
            v.data_start,
            v.chunks.len()
        ));
    }
    // Nothing under the root is trusted: every entry is looked at without following links,
    // and a link or a non-directory where a step directory belongs is refused.
    let root_fd = match fsx::open_dir(root) {
        Ok(fd) => fd,
        Err(e) => return classify(e),
    };
    let final_name = step_dir_name(v.step);
    let final_dir = root.join(&final_name);
    match fsx::entry_kind(root_fd.as_fd(), root, &final_name) {
        Ok(None) => {}
        Ok(Some(libc::S_IFDIR)) => {
            let has_manifest = fsx::open_subdir(root_fd.as_fd(), root, &final_name)
                .and_then(|d| fsx::entry_kind(d.as_fd(), &final_dir, MANIFEST))
                .is_ok_and(|k| k == Some(libc::S_IFREG));
            return if has_manifest {
                SlotOutcome::AlreadyCommitted { dir: final_dir }
            } else {
                refused(format!(
                    "{} exists but holds no manifest",
                    final_dir.display()
                ))
            };
        }
        Ok(Some(_)) => {
            return unsafe_path(&final_dir, "is not a directory (a link or a file)");
        }
        Err(e) => return classify(e),
    }
    if let Some(k) = v
        .chunks
        .iter()
        .position(|&(s, _)| s != chunk_state::STAGED && s != chunk_state::WRITTEN)
    {
        return refused(format!(
            "{} of {} chunks are neither staged nor written (first: chunk {k}); the save had \
             failed before the crash",
            info.missing, info.chunks
        ));
    }
    if let Some(&(_, idx)) = v
        .chunks
        .iter()
        .find(|&&(s, idx)| s == chunk_state::STAGED && u64::from(idx) >= h.geometry.n_chunks)
    {
        return refused(format!(
            "the descriptor names arena chunk {idx}, past the arena's {} chunks",
            h.geometry.n_chunks
        ));
    }

    let partial = root.join(&v.partial_dir);
    let path = partial.join(&file_name);
    let made_dir = match fsx::entry_kind(root_fd.as_fd(), root, &v.partial_dir) {
        Ok(None) => true,
        Ok(Some(libc::S_IFDIR)) => false,
        Ok(Some(_)) => {
            return unsafe_path(&partial, "is not a directory (a link or a file)");
        }
        Err(e) => return classify(e),
    };
    // What is in the way of the file itself (a link, FIFO, directory) is refused when it is
    // opened (`O_NOFOLLOW | O_NONBLOCK`, then `fstat`).
    let made_file = made_dir
        || match fsx::open_subdir(root_fd.as_fd(), root, &v.partial_dir)
            .and_then(|d| fsx::entry_kind(d.as_fd(), &partial, &file_name))
        {
            Ok(k) => k.is_none(),
            Err(e) => return classify(e),
        };
    let outcome = rebuild_and_commit(att, h, root, v, &info, &partial, &path);
    if matches!(outcome, SlotOutcome::Refused { .. }) {
        // Leave no trace of a save that cannot be restored where there was none.
        if made_dir {
            commit::abort_partial(&partial, &file_name);
        } else if made_file {
            let _ = std::fs::remove_file(&path);
        }
    }
    outcome
}

/// Write what staging holds into the partial file, make it exact and durable, describe it
/// and commit it.
fn rebuild_and_commit(
    att: &AttachedArena,
    h: &HeaderView,
    root: &Path,
    v: &SlotView,
    info: &SlotInfo,
    partial: &Path,
    path: &Path,
) -> SlotOutcome {
    let cs = h.geometry.chunk_size;
    let chunk_end = |k: u64| ((k + 1) * cs).min(v.file_len);
    let written_end = v
        .chunks
        .iter()
        .enumerate()
        .filter(|(_, c)| c.0 == chunk_state::WRITTEN)
        .map(|(k, _)| chunk_end(k as u64))
        .max();
    let root_fd = match fsx::open_dir(root) {
        Ok(fd) => fd,
        Err(e) => return classify(e),
    };
    let Some(partial_name) = partial.file_name().and_then(|n| n.to_str()) else {
        return refused(format!("{} has no file name", partial.display()));
    };
    let file_name = v.file_name.as_str();
    if written_end.is_none()
        && let Err(e) = fsx::mkdir_in(root_fd.as_fd(), root, partial_name)
        && !matches!(&e, Error::Io { source, .. } if source.kind() == io::ErrorKind::AlreadyExists)
    {
        return classify(e);
    }
    // The partial directory and the file are opened without following links, and must be
    // a directory and a regular file (never a FIFO: opening does not block).
    let partial_fd = match fsx::open_subdir(root_fd.as_fd(), root, partial_name) {
        Ok(fd) => fd,
        Err(e) if written_end.is_some() && is_not_found(&e) => {
            return refused(format!(
                "{} chunk(s) had been written to {} before the crash, but the file is gone \
                 (an engine opened on this root since then removes partial directories) \
                 and staging no longer holds them",
                info.written,
                path.display()
            ));
        }
        Err(e) => return classify(e),
    };
    let create = if written_end.is_none() {
        fsx::Create::IfMissing
    } else {
        fsx::Create::No
    };
    let file = match fsx::open_file(partial_fd.as_fd(), partial, file_name, true, create, None) {
        Ok(f) => f,
        Err(e) if is_not_found(&e) => {
            return refused(format!(
                "{} chunk(s) had been written to {} before the crash, but the file is gone \
                 (an engine opened on this root since then removes partial directories) \
                 and staging no longer holds them",
                info.written,
                path.display()
            ));
        }
        Err(e) => return classify(e),
    };
    if let Some(need) = written_end {
        match file.metadata() {
            Ok(m) if m.len() >= need => {}
            Ok(m) => {
                return refused(format!(
                    "{} holds {} bytes, but chunks written before the crash reach byte {need}",
                    path.display(),
                    m.len()
                ));
            }
            Err(e) => {
                return SlotOutcome::Failed {
                    error: Error::io("stat", path, e),
                };
            }
        }
    }

    // Write what only staging holds, then make the file exact and durable.
    let mut buf = vec![0u8; IO_PIECE.min(cs as usize)];
    for (k, &(s, idx)) in v.chunks.iter().enumerate() {
        if s != chunk_state::STAGED {
            continue;
        }
        let start = k as u64 * cs;
        let len = chunk_end(k as u64) - start;
        let mut at = 0u64;
        while at < len {
            let n = (len - at).min(buf.len() as u64) as usize;
            if att.read_chunk(idx, at, &mut buf[..n]).is_none() {
                return refused(format!("arena chunk {idx} cannot be read"));
            }
            if let Err(e) = file.write_all_at(&buf[..n], start + at) {
                return SlotOutcome::Failed {
                    error: Error::io_at("write", path, start + at, e),
                };
            }
            at += n as u64;
        }
    }
    if let Err(e) = file.set_len(v.file_len) {
        return SlotOutcome::Failed {
            error: Error::io("ftruncate", path, e),
        };
    }
    if let Err(e) = file.sync_data() {
        return SlotOutcome::Failed {
            error: Error::io("fdatasync", path, e),
        };
    }
    let (entry, metadata) = match describe(&file, path, v, h.rank, h.world_size) {
        Ok(x) => x,
        Err(e) => return classify(e),
    };
    let from_file = info.written;
    let from_staging = info.staged;
    let bytes = entry.bytes;
    match commit::commit(root, v.step, h.world_size, partial, entry, &metadata) {
        Ok(Some(dir)) => SlotOutcome::Committed {
            dir,
            bytes,
            from_staging,
            from_file,
        },
        Ok(None) => SlotOutcome::AwaitingRanks {
            partial: partial.to_owned(),
        },
        Err(e) => classify(e),
    }
}

/// Read the rebuilt file back: parse its safetensors header (it was staged with the data),
/// check it belongs to this save, and checksum every tensor. Returns the manifest entry and
/// the user metadata.
fn describe(
    file: &File,
    path: &Path,
    v: &SlotView,
    rank: u32,
    world_size: u32,
) -> Result<(FileEntry, Metadata)> {
    let mut n8 = [0u8; 8];
    file.read_exact_at(&mut n8, 0)
        .map_err(|e| Error::io_at("read", path, 0, e))?;
    let n = u64::from_le_bytes(n8);
    if n > MAX_HEADER_LEN || 8 + n != v.data_start {
        return Err(Error::corrupt(
            path,
            None,
            format!(
                "staged header length {n} does not match the recorded data start {}",
                v.data_start
            ),
        ));
    }
    let mut hdr = vec![0u8; n as usize];
    file.read_exact_at(&mut hdr, 8)
        .map_err(|e| Error::io_at("read", path, 8, e))?;
    let meta: safetensors::tensor::Metadata = serde_json::from_slice(&hdr)
        .map_err(|e| Error::corrupt(path, None, format!("staged header is not valid: {e}")))?;
    if meta.data_len() as u64 != v.file_len - v.data_start {
        return Err(Error::corrupt(
            path,
            None,
            format!(
                "staged header describes {} data bytes, the save {}",
                meta.data_len(),
                v.file_len - v.data_start
            ),
        ));
    }
    let system = meta.metadata().clone().unwrap_or_default();
    let expect = [
        (META_STEP, v.step.to_string()),
        (META_RANK, rank.to_string()),
        (META_WORLD, world_size.to_string()),
    ];
    for (k, want) in &expect {
        if system.get(*k) != Some(want) {
            return Err(Error::corrupt(
                path,
                None,
                format!(
                    "staged header says {k} = {:?}, the descriptor {want:?}",
                    system.get(*k)
                ),
            ));
        }
    }
    let user: Metadata = system
        .into_iter()
        .filter(|(k, _)| !k.starts_with(RESERVED_PREFIX))
        .collect();

    let mut tensors = Vec::new();
    let mut buf = vec![0u8; IO_PIECE];
    for name in meta.offset_keys() {
        let info = meta.info(&name).expect("offset_keys names known tensors");
        let dtype: Dtype = format!("{:?}", info.dtype)
            .parse()
            .map_err(|e| Error::corrupt(path, Some(&name), format!("{e}")))?;
        let [b, e] = [info.data_offsets.0 as u64, info.data_offsets.1 as u64];
        let mut crc = 0u32;
        let mut at = v.data_start + b;
        let end = v.data_start + e;
        while at < end {
            let k = (end - at).min(buf.len() as u64) as usize;
            file.read_exact_at(&mut buf[..k], at)
                .map_err(|err| Error::io_at("read", path, at, err))?;
            crc = crc32c::crc32c_append(crc, &buf[..k]);
            at += k as u64;
        }
        tensors.push(TensorEntry {
            name,
            dtype,
            shape: info.shape.clone(),
            data_offsets: [b, e],
            crc32c: crc,
        });
    }
    let entry = FileEntry {
        rank,
        file: v.file_name.clone(),
        bytes: v.file_len,
        data_start: v.data_start,
        tensors,
    };
    // The manifest built from this entry must pass the reader's own checks.
    let probe = Manifest {
        format_version: FORMAT_VERSION,
        step: v.step,
        world_size,
        created_unix_ms: 0,
        total_bytes: entry.bytes,
        metadata: user.clone(),
        files: vec![entry.clone()],
    };
    let bytes = serde_json::to_vec(&probe).expect("manifests serialize");
    Manifest::parse(&bytes, path)?;
    Ok((entry, user))
}
