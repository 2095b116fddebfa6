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
//!
//! The module is split by concern: `inspect` reads arenas without changing them (listing,
//! owner liveness), `rebuild` turns one staged slot into a committed checkpoint, and
//! `report` holds what recovery returns.
#![forbid(unsafe_code)]

pub(crate) mod inspect;
mod rebuild;
mod report;

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::commit;
use crate::error::{Error, Result};
use crate::staging::AttachedArena;
use crate::staging::attach::AttachOptions;
use crate::staging::descriptor::{chunk_state, slot_state};

pub use inspect::{
    ArenaDetails, ArenaInfo, Owner, SlotInfo, SlotState, inspect_arena, list_arenas,
};
pub use report::{RecoveryReport, SlotOutcome, SlotRecovery};

use inspect::{details_of, owner_status, used_slots};
pub(crate) use rebuild::StagedStep;
use rebuild::recover_slot;

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
    recover_impl(name, root_override, LockPolicy::Take, opts, None, None)
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
                recover_impl(&name, Some(root), LockPolicy::Take, opts, None, None)
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

/// What an engine being opened can take over from its dead predecessor ([`on_open`]):
/// flash restore's arena `name` of its root and rank, when its layout is the one the
/// engine would create and it saved for the same world size and session. Its newest save,
/// when fully staged and newer than every other save in it, is then left staged
/// ([`SlotOutcome::Adopted`]) for the engine to hold as its memory-only step instead of
/// being written to disk before the open returns.
#[derive(Debug, Clone)]
pub(crate) struct AdoptSpec {
    pub(crate) name: String,
    pub(crate) geometry: crate::staging::descriptor::Geometry,
    pub(crate) world_size: u32,
    pub(crate) session: Option<String>,
}

/// A save [`on_open`] left staged in arena `name` for the engine to adopt: its slot as read
/// then, and its layout, read and checked; and the older saves of the arena left staged
/// for the engine to recover behind its open ([`SlotOutcome::Behind`]), as read then.
#[derive(Debug, Clone)]
pub(crate) struct Deferred {
    pub(crate) name: String,
    pub(crate) view: crate::staging::descriptor::SlotView,
    pub(crate) staged: StagedStep,
    pub(crate) behind: Vec<crate::staging::descriptor::SlotView>,
}

/// What [`crate::Engine::open`] recovered from dead engines' arenas.
#[derive(Debug, Default)]
pub(crate) struct OpenRecovery {
    /// A save left staged for the engine to adopt (its report's outcome
    /// [`SlotOutcome::Adopted`]); [`OpenRecovery::recover_deferred`] commits it instead
    /// when the engine cannot take it over.
    pub(crate) deferred: Option<Deferred>,
    /// The step the engine took over and holds in memory (the deferred save, held).
    pub(crate) held: Option<u64>,
    /// One report per arena recovery handled.
    pub(crate) reports: Vec<RecoveryReport>,
    /// Arenas of dead engines of the root and rank still holding saves to recover.
    pub(crate) unrecovered: Vec<String>,
    /// Threads freeing the memory of the dead arenas removed (names already unlinked):
    /// freeing a 12 GiB segment's pages takes ~1 s, which the open need not wait for.
    pub(crate) freeing: Vec<std::thread::JoinHandle<()>>,
}

impl OpenRecovery {
    /// Whether removed arenas' memory may still be being freed.
    pub(crate) fn is_freeing(&self) -> bool {
        !self.freeing.is_empty()
    }

    /// The deferred save could not be taken over: recover its arena now, as without
    /// adoption (its newest recovered step becomes the kept image), and report the slot's
    /// real outcome in place of [`SlotOutcome::Adopted`].
    pub(crate) fn recover_deferred(&mut self, root: &Path) {
        let Some(d) = self.deferred.take() else {
            return;
        };
        let r = recover_impl(
            &d.name,
            Some(root),
            LockPolicy::Held,
            RecoverOptions::default(),
            Some(&mut self.freeing),
            None,
        );
        let Some(prev) = self.reports.iter_mut().find(|r| r.arena == d.name) else {
            return;
        };
        match r {
            Ok(r) => {
                for s in r.slots {
                    match prev.slots.iter_mut().find(|p| p.slot == s.slot) {
                        Some(p) => p.outcome = s.outcome,
                        None => prev.slots.push(s),
                    }
                }
                prev.kept = r.kept;
                prev.removed = r.removed;
            }
            Err(e) => {
                tracing::warn!(arena = %d.name, error = %e, "staging arena not recovered");
                for p in prev.slots.iter_mut().filter(|p| p.slot == d.view.slot) {
                    p.outcome = SlotOutcome::Refused {
                        reason: format!("not taken over, and not recovered: {e}"),
                    };
                }
            }
        }
    }

    /// Wait until the removed arenas' memory is free (an arena that did not fit in
    /// `/dev/shm` while they were freed is then tried again).
    pub(crate) fn wait_freed(&mut self) {
        for h in self.freeing.drain(..) {
            let _ = h.join();
        }
    }
}

/// Drop `att`, an arena whose name is unlinked already, on a thread of its own pushed to
/// `freeing` (the memory is freed when its last descriptor closes); inline when no thread
/// can be started.
fn free_behind(att: AttachedArena, freeing: &mut Vec<std::thread::JoinHandle<()>>) {
    if let Ok(h) = std::thread::Builder::new()
        .name("shmckpt-free-arena".into())
        .spawn(move || drop(att))
    {
        freeing.push(h);
    }
}

/// Run by [`crate::Engine::open`] (with the rank's root lock held) before stale partial
/// directories are cleaned. With `recover` on, recover the arenas of dead engines of this
/// root and rank, and log what happened; either way, name (and log) the dead engines'
/// arenas left holding saves to recover (recovery off, or failed for them).
///
/// With `adopt`, the newest save of that kept arena may be left staged for the engine
/// ([`AdoptSpec`], [`OpenRecovery::deferred`]).
pub(crate) fn on_open(
    root: &Path,
    rank: u32,
    recover: bool,
    adopt: Option<&AdoptSpec>,
) -> OpenRecovery {
    let mut out = OpenRecovery::default();
    for (name, in_use) in arenas_of(root, Some(rank), RecoverOptions::default()) {
        if in_use {
            tracing::debug!(arena = %name, "staging arena of this root is in use; not recovering");
            continue;
        }
        if !recover {
            continue;
        }
        let mut deferred = None;
        let defer = adopt
            .filter(|a| a.name == name && out.deferred.is_none())
            .map(|a| (a, &mut deferred));
        let r = recover_impl(
            &name,
            Some(root),
            LockPolicy::Held,
            RecoverOptions::default(),
            Some(&mut out.freeing),
            defer,
        );
        if deferred.is_some() {
            out.deferred = deferred;
        }
        match r {
            Ok(r) => out.reports.push(r),
            Err(e) => tracing::warn!(arena = %name, error = %e, "staging arena not recovered"),
        }
    }
    // What is left of dead predecessors that holds nothing to recover (recovery off, or
    // an arena recovery could not handle as a whole) is removed: a crash leaks no
    // `/dev/shm`.
    for a in arenas_of_dead(root, rank) {
        if a.slots.iter().any(SlotInfo::recoverable) {
            out.unrecovered.push(a.name);
            continue;
        }
        match remove_dead(&a.name) {
            Ok(att) => {
                free_behind(att, &mut out.freeing);
                tracing::warn!(arena = %a.name, owner_pid = a.owner_pid, "removed a dead engine's staging arena (nothing to recover)");
            }
            Err(e) => {
                tracing::warn!(arena = %a.name, error = %e, "could not remove a dead engine's staging arena");
            }
        }
    }
    // A predecessor killed while creating its arena (between `shm_open` and the header's
    // first write) left a segment of zeros, which names no root: removed by the next
    // open of its rank once the pid in its name is gone.
    for name in unwritten_of_dead(rank) {
        let path = Path::new(crate::staging::shm::SHM_MOUNT).join(&name);
        match std::fs::remove_file(&path) {
            Ok(()) => {
                tracing::warn!(arena = %name, "removed a dead engine's never-written staging arena");
            }
            Err(e) => {
                tracing::warn!(arena = %name, error = %e, "could not remove a dead engine's never-written staging arena");
            }
        }
    }
    if !out.unrecovered.is_empty() {
        tracing::warn!(
            root = %root.display(),
            rank,
            arenas = ?out.unrecovered,
            recover_on_open = recover,
            "staging arenas of dead engines of this root hold saves to recover; they and \
             their partial directories are kept: run `shmckpt recover`"
        );
    }
    out
}

/// This user's staging arenas of `rank` (`shmckpt.<pid>.r<rank>.<n>`, regular files) whose
/// first page is all zeros (the header was never written) and whose pid no longer exists
/// (not merely "does not map it": a live creator maps its segment only after sizing it).
fn unwritten_of_dead(rank: u32) -> Vec<String> {
    use std::io::Read;
    let me = rustix::process::geteuid().as_raw();
    let Ok(rd) = std::fs::read_dir(crate::staging::shm::SHM_MOUNT) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in rd.flatten() {
        let Some(name) = e.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        let Some(rest) = name.strip_prefix(crate::staging::NAME_PREFIX) else {
            continue;
        };
        let parts: Vec<&str> = rest.split('.').collect();
        let [pid, r, n] = parts[..] else { continue };
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        let (Ok(pid), Some(Ok(r))) = (
            pid.parse::<i32>(),
            r.strip_prefix('r').map(str::parse::<u32>),
        ) else {
            continue;
        };
        if r != rank || !digits(n) || pid <= 0 || pid as u32 == std::process::id() {
            continue;
        }
        let gone = rustix::process::Pid::from_raw(pid)
            .is_some_and(|p| rustix::process::test_kill_process(p) == Err(rustix::io::Errno::SRCH));
        if !gone {
            continue;
        }
        let path = e.path();
        let Ok(m) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if !m.file_type().is_file() || m.uid() != me {
            continue;
        }
        let Ok(f) = crate::fsx::open_path(&path, false) else {
            continue;
        };
        let mut page = Vec::with_capacity(4096);
        if f.take(4096).read_to_end(&mut page).is_ok() && page.iter().all(|&b| b == 0) {
            out.push(name);
        }
    }
    out
}

/// A staging arena of a dead (or cleanly closed) engine, as [`arenas_of_dead`] finds it.
struct DeadArena {
    name: String,
    owner_pid: u32,
    slots: Vec<SlotInfo>,
}

/// This user's staging arenas (not flash restore's kept ones) of dead or closed engines of
/// `root` and `rank`, readable regular files only (links and other users' segments are
/// never read: [`list_arenas`]).
fn arenas_of_dead(root: &Path, rank: u32) -> Vec<DeadArena> {
    let want = std::fs::canonicalize(root).unwrap_or_else(|_| root.to_owned());
    list_arenas()
        .into_iter()
        .filter(|a| !crate::staging::is_kept_name(&a.name))
        .filter_map(|a| {
            let d = a.details.ok()?;
            ((d.root == want || d.root == root) && d.rank == rank && !d.in_use()).then_some(
                DeadArena {
                    name: a.name,
                    owner_pid: d.owner_pid,
                    slots: d.slots,
                },
            )
        })
        .collect()
}

/// Remove the staging arena `/dev/shm/<name>` of a dead engine (`shmckpt shm rm`): a
/// `shmckpt.` segment of this user, never through a link, whose owner is dead (or closed
/// its engine cleanly). Whatever saves it still holds are lost (`shmckpt recover` first
/// commits them). [`Error::ArenaInUse`] when its owner may be running, or when that cannot
/// be told (its descriptor cannot be read); [`Error::UnsafePath`] for a link, a non-regular
/// file or another user's segment; [`Error::Config`] for a name that is not a staging
/// arena's (flash restore's kept arenas: [`crate::flash::remove_kept`]).
pub fn remove_dead_arena(name: &str) -> Result<()> {
    remove_dead(name).map(drop)
}

/// [`remove_dead_arena`], returning the arena attached (its name unlinked): its memory is
/// freed when the caller drops it.
fn remove_dead(name: &str) -> Result<AttachedArena> {
    if !name.starts_with(crate::staging::NAME_PREFIX)
        || name.contains('/')
        || crate::staging::is_kept_name(name)
    {
        return Err(Error::Config(format!(
            "{name:?} is not a staging arena's name"
        )));
    }
    let path = Path::new(crate::staging::shm::SHM_MOUNT).join(name);
    let m = std::fs::symlink_metadata(&path).map_err(|e| Error::io("stat", &path, e))?;
    if !m.file_type().is_file() || m.uid() != rustix::process::geteuid().as_raw() {
        return Err(Error::UnsafePath {
            path,
            reason: "not a regular file of this user".into(),
        });
    }
    let att = AttachedArena::open(name).map_err(|e| Error::ArenaInUse {
        name: name.to_owned(),
        reason: format!(
            "whether its owner is running cannot be told (its descriptor cannot be read: {e})"
        ),
    })?;
    let h = att.header();
    let owner = owner_status(h.owner_pid, name);
    if owner.is_alive() && !h.closed {
        return Err(Error::ArenaInUse {
            name: name.to_owned(),
            reason: format!("its owner, pid {}, is {owner}", h.owner_pid),
        });
    }
    att.unlink().map_err(|e| Error::io("remove", &path, e))?;
    Ok(att)
}

fn refuse(name: &str, reason: impl Into<String>) -> Error {
    Error::Recovery {
        arena: name.to_owned(),
        reason: reason.into(),
    }
}

/// `freeing`: where the open keeps the threads freeing a removed arena's memory (`None`:
/// freed before returning). `defer`: the save an opening engine can adopt is left staged
/// and described there ([`adoptable`]).
fn recover_impl(
    name: &str,
    root_override: Option<&Path>,
    lock: LockPolicy,
    opts: RecoverOptions,
    freeing: Option<&mut Vec<std::thread::JoinHandle<()>>>,
    defer: Option<(&AdoptSpec, &mut Option<Deferred>)>,
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
        let mut behind = Vec::new();
        let adopted = defer.and_then(|(spec, out)| {
            let (view, staged) = adoptable(&att, &h, &root, &slots, spec)?;
            let slot = view.slot;
            behind = recoverable_behind(&h, &slots, &view);
            *out = Some(Deferred {
                name: name.to_owned(),
                view,
                staged,
                behind: behind.clone(),
            });
            Some(slot)
        });
        for v in &slots {
            let left = if adopted == Some(v.slot) {
                Some(SlotOutcome::Adopted)
            } else if behind.iter().any(|b| b.slot == v.slot) {
                Some(SlotOutcome::Behind)
            } else {
                None
            };
            if let Some(outcome) = left {
                tracing::info!(arena = %name, step = v.step, ?outcome, "staged save left for the opening engine");
                report.slots.push(SlotRecovery {
                    slot: v.slot,
                    step: v.step,
                    state: SlotState::from_raw(v.state),
                    outcome,
                });
                continue;
            }
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
    let adopting = report
        .slots
        .iter()
        .any(|s| matches!(s.outcome, SlotOutcome::Adopted | SlotOutcome::Behind));
    let kept_step = if failed == 0 && !adopting && crate::staging::is_kept_name(name) {
        keep_newest_recovered(&att, name, &slots, &report)
    } else {
        None
    };
    if failed > 0 {
        let why = format!(
            "{failed} save(s) failed (I/O errors or unsafe entries in the way); the arena is kept: \
             fix the cause and run \
             `shmckpt recover --shm {name}` again"
        );
        tracing::warn!(arena = %name, "{why}");
        report.kept = Some(why);
    } else if crate::staging::is_kept_name(name) {
        // Flash restore's arena: its committed image stays for the next engine (`shmckpt
        // shm rm` removes it).
        report.kept = Some(match kept_step {
            None if adopting => {
                "taken over by the opening engine, its newest save held in memory".into()
            }
            Some(step) => format!(
                "kept for flash restore, with recovered step {step} as its image (`shmckpt shm rm` removes it)"
            ),
            None => "kept for flash restore (`shmckpt shm rm` removes it)".into(),
        });
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
    if report.removed
        && let Some(freeing) = freeing
    {
        free_behind(att, freeing);
    }
    Ok(report)
}

/// The save of `slots` (the used slots of `att`, header `h`, sorted by step) an opening
/// engine can hold in memory instead of recovery committing it ([`AdoptSpec`]): the arena
/// is `spec`'s (layout, world size); the newest slot is the only one of its step, fully
/// staged (the chunks a disk save in flight had written read back from its file first,
/// [`rebuild::restage_written`]) and checked ([`rebuild::staged_step`]), of `spec`'s
/// session, and nothing exists under its step's name in `root` (a committed step is
/// recovery's to report).
fn adoptable(
    att: &AttachedArena,
    h: &crate::staging::descriptor::HeaderView,
    root: &Path,
    slots: &[crate::staging::descriptor::SlotView],
    spec: &AdoptSpec,
) -> Option<(crate::staging::descriptor::SlotView, StagedStep)> {
    if h.geometry != spec.geometry || h.world_size != spec.world_size {
        return None;
    }
    // The newest save that returned from `save` (`STAGED`): a save still `STAGING` at the
    // crash never did, recovery refuses it whatever its step (a trainer that saves every
    // step is killed inside the next save's staging most of the time), and its chunks are
    // none of the staged saves' (those were out of the pool while it staged).
    let v = slots.iter().rfind(|x| x.state == slot_state::STAGED)?;
    let alone = slots
        .iter()
        .filter(|x| x.slot != v.slot && x.step >= v.step)
        .all(|x| x.step > v.step && x.state == slot_state::STAGING);
    if !alone {
        return None;
    }
    let name = crate::manifest::step_dir_name(v.step);
    let free = crate::fsx::open_dir(root)
        .and_then(|d| crate::fsx::entry_kind(std::os::fd::AsFd::as_fd(&d), root, &name))
        .is_ok_and(|k| k.is_none());
    if !free {
        tracing::debug!(
            step = v.step,
            "staged save not adoptable ({name} exists): recovered to disk"
        );
        return None;
    }
    // A disk save in flight at the crash had chunks written already: they are read back
    // from its file into the arena, so the save is whole in memory again.
    let restaged;
    let v = if v.chunks.iter().any(|c| c.0 == chunk_state::WRITTEN) {
        match rebuild::restage_written(att, h, root, v) {
            Ok(now) => {
                restaged = now;
                &restaged
            }
            Err(why) => {
                tracing::info!(step = v.step, reason = %why, "staged save not read back into staging: recovered to disk");
                return None;
            }
        }
    } else {
        v
    };
    let why = match rebuild::staged_step(att, h, v) {
        Ok(st) if st.entry.session == spec.session => return Some((v.clone(), st)),
        Ok(_) => "saved by another session".into(),
        Err(why) => why,
    };
    tracing::debug!(step = v.step, reason = %why, "staged save not adoptable: recovered to disk");
    None
}

/// The other saves of `slots` (used slots of an arena with header `h`) an opening engine
/// that adopts `adopted` recovers behind its open: those older than it, `STAGED`, every
/// chunk staged or written, the staged ones in distinct in-range arena chunks that are
/// none of `adopted`'s (the engine holds them out of its pool until their recovery ends).
/// The others are recovered at once.
fn recoverable_behind(
    h: &crate::staging::descriptor::HeaderView,
    slots: &[crate::staging::descriptor::SlotView],
    adopted: &crate::staging::descriptor::SlotView,
) -> Vec<crate::staging::descriptor::SlotView> {
    use crate::staging::descriptor::{chunk_state, slot_state};
    let mut taken: std::collections::BTreeSet<u32> =
        adopted.chunks.iter().map(|&(_, i)| i).collect();
    let mut out = Vec::new();
    for v in slots {
        if v.slot == adopted.slot || v.step >= adopted.step || v.state != slot_state::STAGED {
            continue;
        }
        let staged: Vec<u32> = v
            .chunks
            .iter()
            .filter(|c| c.0 == chunk_state::STAGED)
            .map(|c| c.1)
            .collect();
        let sound = v
            .chunks
            .iter()
            .all(|c| c.0 == chunk_state::STAGED || c.0 == chunk_state::WRITTEN)
            && staged.iter().all(|&i| u64::from(i) < h.geometry.n_chunks)
            && {
                let mut mine = std::collections::BTreeSet::new();
                staged
                    .iter()
                    .all(|&i| mine.insert(i) && !taken.contains(&i))
            };
        if sound {
            taken.extend(staged);
            out.push(v.clone());
        }
    }
    out
}

/// Recover slot `v` of `att` (header `h`, read before the arena was taken over) into
/// `root`, as recovery at open would: for an engine that took the arena over and recovers
/// its older saves behind its open ([`SlotOutcome::Behind`]). The caller holds the slot's
/// staged chunks out of its pool meanwhile, each until `on_written` says it is on the
/// device (then the caller records it `WRITTEN` and may give it back).
pub(crate) fn recover_behind(
    att: &AttachedArena,
    h: &crate::staging::descriptor::HeaderView,
    root: &Path,
    v: &crate::staging::descriptor::SlotView,
    on_written: Option<rebuild::OnWritten<'_>>,
) -> SlotOutcome {
    let outcome = rebuild::recover_slot_with(att, h, root, v, on_written);
    log_outcome(att.name(), v.step, &outcome);
    outcome
}

/// Flash restore's arena `name`, every save in it recovered: the newest step committed from
/// it whose bytes are all still in the arena (a memory-only save's) becomes its kept image
/// ([`AttachedArena::keep_recovered`]), replacing an older one, so the next engine of the
/// root and rank serves that step from memory (checked by CRC-32C against the manifest
/// recovery just wrote) instead of reading the file back. `views`: the recovered slots as
/// read before recovery, in the order of `report.slots`. Returns the step kept.
fn keep_newest_recovered(
    att: &AttachedArena,
    name: &str,
    views: &[crate::staging::descriptor::SlotView],
    report: &RecoveryReport,
) -> Option<u64> {
    use crate::staging::descriptor::{chunk_state, slot_state};
    let v = report
        .slots
        .iter()
        .zip(views)
        .filter(|(r, v)| {
            matches!(
                r.outcome,
                SlotOutcome::Committed { .. } | SlotOutcome::AlreadyCommitted { .. }
            ) && r.slot == v.slot
                && !v.chunks.is_empty()
                && v.chunks.iter().all(|&(s, _)| s == chunk_state::STAGED)
        })
        .map(|(_, v)| v)
        .max_by_key(|v| v.step)?;
    // The image kept before (an older disk save's): given up for the newer one; a newer
    // one (never written by an engine, whose saves are newer than its kept image) wins.
    let mut older = Vec::new();
    for s in 0..att.slot_count() {
        match att.try_slot(s) {
            Ok(k) if k.state == slot_state::KEPT && k.step > v.step => return None,
            Ok(k) if k.state == slot_state::KEPT => older.push(s),
            _ => {}
        }
    }
    for s in older {
        if let Err(e) = att.release_slot(s) {
            tracing::warn!(arena = %name, slot = s, error = %e, "could not give the older kept image up");
            return None;
        }
    }
    match att.keep_recovered(v) {
        Ok(()) => {
            tracing::info!(arena = %name, step = v.step, "recovered step kept in the arena for flash restore");
            Some(v.step)
        }
        Err(e) => {
            tracing::warn!(arena = %name, step = v.step, error = %e, "recovered step not kept for flash restore");
            None
        }
    }
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
        SlotOutcome::Adopted => {
            tracing::info!(
                arena,
                step,
                "staged save held in memory by the opening engine"
            )
        }
        SlotOutcome::Behind => {
            tracing::info!(arena, step, "staged save recovered behind the open")
        }
        SlotOutcome::Refused { reason } => {
            tracing::warn!(arena, step, reason = %reason, "staged save cannot be recovered")
        }
        SlotOutcome::Failed { error } => {
            tracing::error!(arena, step, error = %error, "recovery of a staged save failed")
        }
    }
}
