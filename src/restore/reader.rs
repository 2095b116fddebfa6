//! Reading a file's data section through the I/O backend: chunk by chunk through staging
//! buffers to a [`ReadSink`] (caller buffers, device memory), or straight into one slab
//! whose ranges become the loaded tensors (host `load`), with CRC-32C verified as the
//! bytes pass.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::header::open_checked;
use super::{ReadOptions, ReadSink, ReadStats};
use crate::error::{Error, Result};
use crate::io::queue::{LeaseQueue, Request};
use crate::io::{BackendOptions, OpKind, align_up, open_backend};
use crate::manifest::FileEntry;
use crate::staging::{Arena, ArenaSpec, ChunkLease};

/// Chunk size of the private buffers used when no engine arena is given.
const PRIVATE_CHUNK: u64 = 4 << 20;

/// A chunk being read.
#[derive(Debug, Clone, Copy)]
struct Pending {
    chunk: u64,
    want: usize,
    got: usize,
}

/// Account one read completion (`result`: bytes read or `-errno`) to chunk `p`: `Ok(true)`
/// once the chunk is complete, `Ok(false)` when the rest must be asked for again (a short
/// read, `EINTR`, `EAGAIN`), else an error naming the file and offset (end of file before
/// the chunk's end is `Truncated`).
fn read_completed(
    p: &mut Pending,
    result: i32,
    path: &Path,
    entry: &FileEntry,
    cs: u64,
) -> Result<bool> {
    let offset = entry.data_start + p.chunk * cs + p.got as u64;
    if result == -libc::EINTR || result == -libc::EAGAIN {
        return Ok(false);
    }
    if result < 0 {
        let e = std::io::Error::from_raw_os_error(-result);
        return Err(Error::io_at("read", path, offset, e));
    }
    if result == 0 {
        return Err(Error::Truncated {
            path: path.to_owned(),
            expected: entry.bytes,
            actual: offset,
        });
    }
    p.got += result as usize;
    Ok(p.got >= p.want)
}

/// Every tensor's CRC-32C computed from the bytes read (`crcs`, file order) must be the
/// manifest's; the error names the file and the first tensor that differs.
fn check_crcs(path: &Path, entry: &FileEntry, crcs: &[u32]) -> Result<()> {
    for (t, &crc) in entry.tensors.iter().zip(crcs) {
        if crc != t.crc32c {
            return Err(Error::Checksum {
                path: path.to_owned(),
                tensor: t.name.clone(),
                expected: t.crc32c,
                actual: crc,
            });
        }
    }
    Ok(())
}

/// Handle read completions: a chunk read whole goes to `complete`; a short read (or
/// `EINTR`, `EAGAIN`) is asked for again with `reissue` (unless an error is recorded
/// already); an error is recorded in `error` (the first one wins) and its buffer dropped.
/// The tuple: the path, entry and chunk size the reads belong to.
fn completions<B>(
    done: Vec<crate::io::queue::Done<Pending, B>>,
    (path, entry, cs): (&Path, &FileEntry, u64),
    error: &mut Option<Error>,
    mut reissue: impl FnMut(B, Pending) -> Result<()>,
    mut complete: impl FnMut(B, Pending),
) {
    for d in done {
        let mut p = d.tag;
        match read_completed(&mut p, d.result, path, entry, cs) {
            Ok(true) => complete(d.lease, p),
            Ok(false) => {
                if error.is_none()
                    && let Err(e) = reissue(d.lease, p)
                {
                    *error = Some(e);
                }
            }
            Err(e) => {
                error.get_or_insert(e);
            }
        }
    }
}

/// Read the data section of `path` (described by `entry`) chunk by chunk, handing every
/// tensor's bytes to `sink` in file order, and verify every checksum. Fails with an error
/// naming file and tensor on any mismatch.
pub fn read_file(
    path: &Path,
    entry: &FileEntry,
    opts: &ReadOptions,
    sink: &mut dyn ReadSink,
) -> Result<ReadStats> {
    let target = open_checked(path, entry, opts.direct_io)?;

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
    let backend = open_backend(&BackendOptions {
        kind: opts.backend,
        queue_depth: qd as u32,
        fixed: None,
        #[cfg(feature = "fault-injection")]
        faults: None,
    })
    .map_err(|e| Error::io("io setup", path, e))?;
    let mut q: LeaseQueue<Pending> = LeaseQueue::new(backend);

    let data_len = entry.bytes - entry.data_start;
    let n = data_len.div_ceil(cs);
    let mut crcs = vec![0u32; entry.tensors.len()];
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
    let issue = |q: &mut LeaseQueue<Pending>, lease: ChunkLease, p: Pending| {
        let offset = entry.data_start + p.chunk * cs + p.got as u64;
        // Whole pages when possible (O_DIRECT); a tail past EOF just comes back short.
        let rest = (p.want - p.got) as u64;
        let len = align_up(rest).min(cs - p.got as u64) as usize;
        q.push(
            lease,
            p,
            &target,
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
            let want = (data_len - k * cs).min(cs) as usize;
            if let Err(e) = issue(
                &mut q,
                lease,
                Pending {
                    chunk: k,
                    want,
                    got: 0,
                },
            ) {
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
            if let Err(e) = process_chunk(
                entry,
                cs,
                &lease.as_slice()[..p.want],
                p.chunk,
                &mut crcs,
                sink,
            ) {
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
            (path, entry, cs),
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
        bytes = data_len,
        chunk = cs,
        depth = qd,
        elapsed = ?started.elapsed(),
        waiting_for_reads = ?t_wait,
        checksums_and_sink = ?t_process,
        waiting_for_sink = ?t_release,
        "data section read"
    );
    if let Some(e) = error {
        return Err(e);
    }
    debug_assert_eq!(next_process, n);
    check_crcs(path, entry, &crcs)?;
    Ok(ReadStats {
        bytes: data_len,
        direct_io: target.is_direct(),
    })
}

fn process_chunk(
    entry: &FileEntry,
    cs: u64,
    bytes: &[u8],
    chunk: u64,
    crcs: &mut [u32],
    sink: &mut dyn ReadSink,
) -> Result<()> {
    // `chunk * cs`: the chunk's offset in the data section.
    for_pieces(&entry.tensors, chunk * cs, bytes, |i, at, piece| {
        crcs[i] = crc32c::crc32c_append(crcs[i], piece);
        sink.piece(i, at, piece)
    })
}

/// Call `f(tensor, offset in the tensor, piece)` for each non-empty tensor piece in `buf`,
/// which holds data-section bytes from `dst` (tensors sorted by offset, as in a manifest).
pub(crate) fn for_pieces<E>(
    tensors: &[crate::manifest::TensorEntry],
    dst: u64,
    buf: &[u8],
    mut f: impl FnMut(usize, u64, &[u8]) -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    let end = dst + buf.len() as u64;
    let first = tensors.partition_point(|t| t.data_offsets[1] <= dst);
    for (i, t) in tensors.iter().enumerate().skip(first) {
        let [b, e] = t.data_offsets;
        if b >= end {
            break;
        }
        if e == b {
            continue;
        }
        let s = b.max(dst);
        let fin = e.min(end);
        f(i, s - b, &buf[(s - dst) as usize..(fin - dst) as usize])?;
    }
    Ok(())
}

/// Processed chunks whose buffers the sink may still read (asynchronous device copies)
/// before `chunk_end` says it is done with them.
const HAND_OFF: usize = 4;

/// Buffers [`read_file`] holds at most with `queue_depth` reads in flight: the reads, and
/// the chunks handed to the sink whose copies may still run. An arena given in
/// [`ReadOptions::arena`] with fewer chunks makes reads wait for the sink.
pub(crate) fn buffers_needed(queue_depth: u32) -> u64 {
    u64::from(queue_depth.max(1)) + HAND_OFF as u64
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

/// Size of each read of [`read_to_slab`].
const SLAB_READ: u64 = 4 << 20;

/// Reads in flight of [`read_to_slab`], at least.
const SLAB_DEPTH: u32 = 16;

/// Read the data section of `path` (described by `entry`) with O_DIRECT straight into one
/// slab (reused from `pool` when it holds one that fits), `max(queue_depth, 16)` reads of
/// 4 MiB in flight, every tensor's CRC-32C computed on a second thread as the reads
/// complete, and return the tensors' bytes (in file order) as views of the slab, each
/// aligned to its dtype's element size (a tensor whose offset is not is copied out).
pub(crate) fn read_to_slab(
    path: &Path,
    entry: &FileEntry,
    opts: &ReadOptions,
    pool: Option<&Arc<crate::slab::SlabPool>>,
) -> Result<(Vec<crate::tensor::AlignedBytes>, ReadStats)> {
    use crate::slab::{SlabBuilder, SlabRegion};
    use crate::tensor::AlignedBytes;

    let target = open_checked(path, entry, opts.direct_io)?;
    let data_len = entry.bytes - entry.data_start;
    let len = usize::try_from(data_len)
        .map_err(|_| Error::corrupt(path, None, "data section larger than the address space"))?;
    let mut slab = SlabBuilder::new(pool, len).ok_or_else(|| {
        Error::io(
            "allocate",
            path,
            std::io::Error::from(std::io::ErrorKind::OutOfMemory),
        )
    })?;
    let qd = opts.queue_depth.max(SLAB_DEPTH);
    let backend = open_backend(&BackendOptions {
        kind: opts.backend,
        queue_depth: qd,
        fixed: None,
        #[cfg(feature = "fault-injection")]
        faults: None,
    })
    .map_err(|e| Error::io("io setup", path, e))?;
    let cs = SLAB_READ;
    let n = data_len.div_ceil(cs);

    let (tx, rx) = std::sync::mpsc::channel::<(u64, usize, SlabRegion)>();
    let populator = slab.populator();
    let reads_done = std::sync::atomic::AtomicBool::new(false);
    let (crcs, error) = std::thread::scope(|scope| {
        // A fresh allocation's pages are faulted in ahead of the reads on another thread:
        // the first touch of fresh memory (slow in VMs) then overlaps the I/O.
        if let Some(p) = populator {
            let done = &reads_done;
            let _ = std::thread::Builder::new()
                .name("shmckpt-load-fault".into())
                .spawn_scoped(scope, move || {
                    const STEP: usize = 32 << 20;
                    let mut off = 0;
                    while off < len && !done.load(std::sync::atomic::Ordering::Relaxed) {
                        if !p.populate(off, STEP) {
                            break;
                        }
                        off += STEP;
                    }
                });
        }
        // The checksums, in file order, on a second thread: the reads do not wait for them.
        let crc_thread = std::thread::Builder::new()
            .name("shmckpt-load-crc".into())
            .spawn_scoped(scope, move || {
                let mut crcs = vec![0u32; entry.tensors.len()];
                let mut ready: BTreeMap<u64, (usize, SlabRegion)> = BTreeMap::new();
                let mut next = 0u64;
                for (k, want, r) in rx {
                    ready.insert(k, (want, r));
                    while let Some((want, r)) = ready.remove(&next) {
                        let bytes = &r.as_slice()[..want];
                        // `Discard` never fails.
                        let _ =
                            process_chunk(entry, cs, bytes, next, &mut crcs, &mut super::Discard);
                        next += 1;
                    }
                }
                (crcs, next)
            });
        let crc_thread = match crc_thread {
            Ok(t) => t,
            Err(e) => return (None, Some(Error::io("spawn", path, e))),
        };

        let mut q: LeaseQueue<Pending, SlabRegion> = LeaseQueue::new(backend);
        let mut next_issue = 0u64;
        let mut error: Option<Error> = None;
        let issue = |q: &mut LeaseQueue<Pending, SlabRegion>, r: SlabRegion, p: Pending| {
            let offset = entry.data_start + p.chunk * cs + p.got as u64;
            // Whole pages when possible (O_DIRECT); a tail past EOF just comes back short.
            let rest = (p.want - p.got) as u64;
            let len = align_up(rest).min((r.len() - p.got) as u64) as usize;
            let req = Request {
                kind: OpKind::Read,
                at: p.got,
                len,
                offset,
            };
            q.push(r, p, &target, req)
                .map_err(|(_, _, e)| Error::io_at("read", path, offset, e))
        };
        loop {
            while error.is_none() && next_issue < n && q.has_room() {
                let k = next_issue;
                let want = (data_len - k * cs).min(cs) as usize;
                let Some(r) = slab.carve(cs as usize) else {
                    error = Some(Error::corrupt(path, None, "read past the slab"));
                    break;
                };
                let p = Pending {
                    chunk: k,
                    want,
                    got: 0,
                };
                if let Err(e) = issue(&mut q, r, p) {
                    error = Some(e);
                    break;
                }
                next_issue += 1;
            }
            if q.in_flight() == 0 {
                break;
            }
            let done = match q.wait(1) {
                Ok(d) => d,
                Err(b) => {
                    error.get_or_insert(Error::io("io wait", path, b.error));
                    break;
                }
            };
            completions(
                done,
                (path, entry, cs),
                &mut error,
                |r, p| issue(&mut q, r, p),
                |r, p| {
                    // The CRC thread may have ended only if it panicked; the join below
                    // reports that.
                    let _ = tx.send((p.chunk, p.want, r));
                },
            );
        }
        drop(q);
        drop(tx);
        reads_done.store(true, std::sync::atomic::Ordering::Relaxed);
        match crc_thread.join() {
            Ok((crcs, done)) if error.is_none() && done == n => (Some(crcs), None),
            Ok(_) => (None, error),
            Err(_) => (
                None,
                Some(
                    error.unwrap_or_else(|| Error::corrupt(path, None, "checksum thread panicked")),
                ),
            ),
        }
    });
    if let Some(e) = error {
        return Err(e);
    }
    let crcs = crcs.ok_or_else(|| Error::corrupt(path, None, "not every chunk was read"))?;
    check_crcs(path, entry, &crcs)?;

    // Every region is gone (the queue and the CRC thread dropped theirs): hand out views.
    let mut copies: Vec<Option<AlignedBytes>> = Vec::with_capacity(entry.tensors.len());
    let mut ranges = Vec::with_capacity(entry.tensors.len());
    {
        let bytes = slab
            .bytes()
            .ok_or_else(|| Error::corrupt(path, None, "a read buffer is still in use"))?;
        for t in &entry.tensors {
            let [b, e] = t.data_offsets;
            let (b, e) = (b as usize, e as usize);
            // The file orders tensors by decreasing element size, so each starts at a
            // multiple of its own alignment: a view then (the copy is for hostile files).
            if b.is_multiple_of(t.dtype.alignment() as usize) {
                ranges.push((b, e));
                copies.push(None);
            } else {
                let mut c = AlignedBytes::zeroed(e - b);
                c.as_bytes_mut().copy_from_slice(&bytes[b..e]);
                copies.push(Some(c));
            }
        }
    }
    let mut views = slab
        .finish(&ranges)
        .ok_or_else(|| Error::corrupt(path, None, "tensor ranges overlap"))?
        .into_iter();
    let data = copies
        .into_iter()
        .map(|c| c.unwrap_or_else(|| AlignedBytes::view(views.next().expect("one view per range"))))
        .collect();
    Ok((
        data,
        ReadStats {
            bytes: data_len,
            direct_io: target.is_direct(),
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Dtype, Engine, EngineConfig, Metadata, Tensor};

    /// Collects every tensor's bytes (file order), checking that pieces come in order.
    struct Collect(Vec<Vec<u8>>);

    impl ReadSink for Collect {
        fn piece(&mut self, tensor: usize, at: u64, bytes: &[u8]) -> Result<()> {
            let t = &mut self.0[tensor];
            assert_eq!(t.len() as u64, at, "tensor {tensor}: pieces out of order");
            t.extend_from_slice(bytes);
            Ok(())
        }
    }

    /// A committed checkpoint of four u8 tensors of odd sizes (about 3.3 MiB, so several
    /// 1 MiB chunks, with tensors straddling their boundaries): its directory, file entry
    /// and each tensor's bytes by name.
    fn saved() -> (
        tempfile::TempDir,
        PathBuf,
        FileEntry,
        Vec<(String, Vec<u8>)>,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let data: Vec<(String, Vec<u8>)> = [300_001usize, 1 << 20, 4097, 2_000_000]
            .iter()
            .enumerate()
            .map(|(k, &n)| {
                let bytes = (0..n)
                    .map(|i| ((i as u32).wrapping_mul(2_654_435_761) >> 13) as u8 ^ k as u8)
                    .collect();
                (format!("t{k}"), bytes)
            })
            .collect();
        let engine = Engine::open(
            EngineConfig::new(dir.path())
                .with_staging_capacity(8 << 20)
                .with_chunk_size(1 << 20),
        )
        .unwrap();
        let tensors: Vec<Tensor<'_>> = data
            .iter()
            .map(|(n, d)| Tensor::host(n.as_str(), Dtype::U8, vec![d.len()], d))
            .collect();
        engine
            .save(1, &tensors, &Metadata::new())
            .unwrap()
            .wait()
            .unwrap();
        drop(engine);
        let step = dir.path().join(crate::manifest::step_dir_name(1));
        let (_, entry) = super::super::rank_file(&step, 0).unwrap();
        let path = step.join(&entry.file);
        (dir, path, entry, data)
    }

    fn arena(chunks: u64) -> Arc<Arena> {
        Arena::create(&ArenaSpec {
            name: None,
            capacity: chunks << 20,
            chunk_size: 1 << 20,
            slots: 1,
            rank: 0,
            world_size: 1,
            root: PathBuf::new(),
        })
        .unwrap()
    }

    /// `read_file` on another thread; a read that has not finished in 60 s fails the
    /// test (the reader this replaced waited forever in both tests below, on a chunk that
    /// only its own unprocessed reads could free).
    fn read_with(path: &Path, entry: &FileEntry, arena: Arc<Arena>, depth: u32) -> Vec<Vec<u8>> {
        let opts = ReadOptions {
            queue_depth: depth,
            arena: Some(arena),
            ..ReadOptions::default()
        };
        let (path, entry) = (path.to_owned(), entry.clone());
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut sink = Collect(vec![Vec::new(); entry.tensors.len()]);
            let r = read_file(&path, &entry, &opts, &mut sink).map(|_| sink.0);
            let _ = tx.send(r);
        });
        match rx.recv_timeout(std::time::Duration::from_secs(60)) {
            Ok(r) => r.unwrap(),
            Err(_) => panic!("the read did not finish in 60 s (depth {depth})"),
        }
    }

    fn assert_exact(entry: &FileEntry, got: &[Vec<u8>], data: &[(String, Vec<u8>)]) {
        for (t, bytes) in entry.tensors.iter().zip(got) {
            let want = &data.iter().find(|(n, _)| *n == t.name).unwrap().1;
            assert!(bytes == want, "{}: bytes differ", t.name);
        }
    }

    /// Fewer buffers than reads in flight: the reader issues what the arena allows, frees
    /// the buffers it handed to the sink when it needs one, and reads every byte.
    #[test]
    fn fewer_buffers_than_the_depth_still_read_every_byte() {
        let (_d, path, entry, data) = saved();
        for (chunks, depth) in [(1, 4), (2, 8), (8, 4), (12, 8)] {
            let got = read_with(&path, &entry, arena(chunks), depth);
            assert_exact(&entry, &got, &data);
        }
    }

    /// A shared arena whose other chunks are held by someone else (a save, in an engine):
    /// the reader gets by with the one left.
    #[test]
    fn a_shared_arena_with_one_free_chunk_is_enough() {
        let (_d, path, entry, data) = saved();
        let a = arena(4);
        let held: Vec<ChunkLease> = (0..3).map(|_| a.try_acquire().unwrap()).collect();
        let got = read_with(&path, &entry, Arc::clone(&a), 4);
        assert_exact(&entry, &got, &data);
        drop(held);
        // Every chunk came back.
        let all: Vec<ChunkLease> = (0..4).map(|_| a.try_acquire().unwrap()).collect();
        assert!(a.try_acquire().is_none());
        drop(all);
    }
}
