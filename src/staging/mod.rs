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
pub mod held;
pub mod layout;
mod lease;
mod mapped;
mod prefault;
pub mod shm;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
pub use attach::AttachedArena;
use descriptor::{Descriptor, Geometry};
pub use lease::ChunkLease;
use mapped::Mapped;
pub use prefault::{Prefault, prefault_threads};
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
    /// Per chunk: the sequence number ([`Arena::begin_save`]) of the save that last took
    /// it, so that a save taking the oldest first can skip its own chunks.
    taken_in: Box<[AtomicU64]>,
    /// The sequence number of the latest save to have begun.
    seq: AtomicU64,
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
    /// Called by [`Arena::acquire`] before it waits for a chunk: the remote tier gives
    /// back the chunks it holds for uploads that can read them from the local file instead.
    reclaim: Mutex<Option<Reclaim>>,
    /// Whether a reclaim hook is installed (read under the pool's lock, which must never
    /// wait for `reclaim`'s: the hook takes the pool's lock).
    has_reclaim: std::sync::atomic::AtomicBool,
}

/// A hook that frees chunks held beyond their write ([`Arena::set_reclaim`]). Its argument:
/// `true` when no chunk is free, `false` when the only free chunks are the current save's
/// own (taking the oldest first: reusing one would break the save's image).
pub struct Reclaim(pub Box<dyn Fn(bool) + Send + Sync>);

impl std::fmt::Debug for Reclaim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Reclaim")
    }
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
        let (seg, geo) = Arena::map_kept(spec, kept, file)?;
        let map = Mapped::take_over(seg, geo, spec.rank, spec.world_size, root_bytes(spec))?;
        Ok(Arena::from_mapped(map, geo, spec, true))
    }

    /// The kept arena `file` (named `spec.name`) mapped for a take-over, when its geometry
    /// `kept` is exactly the one `spec` asks for ([`Arena::take_over`],
    /// [`Arena::take_over_keeping`]).
    fn map_kept(
        spec: &ArenaSpec,
        kept: Geometry,
        file: std::fs::File,
    ) -> Result<(Segment, Geometry)> {
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
        Ok((
            Segment::map_existing(name, file, geo.total_len as usize)?,
            geo,
        ))
    }

    /// [`Arena::take_over`], keeping the saves in descriptor slots `keep` (a dead engine's
    /// saves the engine holds in memory or recovers behind its open): nothing of the
    /// descriptor is zeroed, those slots stay `STAGED` and out of the slot pool (the
    /// caller takes their staged chunks out of the chunk pool with [`Arena::take_chunk`]
    /// and gives each slot back with [`Arena::release_slot`]); every other slot is freed
    /// (`Mapped::take_over_keeping`). The caller checked that `spec`'s rank, world size and
    /// root are the arena's.
    pub fn take_over_keeping(
        spec: &ArenaSpec,
        kept: Geometry,
        file: std::fs::File,
        keep: &[u32],
    ) -> Result<Arc<Arena>> {
        let (seg, geo) = Arena::map_kept(spec, kept, file)?;
        let map = Mapped::take_over_keeping(seg, geo, root_bytes(spec), keep)?;
        let arena = Arena::from_mapped(map, geo, spec, true);
        arena
            .slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|s| !keep.contains(s));
        Ok(arena)
    }

    /// The layout `spec` asks for, checked.
    pub(crate) fn geometry(spec: &ArenaSpec) -> Result<Geometry> {
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
            taken_in: (0..n_chunks).map(|_| AtomicU64::new(0)).collect(),
            seq: AtomicU64::new(0),
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
            reclaim: Mutex::new(None),
            has_reclaim: std::sync::atomic::AtomicBool::new(false),
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
        let empty = free.is_empty();
        if empty || self.only_own(&free) {
            // Chunks held only for uploads or replication come back first (they drop their
            // leases, which takes this lock: call the hook without it). Taking the oldest
            // first, a save asks for them too before it would reuse a chunk of its own.
            drop(free);
            if let Some(r) = &*crate::util::lock(&self.reclaim) {
                (r.0)(empty);
            }
            free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        }
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
            // The oldest free chunk that the current save has not taken yet (its own come
            // back behind the older ones, chunks given back by the reclaim hook behind
            // those), else the oldest.
            match free.iter().position(|&i| !self.own(i)) {
                Some(at) => free.remove(at),
                None => free.pop_front(),
            }
        } else {
            free.pop_back()
        }
    }

    /// Whether chunk `index` was taken by the latest save to have begun (taking the oldest
    /// first; none before the first save).
    fn own(&self, index: u32) -> bool {
        let seq = self.seq.load(Ordering::Relaxed);
        seq != 0 && self.taken_in[index as usize].load(Ordering::Relaxed) == seq
    }

    /// Taking the oldest first, whether every free chunk is the current save's own (reusing
    /// one breaks its image: the reclaim hook is asked first).
    fn only_own(&self, free: &std::collections::VecDeque<u32>) -> bool {
        self.fifo.load(Ordering::Relaxed)
            && self.has_reclaim.load(Ordering::Relaxed)
            && !free.is_empty()
            && free.iter().all(|&i| self.own(i))
    }

    /// Take a free chunk if one is available right now (taking the oldest first with a
    /// reclaim hook installed: `None` when the only free chunks are the current save's
    /// own, so that [`Arena::acquire`] asks the hook first).
    pub fn try_acquire(self: &Arc<Self>) -> Option<ChunkLease> {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        if self.only_own(&free) {
            return None;
        }
        let index = self.pop(&mut free)?;
        drop(free);
        Some(self.lease(index))
    }

    fn lease(self: &Arc<Self>, index: u32) -> ChunkLease {
        if let Some(t) = self.taken_in.get(index as usize) {
            t.store(self.seq.load(Ordering::Relaxed), Ordering::Relaxed);
        }
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

    /// Install the hook [`Arena::acquire`] calls before it waits for a free chunk. The hook
    /// must not acquire chunks itself, and must not hold a strong reference to this arena
    /// (the arena owns it).
    pub fn set_reclaim(&self, hook: Reclaim) {
        *crate::util::lock(&self.reclaim) = Some(hook);
        self.has_reclaim.store(true, Ordering::Relaxed);
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
        self.take_oldest_first();
    }

    /// Take free chunks from the front of the pool (the longest free) from now on, so
    /// that a save never reuses a chunk it filled itself while other chunks are free (its
    /// image stays whole in the arena: kept, or held for replication). The pool is put in
    /// ascending order first, and batches allocated later join it in ascending order, so a
    /// fresh arena hands out consecutive chunks (a held image's pieces are then zero-copy
    /// views).
    pub fn take_oldest_first(&self) {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        if !self.fifo.swap(true, Ordering::Relaxed) {
            free.make_contiguous().sort_unstable();
        }
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
        self.seq.store(k.begun, Ordering::Relaxed);
        k.begun
    }

    /// The save with sequence `seq` in `slot` ended. With keeping on, a committed save
    /// that is still the latest to have begun becomes the kept image (its slot stays out
    /// of the pool until the next save begins); otherwise the slot is freed.
    pub fn finish_slot(self: &Arc<Self>, slot: u32, seq: u64, committed: bool) {
        drop(self.finish_slot_holding(slot, seq, committed, None));
    }

    /// [`Arena::finish_slot`], and with `hold` (`(registry, the file's length)`): a
    /// committed save whose image is whole in the arena (the condition of keeping: still
    /// the latest save to have begun, its file chunks in distinct arena chunks) is held,
    /// its chunks taken out of the free pool as the leases of the returned image (taken
    /// here, under the lock [`Arena::begin_save`] takes, so no later save can have reused
    /// them). A chunk not in the pool (a remote upload still holds it) is not held (that
    /// piece is read from the file). `None` when the image is not whole.
    pub fn finish_slot_holding(
        self: &Arc<Self>,
        slot: u32,
        seq: u64,
        committed: bool,
        hold: Option<(&held::HeldImages, u64)>,
    ) -> Option<held::HeldImage> {
        let mut k = crate::util::lock(&self.keep);
        let latest = committed && seq == k.begun;
        let whole = latest && (k.enabled || hold.is_some()) && self.slot_chunks_distinct(slot);
        let image = match hold {
            Some((registry, file_len)) if whole => self.hold_slot(registry, slot, file_len),
            _ => None,
        };
        if k.enabled && whole {
            self.descriptor().keep(slot);
            k.slot = Some(slot);
        } else {
            drop(k);
            self.release_slot(slot);
        }
        image
    }

    /// Take `slot`'s chunks out of the pool as a held image of `file_len` bytes (the
    /// caller holds the keep lock and checked the image is whole).
    fn hold_slot(
        self: &Arc<Self>,
        registry: &held::HeldImages,
        slot: u32,
        file_len: u64,
    ) -> Option<held::HeldImage> {
        let v = self.descriptor().slot_view(slot);
        let cs = self.geo.chunk_size;
        if v.file_len != file_len || v.chunks.len() as u64 != file_len.div_ceil(cs) || file_len == 0
        {
            return None;
        }
        // Only chunks in the pool are taken (indices read from the shared descriptor are
        // never trusted beyond that).
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        let wanted: std::collections::BTreeSet<u32> = v.chunks.iter().map(|&(_, i)| i).collect();
        let mut present = std::collections::BTreeSet::new();
        free.retain(|i| !(wanted.contains(i) && present.insert(*i)));
        drop(free);
        let leases = v
            .chunks
            .iter()
            .map(|&(_, i)| present.contains(&i).then(|| self.lease(i)))
            .collect();
        Some(held::HeldImage::new(registry, v.step, file_len, cs, leases))
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

#[cfg(test)]
mod held_tests;
#[cfg(test)]
mod tests;
