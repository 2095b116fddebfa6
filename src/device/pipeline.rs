//! The CUDA staging pipeline: device-to-host copies on the engine's own stream per device,
//! one event per chunk and device, chunks handed to the writers as their events fire.
#![allow(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::cuda::{
    self, Context, CtxGuard, Event, HostRegistration, Latch, LatchPool, MemPool, Stream,
    StreamBuffer,
};
use super::snapshot::{LOOKAHEAD_BYTES, Layout};
use super::{Latches, Marks, StageJob};
use crate::error::{Error, Result};
use crate::plan::PieceSource;
use crate::staging::{Arena, ChunkLease};
use crate::util::lock;

/// How device copies are ordered after the trainer's work on one device. Built only from
/// a [`cuda::StreamRef`] / [`cuda::EventRef`], whose lifetime (or `from_raw`'s contract)
/// keeps the handle live while the save is staged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum After {
    /// Wait for everything queued on this `CUstream` when `save` is called.
    Stream(u64),
    /// Wait for this `CUevent` (recorded by the caller).
    Event(u64),
}

/// Per-device CUDA state: the primary context, one copy stream, reusable events, and the
/// memory pool of device snapshots (made on the first one).
#[derive(Debug)]
pub(crate) struct DeviceState {
    pub(crate) ctx: Arc<Context>,
    pub(crate) stream: Arc<Stream>,
    events: Mutex<Vec<Event>>,
    pool: Mutex<Option<Arc<MemPool>>>,
    /// The latches the trainer's streams wait on (`SaveWatch::hold_stream`).
    latches: Arc<LatchPool>,
    /// Whether waits for this device's events sleep instead of spinning
    /// (`EngineConfig::with_blocking_sync`).
    blocking_sync: bool,
}

impl DeviceState {
    fn pool(&self) -> Result<Arc<MemPool>> {
        let mut p = lock(&self.pool);
        if let Some(p) = &*p {
            return Ok(Arc::clone(p));
        }
        let made = MemPool::new(&self.ctx)?;
        *p = Some(Arc::clone(&made));
        Ok(made)
    }

    /// After a snapshot's buffer was dropped (its free queued on the stream): wait for the
    /// stream (only the engine's copies, complete by now, and the free are on it), then
    /// give the pool's memory back to the driver.
    fn release_snapshot(&self) {
        let Some(pool) = lock(&self.pool).clone() else {
            return;
        };
        let res = self
            .ctx
            .bind()
            .and_then(|()| self.stream.synchronize())
            .and_then(|()| pool.trim())
            .and_then(|()| pool.reserved());
        match res {
            Ok(0) => {}
            Ok(n) => tracing::warn!(bytes = n, "device snapshot memory not given back yet"),
            Err(e) => tracing::warn!(error = %e, "device snapshot memory not given back"),
        }
    }

    /// A shut latch on this device.
    pub(crate) fn latch(&self) -> Result<Latch> {
        self.latches.take()
    }

    fn event(&self) -> Result<Event> {
        match lock(&self.events).pop() {
            Some(e) => Ok(e),
            None => Event::with_sync(&self.ctx, self.blocking_sync),
        }
    }

    fn give_back(&self, e: Event) {
        lock(&self.events).push(e);
    }
}

/// The engine's CUDA side: created on first use (or at open), reused by every save.
#[derive(Debug)]
pub struct CudaStaging {
    arena: Arc<Arena>,
    devices: Mutex<BTreeMap<i32, Arc<DeviceState>>>,
    registration: Mutex<Option<HostRegistration>>,
    /// Whether device snapshots queue their copies in one driver call per device where
    /// the driver can (`EngineConfig::with_batch_device_copies`).
    batch: bool,
    /// Bytes of device copies queued ahead of their completion; 0: no bound
    /// (`EngineConfig::with_copy_ahead`).
    copy_ahead: u64,
    /// Whether the staging thread sleeps in its waits for copies instead of spinning
    /// (`EngineConfig::with_blocking_sync`).
    blocking_sync: bool,
}

impl CudaStaging {
    /// Nothing set up yet. `batch`: queue a device snapshot's copies in one driver call
    /// per device where the driver can. `copy_ahead`: bytes of device copies a save keeps
    /// queued ahead of their completion (0: all at once). `blocking_sync`: waits for the
    /// copies sleep instead of spinning.
    pub fn new(arena: Arc<Arena>, batch: bool, copy_ahead: u64, blocking_sync: bool) -> Self {
        CudaStaging {
            arena,
            devices: Mutex::new(BTreeMap::new()),
            registration: Mutex::new(None),
            batch,
            copy_ahead,
            blocking_sync,
        }
    }

    /// Contexts and streams of `devices`, without the registration.
    pub fn prepare_devices(&self, devices: &BTreeSet<i32>) -> Result<()> {
        if devices.is_empty() {
            return Ok(());
        }
        cuda::init()?;
        let _guard = CtxGuard::save()?;
        for &d in devices {
            self.device(d)?;
        }
        Ok(())
    }

    /// Make `devices` ready: contexts, streams, and (once) the staging registration, which
    /// first waits until the whole arena is allocated (its background prefault).
    /// Returns the registration time when this call registered.
    pub fn prepare(&self, devices: &BTreeSet<i32>) -> Result<Option<Duration>> {
        if devices.is_empty() {
            return Ok(None);
        }
        cuda::init()?;
        let _guard = CtxGuard::save()?;
        let mut first = None;
        for &d in devices {
            let st = self.device(d)?;
            first.get_or_insert(st);
        }
        let mut reg = lock(&self.registration);
        if reg.is_none() {
            // Registering pins every page: unallocated ones would be faulted in here, on
            // one thread, in the save's stall.
            self.arena.wait_filled()?;
            let st = first.expect("non-empty");
            let r = HostRegistration::new(&self.arena, &st.ctx)?;
            let took = r.took();
            tracing::info!(
                bytes = self.arena.capacity(),
                ?took,
                "staging arena registered with CUDA"
            );
            *reg = Some(r);
            return Ok(Some(took));
        }
        Ok(None)
    }

    /// The arena whose memory this staging registers.
    pub(crate) fn arena(&self) -> &Arc<Arena> {
        &self.arena
    }

    /// Whether the arena is registered, or a registration is under way (without waiting
    /// for one: `try_lock`).
    pub fn registered_or_busy(&self) -> bool {
        match self.registration.try_lock() {
            Ok(r) => r.is_some(),
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner().is_some(),
            Err(std::sync::TryLockError::WouldBlock) => true,
        }
    }

    /// Registration time, if registered.
    pub fn registration_time(&self) -> Option<Duration> {
        lock(&self.registration)
            .as_ref()
            .map(HostRegistration::took)
    }

    pub(crate) fn device(&self, d: i32) -> Result<Arc<DeviceState>> {
        let mut m = lock(&self.devices);
        if let Some(s) = m.get(&d) {
            return Ok(Arc::clone(s));
        }
        let ctx = Context::new(d)?;
        let stream = Arc::new(Stream::new(&ctx)?);
        let latches = LatchPool::new(&ctx);
        let st = Arc::new(DeviceState {
            ctx,
            stream,
            events: Mutex::new(Vec::new()),
            pool: Mutex::new(None),
            latches,
            blocking_sync: self.blocking_sync,
        });
        m.insert(d, Arc::clone(&st));
        Ok(st)
    }

    /// Copy a save whose sources include device memory into staging, handing each chunk
    /// to `dispatch` as soon as its copies completed. Returns the time spent waiting for
    /// free chunks.
    pub(crate) fn stage(&self, job: &StageJob<'_>, after: &[(i32, After)]) -> Result<Duration> {
        let devices = job.sources.devices();
        self.prepare(&devices)?;
        let _guard = CtxGuard::save()?;
        let states: BTreeMap<i32, Arc<DeviceState>> = devices
            .iter()
            .map(|&d| Ok((d, self.device(d)?)))
            .collect::<Result<_>>()?;
        // Order the copies after the trainer's work.
        for (&d, st) in &states {
            st.ctx.bind()?;
            match after.iter().find(|(dev, _)| *dev == d).map(|(_, a)| *a) {
                Some(After::Stream(s)) => {
                    let e = st.event()?;
                    // SAFETY: `After` values come only from a `StreamRef` (`SaveOptions`),
                    // borrowed from a live `Stream` for the save, or from `from_raw`, whose
                    // contract keeps the handle live until the save is staged.
                    unsafe { e.record_raw(s)? };
                    st.stream.wait_event(&e)?;
                    st.give_back(e);
                }
                // SAFETY: as for streams: an `EventRef` borrowed from a live `Event`, or
                // `from_raw`'s contract.
                Some(After::Event(e)) => unsafe { st.stream.wait_raw_event(e)? },
                None => st.ctx.synchronize()?,
            }
        }

        let mut pipeline = Pipeline {
            pending: VecDeque::new(),
            states: &states,
        };
        let mut snap = match job.snapshot {
            Some(_) => self.alloc_snapshot(job, &states),
            None => SnapshotState::Ready(None),
        };
        let res = self
            .stage_chunks(job, &mut pipeline, &mut snap)
            .and_then(|waited| {
                if let SnapshotState::Taken(_) = snap {
                    // `queued` was called when the snapshot was taken.
                    return Ok(waited);
                }
                let marks = self.mark(&states)?;
                if job.hold {
                    self.hold(&marks, after)?;
                }
                Self::open_latches((job.queued)(marks), &states)?;
                Ok(waited)
            });
        // Every copy into and out of the snapshot is queued: dropping it queues its free on
        // each device's stream, behind them (no host wait, no device-wide `cuMemFree`).
        let snapshot = matches!(
            snap,
            SnapshotState::Taken(_) | SnapshotState::Ready(Some(_))
        );
        drop(snap);
        let res = match res {
            Ok(waited) => pipeline.drain(job).map(|()| waited),
            Err(e) => {
                pipeline.abandon();
                Err(e)
            }
        };
        if snapshot {
            for st in states.values() {
                st.release_snapshot();
            }
        }
        res
    }

    /// One new event per device, recorded on its engine stream after every copy queued so
    /// far: whoever waits for it waits for the save's copies on that device.
    fn mark(&self, states: &BTreeMap<i32, Arc<DeviceState>>) -> Result<Marks> {
        let mut marks = Vec::with_capacity(states.len());
        for (&d, st) in states {
            st.ctx.bind()?;
            let e = Event::with_sync(&st.ctx, st.blocking_sync)?;
            e.record(&st.stream)?;
            marks.push((d, e));
        }
        Ok(marks)
    }

    /// Open each latch on its device's engine stream, behind every copy queued there so far.
    /// A latch of a device without copies of this save is dropped: opened from the host.
    /// One whose open could not be queued is opened from the host once that stream's copies
    /// have run; if the stream cannot be waited for, it is opened all the same (a latch left
    /// shut would stall the trainer's stream forever) and the error fails the save, whose
    /// bytes the trainer may then change under its copies.
    fn open_latches(latches: Latches, states: &BTreeMap<i32, Arc<DeviceState>>) -> Result<()> {
        let mut res = Ok(());
        for (d, mut l) in latches {
            let Some(st) = states.get(&d) else { continue };
            if let Err(e) = l.open_after(&st.stream) {
                tracing::warn!(error = %e, device = d, "latch opened from the host");
                if let Err(e) = st.stream.synchronize() {
                    res = res.and(Err(e));
                }
            }
        }
        res
    }

    /// Make every `After::Stream` stream wait for its device's mark.
    fn hold(&self, marks: &[(i32, Event)], after: &[(i32, After)]) -> Result<()> {
        for (d, e) in marks {
            let Some(After::Stream(s)) = after.iter().find(|(dev, _)| dev == d).map(|(_, a)| *a)
            else {
                continue;
            };
            e.context().bind()?;
            // SAFETY: `After::Stream` values come only from a `StreamRef` borrowed for the
            // save, or from `from_raw`, whose contract keeps the handle live until the save
            // is staged; it is a stream of this device's context.
            unsafe { e.hold_raw(s)? };
        }
        Ok(())
    }

    fn stage_chunks(
        &self,
        job: &StageJob<'_>,
        pipe: &mut Pipeline<'_>,
        snap: &mut SnapshotState,
    ) -> Result<Duration> {
        let cs = self.arena.chunk_size();
        let n = job.plan.chunk_count(cs);
        let mut waited = Duration::ZERO;
        for c in 0..n {
            if (job.failed)() {
                return Err(Error::Cancelled("the save failed while staging".into()));
            }
            if let (Some(req), SnapshotState::Ready(_)) = (job.snapshot, &*snap)
                && req.is_requested()
            {
                let SnapshotState::Ready(buffers) =
                    std::mem::replace(snap, SnapshotState::Declined)
                else {
                    unreachable!("matched Ready above")
                };
                *snap = self.take_snapshot(job, pipe, c, buffers.unwrap_or_default())?;
                if let SnapshotState::Taken(s) = &*snap {
                    req.set_bytes(s.allocated());
                    let marks = self.mark(pipe.states)?;
                    Self::open_latches((job.queued)(marks), pipe.states)?;
                }
            }
            // Keep the copies a bounded amount ahead of completion (waiting for our own
            // copies here is not backpressure: not counted). Before a snapshot: most device
            // bytes stay unqueued, for a snapshot asked for later. Otherwise: the trainer
            // runs on while the copies run, and a burst of thousands of queued copies would
            // fill the driver's queue, where its kernel launches wait behind the engine's
            // calls (measured on an H200: the step after a snapshot of 8.5 GB took 35 ms
            // longer, its launching thread blocked ~350 times).
            let snapshot = job.snapshot.is_some() && !matches!(snap, SnapshotState::Declined);
            if let Some(ahead) = chunks_ahead(self.copy_ahead, job.hold, snapshot, cs) {
                while pipe.pending.len() >= ahead {
                    pipe.complete_front(job)?;
                }
            }
            // Never block on the arena while chunks we filled are still waiting for their
            // copies: they are what the writers need to free space.
            let lease = loop {
                if let Some(l) = self.arena.try_acquire() {
                    break l;
                }
                if pipe.pending.is_empty() {
                    let (l, w) = self.arena.acquire();
                    waited += w;
                    break l;
                }
                let t = std::time::Instant::now();
                pipe.complete_front(job)?;
                waited += t.elapsed();
            };
            let range = job.plan.chunk_range(c, cs);
            let len = (range.end - range.start) as usize;
            let mut used: BTreeSet<i32> = BTreeSet::new();
            // Fill the chunk and record its events; on an error part way, copies into the
            // lease may be queued on the streams of `used`: the lease must not go back to
            // the pool (its `Drop`) before they complete.
            let taken = match &*snap {
                SnapshotState::Taken(s) => Some(s),
                _ => None,
            };
            let filled = self.fill_chunk(job, pipe, &lease, range, len, &mut used, taken);
            let (write_len, events) = match filled {
                Ok(f) => f,
                Err(e) => {
                    let done = used
                        .iter()
                        .all(|d| pipe.states[d].stream.synchronize().is_ok());
                    if !done {
                        tracing::error!(
                            chunk = c,
                            "device copy state unknown; staging chunk leaked"
                        );
                        std::mem::forget(lease);
                    }
                    return Err(e);
                }
            };
            pipe.pending.push_back(PendingChunk {
                chunk: c,
                lease,
                len,
                write_len,
                events,
            });
            // Hand over every chunk whose copies are already done.
            while pipe.front_ready()? {
                pipe.complete_front(job)?;
            }
        }
        Ok(waited)
    }

    /// Copy the pieces of file chunk `range` into `lease` (host bytes now, device bytes
    /// queued on each device's stream, the devices added to `used`), zero its tail up to
    /// the write length, and record an event after the copies on each stream used.
    /// Returns the write length and the events.
    #[allow(clippy::too_many_arguments)]
    fn fill_chunk(
        &self,
        job: &StageJob<'_>,
        pipe: &Pipeline<'_>,
        lease: &ChunkLease,
        range: std::ops::Range<u64>,
        len: usize,
        used: &mut BTreeSet<i32>,
        snap: Option<&Snapshot>,
    ) -> Result<(usize, Vec<(i32, Event)>)> {
        let mut bound: Option<i32> = None;
        let base = lease.as_ptr();
        let chunk_len = lease.len();
        // Host bytes are written through `base`, never through a `&mut` of the whole chunk:
        // device copies into other bytes of it may be queued meanwhile.
        let put = |dst: usize, src: &[u8]| {
            assert!(dst + src.len() <= chunk_len, "plan piece outside its chunk");
            // SAFETY: `dst..dst+len` lies in the leased chunk (asserted); the lease makes it
            // ours, and no queued device copy writes these bytes (a plan's pieces are
            // disjoint); `src` is a different allocation (the caller's tensor or the plan's
            // header), so the ranges do not overlap.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), base.add(dst), src.len()) };
        };
        for p in job.plan.pieces(range) {
            match p.source {
                PieceSource::Header { at } => {
                    put(p.dst, &job.plan.header()[at as usize..at as usize + p.len]);
                }
                PieceSource::Tensor { entry, at } => {
                    let input = job.plan.entries()[entry].input;
                    if let Some(b) = job.sources.host(input) {
                        put(p.dst, &b[at as usize..at as usize + p.len]);
                    } else {
                        let d = job.sources.device(input).expect("device source");
                        let st = &pipe.states[&d.device()];
                        used.insert(d.device());
                        if bound != Some(d.device()) {
                            st.ctx.bind()?;
                            bound = Some(d.device());
                        }
                        let held = snap.and_then(|s| {
                            let (dev, off) = s.layout.locate(input, at, p.len as u64)?;
                            Some(s.buffers.get(&dev)?.ptr() + off)
                        });
                        let src = held.unwrap_or(d.ptr() + at);
                        // SAFETY: `dst..dst+len` lies in the leased chunk, which is not
                        // read, written or released until this copy has completed: it
                        // goes to `pending` until an event recorded after the copy
                        // completes, and on an error before that `stage_chunks`
                        // synchronizes this stream (or leaks the chunk) before the lease
                        // can drop. The source range is inside the caller's device
                        // tensor (plan offsets are bounded by its length, checked at
                        // validation) and valid until staging ends, or, once a snapshot
                        // holds these bytes (`locate` checked the whole range), inside
                        // the snapshot buffer of this device: written by a copy queued
                        // earlier on this same stream (so complete before this one
                        // starts), and freed in this stream's order after this copy (its
                        // drop queues the free on the stream, after staging queued its
                        // last copy).
                        unsafe { st.stream.copy_dtoh(base.add(p.dst), src, p.len)? };
                    }
                }
            }
        }
        let write_len = (job.write_len)(len);
        assert!(
            len <= write_len && write_len <= chunk_len,
            "write length outside its chunk"
        );
        // SAFETY: `len..write_len` lies in the leased chunk (asserted) and past every piece,
        // so no queued device copy writes it.
        unsafe { std::ptr::write_bytes(base.add(len), 0, write_len - len) };
        let mut events = Vec::with_capacity(used.len());
        for d in used.iter() {
            let st = &pipe.states[d];
            st.ctx.bind()?;
            let e = st.event()?;
            e.record(&st.stream)?;
            events.push((*d, e));
        }
        Ok((write_len, events))
    }
}

/// How many staged chunks (`Pipeline::pending`) may wait for their copies before the next
/// chunk's are queued, or `None` for no bound. A save holding the trainer's streams
/// (`hold`) queues everything before it returns (none); a snapshot-mode save (`snapshot`:
/// its buffers allocated) is always bounded, at most by `LOOKAHEAD_BYTES`, so that most
/// device bytes are still unqueued when a snapshot is asked for; any other save by
/// `copy_ahead` (`EngineConfig::with_copy_ahead`; 0: none). At least 2 chunks of `cs`
/// bytes, so that one chunk's copies run while the next chunk's are queued.
fn chunks_ahead(copy_ahead: u64, hold: bool, snapshot: bool, cs: u64) -> Option<usize> {
    let bytes = if snapshot {
        match copy_ahead {
            0 => LOOKAHEAD_BYTES,
            b => b.min(LOOKAHEAD_BYTES),
        }
    } else if hold || copy_ahead == 0 {
        return None;
    } else {
        copy_ahead
    };
    Some(
        usize::try_from(bytes / cs.max(1))
            .unwrap_or(usize::MAX)
            .max(2),
    )
}

/// A save's device snapshot ([`super::snapshot`]).
#[derive(Debug)]
pub(crate) struct Snapshot {
    layout: Layout,
    /// One buffer per device of `layout.totals`, ordered on that device's engine stream.
    buffers: BTreeMap<i32, StreamBuffer>,
}

impl Snapshot {
    /// Device bytes of its buffers (the save's peak extra device memory).
    fn allocated(&self) -> u64 {
        self.buffers.values().map(|b| b.len() as u64).sum()
    }
}

/// Where a save is with its snapshot.
#[derive(Debug)]
pub(crate) enum SnapshotState {
    /// None taken (or not snapshot mode). A snapshot-mode save holds its buffers, one per
    /// device, allocated when it started (`alloc_snapshot`).
    Ready(Option<BTreeMap<i32, StreamBuffer>>),
    /// Taken: the rest is copied from its buffers.
    Taken(Snapshot),
    /// Asked for, but the buffers could not be allocated: the save goes on copying from
    /// the caller's tensors, and `queued` is called at the end as without a snapshot.
    Declined,
}

impl CudaStaging {
    /// The layout of every device byte of file chunks `from..`.
    fn snapshot_layout(job: &StageJob<'_>, cs: u64, from: u64) -> Result<Layout> {
        let start = job.plan.chunk_range(from, cs).start;
        let mut pieces = Vec::new();
        for p in job.plan.pieces(start..job.plan.file_len()) {
            if let PieceSource::Tensor { entry, at } = p.source {
                let input = job.plan.entries()[entry].input;
                if let Some(d) = job.sources.device(input) {
                    pieces.push((input, d.device(), at, p.len as u64));
                }
            }
        }
        Layout::new(pieces)
    }

    /// A snapshot-mode save's buffers, allocated when it starts (stream-ordered, on each
    /// device's engine stream) for every device byte of the save: a request then only
    /// queues device-to-device copies. Mapping fresh pool memory is the slow part (12 ms
    /// for 8.5 GB on an H200), and here it runs while the trainer computes, not while its
    /// optimizer step waits for the snapshot. `Declined` when the memory is not there.
    fn alloc_snapshot(
        &self,
        job: &StageJob<'_>,
        states: &BTreeMap<i32, Arc<DeviceState>>,
    ) -> SnapshotState {
        let layout = match Self::snapshot_layout(job, self.arena.chunk_size(), 0) {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "device snapshot declined");
                return SnapshotState::Declined;
            }
        };
        let mut buffers = BTreeMap::new();
        for (&dev, &total) in &layout.totals {
            let st = &states[&dev];
            let made = usize::try_from(total)
                .map_err(|_| Error::Internal("snapshot larger than the address space".into()))
                .and_then(|len| st.pool()?.alloc(&st.stream, len));
            match made {
                Ok(b) => {
                    buffers.insert(dev, b);
                }
                Err(e) => {
                    tracing::warn!(bytes = total, device = dev, error = %e, "device snapshot declined: cannot allocate its buffer");
                    return SnapshotState::Declined;
                }
            }
        }
        SnapshotState::Ready(Some(buffers))
    }

    /// Copy every device byte of file chunks `from..` (none queued yet) into `buffers`
    /// (allocated at the save's start for all of its device bytes), on each device's
    /// engine stream after the copies queued so far.
    fn take_snapshot(
        &self,
        job: &StageJob<'_>,
        pipe: &Pipeline<'_>,
        from: u64,
        buffers: BTreeMap<i32, StreamBuffer>,
    ) -> Result<SnapshotState> {
        let layout = Self::snapshot_layout(job, self.arena.chunk_size(), from)?;
        for (&dev, &total) in &layout.totals {
            let room = buffers.get(&dev).map_or(0, |b| b.len() as u64);
            if total > room {
                // Never: the rest of a save is a part of all of it.
                tracing::warn!(
                    bytes = total,
                    room,
                    device = dev,
                    "device snapshot declined: its buffer is too small"
                );
                return Ok(SnapshotState::Declined);
            }
        }
        // One list of copies per device, queued in one driver call each where the driver
        // batches them (`copy_dtod_many`): the optimizer step waits while they are queued.
        let mut copies: BTreeMap<i32, Vec<(u64, u64, usize)>> = BTreeMap::new();
        for (&input, p) in &layout.inputs {
            let d = job.sources.device(input).expect("device source");
            let buf = &buffers[&p.device];
            let len = usize::try_from(p.end - p.from).map_err(|_| {
                Error::Internal("snapshot range larger than the address space".into())
            })?;
            copies
                .entry(p.device)
                .or_default()
                .push((buf.ptr() + p.offset, d.ptr() + p.from, len));
        }
        let mut batched = !copies.is_empty();
        for (dev, list) in &copies {
            let st = &pipe.states[dev];
            st.ctx.bind()?;
            // SAFETY: each source `from..end` lies inside the caller's device tensor (plan
            // offsets are bounded by its length, checked at validation), valid and not
            // modified until the event recorded after these copies completes (the caller's
            // writers wait for it: `queued`); each destination lies inside this device's
            // buffer (the layout's total bounds every range placed in it and is at most the
            // buffer's length: checked above), an allocation made for this save that
            // nothing else uses, ordered on this stream (allocated before these copies,
            // freed after them); the layout gives each input its own range (destinations
            // never overlap), and sources and destinations are different allocations.
            batched &= unsafe { st.stream.copy_dtod_many(list, self.batch)? };
        }
        if let Some(req) = job.snapshot {
            req.set_batched(batched);
        }
        tracing::debug!(
            bytes = layout.bytes(),
            chunk = from,
            "device snapshot taken"
        );
        Ok(SnapshotState::Taken(Snapshot { layout, buffers }))
    }
}

struct PendingChunk {
    chunk: u64,
    lease: ChunkLease,
    len: usize,
    write_len: usize,
    events: Vec<(i32, Event)>,
}

struct Pipeline<'s> {
    pending: VecDeque<PendingChunk>,
    states: &'s BTreeMap<i32, Arc<DeviceState>>,
}

impl Pipeline<'_> {
    fn front_ready(&self) -> Result<bool> {
        match self.pending.front() {
            None => Ok(false),
            Some(p) => {
                for (_, e) in &p.events {
                    if !e.query()? {
                        return Ok(false);
                    }
                }
                Ok(true)
            }
        }
    }

    /// Wait for the oldest chunk's copies and dispatch it.
    fn complete_front(&mut self, job: &StageJob<'_>) -> Result<()> {
        let p = self.pending.front().expect("pending chunk");
        for (_, e) in &p.events {
            e.synchronize()?;
        }
        let p = self.pending.pop_front().expect("pending chunk");
        for (d, e) in p.events {
            self.states[&d].give_back(e);
        }
        (job.dispatch)(p.lease, p.chunk, p.len, p.write_len)
    }

    fn drain(&mut self, job: &StageJob<'_>) -> Result<()> {
        while !self.pending.is_empty() {
            if let Err(e) = self.complete_front(job) {
                self.abandon();
                return Err(e);
            }
        }
        Ok(())
    }

    /// After an error: wait for the copies in flight so their chunks can be reused; if the
    /// device cannot confirm completion, leak the chunks instead of reusing memory a DMA
    /// engine may still write.
    fn abandon(&mut self) {
        for p in self.pending.drain(..) {
            let ok = p.events.iter().all(|(_, e)| e.synchronize().is_ok());
            if ok {
                for (d, e) in p.events {
                    self.states[&d].give_back(e);
                }
            } else {
                tracing::error!(
                    chunk = p.chunk,
                    "device copy state unknown; staging chunk leaked"
                );
                std::mem::forget(p.lease);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{LOOKAHEAD_BYTES, chunks_ahead};

    const MIB: u64 = 1 << 20;

    #[test]
    fn copies_are_queued_copy_ahead_bytes_ahead_unless_the_streams_are_held() {
        // The default: 256 MiB of 8 MiB chunks.
        assert_eq!(chunks_ahead(256 * MIB, false, false, 8 * MIB), Some(32));
        // Holding the trainer's streams: everything is queued before the save returns.
        assert_eq!(chunks_ahead(256 * MIB, true, false, 8 * MIB), None);
        // 0: every copy at once.
        assert_eq!(chunks_ahead(0, false, false, 8 * MIB), None);
        // Never fewer than two chunks: one copying while the next is queued.
        assert_eq!(chunks_ahead(MIB, false, false, 8 * MIB), Some(2));
        assert_eq!(chunks_ahead(u64::MAX, false, false, 1), Some(usize::MAX));
        // A snapshot-mode save is bounded, at most by LOOKAHEAD_BYTES, even at 0.
        let snap = usize::try_from(LOOKAHEAD_BYTES / (8 * MIB)).unwrap();
        assert_eq!(chunks_ahead(0, false, true, 8 * MIB), Some(snap));
        assert_eq!(chunks_ahead(4096 * MIB, false, true, 8 * MIB), Some(snap));
        assert_eq!(chunks_ahead(64 * MIB, false, true, 8 * MIB), Some(8));
    }
}
