//! Rebuilding one fully staged save into `root/step-N.partial/`, making it durable and
//! committing it. Every entry under the root is examined without following links and
//! opened relative to the root's directory fd.
#![forbid(unsafe_code)]

use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::{SlotInfo, SlotOutcome, SlotState};
use crate::commit;
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::fsx;
use crate::manifest::{
    FileEntry, MANIFEST, Metadata, TensorEntry, partial_dir_name, rank_file_name, step_dir_name,
};
use crate::plan::{
    DATA_ALIGN, MAX_HEADER_LEN, META_RANK, META_SESSION, META_STEP, META_WORLD, RESERVED_PREFIX,
};
use crate::restore::{CrcPiece, combine_crcs, file_crc_pieces};
use crate::staging::AttachedArena;
use crate::staging::descriptor::{HeaderView, SlotView, chunk_state};

/// Bytes copied or read per call while rebuilding and checksumming a file.
const IO_PIECE: usize = 4 << 20;

/// Run `job(index, item, buffer)` on every item of `items`, dealt round-robin to
/// [`crate::util::threads_for`] threads (a buffer per thread); the first error by item
/// order (a failed job stops the others' remaining items), else `Ok`.
fn in_lanes<T: Sync, E: Send>(
    items: &[T],
    job: impl Fn(usize, &T, &mut Vec<u8>) -> std::result::Result<(), E> + Sync,
    panicked: impl Fn() -> E,
) -> std::result::Result<(), E> {
    use std::sync::atomic::{AtomicBool, Ordering};
    let threads = crate::util::threads_for(items.len());
    let stop = AtomicBool::new(false);
    let (job, stop) = (&job, &stop);
    let errors: Vec<Option<(usize, E)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                scope.spawn(move || {
                    let mut buf = Vec::new();
                    for (i, item) in items.iter().enumerate().skip(t).step_by(threads) {
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        if let Err(e) = job(i, item, &mut buf) {
                            stop.store(true, Ordering::Relaxed);
                            return Some((i, e));
                        }
                    }
                    None
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Some((0, panicked()))))
            .collect()
    });
    match errors.into_iter().flatten().min_by_key(|(i, _)| *i) {
        Some((_, e)) => Err(e),
        None => Ok(()),
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

/// Called by [`recover_slot_with`] once file chunk `k`, staged in arena chunk `index`, is
/// written to the file and its pages are on the device (`sync_file_range` waited for
/// them, and reported no error): a chunk the caller may record `WRITTEN` and give back.
pub(crate) type OnWritten<'a> = &'a (dyn Fn(u64, u32) + Sync);

pub(super) fn recover_slot(
    att: &AttachedArena,
    h: &HeaderView,
    root: &Path,
    v: &SlotView,
) -> SlotOutcome {
    recover_slot_with(att, h, root, v, None)
}

/// [`recover_slot`], calling `on_written` for each staged chunk once it is on the device.
pub(super) fn recover_slot_with(
    att: &AttachedArena,
    h: &HeaderView,
    root: &Path,
    v: &SlotView,
    on_written: Option<OnWritten<'_>>,
) -> SlotOutcome {
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
    let file_name = rank_file_name(h.rank, h.world_size);
    if !descriptor_consistent(h, v) {
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
    let outcome = rebuild_and_commit(att, h, root, v, &info, (&partial, &path), on_written);
    if matches!(outcome, SlotOutcome::Refused { .. }) {
        // Leave no trace of a save that cannot be restored where there was none.
        // A refusal after the commit wrote this rank's part (the merge failed) must take
        // the part out before the file it names (`commit::withdraw_rank`).
        if made_dir {
            commit::abort_partial(&partial, h.rank, &file_name);
        } else if made_file {
            commit::withdraw_rank(&partial, h.rank, &file_name);
        }
    }
    outcome
}

/// Whether slot `v`'s record agrees with the arena's header `h` and with itself: a rank
/// inside the world, the partial directory and file names of its step and rank, one
/// chunk entry per chunk of the file, the data section starting after a length prefix,
/// aligned, inside the file.
fn descriptor_consistent(h: &HeaderView, v: &SlotView) -> bool {
    h.world_size != 0
        && h.rank < h.world_size
        && v.partial_dir == partial_dir_name(v.step)
        && v.file_name == rank_file_name(h.rank, h.world_size)
        && v.chunks.len() as u64 == v.file_len.div_ceil(h.geometry.chunk_size)
        && v.data_start >= 8
        && v.data_start <= v.file_len
        && v.data_start.is_multiple_of(DATA_ALIGN)
}

/// A fully staged save read from a dead engine's arena, checked, for an engine that takes
/// the arena over and holds the save as its memory-only step instead of committing it
/// (`crate::recover::Deferred`).
#[derive(Debug, Clone)]
pub(crate) struct StagedStep {
    /// The plan of its file: the staged header (the file's first `data_start` bytes) and
    /// the tensors it lays out, checked ([`crate::plan::Plan::from_layout`]).
    pub(crate) plan: crate::plan::Plan,
    /// This rank's manifest entry (checksums 0: computed when the step goes to disk).
    pub(crate) entry: FileEntry,
    /// The user metadata of the save.
    pub(crate) metadata: Metadata,
}

/// Slot `v` of `att` (header `h`), read and checked as [`recover_slot`] checks a slot, for
/// a take-over: `STAGED` with every chunk still in staging (`STAGED`, none written: a
/// memory-only save, or a disk save whose writes had not begun), each in its own arena
/// chunk of range, the descriptor consistent, the staged header this save's. The error
/// says why not (recovery then commits the slot as usual).
pub(crate) fn staged_step(
    att: &AttachedArena,
    h: &HeaderView,
    v: &SlotView,
) -> std::result::Result<StagedStep, String> {
    let cs = h.geometry.chunk_size;
    if v.state != crate::staging::descriptor::slot_state::STAGED {
        return Err(format!("slot {} is not staged", v.slot));
    }
    if !descriptor_consistent(h, v) || v.chunks.is_empty() {
        return Err(format!("the descriptor of step {} is inconsistent", v.step));
    }
    let mut seen = std::collections::BTreeSet::new();
    for &(state, idx) in &v.chunks {
        if state != chunk_state::STAGED {
            return Err(format!("step {} had chunks written to disk", v.step));
        }
        if u64::from(idx) >= h.geometry.n_chunks || !seen.insert(idx) {
            return Err(format!(
                "step {} names arena chunk {idx} twice or past the arena",
                v.step
            ));
        }
    }
    let path = Path::new(crate::staging::shm::SHM_MOUNT).join(att.name());
    // Every chunk is staged: the header is read from the arena alone.
    let header = read_header(att, None, &path, v, cs).map_err(|e| e.to_string())?;
    let d = parse_header(&header, &path, v, h.rank, h.world_size).map_err(|e| e.to_string())?;
    d.entry.validate(&path).map_err(|e| e.to_string())?;
    let tensors = d
        .entry
        .tensors
        .iter()
        .map(|t| (t.name.as_str(), t.dtype, t.shape.as_slice(), t.data_offsets));
    let plan =
        crate::plan::Plan::from_layout(header, tensors, v.file_len).map_err(|e| e.to_string())?;
    Ok(StagedStep {
        plan,
        entry: d.entry,
        metadata: d.metadata,
    })
}

/// The end of file chunk `k` of slot `v` (chunks of `cs` bytes, the last one short).
fn chunk_end(v: &SlotView, cs: u64, k: u64) -> u64 {
    ((k + 1) * cs).min(v.file_len)
}

/// The byte the chunks of `v` written to its file before the crash reach, if any.
fn written_end(v: &SlotView, cs: u64) -> Option<u64> {
    v.chunks
        .iter()
        .enumerate()
        .filter(|(_, c)| c.0 == chunk_state::WRITTEN)
        .map(|(k, _)| chunk_end(v, cs, k as u64))
        .max()
}

/// Why `file` (at `path`) cannot hold the chunks written before the crash, which reach byte
/// `need`: it is shorter (`Ok(Some(why))`), or cannot be looked at (`Err`).
fn short_of(file: &File, path: &Path, need: u64) -> io::Result<Option<String>> {
    let len = file.metadata()?.len();
    Ok((len < need).then(|| {
        format!(
            "{} holds {len} bytes, but chunks written before the crash reach byte {need}",
            path.display()
        )
    }))
}

/// Slot `v` of `att` (header `h`, its owner dead), a `STAGED` save some of whose chunks
/// were written to its partial file before the crash (a disk save in flight): read those
/// chunks back from the file into the arena chunks the descriptor names for them, each
/// marked `STAGED` once its bytes are whole ([`AttachedArena::restaged`]), so the save is
/// whole in the arena again and an opening engine can hold it in memory ([`staged_step`])
/// instead of committing it before its open returns.
///
/// The file is opened as recovery opens it (no link followed, a regular file) and must be
/// this user's and reach every written chunk. The slot's chunks must be distinct and in
/// range, and no arena chunk another slot still needs (a `STAGED` entry of another staged
/// save, any entry of a kept image) is written. A crash midway leaves each entry `WRITTEN`
/// (the file, still there, holds its bytes) or `STAGED` (its bytes whole): recovery reads
/// either. The bytes read back are the ones recovery would commit from the file.
///
/// Returns the slot as it is now, every chunk `STAGED`; or why not (recovery then commits
/// the slot as usual).
pub(crate) fn restage_written(
    att: &AttachedArena,
    h: &HeaderView,
    root: &Path,
    v: &SlotView,
) -> std::result::Result<SlotView, String> {
    use crate::staging::descriptor::slot_state;
    let cs = h.geometry.chunk_size;
    if v.state != slot_state::STAGED || !descriptor_consistent(h, v) || v.chunks.is_empty() {
        return Err(format!("slot {} is not a consistent staged save", v.slot));
    }
    let mut seen = std::collections::BTreeSet::new();
    for &(state, idx) in &v.chunks {
        if (state != chunk_state::STAGED && state != chunk_state::WRITTEN)
            || u64::from(idx) >= h.geometry.n_chunks
            || !seen.insert(idx)
        {
            return Err(format!(
                "step {} names arena chunk {idx} twice, past the arena or in no state to read",
                v.step
            ));
        }
    }
    let written: Vec<(u64, u32)> = v
        .chunks
        .iter()
        .enumerate()
        .filter(|(_, c)| c.0 == chunk_state::WRITTEN)
        .map(|(k, c)| (k as u64, c.1))
        .collect();
    let wanted: std::collections::BTreeSet<u32> = written.iter().map(|w| w.1).collect();
    for s in (0..att.slot_count()).filter(|&s| s != v.slot) {
        let other = att.try_slot(s).map_err(|e| e.to_string())?;
        let needed = match other.state {
            slot_state::STAGED => other
                .chunks
                .iter()
                .any(|c| c.0 == chunk_state::STAGED && wanted.contains(&c.1)),
            slot_state::KEPT => other.chunks.iter().any(|c| wanted.contains(&c.1)),
            _ => false,
        };
        if needed {
            return Err(format!(
                "an arena chunk step {} was written from holds step {}'s bytes now",
                v.step, other.step
            ));
        }
    }
    let partial = root.join(&v.partial_dir);
    let path = partial.join(&v.file_name);
    let uid = rustix::process::geteuid().as_raw();
    let file = fsx::open_dir(root)
        .and_then(|r| fsx::open_subdir(r.as_fd(), root, &v.partial_dir))
        .and_then(|d| {
            fsx::open_file(
                d.as_fd(),
                &partial,
                &v.file_name,
                false,
                fsx::Create::No,
                Some(uid),
            )
        })
        .map_err(|e| e.to_string())?;
    let need = written_end(v, cs).unwrap_or(0);
    match short_of(&file, &path, need) {
        Ok(None) => {}
        Ok(Some(why)) => return Err(why),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    }
    let piece = IO_PIECE.min(cs as usize);
    in_lanes(
        &written,
        |_, &(k, idx), buf| {
            buf.resize(piece, 0);
            let start = k * cs;
            let len = chunk_end(v, cs, k) - start;
            let mut at = 0u64;
            while at < len {
                let n = (len - at).min(piece as u64) as usize;
                file.read_exact_at(&mut buf[..n], start + at)
                    .map_err(|e| format!("{}: read at {}: {e}", path.display(), start + at))?;
                att.write_chunk(idx, at, &buf[..n])
                    .map_err(|e| e.to_string())?;
                at += n as u64;
            }
            att.restaged(v.slot, v.step, k, idx)
                .map_err(|e| e.to_string())
        },
        || "a thread reading written chunks back panicked".to_owned(),
    )?;
    let now = att.try_slot(v.slot).map_err(|e| e.to_string())?;
    let whole = now.state == slot_state::STAGED
        && now.step == v.step
        && now.chunks.len() == v.chunks.len()
        && now.chunks.iter().all(|c| c.0 == chunk_state::STAGED);
    if !whole {
        return Err(format!(
            "slot {} changed while step {} was restaged",
            v.slot, v.step
        ));
    }
    tracing::info!(
        step = v.step,
        chunks = written.len(),
        "chunks written before the crash read back into staging: the save is whole in memory"
    );
    Ok(now)
}

/// Write what staging holds into the partial file, make it exact and durable, describe it
/// and commit it.
fn rebuild_and_commit(
    att: &AttachedArena,
    h: &HeaderView,
    root: &Path,
    v: &SlotView,
    info: &SlotInfo,
    (partial, path): (&Path, &Path),
    on_written: Option<OnWritten<'_>>,
) -> SlotOutcome {
    let cs = h.geometry.chunk_size;
    let written_end = written_end(v, cs);
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
    let file_gone = || {
        refused(format!(
            "{} chunk(s) had been written to {} before the crash, but the file is gone \
             (an engine opened on this root since then removes partial directories) \
             and staging no longer holds them",
            info.written,
            path.display()
        ))
    };
    // The partial directory and the file are opened without following links, and must be
    // a directory and a regular file (never a FIFO: opening does not block).
    let partial_fd = match fsx::open_subdir(root_fd.as_fd(), root, partial_name) {
        Ok(fd) => fd,
        Err(e) if written_end.is_some() && is_not_found(&e) => {
            return file_gone();
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
            return file_gone();
        }
        Err(e) => return classify(e),
    };
    if let Some(need) = written_end {
        match short_of(&file, path, need) {
            Ok(None) => {}
            Ok(Some(why)) => return refused(why),
            Err(e) => {
                return SlotOutcome::Failed {
                    error: Error::io("stat", path, e),
                };
            }
        }
    }

    // The staged header first (from staging, or from the file for chunks written before
    // the crash): the tensors it lays out are checksummed while their bytes are copied.
    let described = match read_header(att, Some(&file), path, v, cs)
        .and_then(|hdr| parse_header(&hdr, path, v, h.rank, h.world_size))
    {
        Ok(d) => d,
        Err(e) => return classify(e),
    };
    // Write what only staging holds, and checksum every data byte on the way: the staged
    // chunks from the buffer just written, the chunks written before the crash read back
    // from the file (chunks dealt to several threads: a restart waits for this). Then the
    // file is made exact and durable.
    let jobs: Vec<(u64, Option<u32>)> = v
        .chunks
        .iter()
        .enumerate()
        .map(|(k, &(state, idx))| (k as u64, (state == chunk_state::STAGED).then_some(idx)))
        .collect();
    let piece = IO_PIECE.min(cs as usize);
    let tensors = &described.entry.tensors;
    let data_start = v.data_start;
    let found: Vec<std::sync::Mutex<Vec<CrcPiece>>> = jobs
        .iter()
        .map(|_| std::sync::Mutex::new(Vec::new()))
        .collect();
    let copied = in_lanes(
        &jobs,
        |i, &(k, staged), buf| {
            buf.resize(piece, 0);
            let start = k * cs;
            let len = chunk_end(v, cs, k) - start;
            let mut out = Vec::new();
            let mut at = 0u64;
            while at < len {
                let n = (len - at).min(piece as u64) as usize;
                let off = start + at;
                match staged {
                    Some(idx) => {
                        if att.read_chunk(idx, at, &mut buf[..n]).is_none() {
                            return Err(refused(format!("arena chunk {idx} cannot be read")));
                        }
                        if let Err(e) = crate::fsops::write_all_at(&file, &buf[..n], off) {
                            return Err(SlotOutcome::Failed {
                                error: Error::io_at("write", path, off, e),
                            });
                        }
                    }
                    None => {
                        if let Err(e) = file.read_exact_at(&mut buf[..n], off) {
                            return Err(SlotOutcome::Failed {
                                error: Error::io_at("read", path, off, e),
                            });
                        }
                    }
                }
                out.extend(file_crc_pieces(tensors, data_start, off, &buf[..n]));
                at += n as u64;
            }
            if let (Some(idx), Some(f)) = (staged, on_written) {
                // The chunk's pages on the device before the caller may give its staged
                // copy up: a failed `fdatasync` later cannot lose them.
                let all = libc::SYNC_FILE_RANGE_WAIT_BEFORE
                    | libc::SYNC_FILE_RANGE_WRITE
                    | libc::SYNC_FILE_RANGE_WAIT_AFTER;
                if let Err(e) = crate::util::sync_file_range(&file, start, len, all) {
                    return Err(SlotOutcome::Failed {
                        error: Error::io_at("sync_file_range", path, start, e),
                    });
                }
                f(k, idx);
            }
            *found[i].lock().unwrap_or_else(|e| e.into_inner()) = out;
            Ok(())
        },
        || refused("a thread copying staged chunks panicked"),
    );
    if let Err(outcome) = copied {
        return outcome;
    }
    if let Err(e) = crate::fsops::set_len(&file, v.file_len) {
        return SlotOutcome::Failed {
            error: Error::io("ftruncate", path, e),
        };
    }
    if let Err(e) = crate::fsops::fdatasync_file(&file) {
        return SlotOutcome::Failed {
            error: Error::io("fdatasync", path, e),
        };
    }
    // The chunks in file order, each one's pieces in order: every tensor's CRC-32C.
    let pieces = found
        .into_iter()
        .flat_map(|m| m.into_inner().unwrap_or_else(|e| e.into_inner()));
    let Described {
        mut entry,
        metadata,
    } = described;
    let crcs = combine_crcs(entry.tensors.len(), pieces);
    for (te, crc) in entry.tensors.iter_mut().zip(crcs) {
        te.crc32c = crc;
    }
    if let Err(e) = entry.validate(path) {
        return classify(e);
    }
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

/// The file's first `data_start` bytes (the length prefix and the JSON header), each
/// chunk's part read from where it is: its staging chunk (`STAGED`, in `att`) or the
/// partial file (`WRITTEN` before the crash).
fn read_header(
    att: &AttachedArena,
    file: Option<&File>,
    path: &Path,
    v: &SlotView,
    cs: u64,
) -> Result<Vec<u8>> {
    if v.data_start > MAX_HEADER_LEN + 8 || v.data_start > v.file_len {
        return Err(Error::corrupt(
            path,
            None,
            format!("recorded data start {} is not a header's end", v.data_start),
        ));
    }
    let mut out = vec![0u8; v.data_start as usize];
    let mut at = 0u64;
    while at < v.data_start {
        let k = at / cs;
        let to = ((k + 1) * cs).min(v.data_start);
        let buf = &mut out[at as usize..to as usize];
        match v.chunks.get(k as usize) {
            Some(&(state, idx)) if state == chunk_state::STAGED => att
                .read_chunk(idx, at - k * cs, buf)
                .ok_or_else(|| Error::Recovery {
                    arena: att.name().to_owned(),
                    reason: format!("arena chunk {idx} cannot be read"),
                })?,
            _ => match file {
                Some(file) => file
                    .read_exact_at(buf, at)
                    .map_err(|e| Error::io_at("read", path, at, e))?,
                None => {
                    return Err(Error::Recovery {
                        arena: att.name().to_owned(),
                        reason: format!("header chunk {k} is not staged"),
                    });
                }
            },
        }
        at = to;
    }
    Ok(out)
}

/// What the staged header says, checked: the manifest entry (checksums to be filled in)
/// and the user metadata.
struct Described {
    entry: FileEntry,
    metadata: Metadata,
}

/// Parse the staged header `hdr` (the file's first `data_start` bytes), check it belongs to
/// this save (its step, rank and world size; its data length the save's), and describe its
/// tensors in file order.
fn parse_header(
    hdr: &[u8],
    path: &Path,
    v: &SlotView,
    rank: u32,
    world_size: u32,
) -> Result<Described> {
    let n8: [u8; 8] = hdr
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| Error::corrupt(path, None, "staged header shorter than its length"))?;
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
    let json = &hdr[8..];
    let meta: safetensors::tensor::Metadata = serde_json::from_slice(json)
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
    // The session that saved the file (its commit counts only its own session's parts).
    let session = system.get(META_SESSION).cloned();
    let user: Metadata = system
        .into_iter()
        .filter(|(k, _)| !k.starts_with(RESERVED_PREFIX))
        .collect();

    let mut tensors = Vec::new();
    for name in meta.offset_keys() {
        let info = meta.info(&name).expect("offset_keys names known tensors");
        let dtype: Dtype = format!("{:?}", info.dtype)
            .parse()
            .map_err(|e| Error::corrupt(path, Some(&name), format!("{e}")))?;
        let [b, e] = [info.data_offsets.0 as u64, info.data_offsets.1 as u64];
        tensors.push(TensorEntry {
            name,
            dtype,
            shape: info.shape.clone(),
            data_offsets: [b, e],
            crc32c: 0,
        });
    }
    let entry = FileEntry {
        rank,
        file: v.file_name.clone(),
        bytes: v.file_len,
        data_start: v.data_start,
        header_crc32c: Some(crc32c::crc32c(hdr)),
        object: None,
        session,
        tensors,
    };
    Ok(Described {
        entry,
        metadata: user,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, b: u64, e: u64) -> TensorEntry {
        TensorEntry {
            name: name.into(),
            dtype: Dtype::U8,
            shape: vec![(e - b) as usize],
            data_offsets: [b, e],
            crc32c: 0,
        }
    }

    /// The file cut into pieces of any size (the header's bytes first, pieces straddling
    /// tensors and the header's end), each piece's tensor parts checksummed and combined
    /// in file order: exactly each whole tensor's CRC-32C (0 for an empty one).
    #[test]
    fn piece_checksums_combined_in_file_order_equal_the_whole_tensors() {
        let data_start = 24u64;
        let bytes: Vec<u8> = (0..100_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        let spans = [
            (0u64, 0u64),
            (0, 1),
            (1, 4_096),
            (4_096, 50_001),
            (50_001, 99_976),
        ];
        let tensors: Vec<TensorEntry> = spans
            .iter()
            .enumerate()
            .map(|(i, &(b, e))| entry(&format!("t{i}"), b, e))
            .collect();
        let want: Vec<u32> = spans
            .iter()
            .map(|&(b, e)| {
                if b == e {
                    0
                } else {
                    crc32c::crc32c(&bytes[(data_start + b) as usize..(data_start + e) as usize])
                }
            })
            .collect();
        for piece in [1usize, 7, 23, 24, 25, 4_096, 1 << 20] {
            let pieces = bytes
                .chunks(piece)
                .enumerate()
                .flat_map(|(k, buf)| file_crc_pieces(&tensors, data_start, (k * piece) as u64, buf))
                .collect::<Vec<_>>();
            assert_eq!(
                combine_crcs(tensors.len(), pieces),
                want,
                "pieces of {piece}"
            );
        }
        // Only the header: no tensor's bytes.
        assert!(file_crc_pieces(&tensors, data_start, 0, &bytes[..24]).is_empty());
    }

    #[test]
    fn in_lanes_runs_every_item_and_reports_the_first_failure_by_order() {
        use std::sync::atomic::{AtomicU64, Ordering};
        let items: Vec<u64> = (0..100).collect();
        let sum = AtomicU64::new(0);
        let ok: std::result::Result<(), String> = in_lanes(
            &items,
            |k, &i, _| {
                assert_eq!(k as u64, i, "each job is given its item's index");
                sum.fetch_add(i, Ordering::Relaxed);
                Ok(())
            },
            || "panic".into(),
        );
        assert_eq!(ok, Ok(()));
        assert_eq!(sum.load(Ordering::Relaxed), 4950);
        let err = in_lanes(
            &items,
            |_, &i, _| {
                if i == 3 || i == 90 {
                    Err(format!("item {i}"))
                } else {
                    Ok(())
                }
            },
            || "panic".to_string(),
        );
        // Item 90 may fail first on another thread; item 3 is reported when it ran too.
        let err = err.as_ref().map_err(String::as_str);
        assert!(matches!(err, Err("item 3") | Err("item 90")), "{err:?}");
        assert_eq!(
            in_lanes(&[] as &[u64], |_, _, _| Err("never"), || "panic"),
            Ok(())
        );
    }
}
