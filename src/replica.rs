//! Peer replicas: a rank's committed checkpoint file held in the shared memory of ranks on
//! other machines, so that losing a machine does not lose its ranks' latest step
//! (`docs/replicas.md`).
//!
//! This module is the protocol: which ranks hold whose image ([`plan`]), what a replica is
//! called in `/dev/shm` ([`replica_name`]), and the checks every image passes before it is
//! stored, served or written back ([`verify_image`]: exactly the size the committed
//! manifest of its step says, a safetensors header describing exactly the manifest's
//! tensors, every tensor's CRC-32C equal to the manifest's), and the step every rank loads
//! for "latest" once the ranks told each other what they can load ([`agree`]). The
//! transport (torch.distributed) is the Python package's (`shmckpt/replicas.py`).
//!
//! Nothing read from `/dev/shm` or received from a peer is trusted: replica files are
//! opened without following a link, must be regular files of this user of exactly the
//! manifest's size, and are checked in full on every read.

use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::fsx::{self, Create};
use crate::manifest::{FileEntry, list_committed};
use crate::staging::shm::SHM_MOUNT;
use crate::tensor::AlignedBytes;
use std::io::Read;

pub mod agree;
mod check;
mod incoming;
mod outgoing;
mod prepared;

pub use crate::staging::held::{HeldCell, HeldImage, HeldPiece, HeldView};
#[cfg(test)]
use check::crcs;
use check::{check_bytes, mem_len};
pub use incoming::{Incoming, IncomingState};
pub use outgoing::Outgoing;
pub use prepared::PreparedArena;

/// Prefix of every replica's name in `/dev/shm` (not under `shmckpt.`, so that arena
/// listings and recovery never take a replica for a staging arena).
pub const REPLICA_PREFIX: &str = "shmckpt-replica.";

/// Suffix of the file beside a memory-only step's replica that holds its sender's manifest
/// entry (`<replica name>.entry`): what a load needs to complete that step's commit for a
/// lost rank ([`memory_entry`]). Not a replica's name: never listed or served as one.
pub const ENTRY_SUFFIX: &str = ".entry";

/// The largest entry file read back ([`memory_entry`]): anything longer is refused.
const MAX_ENTRY_BYTES: u64 = 64 << 20;

/// The name of the entry file beside the replica `replica` ([`ENTRY_SUFFIX`]).
pub fn entry_name(replica: &str) -> String {
    format!("{replica}{ENTRY_SUFFIX}")
}

/// `(replica name, writer pid)` of an entry file (`<replica>.entry`, pid `None`) or of its
/// temporary file (`<replica>.entry.tmp<pid>`); `None` for any other name.
fn parse_entry_name(name: &str) -> Option<(&str, Option<u32>)> {
    let (base, pid) = match name.rsplit_once(".tmp") {
        Some((b, p)) if b.ends_with(ENTRY_SUFFIX) => (b, Some(parse_pid(p)?)),
        _ => (name, None),
    };
    let replica = base.strip_suffix(ENTRY_SUFFIX)?;
    parse_replica_name(replica)?;
    Some((replica, pid))
}

/// Write `entry`, the entry a memory-only step's replica `name` was checked against, beside
/// it in `/dev/shm` (a new temporary file of this user, never through a link, renamed to
/// `<name>.entry`).
fn write_memory_entry(name: &str, entry: &FileEntry) -> Result<()> {
    let bytes = serde_json::to_vec(entry).map_err(|e| Error::Internal(format!("entry: {e}")))?;
    let ename = entry_name(name);
    let tmp = format!("{ename}.tmp{}", std::process::id());
    write_atomic(Path::new(SHM_MOUNT), &ename, &tmp, &bytes, false).map(|_| ())
}

/// The entry kept beside this user's replica of `rank`'s image of the memory-only `step`
/// of `root` (its sender's: names, dtypes, shapes, offsets, CRC-32Cs, size), read back
/// and checked: a regular file of this user (never through a link) of at most 64 MiB, a
/// manifest entry of `rank` that passes the checks of every manifest's entries. Nothing
/// here says the replica matches it: [`Incoming::serve_memory`] checks the image against
/// it in full before it is sent.
pub fn memory_entry(root: &Path, step: u64, rank: u32) -> Result<FileEntry> {
    let name = replica_name(root, rank, step)?;
    read_memory_entry(&name, rank)
}

fn read_memory_entry(name: &str, rank: u32) -> Result<FileEntry> {
    let dir = Path::new(SHM_MOUNT);
    let ename = entry_name(name);
    let path = dir.join(&ename);
    let dfd = fsx::open_dir(dir)?;
    let file = fsx::open_file(dfd.as_fd(), dir, &ename, false, Create::No, Some(euid()))?;
    let mut bytes = Vec::new();
    file.take(MAX_ENTRY_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::io("read", &path, e))?;
    if bytes.len() as u64 > MAX_ENTRY_BYTES {
        return Err(Error::corrupt(&path, None, "longer than an entry can be"));
    }
    let entry: FileEntry = serde_json::from_slice(&bytes)
        .map_err(|e| Error::corrupt(&path, None, format!("not a manifest entry: {e}")))?;
    check_pending_entry(&entry, rank, &path)?;
    Ok(entry)
}

/// Check `entry` as `rank`'s entry of a step not committed yet (from a peer or from
/// `/dev/shm`): of that rank, passing every manifest entry's checks, not empty.
fn check_pending_entry(entry: &FileEntry, rank: u32, what: &Path) -> Result<()> {
    if entry.rank != rank {
        return Err(Error::corrupt(
            what,
            None,
            format!("the entry is rank {}'s, not rank {rank}'s", entry.rank),
        ));
    }
    entry.validate(what)?;
    if mem_len(entry.bytes, what)? == 0 {
        return Err(Error::corrupt(
            what,
            None,
            "the entry says the file is empty",
        ));
    }
    Ok(())
}

/// Which ranks hold each rank's image: `plan(nodes, k)[r]` lists the `k` ranks that
/// hold rank `r`'s replicas, in the order a load asks them.
///
/// `nodes[r]` names rank `r`'s machine. Machines are ordered by their lowest rank, the
/// ranks of a machine by rank (the local index). The ring: rank `r`, at local index `i`
/// of machine `m`, sends its `j`-th replica (`j` = 1..=k) to the rank at local index
/// `i mod n` of machine `(m + j) mod M` (`n` that machine's rank count, `M` the machine
/// count). Deterministic for a given world; the partners are always on other machines.
/// [`Error::Config`] when `k` is not below the number of machines.
pub fn plan(nodes: &[String], replicas: u32) -> Result<Vec<Vec<u32>>> {
    let mut machines: Vec<(&str, Vec<u32>)> = Vec::new();
    let mut of_rank = Vec::with_capacity(nodes.len());
    for (r, n) in nodes.iter().enumerate() {
        let r = u32::try_from(r).map_err(|_| Error::Config("too many ranks".into()))?;
        let m = match machines.iter().position(|(name, _)| *name == n.as_str()) {
            Some(m) => m,
            None => {
                machines.push((n.as_str(), Vec::new()));
                machines.len() - 1
            }
        };
        of_rank.push((m, machines[m].1.len()));
        machines[m].1.push(r);
    }
    if replicas == 0 {
        return Ok(vec![Vec::new(); nodes.len()]);
    }
    let count = machines.len();
    if replicas as usize >= count {
        return Err(Error::Config(format!(
            "replicas={replicas} needs at least {} machines, the world has {count} ({})",
            replicas as usize + 1,
            machines
                .iter()
                .map(|(n, _)| format!("{n:?}"))
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    Ok(of_rank
        .iter()
        .map(|&(m, i)| {
            (1..=replicas as usize)
                .map(|j| {
                    let ranks = &machines[(m + j) % count].1;
                    ranks[i % ranks.len()]
                })
                .collect()
        })
        .collect())
}

/// FNV-1a 64 of the canonical root's bytes, as 16 hex digits.
fn root_tag(root: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in root.as_os_str().as_bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

fn canonical(root: &Path) -> Result<PathBuf> {
    std::fs::canonicalize(root).map_err(|e| Error::io("canonicalize", root, e))
}

/// The name in `/dev/shm` of the replica of `rank`'s image of `step` of `root`:
/// `shmckpt-replica.<FNV-1a 64 of the canonical root>.r<rank>.s<step>`.
pub fn replica_name(root: &Path, rank: u32, step: u64) -> Result<String> {
    let tag = root_tag(&canonical(root)?);
    Ok(format!("{REPLICA_PREFIX}{tag}.r{rank}.s{step}"))
}

/// `(root tag, source rank, step)` of a replica's name; `None` for any other name.
pub fn parse_replica_name(name: &str) -> Option<(String, u32, u64)> {
    let rest = name.strip_prefix(REPLICA_PREFIX)?;
    let mut parts = rest.split('.');
    let tag = parts.next()?;
    let rank = parts.next()?.strip_prefix('r')?;
    let step = parts.next()?.strip_prefix('s')?;
    if parts.next().is_some()
        || tag.len() != 16
        || !tag.bytes().all(|b| b.is_ascii_hexdigit())
        || rank.is_empty()
        || step.is_empty()
        || !rank.bytes().all(|b| b.is_ascii_digit())
        || !step.bytes().all(|b| b.is_ascii_digit())
        || (rank.len() > 1 && rank.starts_with('0'))
        || (step.len() > 1 && step.starts_with('0'))
    {
        return None;
    }
    Some((tag.to_owned(), rank.parse().ok()?, step.parse().ok()?))
}

/// The committed directory of `step` under `root` and `rank`'s entry in its manifest.
fn committed_entry(root: &Path, step: u64, rank: u32) -> Result<(PathBuf, FileEntry)> {
    let info = list_committed(root)?
        .into_iter()
        .find(|c| c.step == step)
        .ok_or_else(|| Error::NotFound {
            what: format!("committed step {step}"),
            step: Some(step),
            root: root.to_owned(),
        })?;
    let (_, entry) = crate::restore::rank_file(&info.dir, rank)?;
    Ok((info.dir, entry))
}

/// Check `bytes` as `rank`'s image of the committed `step` of `root` (see the module).
pub fn verify_image(root: &Path, step: u64, rank: u32, bytes: &[u8]) -> Result<()> {
    let (_, entry) = committed_entry(root, step, rank)?;
    let what = PathBuf::from(format!("<image of rank {rank}, step {step}>"));
    check_bytes(bytes, &entry, &what)
}

/// Open the regular file `name` of the directory `dir` (never through a link; owned by
/// `uid` when given), which must be exactly `entry.bytes` long: shorter is
/// [`Error::Truncated`], longer is corrupt. Returns the file and its path.
fn open_sized(
    dir: &Path,
    name: &str,
    uid: Option<u32>,
    entry: &FileEntry,
) -> Result<(std::fs::File, PathBuf)> {
    let dfd = fsx::open_dir(dir)?;
    let path = dir.join(name);
    let file = fsx::open_file(dfd.as_fd(), dir, name, false, Create::No, uid)?;
    let actual = file
        .metadata()
        .map_err(|e| Error::io("stat", &path, e))?
        .len();
    if actual != entry.bytes {
        return Err(if actual < entry.bytes {
            Error::Truncated {
                path,
                expected: entry.bytes,
                actual,
            }
        } else {
            Error::corrupt(
                &path,
                None,
                format!("{actual} bytes, the manifest says {}", entry.bytes),
            )
        });
    }
    Ok((file, path))
}

/// `len` bytes of fresh private anonymous memory, readable and writable (zero pages,
/// faulted in on first touch); its owner unmaps it with `len`.
#[allow(unsafe_code)]
fn anonymous_map(len: usize) -> Result<std::ptr::NonNull<u8>> {
    let anon = || std::path::Path::new("(anonymous)");
    // SAFETY: a fresh anonymous mapping with a null hint aliases no existing memory.
    let raw = unsafe {
        rustix::mm::mmap_anonymous(
            std::ptr::null_mut(),
            len,
            rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
            rustix::mm::MapFlags::PRIVATE,
        )
    }
    .map_err(|e| Error::io("mmap", anon(), e.into()))?;
    std::ptr::NonNull::new(raw.cast::<u8>())
        .ok_or_else(|| Error::io("mmap", anon(), std::io::Error::other("null")))
}

/// Read the regular file `name` of the directory `dir` (never through a link; owned by
/// `uid` when given), which must be exactly `entry.bytes` long, and check it.
fn read_checked(
    dir: &Path,
    name: &str,
    uid: Option<u32>,
    entry: &FileEntry,
) -> Result<AlignedBytes> {
    let (file, path) = open_sized(dir, name, uid, entry)?;
    let mut out = AlignedBytes::zeroed(mem_len(entry.bytes, &path)?);
    file.read_exact_at(out.as_bytes_mut(), 0)
        .map_err(|e| Error::io_at("read", &path, 0, e))?;
    check_bytes(out.as_bytes(), entry, &path)?;
    Ok(out)
}

/// `rank`'s committed file of `step` under `root`, read and checked against the manifest:
/// the image a rank sends to its partners.
pub fn read_committed(root: &Path, step: u64, rank: u32) -> Result<AlignedBytes> {
    let (dir, entry) = committed_entry(root, step, rank)?;
    read_checked(&dir, &entry.file.clone(), None, &entry)
}

fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// Write `bytes` as the regular file `name` of `dir` (opened as a directory fd): first to
/// the new temporary name `tmp` (never through a link), flushed, then renamed over `name`,
/// so `name` never holds a partial image.
fn write_atomic(dir: &Path, name: &str, tmp: &str, bytes: &[u8], durable: bool) -> Result<PathBuf> {
    let dfd = fsx::open_dir(dir)?;
    // A rank file's temporary (`.<file>.tmp<pid>`, in a step's directory): those of dead
    // writers go first. Not for the `/dev/shm` names (`<name>.tmp<pid>`), which
    // `remove_stale` sweeps: no listing of `/dev/shm` on every store.
    if tmp
        .strip_prefix('.')
        .is_some_and(|t| t.starts_with(&format!("{name}.tmp")))
    {
        remove_dead_tmps(dfd.as_fd(), dir, name);
    }
    fsx::unlink_in(dfd.as_fd(), dir, tmp)?;
    let path = dir.join(tmp);
    let res = (|| {
        let mut f = fsx::open_file(dfd.as_fd(), dir, tmp, true, Create::New, Some(euid()))?;
        f.write_all(bytes)
            .map_err(|e| Error::io("write", &path, e))?;
        if durable {
            f.sync_all().map_err(|e| Error::io("fsync", &path, e))?;
        }
        rustix::fs::renameat(dfd.as_fd(), tmp, dfd.as_fd(), name)
            .map_err(|e| Error::io("rename", dir.join(name), e.into()))?;
        if durable {
            rustix::fs::fsync(&dfd).map_err(|e| Error::io("fsync", dir, e.into()))?;
        }
        Ok(dir.join(name))
    })();
    if res.is_err() {
        let _ = fsx::unlink_in(dfd.as_fd(), dir, tmp);
    }
    res
}

/// Remove the temporary files `.<file>.tmp<pid>` that writers of `file` in `dir` left when
/// they died (a restore killed before its rename; nothing else removes them from a
/// committed step's directory): names of a pid that is not this process and no longer
/// exists, unlinked without following a link. Failures are logged.
pub(crate) fn remove_dead_tmps(dfd: std::os::fd::BorrowedFd<'_>, dir: &Path, file: &str) {
    let prefix = format!(".{file}.tmp");
    let me = std::process::id();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let Ok(name) = e.file_name().into_string() else {
            continue;
        };
        let dead = name
            .strip_prefix(&prefix)
            .and_then(parse_pid)
            .is_some_and(|pid| pid != me && !process_exists(pid));
        if dead && let Err(err) = fsx::unlink_in(dfd, dir, &name) {
            tracing::warn!(file = %dir.join(&name).display(), error = %err, "could not remove a dead writer's temporary file");
        }
    }
}

/// Store `bytes`, received from a peer as `rank`'s image of `step` of `root`, as a replica
/// in `/dev/shm` once it passes [`verify_image`]; then remove this user's older replicas
/// of the same root and rank. Returns the replica's name. Nothing is stored when the check
/// fails (the error says why).
pub fn store(root: &Path, step: u64, rank: u32, bytes: &[u8]) -> Result<String> {
    verify_image(root, step, rank, bytes)?;
    let tag = tag_of(root)?;
    let name = format!("{REPLICA_PREFIX}{tag}.r{rank}.s{step}");
    let pid = std::process::id();
    write_atomic(
        Path::new(SHM_MOUNT),
        &name,
        &format!("{name}.tmp{pid}"),
        bytes,
        false,
    )?;
    remove_stale(&tag, rank, step, None);
    Ok(name)
}

/// Remove this user's older replicas of the root tagged `tag` and `rank` (any step but
/// `step`), and temporary files of writers of them that died (`<replica name>.tmp<pid>` of
/// a process that no longer exists). Failures are logged.
fn remove_stale(tag: &str, rank: u32, step: u64, keep: Option<u64>) {
    let pid = std::process::id();
    for old in list_names() {
        // Older replicas of this root and rank, and temporary files of writers that died
        // (`<replica name>.tmp<pid>` of a process that no longer exists).
        let stale = match parse_replica_name(&old) {
            Some((t, r, s)) => t == tag && r == rank && s != step && Some(s) != keep,
            // Entry files of those replicas, and temporary entry files of dead writers.
            None if parse_entry_name(&old).is_some() => {
                parse_entry_name(&old).is_some_and(|(base, p)| {
                    parse_replica_name(base).is_some_and(|(t, r, s)| {
                        t == tag
                            && r == rank
                            && match p {
                                None => s != step && Some(s) != keep,
                                Some(p) => p != pid && !process_exists(p),
                            }
                    })
                })
            }
            None => parse_unfinished_name(&old).is_some_and(|(base, p)| {
                parse_replica_name(base).is_some_and(|(t, r, _)| t == tag && r == rank)
                    && p != pid
                    && !process_exists(p)
            }),
        };
        if stale && let Err(e) = remove_own(&old) {
            tracing::warn!(replica = %old, error = %e, "could not remove an older replica");
        }
    }
}

/// Remove this user's replicas of `rank`'s images of `root` other than `step`'s, and the
/// temporary replica files of dead processes for them (what [`Incoming::seal`] does after
/// publishing, and [`Incoming::seal_keeping_older`] leaves to this call).
pub fn remove_older(root: &Path, rank: u32, step: u64) -> Result<()> {
    remove_stale(&tag_of(root)?, rank, step, None);
    Ok(())
}

/// [`remove_older`], keeping the replica of step `keep` too when given: a memory-only
/// step's replica does not replace the replica of the newest committed step, which stays
/// the one a lost rank can load until the memory-only step is committed.
pub fn remove_older_keeping(root: &Path, rank: u32, step: u64, keep: Option<u64>) -> Result<()> {
    remove_stale(&tag_of(root)?, rank, step, keep);
    Ok(())
}

/// This user's replica of `rank`'s image of `step` of `root`, read from `/dev/shm` and
/// checked in full against the committed manifest of `step` (see the module). An error when
/// there is none or it does not match: a replica that fails the check is never served.
pub fn load(root: &Path, step: u64, rank: u32) -> Result<AlignedBytes> {
    let (_, entry) = committed_entry(root, step, rank)?;
    let name = replica_name(root, rank, step)?;
    read_checked(Path::new(SHM_MOUNT), &name, Some(euid()), &entry)
}

/// Write `bytes`, `rank`'s image of the committed `step` of `root` (from a peer), back as
/// that rank's file in the step's directory once it passes [`verify_image`]: written to a
/// temporary name, fsynced, renamed over the file's name (replacing a damaged copy), the
/// directory fsynced. Returns the file's path.
pub fn restore_file(root: &Path, step: u64, rank: u32, bytes: &[u8]) -> Result<PathBuf> {
    let (dir, entry) = committed_entry(root, step, rank)?;
    let what = PathBuf::from(format!("<image of rank {rank}, step {step}>"));
    check_bytes(bytes, &entry, &what)?;
    let tmp = format!(".{}.tmp{}", entry.file, std::process::id());
    write_atomic(&dir, &entry.file, &tmp, bytes, true)
}

/// Names in `/dev/shm` that start with [`REPLICA_PREFIX`], sorted.
fn list_names() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(SHM_MOUNT)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with(REPLICA_PREFIX))
        .collect();
    names.sort();
    names
}

/// A replica in `/dev/shm`, as `shmckpt shm list` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReplicaInfo {
    /// Name in `/dev/shm`.
    pub name: String,
    /// FNV-1a 64 of the canonical root, as in the name.
    pub root_tag: String,
    /// The rank whose image it is.
    pub source_rank: u32,
    /// The step.
    pub step: u64,
    /// Size in bytes (not followed through a link).
    pub bytes: u64,
    /// Owner uid.
    pub owner_uid: u32,
}

/// Every replica in `/dev/shm` (any user's; names that do not parse are left out).
pub fn list() -> Vec<ReplicaInfo> {
    use std::os::unix::fs::MetadataExt;
    list_names()
        .into_iter()
        .filter_map(|name| {
            let (root_tag, source_rank, step) = parse_replica_name(&name)?;
            let m = std::fs::symlink_metadata(Path::new(SHM_MOUNT).join(&name)).ok()?;
            Some(ReplicaInfo {
                name,
                root_tag,
                source_rank,
                step,
                bytes: m.len(),
                owner_uid: m.uid(),
            })
        })
        .collect()
}

/// `(replica name, writer pid)` of the temporary file `<replica name>.tmp<pid>` a replica
/// is written under before it is renamed to its name; `None` for any other name.
pub fn parse_unfinished_name(name: &str) -> Option<(&str, u32)> {
    let (base, pid) = name.rsplit_once(".tmp")?;
    parse_replica_name(base)?;
    Some((base, parse_pid(pid)?))
}

/// The writer's pid a temporary name ends with (`<name>.tmp<pid>`): decimal digits only
/// (no sign, not empty), within `u32`.
fn parse_pid(digits: &str) -> Option<u32> {
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Whether a process `pid` exists (in this PID namespace).
fn process_exists(pid: u32) -> bool {
    Path::new("/proc").join(pid.to_string()).exists()
}

/// A replica's temporary file in `/dev/shm` (`<replica name>.tmp<pid>`): a replica being
/// written, or one whose writer died before renaming it (such a file is removed when the
/// next replica of its root and rank is stored, or by `shmckpt shm rm`). Never served.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct UnfinishedReplica {
    /// Name in `/dev/shm`.
    pub name: String,
    /// The replica's name it was being written for.
    pub replica: String,
    /// The writer's process id, from the name.
    pub writer_pid: u32,
    /// Whether a process of that id exists (in this PID namespace).
    pub writer_alive: bool,
    /// Size in bytes (not followed through a link).
    pub bytes: u64,
    /// Owner uid.
    pub owner_uid: u32,
}

/// Every replica's temporary file in `/dev/shm` (any user's), sorted by name.
pub fn list_unfinished() -> Vec<UnfinishedReplica> {
    use std::os::unix::fs::MetadataExt;
    list_names()
        .into_iter()
        .filter_map(|name| {
            let (replica, writer_pid) = parse_unfinished_name(&name)?;
            let replica = replica.to_owned();
            let m = std::fs::symlink_metadata(Path::new(SHM_MOUNT).join(&name)).ok()?;
            Some(UnfinishedReplica {
                replica,
                writer_pid,
                writer_alive: process_exists(writer_pid),
                bytes: m.len(),
                owner_uid: m.uid(),
                name,
            })
        })
        .collect()
}

/// The tag of `root` as replica names carry it (to pick one root's replicas from [`list`]).
pub fn tag_of(root: &Path) -> Result<String> {
    Ok(root_tag(&canonical(root)?))
}

/// Remove the replica `name` from `/dev/shm`, or a replica's temporary file
/// ([`UnfinishedReplica`]) whose writer no longer exists ([`Error::ArenaInUse`] while it
/// does): this user's regular files only, never following a link.
pub fn remove(name: &str) -> Result<()> {
    if parse_replica_name(name).is_some() {
        remove_own(name)?;
        // The entry beside a memory-only step's replica goes with it.
        let _ = remove_own(&entry_name(name));
        return Ok(());
    }
    match parse_unfinished_name(name) {
        Some((_, pid)) if process_exists(pid) => Err(Error::ArenaInUse {
            name: name.to_owned(),
            reason: format!("its writer, process {pid}, is running"),
        }),
        Some(_) => remove_own(name),
        None => Err(Error::Config(format!("{name:?} is not a replica's name"))),
    }
}

/// Remove `/dev/shm/name` if it is a regular file of this user (never following a link).
fn remove_own(name: &str) -> Result<()> {
    let dir = Path::new(SHM_MOUNT);
    let dfd = fsx::open_dir(dir)?;
    // Checked on an fd opened without following a link, then the name removed.
    let f = fsx::open_file(dfd.as_fd(), dir, name, false, Create::No, Some(euid()))?;
    drop(f);
    fsx::unlink_in(dfd.as_fd(), dir, name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn ring_across_machines() {
        let nodes = names(&["a", "a", "b", "b"]);
        assert_eq!(
            plan(&nodes, 1).unwrap(),
            vec![vec![2], vec![3], vec![0], vec![1]]
        );
        assert_eq!(plan(&nodes, 0).unwrap(), vec![Vec::<u32>::new(); 4]);
        let three = names(&["x", "y", "z", "x", "y", "z"]);
        assert_eq!(
            plan(&three, 2).unwrap(),
            vec![
                vec![1, 2],
                vec![2, 0],
                vec![0, 1],
                vec![4, 5],
                vec![5, 3],
                vec![3, 4]
            ]
        );
        // Unequal machines: the local index wraps.
        let uneven = names(&["a", "a", "a", "b"]);
        assert_eq!(
            plan(&uneven, 1).unwrap(),
            vec![vec![3], vec![3], vec![3], vec![0]]
        );
    }

    #[test]
    fn parallel_crcs_equal_whole_crcs() {
        // Pieces larger than a part (64 MiB) are cut and their parts' CRCs combined.
        let big: Vec<u8> = (0..(65usize << 20) + 3)
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        let small = b"shmckpt".to_vec();
        let pieces: Vec<&[u8]> = vec![&big, &[], &small, &big[1..(64 << 20) + 1]];
        let want: Vec<u32> = pieces.iter().map(|p| crc32c::crc32c(p)).collect();
        assert_eq!(crcs(&pieces), want);
        assert_eq!(crcs(&[]), Vec::<u32>::new());
    }

    #[test]
    fn too_few_machines_is_a_config_error() {
        assert!(matches!(
            plan(&names(&["a", "a"]), 1),
            Err(Error::Config(_))
        ));
        assert!(matches!(
            plan(&names(&["a", "b"]), 2),
            Err(Error::Config(_))
        ));
    }

    #[test]
    fn unfinished_names_parse_and_refuse_others() {
        let base = format!("{REPLICA_PREFIX}0123456789abcdef.r3.s42");
        let n = format!("{base}.tmp1234");
        assert_eq!(parse_unfinished_name(&n), Some((base.as_str(), 1234)));
        for bad in [
            base.clone(),
            format!("{base}.tmp"),
            format!("{base}.tmp+12"),
            format!("{base}.tmp12x"),
            format!("{base}.tmp99999999999"),
            format!("{base}.tmp12.tmp13x"),
            "shmckpt-replica.0123456789abcdef.r03.s42.tmp1".to_owned(),
            ".rank-00000-of-00001.safetensors.tmp1".to_owned(),
        ] {
            assert_eq!(parse_unfinished_name(&bad), None, "{bad}");
        }
    }

    /// A temporary replica file of a dead writer is listed (never as a replica) and
    /// removed by name; one whose writer runs is refused; another user's is never removed.
    #[test]
    fn unfinished_replicas_are_listed_and_removed_only_when_their_writer_is_dead() {
        let tag = format!(
            "{:016x}",
            0xfeed_0000_0000_0000_u64 | u64::from(std::process::id())
        );
        let base = format!("{REPLICA_PREFIX}{tag}.r1.s7");
        // A pid that cannot exist (above the kernel's maximum, 2^22) names a dead writer.
        let dead = format!("{base}.tmp{}", (1u32 << 22) + 1);
        let alive = format!("{base}.tmp{}", std::process::id());
        let shm = Path::new(SHM_MOUNT);
        std::fs::write(shm.join(&dead), b"half").unwrap();
        std::fs::write(shm.join(&alive), b"writing").unwrap();
        let mine: Vec<UnfinishedReplica> = list_unfinished()
            .into_iter()
            .filter(|u| u.replica == base)
            .collect();
        let got: Vec<(&str, bool, u64)> = mine
            .iter()
            .map(|u| (u.name.as_str(), u.writer_alive, u.bytes))
            .collect();
        let mut want = vec![(alive.as_str(), true, 7), (dead.as_str(), false, 4)];
        want.sort();
        assert_eq!(got, want);
        assert!(mine.iter().all(|u| u.owner_uid == euid()));
        assert!(list().iter().all(|r| !r.name.starts_with(&base)));
        assert!(matches!(remove(&alive), Err(Error::ArenaInUse { .. })));
        assert!(shm.join(&alive).exists());
        remove(&dead).unwrap();
        assert!(!shm.join(&dead).exists());
        std::fs::remove_file(shm.join(&alive)).unwrap();
        // A link under such a name is refused, and left.
        std::os::unix::fs::symlink("/etc/hostname", shm.join(&dead)).unwrap();
        assert!(remove(&dead).is_err());
        assert!(shm.join(&dead).is_symlink());
        std::fs::remove_file(shm.join(&dead)).unwrap();
    }

    /// A restore killed before its rename leaves `.<file>.tmp<pid>` in the step's directory:
    /// the next write of that file removes a dead writer's, never a live writer's, another
    /// file's, or a name that only looks alike; a link is removed as a name, never followed.
    #[test]
    fn dead_writers_temporary_files_are_removed_by_the_next_write() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let file = "rank-00000-of-00001.safetensors";
        let dead = format!(".{file}.tmp{}", (1u32 << 22) + 1);
        let alive = format!(".{file}.tmp1");
        let other = format!(".rank-00001-of-00002.safetensors.tmp{}", (1u32 << 22) + 1);
        let alike = format!(".{file}.tmp{}x", (1u32 << 22) + 1);
        let link = format!(".{file}.tmp{}", (1u32 << 22) + 2);
        for n in [&dead, &alive, &other, &alike] {
            std::fs::write(d.join(n), b"half").unwrap();
        }
        let target = tempfile::NamedTempFile::new().unwrap();
        std::os::unix::fs::symlink(target.path(), d.join(&link)).unwrap();
        let tmp = format!(".{file}.tmp{}", std::process::id());
        write_atomic(d, file, &tmp, b"image", true).unwrap();
        let mut left: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().into_string().unwrap())
            .collect();
        left.sort();
        let mut want = vec![file.to_owned(), alive, other, alike];
        want.sort();
        assert_eq!(left, want);
        assert_eq!(std::fs::read(d.join(file)).unwrap(), b"image");
        assert!(target.path().exists(), "a link's target is never touched");
    }

    #[test]
    fn entry_names_parse_and_are_no_replicas() {
        let base = format!("{REPLICA_PREFIX}0123456789abcdef.r3.s42");
        let e = entry_name(&base);
        assert_eq!(parse_entry_name(&e), Some((base.as_str(), None)));
        let t = format!("{e}.tmp77");
        assert_eq!(parse_entry_name(&t), Some((base.as_str(), Some(77))));
        assert_eq!(parse_replica_name(&e), None);
        assert_eq!(parse_unfinished_name(&e), None);
        assert_eq!(parse_unfinished_name(&t), None);
        for bad in [
            base.clone(),
            format!("{base}.tmp5"),
            format!("{e}.tmp"),
            format!("{e}.tmp5x"),
            format!("{e}x"),
            format!("{REPLICA_PREFIX}0123.r3.s42.entry"),
        ] {
            assert_eq!(parse_entry_name(&bad), None, "{bad}");
        }
    }

    /// A replica's entry goes with it: when a newer replica of its root and rank replaces
    /// it, and a dead writer's temporary entry file too; the current one's stays.
    #[test]
    fn stale_entries_are_removed_with_their_replicas() {
        let tag = format!(
            "{:016x}",
            0xbeef_0000_0000_0000_u64 | u64::from(std::process::id())
        );
        let shm = Path::new(SHM_MOUNT);
        let old = format!("{REPLICA_PREFIX}{tag}.r0.s1");
        let new = format!("{REPLICA_PREFIX}{tag}.r0.s2");
        let dead_tmp = format!("{}.tmp{}", entry_name(&new), (1u32 << 22) + 1);
        for n in [&old, &entry_name(&old), &new, &entry_name(&new), &dead_tmp] {
            std::fs::write(shm.join(n), b"x").unwrap();
        }
        remove_stale(&tag, 0, 2, None);
        assert!(!shm.join(&old).exists());
        assert!(!shm.join(entry_name(&old)).exists());
        assert!(!shm.join(&dead_tmp).exists());
        assert!(shm.join(entry_name(&new)).exists());
        remove(&new).unwrap();
        assert!(!shm.join(&new).exists());
        assert!(!shm.join(entry_name(&new)).exists());
    }

    #[test]
    fn names_round_trip_and_refuse_others() {
        let n = format!("{REPLICA_PREFIX}0123456789abcdef.r3.s42");
        assert_eq!(
            parse_replica_name(&n),
            Some(("0123456789abcdef".into(), 3, 42))
        );
        for bad in [
            "shmckpt-replica.0123456789abcdef.r3.s42.tmp1",
            "shmckpt-replica.0123456789abcdef.r03.s42",
            "shmckpt-replica.0123456789abcdef.r3.s",
            "shmckpt-replica.0123.r3.s4",
            "shmckpt-replica.0123456789abcdeg.r3.s4",
            "shmckpt-replica.0123456789abcdef.r99999999999.s4",
            "shmckpt.keep-0123456789abcdef.r3",
        ] {
            assert_eq!(parse_replica_name(bad), None, "{bad}");
        }
    }
}
