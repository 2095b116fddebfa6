//! Every call into the `shmckpt` crate made by the binding, in one place.
//!
//! The rest of the extension (`lib.rs`) deals with Python objects only; when the crate's API
//! changes, this file is the one to adapt. Nothing here touches Python.

use std::path::PathBuf;
use std::time::Duration;

use crate::dlpack::{Memory, Place};
use shmckpt::cuda::{EventRef, StreamRef};
use shmckpt::{
    Checkpoint, DeviceSlice, Dtype, Engine, EngineConfig, LoadInto, LoadReport, LoadRequest,
    LoadSource, Metadata, Result, SaveHandle, SaveOptions, SaveReport, Sources, StagedReport,
    StepSel, Tensor,
};

/// Engine settings as the Python constructor passes them (`None`: the crate's default).
#[derive(Debug, Default, Clone)]
pub struct EngineOpts {
    pub root: PathBuf,
    pub staging_capacity: Option<u64>,
    pub chunk_size: Option<u64>,
    pub writer_threads: Option<usize>,
    pub queue_depth: Option<u32>,
    pub copy_threads: Option<usize>,
    pub copy_ahead: Option<u64>,
    pub stream_latches: Option<bool>,
    pub blocking_sync: Option<bool>,
    pub direct_io: Option<bool>,
    pub keep_last: Option<usize>,
    pub rank: u32,
    pub world_size: u32,
    pub shm_name: Option<String>,
    pub max_inflight_saves: Option<u32>,
    pub recover_on_open: Option<bool>,
    pub keep_in_memory: Option<bool>,
    pub create_root: Option<bool>,
    pub remote: Option<String>,
    pub remote_keep_last: Option<usize>,
    pub remote_max_pending: Option<usize>,
    pub remote_part_size: Option<usize>,
    pub remote_concurrency: Option<usize>,
    /// Seconds; see `RemoteOptions::request_timeout`.
    pub remote_request_timeout: Option<f64>,
    /// Seconds; see `RemoteOptions::complete_timeout`.
    pub remote_complete_timeout: Option<f64>,
    pub remote_only: bool,
    /// `EngineConfig::with_session`.
    pub session: Option<String>,
    /// `EngineConfig::with_replica_hold`.
    pub replica_hold: bool,
    /// `EngineConfig::with_disk_cadence`: `Every(n)`, or `None` for the default.
    pub disk_cadence: Option<shmckpt::DiskCadence>,
    /// Seconds; see `EngineConfig::with_disk_interval`.
    pub disk_interval: Option<f64>,
    /// `EngineConfig::with_remote_every`.
    pub remote_every: Option<u64>,
    /// `EngineConfig::with_memory_steps`.
    pub memory_steps: Option<usize>,
}

/// `disk_every=` as the engine's cadence: a positive number `n` (every `n`-th save goes to
/// disk) or `"auto"` (when the previous disk save has finished). `Err` is the message of
/// the caller's `ValueError`.
pub fn disk_cadence(
    every: Option<DiskEvery>,
) -> std::result::Result<Option<shmckpt::DiskCadence>, String> {
    match every {
        None => Ok(None),
        Some(DiskEvery::N(n)) if n >= 1 => Ok(Some(shmckpt::DiskCadence::Every(n))),
        Some(DiskEvery::N(n)) => Err(format!("disk_every must be at least 1, not {n}")),
        Some(DiskEvery::Mode(m)) if m == "auto" => Ok(Some(shmckpt::DiskCadence::WhenIdle)),
        Some(DiskEvery::Mode(m)) => Err(format!(
            "disk_every must be a number >= 1 or \"auto\", not {m:?}"
        )),
    }
}

/// What `disk_every=` may be.
#[derive(Debug, Clone)]
pub enum DiskEvery {
    /// Every `n`-th save.
    N(u64),
    /// A mode by name (`"auto"`).
    Mode(String),
}

/// Steps committed by recovery at open.
pub fn recovered(engine: &Engine) -> Vec<u64> {
    engine.recovered_steps()
}

/// Where the open spent its time, in seconds by phase.
pub fn open_timings(engine: &Engine) -> Vec<(&'static str, f64)> {
    let t = engine.open_timings();
    vec![
        ("recovery", t.recovery.as_secs_f64()),
        ("clean", t.clean.as_secs_f64()),
        ("arena", t.arena.as_secs_f64()),
        ("writers", t.writers.as_secs_f64()),
        ("total", t.total.as_secs_f64()),
    ]
}

/// Dead engines' arenas left holding saves to recover.
pub fn unrecovered(engine: &Engine) -> Vec<String> {
    engine.unrecovered().to_vec()
}

/// Bytes per staging chunk.
pub fn chunk_size(engine: &Engine) -> u64 {
    engine.config().chunk_size()
}

/// Open an engine.
pub fn open(o: EngineOpts) -> Result<Engine> {
    let mut cfg = EngineConfig::new(o.root).with_rank(o.rank, o.world_size);
    if let Some(v) = o.staging_capacity {
        cfg = cfg.with_staging_capacity(v);
    }
    if let Some(v) = o.chunk_size {
        cfg = cfg.with_chunk_size(v);
    }
    if let Some(v) = o.writer_threads {
        cfg = cfg.with_writer_threads(v);
    }
    if let Some(v) = o.queue_depth {
        cfg = cfg.with_queue_depth(v);
    }
    if let Some(v) = o.copy_threads {
        cfg = cfg.with_copy_threads(v);
    }
    if let Some(v) = o.copy_ahead {
        cfg = cfg.with_copy_ahead(v);
    }
    if let Some(v) = o.stream_latches {
        cfg = cfg.with_stream_latches(v);
    }
    if let Some(v) = o.blocking_sync {
        cfg = cfg.with_blocking_sync(v);
    }
    if let Some(v) = o.direct_io {
        cfg = cfg.with_direct_io(v);
    }
    if o.keep_last.is_some() {
        cfg = cfg.with_keep_last(o.keep_last);
    }
    if let Some(v) = o.shm_name {
        cfg = cfg.with_shm_name(v);
    }
    if let Some(v) = o.max_inflight_saves {
        cfg = cfg.with_max_inflight_saves(v);
    }
    if let Some(v) = o.recover_on_open {
        cfg = cfg.with_recover_on_open(v);
    }
    if let Some(v) = o.keep_in_memory {
        cfg = cfg.with_keep_in_memory(v);
    }
    cfg = cfg
        .with_replica_hold(o.replica_hold)
        .with_session(o.session);
    if let Some(c) = o.disk_cadence {
        cfg = cfg.with_disk_cadence(c);
    }
    if let Some(s) = o.disk_interval {
        cfg = cfg.with_disk_interval(Some(seconds("disk_interval_s", s)?));
    }
    if let Some(n) = o.memory_steps {
        cfg = cfg.with_memory_steps(n);
    }
    if let Some(v) = o.create_root {
        cfg = cfg.with_create_root(v);
    }
    if let Some(url) = o.remote {
        cfg = cfg
            .with_remote(url)
            .with_remote_keep_last(o.remote_keep_last);
        if let Some(n) = o.remote_max_pending {
            cfg = cfg.with_remote_max_pending(n);
        }
        let mut ro = shmckpt::remote::RemoteOptions::default();
        if let Some(n) = o.remote_part_size {
            ro.part_size = n;
        }
        if let Some(n) = o.remote_concurrency {
            ro.concurrency = n;
        }
        if let Some(s) = o.remote_request_timeout {
            ro.request_timeout = seconds("remote_request_timeout", s)?;
        }
        if let Some(s) = o.remote_complete_timeout {
            ro.complete_timeout = seconds("remote_complete_timeout", s)?;
        }
        if ro != shmckpt::remote::RemoteOptions::default() {
            cfg = cfg.with_remote_options(ro);
        }
        if let Some(k) = o.remote_every {
            cfg = cfg.with_remote_every(k);
        }
        cfg = cfg.with_remote_only(o.remote_only);
    }
    cfg.build()
}

/// The staging capacity an engine opens with when the caller gives none: 64 MiB, or the
/// crate's 2 GiB default with `keep_in_memory` (so that a kept arena has one size from
/// process to process and the next process takes it over).
pub fn auto_initial_capacity(keep_in_memory: bool) -> u64 {
    if keep_in_memory {
        shmckpt::DEFAULT_STAGING_CAPACITY
    } else {
        shmckpt::AUTO_STAGING_INITIAL
    }
}

/// The capacity to reopen `engine` (opened with `o`) with for a save needing `needed`
/// bytes of staging, checked against `/dev/shm` (its arena is freed first unless kept in
/// memory).
///
/// With a disk cadence (`disk_every` other than 1) the arena is sized for `2 + memory_steps`
/// saves (the disk save draining, the memory-only steps held, the save being staged), or
/// for one when `/dev/shm` cannot hold them (the memory-only step then goes to disk before
/// the next save stages, logged).
pub fn auto_capacity(engine: &Engine, o: &EngineOpts, needed: u64) -> Result<u64> {
    let keep = o.keep_in_memory == Some(true);
    let chunk = o.chunk_size.unwrap_or(shmckpt::DEFAULT_CHUNK_SIZE);
    let reclaimable = if keep { 0 } else { engine.staging_capacity() };
    let saves = 2 + engine.config().memory_steps() as u64;
    if !engine.config().disk_cadence().is_every_save()
        && let Ok(cap) =
            shmckpt::auto_staging_capacity(needed.saturating_mul(saves), chunk, reclaimable)
    {
        return Ok(cap);
    }
    shmckpt::auto_staging_capacity(needed, chunk, reclaimable)
}

/// Delete committed checkpoint `step`.
pub fn remove(engine: &Engine, step: u64) -> Result<()> {
    engine.remove(step)
}

/// `root/name -> step-N`, published for committed `step` ([`shmckpt::links::link_step`]);
/// the step it named before.
pub fn link_step(root: &std::path::Path, name: &str, step: u64) -> Result<Option<u64>> {
    shmckpt::links::link_step(root, name, step)
}

/// The step `root/name` names ([`shmckpt::links::linked_step`]).
pub fn linked_step(root: &std::path::Path, name: &str) -> Result<Option<u64>> {
    shmckpt::links::linked_step(root, name)
}

/// Every step a name of `root` names (published or reserved).
pub fn linked_steps(root: &std::path::Path) -> Result<Vec<u64>> {
    shmckpt::links::linked_steps(root).map(|s| s.into_iter().collect())
}

/// Reserve `root/name` for the save of `step` in flight ([`shmckpt::links::reserve_name`]).
pub fn reserve_name(root: &std::path::Path, name: &str, step: u64) -> Result<bool> {
    shmckpt::links::reserve_name(root, name, step)
}

/// What `root/name` leads to: `(step, None)` published, `(step, reservation file name)`
/// reserved ([`shmckpt::links::resolve_name`]).
pub fn resolve_name(root: &std::path::Path, name: &str) -> Result<Option<(u64, Option<String>)>> {
    use shmckpt::links::Named;
    Ok(shmckpt::links::resolve_name(root, name)?.map(|n| match n {
        Named::Published(s) => (s, None),
        Named::Reserved { step, name } => (step, Some(name)),
    }))
}

/// Remove `root/name`; the step it named.
pub fn unlink_name(root: &std::path::Path, name: &str) -> Result<Option<u64>> {
    shmckpt::links::unlink_name(root, name)
}

/// Staging bytes available to one save.
pub fn staging_capacity(engine: &Engine) -> u64 {
    engine.staging_capacity()
}

/// One tensor of a save as the Python side hands it over: its memory taken from a DLPack
/// capsule and owned (kept allocated) by this value, `None` for a tensor of no bytes.
#[derive(Debug)]
pub struct RawTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub mem: Option<Memory>,
}

/// What device copies are ordered after: a `CUstream` or a `CUevent` of a device.
#[derive(Debug, Clone, Copy)]
pub enum After {
    Stream { device: i32, stream: u64 },
    Event { device: i32, event: u64 },
}

/// Build the crate's tensor list over the tensors' memory (kept allocated by `raw`, which
/// the result borrows).
///
/// # Safety
/// Nobody may write any tensor's memory while the returned tensors (and any save that
/// receives them) read it.
unsafe fn tensors(raw: &[RawTensor]) -> Vec<Tensor<'_>> {
    raw.iter()
        .map(|t| match &t.mem {
            None => Tensor::host(t.name.as_str(), t.dtype, t.shape.clone(), &[]),
            Some(m) => match m.place() {
                Place::Host => {
                    // SAFETY: forwarded from this function's contract (no writer meanwhile).
                    let bytes = unsafe { m.host_bytes() };
                    Tensor::host(t.name.as_str(), t.dtype, t.shape.clone(), bytes)
                }
                Place::Cuda(_) => {
                    // SAFETY: forwarded from this function's contract (no writer meanwhile).
                    let slice = unsafe { m.device_slice() }.expect("CUDA memory");
                    Tensor::cuda(t.name.as_str(), t.dtype, t.shape.clone(), slice)
                }
            },
        })
        .collect()
}

/// # Safety
/// Every stream or event must be live, of its device, until the save is staged.
unsafe fn options(after: &[After]) -> SaveOptions<'static> {
    let mut o = SaveOptions::new();
    for a in after {
        o = match *a {
            After::Stream { device, stream } => {
                // SAFETY: forwarded from this function's contract: the stream is a live
                // `CUstream` of `device` for as long as the save uses it.
                o.after_stream(unsafe { StreamRef::from_raw(stream, device) })
            }
            After::Event { device, event } => {
                // SAFETY: forwarded from this function's contract: the event is a live
                // `CUevent` of `device` for as long as the save uses it.
                o.after_event(unsafe { EventRef::from_raw(event, device) })
            }
        };
    }
    o
}

/// How a save commits: `part_only` writes the rank's part without committing the step
/// (`SaveOptions::part_only`); `confirm` makes the commit wait for the handle's decision
/// (`SaveOptions::confirm_commit`); `provisional` lets no tier take the save before that
/// decision (`SaveOptions::provisional`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Commit {
    pub part_only: bool,
    pub confirm: bool,
    pub provisional: bool,
}

impl Commit {
    fn apply(self, mut o: SaveOptions<'_>) -> SaveOptions<'_> {
        if self.part_only {
            o = o.part_only();
        }
        if self.confirm {
            o = o.confirm_commit();
        }
        if self.provisional {
            o = o.provisional();
        }
        o
    }
}

/// Save and return once staged, committing as `commit` says.
///
/// # Safety
/// As [`tensors`] and [`options`], for the duration of this call.
pub unsafe fn save(
    engine: &Engine,
    step: u64,
    raw: &[RawTensor],
    meta: &Metadata,
    after: &[After],
    commit: Commit,
) -> Result<SaveHandle> {
    // SAFETY: forwarded from this function's contract.
    let (t, o) = unsafe { (tensors(raw), options(after)) };
    engine.save_with(step, &t, meta, &commit.apply(o))
}

/// Start a save and return at once (with `hold`: once every device copy is queued and
/// the `after` streams wait for them, `SaveOptions::hold_streams`; with `snapshot`:
/// `SaveOptions::snapshot_on_request`), committing as `commit` says.
///
/// # Safety
/// As [`tensors`] and [`options`], and `raw` (which keeps the memory allocated) must live,
/// and the memory stay unmodified, until the returned handle reports the save staged
/// (with `hold`, work queued afterwards on the `after` streams is ordered after the
/// copies and may modify it).
#[allow(clippy::too_many_arguments)]
pub unsafe fn save_async(
    engine: &Engine,
    step: u64,
    raw: &[RawTensor],
    meta: &Metadata,
    after: &[After],
    hold: bool,
    snapshot: bool,
    commit: Commit,
) -> Result<SaveHandle> {
    // SAFETY: forwarded from this function's contract.
    let (t, o) = unsafe { (tensors(raw), options(after)) };
    let mut o = commit.apply(o);
    if hold {
        o = o.hold_streams();
    }
    if snapshot {
        o = o.snapshot_on_request();
    }
    // SAFETY: forwarded from this function's contract (memory valid until staged).
    unsafe { engine.save_async(step, &t, meta, &o) }
}

fn sel(step: Option<u64>) -> StepSel {
    step.map_or(StepSel::Latest, StepSel::Step)
}

/// Load this rank's tensors into owned buffers.
/// Which path served a load: `("disk", why memory could not)` or `("memory", what the
/// cheap check of the disk copy found wrong)`.
pub type Served = (&'static str, Option<String>);

fn served(r: &LoadReport) -> Served {
    match r.source {
        LoadSource::Memory => ("memory", r.disk_problem.clone()),
        LoadSource::Remote => ("remote", r.fallback_reason.clone()),
        _ => ("disk", r.fallback_reason.clone()),
    }
}

/// The request of a load of `step` (`None`: the latest): every source, or with `bucket`
/// false memory and disk only (`load(..., source="local")`).
fn request(step: Option<u64>, bucket: bool) -> LoadRequest {
    let sources = if bucket { Sources::ALL } else { Sources::LOCAL };
    LoadRequest::new(sel(step)).with_sources(sources)
}

/// `bucket`: false never reads the bucket (`load(..., source="local")`).
pub fn load(engine: &Engine, step: Option<u64>, bucket: bool) -> Result<(Checkpoint, Served)> {
    let got = engine.load_with(&request(step, bucket), LoadInto::owned())?;
    let ck = got
        .checkpoint
        .expect("a load into owned buffers returns its checkpoint");
    Ok((ck, served(&got.report)))
}

/// Load into host memory given as `(name, memory)`, from every source.
///
/// # Safety
/// As [`host_slices`], for the duration of the call.
pub unsafe fn load_into_host(
    engine: &Engine,
    step: Option<u64>,
    dest: &mut [(String, Memory)],
) -> Result<u64> {
    // SAFETY: forwarded from this function's contract.
    let mut slices = unsafe { host_slices(dest) };
    let got = engine.load_with(&request(step, true), LoadInto::host(&mut slices))?;
    Ok(got.report.step)
}

/// `(name, memory)` host destinations as named byte slices (an empty one for a CUDA
/// memory or no bytes).
///
/// # Safety
/// No one else may access the memory while the slices are used, and no two destinations
/// may overlap.
pub unsafe fn host_slices(dest: &mut [(String, Memory)]) -> Vec<(&str, &mut [u8])> {
    dest.iter_mut()
        .map(|(n, m)| {
            // SAFETY: forwarded from this function's contract (exclusive, non-overlapping).
            let s = unsafe { m.host_bytes_mut() };
            (n.as_str(), s)
        })
        .collect()
}

/// `(name, memory)` device destinations as device slices (host memory is left out: the
/// callers checked every one is CUDA memory).
///
/// # Safety
/// No one else may access the memory while the slices are used.
unsafe fn device_slices(dest: &[(String, Memory)]) -> Vec<(&str, DeviceSlice<'_>)> {
    dest.iter()
        .filter_map(|(n, m)| {
            // SAFETY: forwarded from this function's contract.
            unsafe { m.device_slice() }.map(|s| (n.as_str(), s))
        })
        .collect()
}

/// Load into device memory given as `(name, memory)`.
///
/// # Safety
/// As [`LoadInto::device_raw`]: the memory not accessed by anyone else during the call
/// (that it is device memory of its device, allocated, is `Memory`'s guarantee).
pub unsafe fn load_into_device(
    engine: &Engine,
    step: Option<u64>,
    dest: &[(String, Memory)],
    bucket: bool,
) -> Result<(u64, Served)> {
    // SAFETY: forwarded from this function's contract.
    let slices = unsafe { device_slices(dest) };
    // SAFETY: forwarded from this function's contract.
    let into = unsafe { LoadInto::device_raw(&slices) };
    let got = engine.load_with(&request(step, bucket), into)?;
    Ok((got.report.step, served(&got.report)))
}

/// Committed steps, oldest first, with their directories.
pub fn list(engine: &Engine) -> Result<Vec<(u64, PathBuf)>> {
    Ok(engine
        .list()?
        .into_iter()
        .map(|c| (c.step, c.dir))
        .collect())
}

/// The newest committed step.
pub fn latest(engine: &Engine) -> Result<Option<u64>> {
    engine.latest()
}

/// `load`'s `source=` as the engine's tiers: `None` every tier, `"local"` memory or disk,
/// `"remote"` the bucket; anything else `None` (the caller's `ValueError`).
pub fn tiers(source: Option<&str>) -> Option<shmckpt::Tiers> {
    match source {
        None => Some(shmckpt::Tiers::All),
        Some("local") => Some(shmckpt::Tiers::Local),
        Some("remote") => Some(shmckpt::Tiers::Remote),
        Some(_) => None,
    }
}

/// The step a load of `step` (`None`: the latest) from `tiers` reads, and where from
/// (`"local"`: memory or disk, `"remote"`: the bucket): the engine's one fallback order.
pub fn resolve_step(
    engine: &Engine,
    step: Option<u64>,
    tiers: shmckpt::Tiers,
) -> Result<(u64, &'static str)> {
    let (s, tier) = engine.resolve_step(sel(step), tiers)?;
    Ok((
        s,
        match tier {
            shmckpt::Tier::Local => "local",
            shmckpt::Tier::Remote => "remote",
        },
    ))
}

/// The step a load of "latest" from `tiers` reads, or `None`.
pub fn latest_in(engine: &Engine, tiers: shmckpt::Tiers) -> Result<Option<u64>> {
    engine.latest_in(tiers)
}

/// The steps a load from `tiers` can read, oldest first, with the tiers holding each
/// (`"memory"`, `"disk"`, `"bucket"`).
pub fn list_in(engine: &Engine, tiers: shmckpt::Tiers) -> Result<Vec<(u64, Vec<&'static str>)>> {
    Ok(engine
        .list_in(tiers)?
        .into_iter()
        .map(|t| {
            let mut tiers = Vec::new();
            if t.memory {
                tiers.push("memory");
            }
            if t.disk {
                tiers.push("disk");
            }
            if t.bucket {
                tiers.push("bucket");
            }
            (t.step, tiers)
        })
        .collect())
}

/// This rank's file metadata of a committed checkpoint, its header checked against the
/// manifest.
pub fn file_metadata(
    engine: &Engine,
    step: Option<u64>,
) -> Result<std::collections::BTreeMap<String, String>> {
    engine.file_metadata(sel(step))
}

/// A committed checkpoint's manifest, as JSON.
pub fn manifest_json(engine: &Engine, step: Option<u64>) -> Result<String> {
    let m = engine.manifest(sel(step))?;
    Ok(serde_json::to_string(&m).expect("a manifest serializes"))
}

/// Set up CUDA for `devices` now.
pub fn prepare_cuda(engine: &Engine, devices: &[i32]) -> Result<Option<Duration>> {
    engine.prepare_cuda(devices)
}

/// Set up CUDA for `devices`, registering the staging arena in the background.
pub fn prepare_cuda_background(engine: &Engine, devices: &[i32]) -> Result<()> {
    engine.prepare_cuda_background(devices)
}

/// Whether the staging arena is allocated and registered (no background set-up left).
pub fn staging_ready(engine: &Engine) -> bool {
    engine.staging_ready()
}

/// Wait until the staging arena is allocated and registered.
pub fn wait_staging_ready(engine: &Engine) -> Result<()> {
    engine.wait_staging_ready()
}

/// Wait for every save in flight.
pub fn flush(engine: &Engine) -> Result<()> {
    engine.flush()
}

/// Finish the saves in flight and release the engine's resources.
pub fn close(engine: Engine) {
    engine.close()
}

/// Facts about an engine, for Python properties.
pub fn describe(engine: &Engine) -> (String, u64, String, PathBuf) {
    (
        engine.shm_name().to_owned(),
        engine.staging_capacity(),
        engine.backend().to_string(),
        engine.config().root().to_owned(),
    )
}

/// Parse a dtype name (`"BF16"`).
pub fn dtype(s: &str) -> Option<Dtype> {
    s.parse().ok()
}

/// The safetensors name of a dtype.
pub fn dtype_name(d: Dtype) -> &'static str {
    d.as_str()
}

/// Whether the save's bytes are all staged (or staging failed).
pub fn is_staged(h: &SaveHandle) -> bool {
    h.is_staged()
}

/// Staging result (returns at once when [`is_staged`]).
pub fn wait_staged(h: &SaveHandle) -> Result<StagedReport> {
    h.wait_staged()
}

/// Order later work on each `(device, stream)` after the save's copies on that device,
/// waiting on the host only until they are queued (`SaveWatch::hold_stream`).
///
/// # Safety
/// Every stream handle must be a live `CUstream` of its device for the duration of the call.
pub unsafe fn hold_streams(h: &shmckpt::SaveWatch, streams: &[(i32, u64)]) -> Result<()> {
    for &(device, stream) in streams {
        // SAFETY: forwarded from this function's contract.
        h.hold_stream(unsafe { StreamRef::from_raw(stream, device) })?;
    }
    Ok(())
}

/// Whether the save is committed or failed.
pub fn is_done(h: &SaveHandle) -> bool {
    h.is_done()
}

/// Wait up to `timeout` for the save to be durable and committed; the handle back if not.
pub fn wait_timeout(
    h: SaveHandle,
    timeout: Duration,
) -> std::result::Result<Result<SaveReport>, SaveHandle> {
    h.wait_timeout(timeout)
}

/// The Python exception class (in `shmckpt.errors`) for an error: one per variant.
pub fn error_class(e: &shmckpt::Error) -> &'static str {
    use shmckpt::Error as E;
    match e {
        E::EmptyName { .. } => "EmptyName",
        E::DuplicateName { .. } => "DuplicateName",
        E::InvalidName { .. } => "InvalidName",
        E::SizeMismatch { .. } => "SizeMismatch",
        E::ShapeOverflow { .. } => "ShapeOverflow",
        E::InvalidMetadata { .. } => "InvalidMetadata",
        E::HeaderTooLarge { .. } => "HeaderTooLarge",
        E::TooLarge { .. } => "TooLarge",
        E::StepExists { .. } => "StepExists",
        E::NotFound { .. } => "NotFound",
        E::RootMissing { .. } => "RootMissing",
        E::RootNotWritable { .. } => "RootNotWritable",
        E::RootCreateFailed { .. } => "RootCreateFailed",
        E::RootLocked { .. } => "RootLocked",
        E::Config(_) => "ConfigError",
        E::ShmTooSmall { .. } => "ShmTooSmall",
        E::Shm { .. } => "ShmError",
        E::Io { .. } => "IoError",
        E::Truncated { .. } => "Truncated",
        E::Corrupt { .. } => "CorruptError",
        E::Checksum { .. } => "ChecksumError",
        E::Destination { .. } => "DestinationError",
        E::Cuda { .. } => "CudaError",
        E::Shutdown(_) => "ShutdownError",
        E::SaveFailed { .. } => "SaveFailed",
        E::Cancelled(_) => "Cancelled",
        E::SizeOverflow { .. } => "SizeOverflow",
        E::UnsafePath { .. } => "UnsafePath",
        E::StepOverflow { .. } => "StepOverflow",
        E::RootTooLong { .. } => "RootTooLong",
        E::Recovery { .. } => "RecoveryError",
        E::Remote { .. } => "RemoteError",
        E::RemoteFailed { .. } => "RemoteFailed",
        E::RemoteSkipped { .. } => "RemoteSkipped",
        E::CommitRefused { .. } => "CommitRefused",
        E::RemoteConflict { .. } => "RemoteConflict",
        _ => "ShmckptError",
    }
}

/// Every dtype name the engine knows.
pub fn all_dtype_names() -> Vec<&'static str> {
    Dtype::ALL.iter().map(|d| d.as_str()).collect()
}

/// The save's remote copy, if the engine has a remote tier.
pub fn remote_progress(h: &SaveHandle) -> Option<shmckpt::remote::RemoteProgress> {
    h.remote()
}

/// Wait up to `timeout` for a save's remote copy (`None`: not yet).
pub fn wait_remote(
    p: &shmckpt::remote::RemoteProgress,
    timeout: Duration,
) -> Option<Result<shmckpt::remote::RemoteReport>> {
    p.wait_timeout(Some(timeout))
}

/// Committed steps in the engine's bucket.
pub fn list_remote(engine: &Engine) -> Result<Vec<u64>> {
    engine.list_remote()
}

/// A step of the engine's bucket, loaded into owned buffers.
pub fn load_remote(engine: &Engine, step: Option<u64>) -> Result<Checkpoint> {
    let req = LoadRequest::new(sel(step)).with_sources(Sources::BUCKET);
    let got = engine.load_with(&req, LoadInto::owned())?;
    Ok(got
        .checkpoint
        .expect("a load into owned buffers returns its checkpoint"))
}

/// Load this rank's tensors of a step of the engine's bucket into device memory given as
/// `(name, memory)`, through the engine's registered device-read
/// buffers (no host copy of the object).
///
/// # Safety
/// As [`load_into_device`].
pub unsafe fn load_into_device_remote(
    engine: &Engine,
    step: Option<u64>,
    dest: &[(String, Memory)],
) -> Result<shmckpt::remote::RemoteLoad> {
    // SAFETY: forwarded from this function's contract.
    let slices = unsafe { device_slices(dest) };
    // SAFETY: forwarded from this function's contract.
    let into = unsafe { LoadInto::device_raw(&slices) };
    let req = LoadRequest::new(sel(step)).with_sources(Sources::BUCKET);
    let got = engine.load_with(&req, into)?;
    Ok(got.remote.expect("the bucket served the load"))
}

/// This rank's file metadata of a step of the engine's bucket (its header checked against
/// the manifest).
pub fn remote_file_metadata(
    engine: &Engine,
    step: u64,
) -> Result<std::collections::BTreeMap<String, String>> {
    engine.remote_file_metadata(step)
}

/// A manifest of the engine's bucket, as JSON.
pub fn remote_manifest_json(engine: &Engine, step: u64) -> Result<String> {
    let r = engine.remote().ok_or_else(|| {
        shmckpt::Error::Config("this engine has no remote tier (remote=...)".into())
    })?;
    let m = r.manifest(step)?;
    Ok(serde_json::to_string(&m).expect("a manifest serializes"))
}

/// A timeout given in seconds: a positive, finite number.
fn seconds(what: &str, s: f64) -> shmckpt::Result<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(s)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            shmckpt::Error::Config(format!(
                "{what} must be a positive number of seconds, not {s}"
            ))
        })
}
