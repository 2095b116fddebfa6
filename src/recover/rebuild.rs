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
use crate::staging::AttachedArena;
use crate::staging::descriptor::{HeaderView, SlotView, chunk_state};

/// Bytes copied or read per call while rebuilding and checksumming a file.
const IO_PIECE: usize = 4 << 20;
/// Bytes of one tensor checksummed as one job (the pieces are combined in file order).
const CRC_SEGMENT: u64 = 64 << 20;

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

pub(super) fn recover_slot(
    att: &AttachedArena,
    h: &HeaderView,
    root: &Path,
    v: &SlotView,
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

    // Write what only staging holds (chunks dealt to several threads: a restart waits for
    // this), then make the file exact and durable.
    let staged: Vec<(u64, u32)> = v
        .chunks
        .iter()
        .enumerate()
        .filter(|(_, c)| c.0 == chunk_state::STAGED)
        .map(|(k, &(_, idx))| (k as u64, idx))
        .collect();
    let piece = IO_PIECE.min(cs as usize);
    let copied = in_lanes(
        &staged,
        |_, &(k, idx), buf| {
            buf.resize(piece, 0);
            let start = k * cs;
            let len = chunk_end(k) - start;
            let mut at = 0u64;
            while at < len {
                let n = (len - at).min(piece as u64) as usize;
                if att.read_chunk(idx, at, &mut buf[..n]).is_none() {
                    return Err(refused(format!("arena chunk {idx} cannot be read")));
                }
                if let Err(e) = crate::fsops::write_all_at(&file, &buf[..n], start + at) {
                    return Err(SlotOutcome::Failed {
                        error: Error::io_at("write", path, start + at, e),
                    });
                }
                at += n as u64;
            }
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

/// Every tensor's CRC-32C, read back from the rebuilt file: each tensor cut into segments
/// of [`CRC_SEGMENT`] bytes, checksummed on several threads and combined in file order.
fn checksum(file: &File, path: &Path, data_start: u64, tensors: &mut [TensorEntry]) -> Result<()> {
    checksum_in(file, path, data_start, tensors, CRC_SEGMENT)
}

/// [`checksum`] with segments of `segment` bytes.
fn checksum_in(
    file: &File,
    path: &Path,
    data_start: u64,
    tensors: &mut [TensorEntry],
    segment: u64,
) -> Result<()> {
    // (tensor, segment start, segment end), file offsets.
    let mut segments = Vec::new();
    for (t, te) in tensors.iter().enumerate() {
        let [b, e] = te.data_offsets;
        let (mut at, end) = (data_start + b, data_start + e);
        while at < end {
            let to = at.saturating_add(segment.max(1)).min(end);
            segments.push((t, at, to));
            at = to;
        }
    }
    let crcs: Vec<std::sync::atomic::AtomicU32> = (0..segments.len())
        .map(|_| std::sync::atomic::AtomicU32::new(0))
        .collect();
    in_lanes(
        &segments,
        |i, &(_, b, e), buf| {
            buf.resize(IO_PIECE, 0);
            let mut crc = 0u32;
            let mut at = b;
            while at < e {
                let k = (e - at).min(IO_PIECE as u64) as usize;
                file.read_exact_at(&mut buf[..k], at)
                    .map_err(|err| Error::io_at("read", path, at, err))?;
                crc = crc32c::crc32c_append(crc, &buf[..k]);
                at += k as u64;
            }
            crcs[i].store(crc, std::sync::atomic::Ordering::Relaxed);
            Ok(())
        },
        || Error::Internal("a checksum thread panicked".into()),
    )?;
    // The scope joined every thread: their stores are visible here.
    let mut acc: Vec<Option<u32>> = vec![None; tensors.len()];
    for (&(t, b, e), c) in segments.iter().zip(&crcs) {
        let c = c.load(std::sync::atomic::Ordering::Relaxed);
        acc[t] = Some(match acc[t] {
            None => c,
            Some(prev) => crc32c::crc32c_combine(prev, c, (e - b) as usize),
        });
    }
    for (te, c) in tensors.iter_mut().zip(acc) {
        te.crc32c = c.unwrap_or(0);
    }
    Ok(())
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
    checksum(file, path, v.data_start, &mut tensors)?;
    let entry = FileEntry {
        rank,
        file: v.file_name.clone(),
        bytes: v.file_len,
        data_start: v.data_start,
        header_crc32c: Some(crc32c::crc32c_append(crc32c::crc32c(&n8), &hdr)),
        object: None,
        session,
        tensors,
    };
    // The entry must pass the reader's own checks (those of `Manifest::from_parts`, which
    // the commit builds its manifest with). Only this rank's: a manifest probe of this
    // entry alone would not cover the world size of a multi-rank save.
    entry.validate(path)?;
    Ok((entry, user))
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

    #[test]
    fn checksums_in_segments_on_several_threads_equal_the_whole_tensors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let data_start = 24u64;
        let bytes: Vec<u8> = (0..100_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        std::fs::write(&path, &bytes).unwrap();
        let file = File::open(&path).unwrap();
        let spans = [
            (0u64, 0u64),
            (0, 1),
            (1, 4_096),
            (4_096, 50_001),
            (50_001, 99_976),
        ];
        for segment in [1u64, 7, 4_096, 1 << 20] {
            let mut tensors: Vec<TensorEntry> = spans
                .iter()
                .enumerate()
                .map(|(i, &(b, e))| entry(&format!("t{i}"), b, e))
                .collect();
            checksum_in(&file, &path, data_start, &mut tensors, segment).unwrap();
            for (t, &(b, e)) in tensors.iter().zip(&spans) {
                let want =
                    crc32c::crc32c(&bytes[(data_start + b) as usize..(data_start + e) as usize]);
                assert_eq!(t.crc32c, want, "{} with segments of {segment}", t.name);
            }
        }
        // A range past the end of the file is an error, not a checksum.
        let mut past = vec![entry("past", 99_970, 99_990)];
        assert!(checksum_in(&file, &path, data_start, &mut past, 7).is_err());
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
