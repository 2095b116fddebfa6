//! Reading a file's data section through the I/O backend: chunk by chunk through staging
//! buffers to a [`ReadSink`] (caller buffers, device memory; the loop is
//! [`super::extents::read_chunks`]), or straight into one slab whose ranges become the
//! loaded tensors (host `load`), with CRC-32C verified as the bytes pass.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use super::completion::{Pending, check_crcs, completions, for_pieces};
use super::extents::{check_wanted, chunks_of, read_chunks, whole_section};
use super::header::open_checked;
use super::{ReadOptions, ReadSink, ReadStats};
use crate::error::{Error, Result};
use crate::io::queue::{LeaseQueue, Request};
use crate::io::{BackendOptions, OpKind, align_up, open_backend};
use crate::manifest::FileEntry;

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
    let cs = match &opts.arena {
        Some(a) => a.chunk_size(),
        None => super::extents::PRIVATE_CHUNK,
    };
    let chunks = chunks_of(&whole_section(entry), cs);
    let wanted = vec![true; entry.tensors.len()];
    let read = read_chunks(path, &target, entry, &chunks, &wanted, opts, sink)?;
    check_wanted(path, entry, &wanted, &read)?;
    Ok(ReadStats {
        bytes: read.bytes,
        direct_io: target.is_direct(),
    })
}

/// The CRC-32C of every tensor piece in `bytes` (data-section bytes of chunk `chunk` of
/// `cs` bytes) appended to `crcs` (file order).
fn crc_chunk(entry: &FileEntry, cs: u64, bytes: &[u8], chunk: u64, crcs: &mut [u32]) {
    // `chunk * cs`: the chunk's offset in the data section.
    let _ = for_pieces::<()>(&entry.tensors, chunk * cs, bytes, |i, _, piece| {
        crcs[i] = crc32c::crc32c_append(crcs[i], piece);
        Ok(())
    });
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
                        crc_chunk(entry, cs, bytes, next, &mut crcs);
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
            let offset = p.offset + p.got as u64;
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
                    offset: entry.data_start + k * cs,
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
                (path, entry),
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
    use crate::staging::{Arena, ArenaSpec, ChunkLease};
    use crate::{Dtype, Engine, EngineConfig, Metadata, Tensor};
    use std::path::PathBuf;

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
