//! Allocating a new arena's pages in the background ([`Arena::create_prefaulting`]): the
//! threads, their batches, and how the chunks enter the free pool as they are backed.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::*;

/// Bytes whose pages one prefault step allocates before its chunks enter the pool.
const PREFAULT_BATCH: u64 = 64 << 20;

/// Threads that allocate a new arena's pages in the background: half the cores, 1 to 8
/// (page allocation in tmpfs scales with threads; the trainer keeps the other half).
pub fn prefault_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get() / 2)
        .unwrap_or(1)
        .clamp(1, 8)
}

/// The threads prefaulting an arena in the background. Dropping it (or
/// [`Prefault::stop`]) stops them after their current batch and joins them: the chunks
/// not yet allocated then stay out of the pool.
#[derive(Debug, Default)]
pub struct Prefault {
    arena: Option<Arc<Arena>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Prefault {
    /// Stop the threads and join them.
    pub fn stop(&mut self) {
        if let Some(a) = &self.arena {
            a.stop_fill.store(true, Ordering::Release);
        }
        for h in self.threads.drain(..) {
            if h.join().is_err() {
                tracing::error!("a prefault thread panicked");
            }
        }
        self.arena = None;
    }
}

impl Drop for Prefault {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Arena {
    /// Create a named arena whose pages are allocated in the background: the segment is
    /// sized without allocating, the descriptor's pages and the first batch of chunks
    /// (64 MiB) are allocated here, and `threads` threads allocate the rest
    /// (`MADV_POPULATE_WRITE`, in order), each batch's chunks entering the free pool once
    /// backed. So construction costs milliseconds, not seconds for many GiB, and a save
    /// started meanwhile waits only for the chunks it takes ([`Arena::acquire`]).
    /// `/dev/shm` must have the whole size free at the call (`ShmTooSmall` otherwise); if
    /// it fills up meanwhile, the rest of the arena stays out of the pool and
    /// [`Arena::fill_error`] reports it. `pause` delays every background batch (tests: a
    /// slow prefault). Anonymous arenas, and kernels without `MADV_POPULATE_WRITE`, are
    /// created as [`Arena::create`] does, all at once.
    pub fn create_prefaulting(
        spec: &ArenaSpec,
        threads: usize,
        pause: Duration,
    ) -> Result<(Arc<Arena>, Prefault)> {
        let Some(name) = spec.name.as_deref() else {
            return Ok((Arena::create(spec)?, Prefault::default()));
        };
        let geo = Arena::geometry(spec)?;
        let len = geo.total_len as usize;
        let seg = Segment::create_sparse(name, len)?;
        if let Err(e) = seg.populate(0, geo.data_offset as usize) {
            let _ = seg.unlink();
            drop(seg);
            if e.raw_os_error() == Some(libc::EINVAL) {
                tracing::debug!("no MADV_POPULATE_WRITE: the arena is allocated at once");
                return Ok((Arena::create(spec)?, Prefault::default()));
            }
            return Err(fill_error(
                name,
                geo.total_len,
                e.raw_os_error().unwrap_or(0),
            ));
        }
        let map = match Mapped::init(seg, geo, spec.rank, spec.world_size, root_bytes(spec)) {
            Ok(m) => m,
            Err(e) => {
                let _ = rustix::shm::unlink(format!("/{name}").as_str());
                return Err(e);
            }
        };
        let arena = Arena::from_mapped(map, geo, spec, false);
        let per = (PREFAULT_BATCH / geo.chunk_size).max(1);
        let batches = geo.n_chunks.div_ceil(per);
        crate::util::lock(&arena.fill).batches = batches;
        if let Err(e) = arena.fill_batch(0, per) {
            let errno = e.raw_os_error().unwrap_or(0);
            arena.close();
            return Err(fill_error(name, geo.total_len, errno));
        }
        if batches == 1 {
            arena.fill_ended();
            return Ok((arena, Prefault::default()));
        }
        let next = Arc::new(AtomicU64::new(1));
        let threads = threads.clamp(1, usize::try_from(batches - 1).unwrap_or(usize::MAX));
        let live = Arc::new(std::sync::atomic::AtomicUsize::new(threads));
        let mut handles = Vec::with_capacity(threads);
        for i in 0..threads {
            let (a, next, live) = (Arc::clone(&arena), Arc::clone(&next), Arc::clone(&live));
            let spawned = std::thread::Builder::new()
                .name(format!("shmckpt-prefault-{i}"))
                .spawn(move || {
                    a.fill_loop(&next, batches, per, pause);
                    if live.fetch_sub(1, Ordering::AcqRel) == 1 {
                        a.fill_ended();
                    }
                });
            match spawned {
                Ok(h) => handles.push(h),
                Err(e) => {
                    // The threads started so far stop; the arena is not used.
                    arena.stop_fill.store(true, Ordering::Release);
                    drop(Prefault {
                        arena: Some(Arc::clone(&arena)),
                        threads: handles,
                    });
                    arena.close();
                    return Err(Error::Config(format!(
                        "cannot spawn a prefault thread: {e}"
                    )));
                }
            }
        }
        let pf = Prefault {
            arena: Some(Arc::clone(&arena)),
            threads: handles,
        };
        Ok((arena, pf))
    }

    /// One prefault thread: take the next batch, allocate it, put its chunks in the pool.
    fn fill_loop(&self, next: &AtomicU64, batches: u64, per: u64, pause: Duration) {
        loop {
            if self.stop_fill.load(Ordering::Acquire) {
                return;
            }
            let b = next.fetch_add(1, Ordering::Relaxed);
            if b >= batches {
                return;
            }
            // Tests: a slow prefault (in slices, so a stop is seen at once).
            let until = Instant::now() + pause;
            while Instant::now() < until {
                if self.stop_fill.load(Ordering::Acquire) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(5).min(pause));
            }
            if let Err(e) = self.fill_batch(b, per) {
                let errno = e.raw_os_error().unwrap_or(0);
                tracing::error!(error = %e, "allocating the staging arena failed: the rest of it stays unused");
                crate::util::lock(&self.fill).errno.get_or_insert(errno);
                self.stop_fill.store(true, Ordering::Release);
                return;
            }
        }
    }

    /// Allocate the pages of chunk batch `b` (`per` chunks) and put its chunks in the pool.
    fn fill_batch(&self, b: u64, per: u64) -> std::io::Result<()> {
        let first = b * per;
        let end = (first + per).min(self.geo.n_chunks);
        let cs = self.geo.chunk_size;
        let offset = self.geo.data_offset + first * cs;
        self.map
            .segment()
            .populate(offset as usize, ((end - first) * cs) as usize)?;
        // Pooled and counted under the fill lock: whoever took one of these chunks and then
        // asks `is_filled` sees the batch counted, and `wait_filled` returns only once every
        // chunk is in the pool (or in use).
        let mut fill = crate::util::lock(&self.fill);
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        // Lowest index first out: `pop` takes from the back, or from the front when
        // taking the oldest first.
        if self.fifo.load(std::sync::atomic::Ordering::Relaxed) {
            free.extend(first as u32..end as u32);
        } else {
            free.extend((first as u32..end as u32).rev());
        }
        drop(free);
        fill.batches_done += 1;
        drop(fill);
        self.freed.notify_all();
        self.filled.notify_all();
        Ok(())
    }

    fn fill_ended(&self) {
        crate::util::lock(&self.fill).finished = true;
        self.filled.notify_all();
    }

    /// Whether every chunk is allocated and in use or in the pool.
    pub fn is_filled(&self) -> bool {
        let f = crate::util::lock(&self.fill);
        f.batches_done == f.batches
    }

    /// Whether the background prefault has ended (all allocated, failed or stopped).
    pub fn fill_finished(&self) -> bool {
        let f = crate::util::lock(&self.fill);
        f.finished || f.batches_done == f.batches
    }

    /// Wait until every chunk is allocated. Fails when the prefault failed (`/dev/shm`
    /// filled up: `ShmTooSmall`) or was stopped (`Shutdown`).
    pub fn wait_filled(&self) -> Result<()> {
        let mut f = crate::util::lock(&self.fill);
        while !(f.finished || f.batches_done == f.batches) {
            f = self.filled.wait(f).unwrap_or_else(|p| p.into_inner());
        }
        if f.batches_done == f.batches {
            return Ok(());
        }
        match f.errno {
            Some(errno) => Err(fill_error(
                self.name().unwrap_or("(anonymous)"),
                self.geo.total_len,
                errno,
            )),
            None => Err(Error::Shutdown(
                "the staging arena was closed before it was allocated".into(),
            )),
        }
    }

    /// The error of a failed prefault, if it failed: saves refuse to start then.
    pub fn fill_error(&self) -> Option<Error> {
        let errno = crate::util::lock(&self.fill).errno?;
        Some(fill_error(
            self.name().unwrap_or("(anonymous)"),
            self.geo.total_len,
            errno,
        ))
    }
}

/// The error of an allocation of arena pages that failed with `errno`: a full tmpfs
/// (`EFAULT`, `ENOMEM`, `ENOSPC`) is `ShmTooSmall`.
fn fill_error(name: &str, requested: u64, errno: i32) -> Error {
    if matches!(errno, libc::EFAULT | libc::ENOMEM | libc::ENOSPC) {
        Error::ShmTooSmall {
            name: name.to_owned(),
            requested,
            available: shm::shm_available(),
            mount: shm::SHM_MOUNT.to_owned(),
        }
    } else {
        Error::Shm {
            name: name.to_owned(),
            op: "madvise(MADV_POPULATE_WRITE)",
            source: std::io::Error::from_raw_os_error(errno),
        }
    }
}
