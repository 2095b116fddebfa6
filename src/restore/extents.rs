//! The read loop of the chunked restores: a list of chunks of a rank file (file offset and
//! length, in file order) read through staging buffers, `queue_depth` reads in flight,
//! each chunk's bytes cut at tensor bounds and handed, in file order, to a [`ReadSink`]
//! with every wanted tensor's CRC-32C accumulated as they pass. [`super::read_file`] reads
//! the whole data section as one run of chunks; [`super::ranged`] reads only the extents
//! of the requested tensors.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::completion::{Pending, completions, for_pieces};
use super::{ReadOptions, ReadSink};
use crate::error::{Error, Result};
use crate::io::file::FileTarget;
use crate::io::queue::{LeaseQueue, Request};
use crate::io::{BackendOptions, DIRECT_ALIGN, OpKind, align_up, open_backend};
use crate::manifest::FileEntry;
use crate::staging::{Arena, ArenaSpec, ChunkLease};

/// Chunk size of the private buffers used when no engine arena is given.
pub(super) const PRIVATE_CHUNK: u64 = 4 << 20;

/// Processed chunks whose buffers the sink may still read (asynchronous device copies)
/// before `chunk_end` says it is done with them.
const HAND_OFF: usize = 4;

/// Buffers [`read_chunks`] holds at most with `queue_depth` reads in flight: the reads, and
/// the chunks handed to the sink whose copies may still run. An arena given in
/// [`ReadOptions::arena`] with fewer chunks makes reads wait for the sink.
pub(crate) fn buffers_needed(queue_depth: u32) -> u64 {
    u64::from(queue_depth.max(1)) + HAND_OFF as u64
}

/// One read of a file: `len` bytes at file offset `offset` (at most a staging buffer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Chunk {
    /// File offset.
    pub(crate) offset: u64,
    /// Bytes.
    pub(crate) len: u64,
}

/// Cut the file extents `[begin, end)` (sorted, disjoint) into chunks of at most `cs`
/// bytes. A chunk starts where its extent starts or `cs` bytes after the previous one, so
/// page-aligned extents and a page-multiple `cs` give page-aligned chunks (O_DIRECT).
pub(crate) fn chunks_of(extents: &[(u64, u64)], cs: u64) -> Vec<Chunk> {
    let cs = cs.max(1);
    let mut out = Vec::new();
    for &(b, e) in extents {
        let mut at = b;
        while at < e {
            let len = (e - at).min(cs);
            out.push(Chunk { offset: at, len });
            at += len;
        }
    }
    out
}

/// The extents of a whole data section (one, or none when it is empty).
pub(crate) fn whole_section(entry: &FileEntry) -> Vec<(u64, u64)> {
    if entry.bytes > entry.data_start {
        vec![(entry.data_start, entry.bytes)]
    } else {
        Vec::new()
    }
}

/// Page-align file extents for O_DIRECT (start down, end up, never past `file_len`) and
/// merge the ones that then touch or overlap, so that no byte is read, or handed to a sink,
/// twice.
pub(crate) fn align_extents(extents: &[(u64, u64)], file_len: u64) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(extents.len());
    for &(b, e) in extents {
        let b = b - b % DIRECT_ALIGN;
        // A file is far below u64::MAX; `file_len` caps the end either way.
        let e = e
            .checked_next_multiple_of(DIRECT_ALIGN)
            .unwrap_or(u64::MAX)
            .min(file_len);
        match out.last_mut() {
            Some(last) if b <= last.1 => last.1 = last.1.max(e),
            _ => out.push((b, e)),
        }
    }
    out
}

/// What [`read_chunks`] read.
#[derive(Debug, Clone, Default)]
pub(crate) struct ChunksRead {
    /// Per tensor of the entry (file order): its CRC-32C over the bytes handed to the sink
    /// (0 for a tensor not wanted).
    pub(crate) crcs: Vec<u32>,
    /// Per tensor: bytes handed to the sink.
    pub(crate) seen: Vec<u64>,
    /// Bytes read from the file (the chunks' lengths).
    pub(crate) bytes: u64,
}

/// Read `chunks` (file order, disjoint, inside the file) of `path` (opened as `target`,
/// described by `entry`) through staging buffers, and hand each wanted tensor's bytes
/// (`wanted[i]`, file order; bytes of other tensors and of the header are dropped) to
/// `sink` in file order, accumulating its CRC-32C. The caller checks the CRCs: a wanted
/// tensor's is whole only when the chunks cover it entirely.
pub(crate) fn read_chunks(
    path: &Path,
    target: &Arc<FileTarget>,
    entry: &FileEntry,
    chunks: &[Chunk],
    wanted: &[bool],
    opts: &ReadOptions,
    sink: &mut dyn ReadSink,
) -> Result<ChunksRead> {
    let qd = opts.queue_depth.max(1) as usize;
    let arena = match &opts.arena {
        Some(a) => Arc::clone(a),
        None => Arena::create(&ArenaSpec {
            name: None,
            capacity: PRIVATE_CHUNK * buffers_needed(qd as u32),
            chunk_size: PRIVATE_CHUNK,
            slots: 1,
            rank: 0,
            world_size: 1,
            root: PathBuf::new(),
        })?,
    };
    let cs = arena.chunk_size();
    if let Some(c) = chunks.iter().find(|c| c.len > cs) {
        return Err(Error::Internal(format!(
            "a read of {} bytes does not fit a staging buffer of {cs}",
            c.len
        )));
    }
    let backend = open_backend(&BackendOptions {
        kind: opts.backend,
        queue_depth: qd as u32,
        fixed: None,
        #[cfg(feature = "fault-injection")]
        faults: None,
    })
    .map_err(|e| Error::io("io setup", path, e))?;
    let mut q: LeaseQueue<Pending> = LeaseQueue::new(backend);

    let n = chunks.len() as u64;
    let mut out = ChunksRead {
        crcs: vec![0u32; entry.tensors.len()],
        seen: vec![0u64; entry.tensors.len()],
        bytes: chunks.iter().map(|c| c.len).sum(),
    };
    let mut ready: BTreeMap<u64, (ChunkLease, Pending)> = BTreeMap::new();
    let mut next_issue = 0u64;
    let mut next_process = 0u64;
    let mut handed: Vec<ChunkLease> = Vec::with_capacity(HAND_OFF);
    let mut error: Option<Error> = None;
    // Where the time goes (logged at the end, `debug`): blocked waiting for reads,
    // checksumming and handing pieces to the sink, and waiting for the sink (device copies).
    let started = std::time::Instant::now();
    let mut t_wait = std::time::Duration::ZERO;
    let mut t_process = std::time::Duration::ZERO;
    let mut t_release = std::time::Duration::ZERO;
    let direct = target.is_direct();
    let issue = |q: &mut LeaseQueue<Pending>, lease: ChunkLease, p: Pending| {
        let offset = p.offset + p.got as u64;
        let rest = (p.want - p.got) as u64;
        // O_DIRECT: whole pages (a tail past the end of the file just comes back short).
        // Buffered: exactly the bytes wanted, nothing past them.
        let len = if direct {
            align_up(rest).min(cs - p.got as u64)
        } else {
            rest
        } as usize;
        q.push(
            lease,
            p,
            target,
            Request {
                kind: OpKind::Read,
                at: p.got,
                len,
                offset,
            },
        )
        .map_err(|(_, _, e)| Error::io_at("read", path, offset, e))
    };

    loop {
        // Keep `qd` reads in flight while buffers last (the arena bounds the chunks held:
        // in flight, read ahead of an earlier chunk, or handed to the sink). The disk gets
        // its next request before a completed chunk is checksummed, not after.
        while error.is_none() && next_issue < n && q.in_flight() < qd {
            let mut lease = arena.try_acquire();
            if lease.is_none() && !handed.is_empty() {
                // Buffers handed to the sink come back once its copies finished.
                let t = std::time::Instant::now();
                let r = release(sink, &mut handed);
                t_release += t.elapsed();
                if let Err(e) = r {
                    error = Some(e);
                    break;
                }
                lease = arena.try_acquire();
            }
            let lease = match lease {
                Some(l) => l,
                // Nothing of ours to wait for: the buffers are someone else's (a shared
                // arena) and come back when they are done with them.
                None if q.in_flight() == 0 && ready.is_empty() => arena.acquire().0,
                // Ours are in flight or read ahead: their completions free one.
                None => break,
            };
            let k = next_issue;
            let c = chunks[k as usize];
            let p = Pending {
                chunk: k,
                offset: c.offset,
                want: c.len as usize,
                got: 0,
            };
            if let Err(e) = issue(&mut q, lease, p) {
                error = Some(e);
                break;
            }
            next_issue += 1;
        }
        // The next chunk in file order, if read: checksum it and hand it to the sink, then
        // refill the queue before the one after.
        if error.is_none()
            && let Some((lease, p)) = ready.remove(&next_process)
        {
            let t = std::time::Instant::now();
            let bytes = &lease.as_slice()[..p.want];
            if let Err(e) = process_chunk(entry, p.offset, bytes, wanted, &mut out, sink) {
                error = Some(e);
            }
            t_process += t.elapsed();
            next_process += 1;
            // The sink may still copy from this buffer (device copies run asynchronously):
            // keep it until `chunk_end`, called once for several chunks so that their
            // copies overlap each other and the reads.
            handed.push(lease);
            if handed.len() >= HAND_OFF {
                let t = std::time::Instant::now();
                let r = release(sink, &mut handed);
                t_release += t.elapsed();
                if let Err(e) = r {
                    error.get_or_insert(e);
                }
            }
            continue;
        }
        if q.in_flight() == 0 {
            break;
        }
        let t = std::time::Instant::now();
        let done = match q.wait(1) {
            Ok(d) => d,
            Err(b) => {
                error.get_or_insert(Error::io("io wait", path, b.error));
                break;
            }
        };
        t_wait += t.elapsed();
        completions(
            done,
            (path, entry),
            &mut error,
            |lease, p| issue(&mut q, lease, p),
            |lease, p| {
                ready.insert(p.chunk, (lease, p));
            },
        );
    }
    let t = std::time::Instant::now();
    if let Err(e) = release(sink, &mut handed) {
        error.get_or_insert(e);
    }
    t_release += t.elapsed();
    tracing::debug!(
        file = %path.display(),
        bytes = out.bytes,
        reads = n,
        chunk = cs,
        depth = qd,
        elapsed = ?started.elapsed(),
        waiting_for_reads = ?t_wait,
        checksums_and_sink = ?t_process,
        waiting_for_sink = ?t_release,
        "chunks read"
    );
    if let Some(e) = error {
        return Err(e);
    }
    if next_process != n {
        return Err(Error::corrupt(path, None, "not every chunk was read"));
    }
    Ok(out)
}

/// Hand the data-section bytes of one chunk (read at file offset `offset`; bytes of the
/// header before `data_start` are dropped) to `sink`, cut at tensor bounds, for the
/// wanted tensors only, accumulating their CRC-32C and byte counts in `out`.
fn process_chunk(
    entry: &FileEntry,
    offset: u64,
    bytes: &[u8],
    wanted: &[bool],
    out: &mut ChunksRead,
    sink: &mut dyn ReadSink,
) -> Result<()> {
    let skip = entry.data_start.saturating_sub(offset);
    if skip >= bytes.len() as u64 {
        // Header bytes only (a chunk that ends before the data section).
        return Ok(());
    }
    let dst = offset + skip - entry.data_start;
    for_pieces(
        &entry.tensors,
        dst,
        &bytes[skip as usize..],
        |i, at, piece| {
            if !wanted.get(i).copied().unwrap_or(false) {
                return Ok(());
            }
            out.crcs[i] = crc32c::crc32c_append(out.crcs[i], piece);
            out.seen[i] += piece.len() as u64;
            sink.piece(i, at, piece)
        },
    )
}

/// Every wanted tensor (`wanted[i]`, file order) was handed over whole (`read.seen`) and
/// its CRC-32C over those bytes is the manifest's: else [`Error::Checksum`] naming the file
/// and the first tensor that differs.
pub(crate) fn check_wanted(
    path: &Path,
    entry: &FileEntry,
    wanted: &[bool],
    read: &ChunksRead,
) -> Result<()> {
    for (i, t) in entry.tensors.iter().enumerate() {
        if !wanted.get(i).copied().unwrap_or(false) {
            continue;
        }
        if read.seen[i] != t.len() {
            return Err(Error::Internal(format!(
                "{}: tensor {:?}: {} of its {} bytes were read",
                path.display(),
                t.name,
                read.seen[i],
                t.len()
            )));
        }
        if read.crcs[i] != t.crc32c {
            return Err(Error::Checksum {
                path: path.to_owned(),
                tensor: t.name.clone(),
                expected: t.crc32c,
                actual: read.crcs[i],
            });
        }
    }
    Ok(())
}

/// Let the sink finish with every buffer handed to it, then free them.
fn release(sink: &mut dyn ReadSink, handed: &mut Vec<ChunkLease>) -> Result<()> {
    if handed.is_empty() {
        return Ok(());
    }
    let r = sink.chunk_end();
    if r.is_err() {
        // A sink that failed to finish may still use the buffers: never reuse them.
        for l in handed.drain(..) {
            std::mem::forget(l);
        }
        return r;
    }
    handed.clear();
    Ok(())
}
