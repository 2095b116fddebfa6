//! Copy sources: how bytes get from host or device memory into staging chunks.
//!
//! Host tensors are copied with `memcpy`, by several threads for large saves. Device
//! tensors are copied with `cuMemcpyDtoHAsync` on the engine's own stream per device, straight
//! into each tensor's place in the staged file image; one event per chunk and device marks
//! the chunk complete, and the chunk goes to the writers as soon as its events have fired,
//! so disk writes overlap the rest of the device-to-host copy.
#![allow(unsafe_code)]

pub mod cuda;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::plan::{PieceSource, Plan};
use crate::restore::ReadSink;
use crate::staging::{Arena, ChunkLease};
use crate::tensor::{DeviceSlice, Source, Tensor};
use cuda::{Context, CtxGuard, Event, HostRegistration, Stream};

/// Where one tensor's bytes are (a raw form of [`Source`], so staging can run on another
/// thread).
#[derive(Debug, Clone, Copy)]
enum SrcPtr {
    Host { ptr: *const u8, len: usize },
    Cuda(DeviceSlice<'static>),
}

/// The sources of one save; host bytes borrowed for `'a`.
#[derive(Debug)]
pub struct Sources<'a> {
    v: Vec<SrcPtr>,
    _borrow: PhantomData<&'a [u8]>,
}

// SAFETY: the pointers are only read; host bytes are shared borrows for `'a` (or, after
// `into_static`, valid by that function's contract), and device ranges are valid by
// `DeviceSlice::new`'s contract, on whatever thread staging runs.
unsafe impl Send for Sources<'_> {}
// SAFETY: as above (read-only).
unsafe impl Sync for Sources<'_> {}

impl<'a> Sources<'a> {
    /// Capture the sources of `tensors`.
    pub fn new(tensors: &[Tensor<'a>]) -> Sources<'a> {
        let v = tensors
            .iter()
            .map(|t| match t.source {
                Source::Host(b) => SrcPtr::Host {
                    ptr: b.as_ptr(),
                    len: b.len(),
                },
                // SAFETY: the same range as `d`; `Sources<'a>` keeps the borrow for `'a`
                // (or `into_static`'s contract keeps it valid), like `d` did.
                Source::Cuda(d) => {
                    SrcPtr::Cuda(unsafe { DeviceSlice::new(d.ptr(), d.len(), d.device()) })
                }
            })
            .collect();
        Sources {
            v,
            _borrow: PhantomData,
        }
    }

    /// Forget the borrow, so staging can outlive the caller's stack frame.
    ///
    /// # Safety
    /// Every host slice must stay valid and unmodified, and every device range valid,
    /// until staging of the save has finished (the handle reports it staged).
    pub unsafe fn into_static(self) -> Sources<'static> {
        Sources {
            v: self.v,
            _borrow: PhantomData,
        }
    }

    /// Devices the save reads from.
    pub fn devices(&self) -> BTreeSet<i32> {
        self.v
            .iter()
            .filter_map(|s| match s {
                SrcPtr::Cuda(d) if !d.is_empty() => Some(d.device()),
                _ => None,
            })
            .collect()
    }

    /// Host bytes of tensor `i` (`None` for device tensors).
    pub fn host(&self, i: usize) -> Option<&[u8]> {
        match self.v[i] {
            // SAFETY: borrowed for `'a` (or valid by `into_static`'s contract) and never
            // written through; the slice cannot outlive `self`.
            SrcPtr::Host { ptr, len } => Some(unsafe { std::slice::from_raw_parts(ptr, len) }),
            SrcPtr::Cuda(_) => None,
        }
    }

    fn device(&self, i: usize) -> Option<DeviceSlice<'static>> {
        match self.v[i] {
            SrcPtr::Cuda(d) => Some(d),
            SrcPtr::Host { .. } => None,
        }
    }
}

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

/// Per-device CUDA state: the primary context, one copy stream, reusable events.
#[derive(Debug)]
struct DeviceState {
    ctx: Arc<Context>,
    stream: Stream,
    events: Mutex<Vec<Event>>,
}

impl DeviceState {
    fn event(&self) -> Result<Event> {
        match self.events.lock().unwrap_or_else(|p| p.into_inner()).pop() {
            Some(e) => Ok(e),
            None => Event::new(&self.ctx),
        }
    }

    fn give_back(&self, e: Event) {
        self.events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(e);
    }
}

/// The engine's CUDA side: created on first use (or at open), reused by every save.
#[derive(Debug)]
pub struct CudaStaging {
    arena: Arc<Arena>,
    devices: Mutex<BTreeMap<i32, Arc<DeviceState>>>,
    registration: Mutex<Option<HostRegistration>>,
}

impl CudaStaging {
    /// Nothing set up yet.
    pub fn new(arena: Arc<Arena>) -> Self {
        CudaStaging {
            arena,
            devices: Mutex::new(BTreeMap::new()),
            registration: Mutex::new(None),
        }
    }

    /// Make `devices` ready: contexts, streams, and (once) the staging registration.
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
        let mut reg = self.registration.lock().unwrap_or_else(|p| p.into_inner());
        if reg.is_none() {
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

    /// Registration time, if registered.
    pub fn registration_time(&self) -> Option<Duration> {
        self.registration
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(HostRegistration::took)
    }

    fn device(&self, d: i32) -> Result<Arc<DeviceState>> {
        let mut m = self.devices.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = m.get(&d) {
            return Ok(Arc::clone(s));
        }
        let ctx = Context::new(d)?;
        let stream = Stream::new(&ctx)?;
        let st = Arc::new(DeviceState {
            ctx,
            stream,
            events: Mutex::new(Vec::new()),
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
        let res = self.stage_chunks(job, &mut pipeline);
        match res {
            Ok(waited) => {
                pipeline.drain(job)?;
                Ok(waited)
            }
            Err(e) => {
                pipeline.abandon();
                Err(e)
            }
        }
    }

    fn stage_chunks(&self, job: &StageJob<'_>, pipe: &mut Pipeline<'_>) -> Result<Duration> {
        let cs = self.arena.chunk_size();
        let n = job.plan.chunk_count(cs);
        let mut waited = Duration::ZERO;
        for c in 0..n {
            if (job.failed)() {
                return Err(Error::Cancelled("the save failed while staging".into()));
            }
            // Never block on the arena while chunks we filled are still waiting for their
            // copies: they are what the writers need to free space.
            let mut lease = loop {
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
            let mut bound: Option<i32> = None;
            let base = lease.as_ptr();
            for p in job.plan.pieces(range) {
                match p.source {
                    PieceSource::Header { at } => lease.as_mut_slice()[p.dst..p.dst + p.len]
                        .copy_from_slice(&job.plan.header()[at as usize..at as usize + p.len]),
                    PieceSource::Tensor { entry, at } => {
                        let input = job.plan.entries()[entry].input;
                        if let Some(b) = job.sources.host(input) {
                            lease.as_mut_slice()[p.dst..p.dst + p.len]
                                .copy_from_slice(&b[at as usize..at as usize + p.len]);
                        } else {
                            let d = job.sources.device(input).expect("device source");
                            let st = &pipe.states[&d.device()];
                            used.insert(d.device());
                            if bound != Some(d.device()) {
                                st.ctx.bind()?;
                                bound = Some(d.device());
                            }
                            // SAFETY: `dst..dst+len` lies in the leased chunk, which stays in
                            // `pending` (not written, not released) until an event recorded
                            // after this copy has completed; the source range is inside
                            // the caller's device tensor (plan offsets are bounded by its
                            // length, checked at validation) and valid until staging ends.
                            unsafe { st.stream.copy_dtoh(base.add(p.dst), d.ptr() + at, p.len)? };
                        }
                    }
                }
            }
            let write_len = (job.write_len)(len);
            lease.as_mut_slice()[len..write_len].fill(0);
            let mut events = Vec::with_capacity(used.len());
            for d in &used {
                let st = &pipe.states[d];
                st.ctx.bind()?;
                let e = st.event()?;
                e.record(&st.stream)?;
                events.push((*d, e));
            }
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
}

/// What staging needs from the engine.
pub struct StageJob<'a> {
    /// The file image.
    pub plan: &'a Plan,
    /// The tensors' bytes.
    pub sources: &'a Sources<'a>,
    /// Bytes to write for a chunk holding `len` file bytes (O_DIRECT rounding).
    pub write_len: &'a (dyn Fn(usize) -> usize + Sync),
    /// True once the save failed (stop early).
    pub failed: &'a (dyn Fn() -> bool + Sync),
    /// Hand a complete chunk to the writers.
    pub dispatch: &'a (dyn Fn(ChunkLease, u64, usize, usize) -> Result<()> + Sync),
}

/// A [`ReadSink`] that copies restored bytes to device memory (`cuMemcpyHtoDAsync` from
/// the staging chunk, synchronized before the chunk is reused).
pub struct DeviceSink {
    dest: Vec<DeviceSlice<'static>>,
    streams: BTreeMap<i32, Arc<DeviceState>>,
    used: BTreeSet<i32>,
    _guard: CtxGuard,
}

impl DeviceSink {
    /// Copy tensor `i` (file order) to `dest[i]`.
    ///
    /// # Safety
    /// Every destination must be device memory of its device, valid for writes of its
    /// length, and not used by anyone else until the load returns.
    pub unsafe fn new(cuda: &CudaStaging, dest: Vec<DeviceSlice<'_>>) -> Result<DeviceSink> {
        // SAFETY: the same ranges; this function's contract keeps them valid until the
        // load returns, and the sink does not outlive the load.
        let dest: Vec<DeviceSlice<'static>> = dest
            .iter()
            .map(|d| unsafe { DeviceSlice::new(d.ptr(), d.len(), d.device()) })
            .collect();
        let devices: BTreeSet<i32> = dest.iter().map(|d| d.device()).collect();
        let guard = CtxGuard::save()?;
        cuda.prepare(&devices)?;
        let streams = devices
            .iter()
            .map(|&d| Ok((d, cuda.device(d)?)))
            .collect::<Result<_>>()?;
        Ok(DeviceSink {
            dest,
            streams,
            used: BTreeSet::new(),
            _guard: guard,
        })
    }
}

impl ReadSink for DeviceSink {
    fn piece(&mut self, tensor: usize, at: u64, bytes: &[u8]) -> Result<()> {
        let d = self.dest[tensor];
        if at + bytes.len() as u64 > d.len() as u64 {
            return Err(Error::Destination {
                name: format!("#{tensor}"),
                reason: "device buffer too small".into(),
            });
        }
        let st = &self.streams[&d.device()];
        self.used.insert(d.device());
        st.ctx.bind()?;
        // SAFETY: the destination range lies in the caller's buffer (`DeviceSink::new`'s
        // contract, length checked above); `bytes` stays valid until `chunk_end`, which
        // synchronizes the stream before the staging chunk is reused.
        unsafe {
            st.stream
                .copy_htod(d.ptr() + at, bytes.as_ptr(), bytes.len())
        }
    }

    fn chunk_end(&mut self) -> Result<()> {
        for d in std::mem::take(&mut self.used) {
            self.streams[&d].stream.synchronize()?;
        }
        Ok(())
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
