//! The staging arena: one shared-memory segment per engine, cut into fixed-size chunks.
//!
//! A save's file image is a sequence of chunks (file chunk `k` covers file bytes
//! `k*chunk_size ..`), each held in some arena chunk. A chunk is leased ([`ChunkLease`])
//! while it is being filled and written, and returns to the free pool when the lease drops,
//! after its write completed. `acquire` blocks when no chunk is free: that is the
//! backpressure a second save feels while an earlier one drains.
#![deny(unsafe_code)]

pub mod attach;
pub mod descriptor;
pub mod layout;
mod lease;
mod mapped;
pub mod shm;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
pub use attach::AttachedArena;
use descriptor::{Descriptor, Geometry};
pub use lease::ChunkLease;
use mapped::Mapped;
pub use shm::Segment;

/// Prefix of every arena name in `/dev/shm`.
pub const NAME_PREFIX: &str = "shmckpt.";

/// Prefix of the arenas kept for flash restore (`EngineConfig::with_keep_in_memory`).
pub const KEEP_PREFIX: &str = "shmckpt.keep-";

/// The stable name of the kept arena of `root` (canonical) and `rank`: FNV-1a 64 of the
/// root's bytes, so one root and rank always map to the same name.
pub fn kept_name(root: &std::path::Path, rank: u32) -> String {
    use std::os::unix::ffi::OsStrExt;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in root.as_os_str().as_bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{KEEP_PREFIX}{h:016x}.r{rank}")
}

/// Whether `name` is a kept arena's name.
pub fn is_kept_name(name: &str) -> bool {
    name.starts_with(KEEP_PREFIX)
}

/// Flash-restore bookkeeping of an arena: which slot holds the last committed image, and
/// how many saves began (a save that is not the latest to begin never becomes the image:
/// a later save may already be overwriting its chunks).
#[derive(Debug, Default)]
struct Keep {
    enabled: bool,
    slot: Option<u32>,
    begun: u64,
}

/// Names of the arenas this process created and has not closed. Recovery asks it when an
/// arena's recorded owner pid is this process's own (a restarted container's pid 1 finds the
/// arenas of its predecessor under the same pid).
static OPEN_HERE: Mutex<std::collections::BTreeSet<String>> =
    Mutex::new(std::collections::BTreeSet::new());

/// Whether this process created the named arena and has not closed it.
pub fn created_here(name: &str) -> bool {
    OPEN_HERE
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .contains(name)
}

/// The root as recorded in an arena's descriptor.
fn root_bytes(spec: &ArenaSpec) -> &[u8] {
    use std::os::unix::ffi::OsStrExt;
    spec.root.as_os_str().as_bytes()
}

/// Shape of an arena to create.
#[derive(Debug, Clone)]
pub struct ArenaSpec {
    /// Name in `/dev/shm` (without slash); `None` for a private anonymous arena.
    pub name: Option<String>,
    /// Data bytes (rounded up to whole chunks).
    pub capacity: u64,
    /// Bytes per chunk, a multiple of 4096.
    pub chunk_size: u64,
    /// Save slots in the descriptor (saves in flight at once).
    pub slots: u32,
    /// Rank, recorded for recovery.
    pub rank: u32,
    /// World size, recorded for recovery.
    pub world_size: u32,
    /// Checkpoint root, recorded for recovery.
    pub root: std::path::PathBuf,
}

/// The staging arena. Shared by the engine, its writer threads and chunk leases.
#[derive(Debug)]
pub struct Arena {
    map: Mapped,
    geo: Geometry,
    /// Free chunks: taken from the back (the most recently freed, warm) normally, from
    /// the front (the longest free) when keeping, so that a save never reuses a chunk it
    /// filled itself while other chunks are free and the kept image stays whole.
    free: Mutex<std::collections::VecDeque<u32>>,
    fifo: std::sync::atomic::AtomicBool,
    freed: Condvar,
    slots: Mutex<Vec<u32>>,
    slot_freed: Condvar,
    /// Nanoseconds callers spent blocked in `acquire` (lifetime total).
    waited_ns: AtomicU64,
    unlinked: std::sync::atomic::AtomicBool,
    keep: Mutex<Keep>,
    /// Pages of the data region allocated so far ([`Arena::create_prefaulting`]); done at
    /// once for the other constructors.
    fill: Mutex<Fill>,
    filled: Condvar,
    /// Set to stop a background prefault (close).
    stop_fill: std::sync::atomic::AtomicBool,
}

/// Progress of an arena's prefault: its chunks enter the free pool batch by batch, as
/// their pages are allocated, so a save takes only chunks that are backed.
#[derive(Debug, Default)]
struct Fill {
    /// Batches whose chunks are in the pool.
    batches_done: u64,
    /// Batches in the data region.
    batches: u64,
    /// No prefault thread runs any more.
    finished: bool,
    /// The errno of a failed allocation (the rest of the arena stays out of the pool).
    errno: Option<i32>,
}

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
    /// Create, size, pre-fault and describe a new arena.
    pub fn create(spec: &ArenaSpec) -> Result<Arc<Arena>> {
        let geo = Arena::geometry(spec)?;
        let len = geo.total_len as usize;
        let seg = match &spec.name {
            Some(n) => Segment::create(n, len)?,
            None => Segment::anonymous(len)?,
        };
        let map = Mapped::init(seg, geo, spec.rank, spec.world_size, root_bytes(spec))?;
        Ok(Arena::from_mapped(map, geo, spec, true))
    }

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
        // Lowest index last: `pop` takes from the back.
        free.extend((first as u32..end as u32).rev());
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

    /// Take over the kept arena `file` (opened read-write, this user's, named
    /// `spec.name`) as this engine's arena, when its geometry `kept` is exactly the one
    /// `spec` asks for (so its data region, which holds the kept image, stays where it is):
    /// no new segment, no copy. Its descriptor is initialised anew; the chunks keep their
    /// bytes. Fails (the file dropped, the segment untouched) when the geometry differs,
    /// the segment is not a whole, allocated arena of that size, or this process maps it
    /// already (a live arena of this process: two arenas over one mapping would hand out
    /// two `&mut` of one chunk). No other process may write the segment meanwhile: the
    /// engine, its only caller, holds the root and rank lock that every engine of a kept
    /// arena's name holds.
    pub fn take_over(spec: &ArenaSpec, kept: Geometry, file: std::fs::File) -> Result<Arc<Arena>> {
        let geo = Arena::geometry(spec)?;
        if geo != kept {
            return Err(Error::Config(format!(
                "the kept arena's layout {kept:?} is not this engine's {geo:?}"
            )));
        }
        let name = spec
            .name
            .as_deref()
            .ok_or_else(|| Error::Config("only a named arena can be taken over".into()))?;
        let seg = Segment::map_existing(name, file, geo.total_len as usize)?;
        let map = Mapped::take_over(seg, geo, spec.rank, spec.world_size, root_bytes(spec))?;
        Ok(Arena::from_mapped(map, geo, spec, true))
    }

    /// The layout `spec` asks for, checked.
    fn geometry(spec: &ArenaSpec) -> Result<Geometry> {
        if spec.chunk_size == 0 || !spec.chunk_size.is_multiple_of(descriptor::PAGE as u64) {
            return Err(Error::Config(format!(
                "chunk size {} is not a positive multiple of 4096",
                spec.chunk_size
            )));
        }
        let n_chunks = spec.capacity.div_ceil(spec.chunk_size).max(1);
        if n_chunks > layout::MAX_CHUNKS {
            return Err(Error::Config(format!(
                "{n_chunks} chunks exceed the arena's limit; use larger chunks"
            )));
        }
        let root = root_bytes(spec);
        if root.len() > layout::MAX_ROOT_LEN {
            return Err(Error::RootTooLong {
                path: spec.root.clone(),
                len: root.len(),
                max: layout::MAX_ROOT_LEN,
            });
        }
        if spec.slots > layout::MAX_SLOTS {
            return Err(Error::Config(format!(
                "{} save slots exceed the arena's limit of {}",
                spec.slots,
                layout::MAX_SLOTS
            )));
        }
        Geometry::new(
            n_chunks,
            spec.chunk_size,
            spec.slots.max(1),
            root.len() as u64,
        )
        .ok_or_else(|| {
            Error::Config(format!(
                "staging capacity of {n_chunks} chunks of {} bytes exceeds the address space",
                spec.chunk_size
            ))
        })
    }

    /// The arena over `map`; with `filled`, every chunk is backed and in the pool,
    /// otherwise the pool starts empty ([`Arena::fill_batch`] fills it).
    fn from_mapped(map: Mapped, geo: Geometry, spec: &ArenaSpec, filled: bool) -> Arc<Arena> {
        if let Some(n) = &spec.name {
            OPEN_HERE
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(n.clone());
        }
        let n_chunks = geo.n_chunks;
        Arc::new(Arena {
            map,
            geo,
            free: Mutex::new(if filled {
                (0..n_chunks as u32).rev().collect()
            } else {
                std::collections::VecDeque::new()
            }),
            fifo: std::sync::atomic::AtomicBool::new(false),
            freed: Condvar::new(),
            slots: Mutex::new((0..geo.n_slots).rev().collect()),
            slot_freed: Condvar::new(),
            waited_ns: AtomicU64::new(0),
            unlinked: std::sync::atomic::AtomicBool::new(false),
            keep: Mutex::new(Keep::default()),
            fill: Mutex::new(Fill {
                batches_done: u64::from(filled),
                batches: 1,
                finished: filled,
                errno: None,
            }),
            filled: Condvar::new(),
            stop_fill: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Take chunk `index` out of the pool, if it is free (flash restore: the chunks of a
    /// kept image in an arena taken over).
    pub fn take_chunk(self: &Arc<Self>, index: u32) -> Option<ChunkLease> {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        let at = free.iter().position(|&i| i == index)?;
        free.remove(at);
        drop(free);
        Some(self.lease(index))
    }

    /// Bytes per chunk.
    pub fn chunk_size(&self) -> u64 {
        self.geo.chunk_size
    }

    /// Number of data chunks.
    pub fn chunk_count(&self) -> u64 {
        self.geo.n_chunks
    }

    /// Data capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.geo.capacity()
    }

    /// The segment name, `None` for anonymous arenas.
    pub fn name(&self) -> Option<&str> {
        self.map.segment().name()
    }

    /// The crash-recovery descriptor.
    pub fn descriptor(&self) -> Descriptor<'_> {
        self.map.descriptor()
    }

    /// The data region: first chunk's address and total data bytes. Writers register it
    /// with io_uring and the CUDA driver.
    pub fn data_region(&self) -> (*mut u8, usize) {
        self.map.data_region()
    }

    /// Total nanoseconds callers have waited for free chunks.
    pub fn waited(&self) -> Duration {
        Duration::from_nanos(self.waited_ns.load(Ordering::Relaxed))
    }

    /// Free chunks right now.
    pub fn free_chunks(&self) -> usize {
        self.free.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Take a free chunk, blocking until one is released. Returns the lease and the time
    /// spent waiting.
    pub fn acquire(self: &Arc<Self>) -> (ChunkLease, Duration) {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        let mut waited = Duration::ZERO;
        if free.is_empty() {
            let t = Instant::now();
            while free.is_empty() {
                free = self.freed.wait(free).unwrap_or_else(|p| p.into_inner());
            }
            waited = t.elapsed();
            self.waited_ns
                .fetch_add(waited.as_nanos() as u64, Ordering::Relaxed);
        }
        let index = self.pop(&mut free).expect("pool is non-empty");
        drop(free);
        (self.lease(index), waited)
    }

    fn pop(&self, free: &mut std::collections::VecDeque<u32>) -> Option<u32> {
        if self.fifo.load(Ordering::Relaxed) {
            free.pop_front()
        } else {
            free.pop_back()
        }
    }

    /// Take a free chunk if one is available right now.
    pub fn try_acquire(self: &Arc<Self>) -> Option<ChunkLease> {
        let index = self.pop(&mut self.free.lock().unwrap_or_else(|p| p.into_inner()))?;
        Some(self.lease(index))
    }

    fn lease(self: &Arc<Self>, index: u32) -> ChunkLease {
        ChunkLease {
            arena: Arc::clone(self),
            index,
            ptr: self
                .map
                .chunk_ptr(index)
                .expect("indices in the free list are < n_chunks"),
        }
    }

    pub(super) fn release(&self, index: u32) {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        free.push_back(index);
        drop(free);
        self.freed.notify_one();
    }

    /// Take a free save slot, blocking until one is released.
    pub fn acquire_slot(&self) -> u32 {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        while slots.is_empty() {
            slots = self
                .slot_freed
                .wait(slots)
                .unwrap_or_else(|p| p.into_inner());
        }
        slots.pop().expect("non-empty")
    }

    /// Mark a slot free in the descriptor and return it to the pool.
    pub fn release_slot(&self, slot: u32) {
        self.descriptor().free(slot);
        self.slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(slot);
        self.slot_freed.notify_one();
    }

    /// Keep the arena in `/dev/shm` when it closes, with its last committed save marked
    /// `KEPT` in the descriptor (flash restore).
    pub fn enable_keep(&self) {
        crate::util::lock(&self.keep).enabled = true;
        self.fifo.store(true, Ordering::Relaxed);
    }

    /// Whether the arena is kept when it closes.
    pub fn keeps(&self) -> bool {
        crate::util::lock(&self.keep).enabled
    }

    /// A save begins: the kept image (if any) is given up before any of its chunks can be
    /// reused. Returns the save's sequence number for [`Arena::finish_slot`].
    pub fn begin_save(&self) -> u64 {
        let mut k = crate::util::lock(&self.keep);
        if let Some(slot) = k.slot.take() {
            self.release_slot(slot);
        }
        k.begun += 1;
        k.begun
    }

    /// The save with sequence `seq` in `slot` ended. With keeping on, a committed save
    /// that is still the latest to have begun becomes the kept image (its slot stays out
    /// of the pool until the next save begins); otherwise the slot is freed.
    pub fn finish_slot(&self, slot: u32, seq: u64, committed: bool) {
        let mut k = crate::util::lock(&self.keep);
        if k.enabled && committed && seq == k.begun && self.slot_chunks_distinct(slot) {
            self.descriptor().keep(slot);
            k.slot = Some(slot);
        } else {
            drop(k);
            self.release_slot(slot);
        }
    }

    /// Record a committed image that this process copied into `leases` (file chunk `k` in
    /// `leases[k]`, each a lease of this arena) as the kept image, exactly as a committed
    /// save would leave it: a descriptor slot in state `KEPT` whose chunk map names the
    /// leases' chunks, all `WRITTEN`. So if the process dies before its first save, the
    /// image is still there for the next engine. The slot is given up by the next
    /// [`Arena::begin_save`]; the caller holds the leases until then (the chunks must not be
    /// reused while the descriptor names them: drop them only after `begin_save`).
    ///
    /// Returns the slot, or `None` (nothing recorded) when keeping is off, a save has begun
    /// or an image is already kept, the leases are not this arena's or do not match
    /// `rec` (one per file chunk, distinct), or no slot is free.
    pub fn adopt_kept(
        &self,
        rec: &descriptor::SaveRecord<'_>,
        leases: &[ChunkLease],
    ) -> Option<u32> {
        let mut k = crate::util::lock(&self.keep);
        if !k.enabled || k.slot.is_some() || k.begun != 0 {
            return None;
        }
        if rec.file_len.div_ceil(self.geo.chunk_size) != rec.n_file_chunks
            || leases.len() as u64 != rec.n_file_chunks
            || !leases
                .iter()
                .all(|l| std::ptr::eq(Arc::as_ptr(&l.arena), self))
        {
            return None;
        }
        let mut seen = std::collections::BTreeSet::new();
        if !leases.iter().all(|l| seen.insert(l.index)) {
            return None;
        }
        let slot = self.slots.lock().unwrap_or_else(|p| p.into_inner()).pop()?;
        let d = self.descriptor();
        // STAGING, then every entry WRITTEN, then KEPT: a crash in between leaves a slot
        // that was never `STAGED`, which recovery refuses (it never re-commits the step).
        d.begin(slot, rec);
        for (i, l) in leases.iter().enumerate() {
            d.chunk_staged(slot, i as u64, l.index);
            d.chunk_written(slot, i as u64);
        }
        d.keep(slot);
        k.slot = Some(slot);
        Some(slot)
    }

    /// Whether every file chunk of `slot` lives in its own arena chunk: a save larger than
    /// the arena reuses chunks it already wrote, and then its image is not whole.
    fn slot_chunks_distinct(&self, slot: u32) -> bool {
        let v = self.descriptor().slot_view(slot);
        let mut seen = std::collections::BTreeSet::new();
        let ok = v.chunks.iter().all(|&(_, i)| seen.insert(i));
        if !ok {
            tracing::info!(
                step = v.step,
                "the save reused staging chunks (arena smaller than the file): nothing kept in memory"
            );
        }
        ok
    }

    /// Mark the arena cleanly closed and remove its name from `/dev/shm` (unless it is
    /// kept). The mapping stays valid until the last reference drops.
    pub fn close(&self) {
        if !self.unlinked.swap(true, Ordering::AcqRel) {
            self.descriptor().mark_closed();
            if self.keeps() {
                if let Some(n) = self.map.segment().name() {
                    OPEN_HERE
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(n);
                }
                return;
            }
            if let Some(n) = self.map.segment().name() {
                OPEN_HERE
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(n);
            }
            if let Err(e) = self.map.segment().unlink() {
                tracing::warn!(name = ?self.map.segment().name(), error = %e, "could not unlink staging arena");
            }
        }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        self.close();
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

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: Option<String>, capacity: u64) -> ArenaSpec {
        ArenaSpec {
            name,
            capacity,
            chunk_size: 65536,
            slots: 2,
            rank: 0,
            world_size: 1,
            root: "/tmp/x".into(),
        }
    }

    #[test]
    fn leases_are_distinct_and_return_to_the_pool() {
        let a = Arena::create(&spec(None, 4 * 65536)).unwrap();
        assert_eq!(a.chunk_count(), 4);
        let leases: Vec<_> = (0..4).map(|_| a.acquire().0).collect();
        let mut idx: Vec<u32> = leases.iter().map(|l| l.index()).collect();
        idx.sort();
        assert_eq!(idx, [0, 1, 2, 3]);
        assert_eq!(a.free_chunks(), 0);
        let a2 = Arc::clone(&a);
        let waiter = std::thread::spawn(move || a2.acquire().0.index());
        std::thread::sleep(Duration::from_millis(50));
        drop(leases);
        let got = waiter.join().unwrap();
        assert!(got < 4);
        assert_eq!(a.free_chunks(), 4);
        assert!(a.waited() > Duration::ZERO);
    }

    fn shm_exists(name: &str) -> bool {
        std::path::Path::new(shm::SHM_MOUNT).join(name).exists()
    }

    #[test]
    fn a_prefaulting_arena_hands_out_chunks_as_they_are_allocated() {
        let name = format!("{NAME_PREFIX}unit-prefault.{}", std::process::id());
        // 1 MiB chunks: 64 per batch, 4 batches; each background batch waits 100 ms.
        let mut sp = spec(Some(name.clone()), 256 << 20);
        sp.chunk_size = 1 << 20;
        let (a, mut pf) = Arena::create_prefaulting(&sp, 2, Duration::from_millis(100)).unwrap();
        assert_eq!(a.chunk_count(), 256);
        // The first batch is allocated by the constructor, the rest not yet.
        assert!(!a.is_filled());
        assert!(!a.fill_finished());
        assert_eq!(a.free_chunks(), 64);
        // A save takes what it needs and waits for the rest: all 256 chunks, distinct,
        // writable; the last ones only once the background threads allocated them.
        let mut leases: Vec<ChunkLease> = (0..256).map(|_| a.acquire().0).collect();
        assert!(a.is_filled());
        for (i, l) in leases.iter_mut().enumerate() {
            l.as_mut_slice().fill(i as u8);
        }
        let mut idx: Vec<u32> = leases.iter().map(|l| l.index()).collect();
        idx.sort_unstable();
        assert_eq!(idx, (0..256).collect::<Vec<u32>>());
        for (i, l) in leases.iter().enumerate() {
            assert!(l.as_slice().iter().all(|&b| b == i as u8));
        }
        a.wait_filled().unwrap();
        assert!(a.fill_error().is_none());
        drop(leases);
        assert_eq!(a.free_chunks(), 256);
        // Every page is allocated: the segment has no hole left.
        let (_, size, blocks) = shm::open_existing(&name, false, false).unwrap();
        assert!(blocks >= size, "{blocks} bytes allocated of {size}");
        pf.stop();
        a.close();
        assert!(!shm_exists(&name));
    }

    #[test]
    fn stopping_a_prefault_ends_its_threads_and_leaves_the_rest_unused() {
        let name = format!("{NAME_PREFIX}unit-prefault-stop.{}", std::process::id());
        let mut sp = spec(Some(name.clone()), 64 << 20);
        sp.chunk_size = 1 << 20;
        // 1 MiB chunks, 64 per batch: one batch only, nothing in the background.
        let (a, _pf) = Arena::create_prefaulting(&sp, 2, Duration::from_secs(3600)).unwrap();
        assert!(a.is_filled());
        a.close();
        drop(a);
        assert!(!shm_exists(&name));

        // 16 batches, each background one paused 200 ms: stopped at once, the threads end
        // after the batch they are in, long before the 3 s the rest would take.
        let mut sp = spec(Some(name.clone()), 1 << 30);
        sp.chunk_size = 1 << 20;
        let (a, mut pf) = Arena::create_prefaulting(&sp, 2, Duration::from_millis(200)).unwrap();
        assert_eq!(a.free_chunks(), 64);
        let waiter = {
            let a = Arc::clone(&a);
            std::thread::spawn(move || a.wait_filled())
        };
        pf.stop();
        // Stopped: the waiter is told (no hang), the chunks allocated stay usable, the
        // others never enter the pool.
        let r = waiter.join().unwrap();
        assert!(matches!(r, Err(Error::Shutdown(_))), "{r:?}");
        assert!(a.fill_finished());
        assert!(!a.is_filled());
        assert!(a.fill_error().is_none());
        let n = a.free_chunks();
        assert!((64..1024).contains(&n), "{n} chunks in the pool");
        // Only the prefault threads' references are gone: ours is the last one.
        assert_eq!(Arc::strong_count(&a), 1);
        a.close();
        assert!(!shm_exists(&name));
    }

    /// Regression: taking over a segment that a live arena of this process maps gave two
    /// arenas over one mapping (two `&mut` of chunk 0). Refused now; allowed once the
    /// first arena is gone.
    #[test]
    fn a_segment_mapped_here_cannot_be_taken_over_twice() {
        let name = format!("{NAME_PREFIX}unit-twice.{}", std::process::id());
        let sp = spec(Some(name.clone()), 2 * 65536);
        let geo = Arena::geometry(&sp).unwrap();
        let first = Arena::create(&sp).unwrap();
        first.enable_keep(); // closing leaves the segment in /dev/shm
        let (file, _, _) = shm::open_existing(&name, true, false).unwrap();
        let err = Arena::take_over(&sp, geo, file).unwrap_err();
        assert!(
            matches!(&err, Error::Shm { op: "map", source, .. }
                if source.kind() == std::io::ErrorKind::AlreadyExists),
            "{err}"
        );
        {
            let mut l = first.take_chunk(0).unwrap();
            l.as_mut_slice()[..4].copy_from_slice(b"kept");
        }
        drop(first);
        let (file, _, _) = shm::open_existing(&name, true, false).unwrap();
        let second = Arena::take_over(&sp, geo, file).unwrap();
        assert_eq!(second.name(), Some(name.as_str()));
        let mut l = second.take_chunk(0).unwrap();
        assert_eq!(&l.as_mut_slice()[..4], b"kept");
        drop(l);
        second.close(); // not kept: unlinks the name
        assert!(shm::open_existing(&name, false, false).is_err());
    }

    #[test]
    fn named_arena_is_attachable_and_unlinked_on_close() {
        let name = format!("{NAME_PREFIX}unit.{}", std::process::id());
        let a = Arena::create(&spec(Some(name.clone()), 2 * 65536)).unwrap();
        let (mut l, _) = a.acquire();
        l.as_mut_slice()[..5].copy_from_slice(b"hello");
        a.descriptor().begin(
            1,
            &descriptor::SaveRecord {
                step: 42,
                file_len: 100,
                data_start: 4096,
                n_file_chunks: 1,
                partial_dir: "step-42.partial",
                file_name: "f",
            },
        );
        a.descriptor().chunk_staged(1, 0, l.index());
        let other = AttachedArena::open(&name).unwrap();
        let v = other.slot(1);
        assert_eq!(
            (v.state, v.step, v.partial_dir.as_str()),
            (1, 42, "step-42.partial")
        );
        assert_eq!(v.chunks, [(descriptor::chunk_state::STAGED, l.index())]);
        let mut seen = [0u8; 5];
        other.read_chunk(l.index(), 0, &mut seen).unwrap();
        assert_eq!(&seen, b"hello");
        assert_eq!(other.header().owner_pid, std::process::id());
        assert_eq!(other.header().root, std::path::Path::new("/tmp/x"));
        drop(l);
        a.close();
        assert!(AttachedArena::open(&name).is_err());
        assert!(a.descriptor().header_view().closed);
    }

    #[test]
    fn an_adopted_image_is_recorded_kept_until_the_next_save_begins() {
        let name = format!("{NAME_PREFIX}unit-adopt.{}", std::process::id());
        let rec = descriptor::SaveRecord {
            step: 7,
            file_len: 65536 + 100,
            data_start: 4096,
            n_file_chunks: 2,
            partial_dir: "step-7.partial",
            file_name: "f",
        };
        let a = Arena::create(&spec(Some(name.clone()), 4 * 65536)).unwrap();
        let other = Arena::create(&spec(None, 4 * 65536)).unwrap();
        let leases: Vec<_> = (0..2).map(|_| a.try_acquire().unwrap()).collect();
        // Keeping off: nothing recorded.
        assert_eq!(a.adopt_kept(&rec, &leases), None);
        a.enable_keep();
        // Leases of another arena, too few leases, or a record that does not match them.
        let foreign: Vec<_> = (0..2).map(|_| other.try_acquire().unwrap()).collect();
        assert_eq!(a.adopt_kept(&rec, &foreign), None);
        assert_eq!(a.adopt_kept(&rec, &leases[..1]), None);
        let wrong = descriptor::SaveRecord {
            file_len: 3 * 65536,
            ..rec
        };
        assert_eq!(a.adopt_kept(&wrong, &leases), None);
        let slot = a.adopt_kept(&rec, &leases).unwrap();
        // Only once.
        assert_eq!(a.adopt_kept(&rec, &leases), None);
        let att = AttachedArena::open(&name).unwrap();
        let v = att.slot(slot);
        assert_eq!(
            (v.state, v.step, v.file_len, v.data_start),
            (descriptor::slot_state::KEPT, 7, 65536 + 100, 4096)
        );
        assert_eq!(
            (v.partial_dir.as_str(), v.file_name.as_str()),
            ("step-7.partial", "f")
        );
        let want: Vec<_> = leases
            .iter()
            .map(|l| (descriptor::chunk_state::WRITTEN, l.index()))
            .collect();
        assert_eq!(v.chunks, want);
        // The next save gives it up (slot freed in the descriptor, back in the pool).
        a.begin_save();
        assert_eq!(att.slot(slot).state, descriptor::slot_state::FREE);
        drop(leases);
        assert_eq!(a.free_chunks(), 4);
        // Keeping survives close: remove the name by hand.
        a.close();
        drop(att);
        let _ = std::fs::remove_file(std::path::Path::new(shm::SHM_MOUNT).join(&name));
    }
}
