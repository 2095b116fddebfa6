//! Starting a save: validate and lay out, take a slot, stage (on the caller's thread or a
//! background one), dispatch chunks to the writers.

use std::collections::BTreeSet;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use crate::device::cuda::{DeviceBuffer, EventRef, StreamRef};
use crate::device::{After, Sources, StageJob, host};
use crate::error::{Error, Result};
use crate::io::pool::{WriteJob, WriteSink};
use crate::manifest::{self, Metadata};
use crate::plan::{self, SpecRef};
use crate::staging::ChunkLease;
use crate::staging::descriptor::SaveRecord;
use crate::tensor::{Source, Tensor};

use super::handle::SaveHandle;
use super::report::StagedReport;
use super::state::{FileSlot, Progress, SaveState};
use super::{Engine, lock};

/// A tensor whose memory is handed to the engine, for [`Engine::save_async_owned`].
#[derive(Debug)]
pub struct OwnedTensor {
    /// Name, unique within a save.
    pub name: String,
    /// Element type.
    pub dtype: crate::Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Its bytes.
    pub data: OwnedData,
}

/// The memory of an [`OwnedTensor`].
#[derive(Debug)]
#[non_exhaustive]
pub enum OwnedData {
    /// Host bytes.
    Host(Vec<u8>),
    /// A whole device buffer.
    Cuda(DeviceBuffer),
}

/// Options of [`Engine::save_with`] and [`Engine::save_async`]; borrows the streams and
/// events it names for `'a`.
#[derive(Debug, Clone, Default)]
pub struct SaveOptions<'a> {
    after: Vec<(i32, After)>,
    hold: bool,
    snapshot: bool,
    part_only: bool,
    confirm: bool,
    provisional: bool,
    _handles: PhantomData<&'a ()>,
}

impl<'a> SaveOptions<'a> {
    /// Default options: device copies start after the device is synchronized.
    ///
    /// With [`Engine::save`]/[`Engine::save_with`] the synchronization and the
    /// [`after_stream`](Self::after_stream) event happen inside the call. With
    /// [`Engine::save_async`] they happen on the staging thread, once it starts: the copies
    /// then also wait for work queued after the call. To order them after exactly the work
    /// queued at the call (and let the next kernels overlap the copy), record an event at the
    /// call and pass it with [`after_event`](Self::after_event), as the Python package does.
    pub fn new() -> Self {
        Self::default()
    }

    /// Copy the tensors of `stream`'s device after the work queued on `stream` when `save`
    /// is called, instead of synchronizing the whole device. Use the stream the tensors
    /// were produced on ([`Stream::handle`](crate::cuda::Stream::handle), or
    /// [`StreamRef::from_raw`](crate::cuda::StreamRef::from_raw) for a framework's stream).
    pub fn after_stream(mut self, stream: StreamRef<'a>) -> Self {
        let device = stream.device();
        self.after.retain(|(d, _)| *d != device);
        self.after.push((device, After::Stream(stream.raw())));
        self
    }

    /// With [`Engine::save_async`]: make the streams given with
    /// [`after_stream`](Self::after_stream) wait, on the device, for the save's copies.
    /// `save_async` then returns once every device copy is queued (on the engine's own
    /// stream, after the work queued on those streams at the call; waiting for free
    /// staging chunks first if earlier saves still hold them), and work the caller queues
    /// on those streams afterwards runs only after the copies: it may overwrite the
    /// tensors at once. The caller's thread does not wait for the device copies; the
    /// device does. Host sources are copied before `save_async` returns. Work on other
    /// streams is not ordered: it still waits for [`SaveHandle::wait_staged`]. Has no
    /// effect on [`Engine::save`] (which returns once staged) or on devices ordered with
    /// [`after_event`](Self::after_event).
    pub fn hold_streams(mut self) -> Self {
        self.hold = true;
        self
    }

    /// With [`Engine::save_async`] (not with [`hold_streams`](Self::hold_streams)): keep
    /// the save's device bytes ready for a device snapshot. Device copies are then queued
    /// at most 256 MiB ahead of their completion instead of all at once, and
    /// [`SaveHandle::request_snapshot`] makes the staging thread copy every device byte
    /// it has not queued yet into a transient device buffer (from a memory pool of the
    /// engine's own, allocated for all of the save's device bytes when it starts, freed
    /// in the order of its copy stream and given back to the driver once its host copies
    /// completed; its size is
    /// [`StagedReport::snapshot_bytes`](crate::StagedReport)), after which
    /// [`SaveHandle::hold_stream`] orders a stream after those device-to-device copies
    /// only (and the copies queued before them), not after the whole device-to-host copy.
    /// When the buffer cannot be allocated the save goes on without it (a warning is
    /// logged) and `hold_stream` waits for every copy to be queued, as without this.
    /// Without a request, `hold_stream` blocks until the last copies are queued (most of
    /// the copy's time): this mode is for callers that request the snapshot.
    pub fn snapshot_on_request(mut self) -> Self {
        self.snapshot = true;
        self
    }

    /// Write this rank's part and stop: its file and its manifest part
    /// (`rank-K.manifest.json`) are made durable in `step-N.partial/`, and the step is not
    /// committed, not even with one rank (nothing merges the parts, nothing is renamed,
    /// retention does not run). The report's `dir` is `None` and its `file` lies in the
    /// partial directory. For callers that gather every rank's part themselves and
    /// commit them with [`crate::commit::assemble_ranks`] (the DCP writer: one engine
    /// root per rank process). Refused with a remote tier, whose upload commits the step
    /// in the bucket.
    pub fn part_only(mut self) -> Self {
        self.part_only = true;
        self
    }

    /// Hold the commit until the caller confirms it: once the file is durable and every
    /// tensor checksummed, the save's CRC-32Cs are published
    /// ([`SaveHandle::checksums`]) and the commit thread waits for
    /// [`SaveHandle::confirm_commit`] before its manifest (part) is written. Refused, the
    /// save fails with [`Error::CommitRefused`] and its file is removed: nothing of the
    /// step becomes visible, and with several ranks the step cannot commit (this rank's
    /// part is never written). For checks across ranks before a commit (replica
    /// divergence). Dropping the handle before confirming refuses the commit. Later saves
    /// of the engine commit only after this one is decided (one commit thread), and
    /// [`Engine::flush`] and [`Engine::close`] wait for the decision: decide (or drop the
    /// handle) before calling them.
    pub fn confirm_commit(mut self) -> Self {
        self.confirm = true;
        self
    }

    /// Start the save before the caller has finished checking what it saves, and let no
    /// tier take it until the caller decides with [`SaveHandle::confirm_commit`]. It is
    /// staged (and, when the cadence sends it to disk, written) like any save, but until
    /// confirmed its descriptor slot is not marked `STAGED` (recovery after a crash drops
    /// it), a memory-only save is not held by the memory tier (not listed, not loadable)
    /// and a disk save's manifest is not written. Refused, or its handle dropped
    /// undecided, it fails with [`Error::CommitRefused`] and nothing of it is visible; its
    /// step may then be saved again once it is done ([`SaveHandle::wait`]). Unlike
    /// [`confirm_commit`](Self::confirm_commit) it does not send the save to disk nor
    /// publish its checksums, and the cadence counts it as the save it was decided to be
    /// (refused or not). The staging report comes at the end of staging as for any save
    /// (the tensors may change then). A disk save's commit waits for the decision
    /// ([`Engine::flush`] and [`Engine::close`] with it); a memory-only save undecided when
    /// the engine closes is dropped. For the Python package's speculative start of a
    /// deferred save (`docs/python.md`).
    pub fn provisional(mut self) -> Self {
        self.provisional = true;
        self
    }

    /// Copy the tensors of `event`'s device after `event` (recorded by the caller after
    /// producing them) instead of synchronizing the whole device.
    pub fn after_event(mut self, event: EventRef<'a>) -> Self {
        let device = event.device();
        self.after.retain(|(d, _)| *d != device);
        self.after.push((device, After::Event(event.raw())));
        self
    }
}

impl Engine {
    /// Save `tensors` as checkpoint `step`.
    ///
    /// Returns as soon as every byte is in staging: the caller may then overwrite or free
    /// its tensors (host or device). The returned handle reports when the checkpoint is
    /// durable and committed. If earlier saves still occupy the staging arena, this waits
    /// for space (reported as `backpressure`). Invalid input is rejected before anything is
    /// written.
    ///
    /// Device tensors are copied after all work queued on their device has finished (the
    /// device is synchronized); use [`Engine::save_with`] to wait for one stream or event
    /// instead.
    pub fn save(
        &self,
        step: u64,
        tensors: &[Tensor<'_>],
        metadata: &Metadata,
    ) -> Result<SaveHandle> {
        self.save_with(step, tensors, metadata, &SaveOptions::default())
    }

    /// [`Engine::save`] with options (ordering of device copies after the trainer's work).
    pub fn save_with(
        &self,
        step: u64,
        tensors: &[Tensor<'_>],
        metadata: &Metadata,
        opts: &SaveOptions<'_>,
    ) -> Result<SaveHandle> {
        let sources = Sources::new(tensors);
        let state = self.begin(step, tensors, metadata, opts)?;
        let jobs = self.jobs()?;
        match stage_and_finish(&state, &sources, &opts.after, &jobs, false, false, &|| {}) {
            Ok(()) => Ok(SaveHandle { state }),
            Err(()) => Err(failed_save_error(state)),
        }
    }

    /// Start a save and return at once; staging runs on a background thread. The handle
    /// reports staged ([`SaveHandle::wait_staged`]) and durable ([`SaveHandle::wait`])
    /// separately. Validation errors are still returned here.
    ///
    /// # Safety
    /// Every tensor's memory (host slices and device ranges) must stay valid and must not
    /// be modified or freed until [`SaveHandle::wait_staged`] (or `wait`) has returned or
    /// [`SaveHandle::is_staged`] is true. Trainers that order their own work after staging
    /// (e.g. the next optimizer step waits on the handle) use this to overlap the copy
    /// with other work.
    #[allow(unsafe_code)]
    pub unsafe fn save_async(
        &self,
        step: u64,
        tensors: &[Tensor<'_>],
        metadata: &Metadata,
        opts: &SaveOptions<'_>,
    ) -> Result<SaveHandle> {
        // SAFETY: this function's contract: the caller keeps every tensor's memory valid and
        // unmodified until the handle reports the save staged.
        let sources = unsafe { Sources::new(tensors).into_static() };
        let state = self.begin(step, tensors, metadata, opts)?;
        if !opts.hold {
            let after = opts.after.clone();
            return self.spawn_staging(state, sources, after, Box::new(()), None, opts.snapshot);
        }
        let (tx, rx) = crossbeam_channel::bounded::<()>(1);
        let after = opts.after.clone();
        let handle = self.spawn_staging(state, sources, after, Box::new(()), Some(tx), false)?;
        // Every copy queued and the streams holding (or staging ended: the sender dropped).
        let _ = rx.recv();
        Ok(handle)
    }

    /// [`Engine::save_async`] without `unsafe`: the engine takes ownership of the tensors'
    /// memory and frees it once the save is staged (device buffers are dropped then, host
    /// vectors deallocated). Device copies start after the device is synchronized.
    #[allow(unsafe_code)]
    pub fn save_async_owned(
        &self,
        step: u64,
        tensors: Vec<OwnedTensor>,
        metadata: &Metadata,
    ) -> Result<SaveHandle> {
        let views: Vec<Tensor<'_>> = tensors
            .iter()
            .map(|t| match &t.data {
                OwnedData::Host(b) => {
                    Tensor::host(t.name.as_str(), t.dtype, t.shape.clone(), b.as_slice())
                }
                OwnedData::Cuda(b) => b.tensor(t.name.as_str(), t.dtype, t.shape.clone()),
            })
            .collect();
        // SAFETY: every tensor's memory is owned by `tensors`, which moves into the staging
        // thread (moving a `Vec` or a `DeviceBuffer` does not move the memory it owns) and
        // is dropped there only after staging has ended; nobody else can reach it, so it is
        // neither modified nor freed while it is read.
        let sources = unsafe { Sources::new(&views).into_static() };
        let state = self.begin(step, &views, metadata, &SaveOptions::default())?;
        drop(views);
        self.spawn_staging(state, sources, Vec::new(), Box::new(tensors), None, false)
    }

    /// Stage `state` on a background thread, dropping `sources` and then `keep` (which may
    /// own the memory `sources` points to) once staging ended. With `queued`, the streams
    /// of `after` are held ([`SaveOptions::hold_streams`]) and `queued` is sent to once
    /// every copy is queued (or dropped when staging ended without). `snapshot`: see
    /// [`SaveOptions::snapshot_on_request`].
    fn spawn_staging(
        &self,
        state: Arc<SaveState>,
        sources: Sources<'static>,
        after: Vec<(i32, After)>,
        keep: Box<dyn Send>,
        queued: Option<Sender<()>>,
        snapshot: bool,
    ) -> Result<SaveHandle> {
        let jobs = self.jobs()?;
        if queued.is_none() && self.shared.cfg.stream_latches && self.shared.cuda_registered() {
            // Ordered after events recorded at the call: staging never waits for work the
            // caller queues later (as a latch held on its stream). Once the arena is
            // registered: registering it, the first save's staging is not one the driver
            // documents as free of implicit synchronization.
            lock(&state.progress).latchable = after
                .iter()
                .filter(|(_, a)| matches!(a, After::Event(_)))
                .map(|(d, _)| *d)
                .collect();
        }
        let st = Arc::clone(&state);
        let spawned = std::thread::Builder::new()
            .name("shmckpt-stage".into())
            .spawn(move || {
                let hold = queued.is_some();
                let signal = Mutex::new(queued);
                let queued = || {
                    if let Some(tx) = lock(&signal).take() {
                        let _ = tx.send(());
                    }
                };
                let _ = stage_and_finish(&st, &sources, &after, &jobs, hold, snapshot, &queued);
                // Also when staging failed before every copy was queued: the caller waits.
                queued();
                drop(sources);
                drop(keep);
            });
        if let Err(e) = spawned {
            let err = Error::Internal(format!("cannot spawn the staging thread: {e}"));
            state.staging_finished(Err(err));
            return Err(failed_save_error(state));
        }
        Ok(SaveHandle { state })
    }

    /// The writers' job queue, or `Shutdown` once the engine is closed.
    pub(super) fn jobs(&self) -> Result<Sender<WriteJob>> {
        self.pool
            .sender()
            .ok_or_else(|| Error::Shutdown("engine closed".into()))
    }

    /// Validate, lay out, create the files and the descriptor slot, queue the save for
    /// commit, and take the staging gate (released when staging ends). Of `opts`, what
    /// decides the commit: [`SaveOptions::part_only`], [`SaveOptions::confirm_commit`] and
    /// [`SaveOptions::provisional`].
    pub(super) fn begin(
        &self,
        step: u64,
        tensors: &[Tensor<'_>],
        metadata: &Metadata,
        opts: &SaveOptions<'_>,
    ) -> Result<Arc<SaveState>> {
        let (part_only, confirm, provisional) = (opts.part_only, opts.confirm, opts.provisional);
        let started = Instant::now();
        let cfg = &self.shared.cfg;
        if part_only && self.shared.remote.is_some() {
            return Err(Error::Config(
                "a part-only save cannot be uploaded: the remote tier commits steps in the bucket"
                    .into(),
            ));
        }
        let arena = &self.shared.arena;
        let cs = arena.chunk_size();

        // 1. Validate and lay out: nothing is touched before this succeeds.
        let mut system: Metadata = [
            (plan::META_STEP.to_owned(), step.to_string()),
            (plan::META_RANK.to_owned(), cfg.rank.to_string()),
            (plan::META_WORLD.to_owned(), cfg.world_size.to_string()),
        ]
        .into();
        if let Some(session) = &cfg.session {
            system.insert(plan::META_SESSION.to_owned(), session.clone());
        }
        // The last save's layout when this one's tensors and metadata are the same.
        let plan = lock(&self.shared.plans).plan(
            tensors.iter().map(|t| SpecRef {
                name: &t.name,
                dtype: t.dtype,
                shape: &t.shape,
                len: t.source.len(),
            }),
            &system,
            metadata,
        )?;
        if let Some(e) = arena.fill_error() {
            // Allocating the arena in the background failed (`/dev/shm` filled up).
            return Err(e);
        }
        let needed = plan.chunk_count(cs) * cs;
        if needed > arena.capacity() {
            return Err(Error::TooLarge {
                needed,
                capacity: arena.capacity(),
            });
        }
        let devices: BTreeSet<i32> = tensors
            .iter()
            .filter_map(|t| match t.source {
                Source::Cuda(d) if !d.is_empty() => Some(d.device()),
                _ => None,
            })
            .collect();
        if !devices.is_empty() {
            crate::device::cuda::init()?;
        }

        // One save stages at a time.
        let gate_wait = self.shared.gate.enter();
        self.shared
            .began_saving
            .store(true, std::sync::atomic::Ordering::Release);
        if !lock(&self.shared.inflight).insert(step) {
            self.shared.gate.leave();
            return Err(Error::StepExists {
                step,
                root: cfg.root.clone(),
            });
        }
        let undo = || {
            lock(&self.shared.inflight).remove(&step);
            self.shared.gate.leave();
        };

        // 2. Files: a committed step is refused here; creating the partial directory and
        // the file (metadata operations that can wait behind the filesystem's journal,
        // e.g. discards of a deleted checkpoint) happens off the caller's path, on the
        // opener thread below, while staging proceeds.
        if cfg.root.join(manifest::step_dir_name(step)).exists() {
            undo();
            return Err(Error::StepExists {
                step,
                root: cfg.root.clone(),
            });
        }
        if self.shared.memory.holds(step) {
            undo();
            return Err(Error::StepExists {
                step,
                root: cfg.root.clone(),
            });
        }
        let file_name = manifest::rank_file_name(cfg.rank, cfg.world_size);
        let partial = cfg.root.join(manifest::partial_dir_name(step));
        // Which tiers take the save: the one decision (`memory::Cadence::decide`).
        let recovering = self.shared.recovering.load(Ordering::Acquire);
        let tiers = lock(&self.shared.cadence).decide(cfg, part_only || confirm, recovering);
        let disk = tiers.disk;
        let n_chunks = plan.chunk_count(cs);
        if let Err(e) = self.make_room_for(n_chunks) {
            undo();
            return Err(e);
        }

        // 3. A descriptor slot, so a crash from here on is recoverable.
        let t_slot = Instant::now();
        // A kept image (flash restore) is given up before this save can reuse its chunks:
        // `begin_save` frees its descriptor slot, then the image adopted at open (if any)
        // drops its leases, so its chunks return to the pool before this save takes any
        // (waiting first for a load still copying from them; loads never wait for saves).
        let keep_seq = arena.begin_save();
        drop(lock(&self.shared.adopted).take());
        let slot = arena.acquire_slot();
        let slot_wait = t_slot.elapsed() + gate_wait;
        arena.descriptor().begin(
            slot,
            &SaveRecord {
                step,
                file_len: plan.file_len(),
                data_start: plan.data_start(),
                n_file_chunks: n_chunks,
                partial_dir: &manifest::partial_dir_name(step),
                file_name: &file_name,
            },
        );
        let state = Arc::new(SaveState {
            shared: Arc::clone(&self.shared),
            step,
            plan,
            metadata: metadata.clone(),
            file: FileSlot {
                path: partial.join(&file_name),
                ..FileSlot::default()
            },
            partial,
            file_name,
            part_only,
            confirm,
            provisional,
            slot,
            keep_seq,
            started,
            slot_wait,
            failed: AtomicBool::new(false),
            progress: Mutex::new(Progress::default()),
            changed: Condvar::new(),
            crcs: Mutex::new(vec![Vec::new(); n_chunks as usize]),
            // Only the saves the cadence sends to the bucket (disk saves) are uploaded.
            upload: tiers
                .bucket
                .then(|| {
                    self.shared
                        .remote
                        .as_ref()
                        .map(|t| t.begin_save(step, n_chunks, cs))
                })
                .flatten(),
            snapshot: crate::device::SnapshotRequest::default(),
            held: Arc::default(),
            disk,
            memory: Mutex::new(if disk {
                Vec::new()
            } else {
                (0..n_chunks).map(|_| None).collect()
            }),
        });
        // A memory-only save ends on its staging thread; a disk save on the commit thread.
        let queued = match &self.commit_tx {
            Some(_) if !disk => true,
            Some(tx) => tx.send(Arc::clone(&state)).is_ok(),
            None => false,
        };
        if !queued {
            // No commit thread to clean up: do it here.
            arena.release_slot(slot);
            undo();
            return Err(Error::Shutdown("engine closed".into()));
        }
        // The upload starts with the save: its parts go out as the chunks are staged and
        // written; it completes once the commit thread reports the local commit.
        if let Some(u) = &state.upload {
            u.start(
                &state.metadata,
                cfg.rank,
                &state.file_name,
                state.plan.file_len(),
            );
        }
        lock(&self.shared.cadence).record(&state, tiers);
        let st = Arc::clone(&state);
        let opener = if !self.shared.files || !disk {
            // No file: the bucket is the save's only copy, or the save is memory-only.
            state.no_file_opened();
            Ok(())
        } else {
            std::thread::Builder::new()
                .name("shmckpt-open".into())
                .spawn(move || st.open_file())
                .map(drop)
        };
        if let Err(e) = opener {
            state.file_opened(Err(Error::Shutdown(format!(
                "cannot spawn the file-opening thread: {e}"
            ))));
        }
        if disk {
            // `flush` waits for the last disk save (the commit thread takes them in order).
            *lock(&self.last_save) = Some(Arc::clone(&state));
        }
        Ok(state)
    }
}

/// Stage every chunk of `state` (host or device sources) and record the outcome. On
/// failure the save is marked failed (the commit thread cleans up) and `Err` is returned.
pub(super) fn stage_and_finish(
    state: &Arc<SaveState>,
    sources: &Sources<'_>,
    after: &[(i32, After)],
    jobs: &Sender<WriteJob>,
    hold: bool,
    snapshot: bool,
    queued: &(dyn Fn() + Sync),
) -> std::result::Result<(), ()> {
    let step = state.step;
    let dispatch = |lease: ChunkLease, chunk: u64, len: usize, write_len: usize| {
        SaveState::dispatch(state, jobs, lease, chunk, len, write_len)
    };
    let devices = sources.devices();
    let mut registration = Duration::ZERO;
    let write_len = |len: usize| state.write_len(len);
    let failed = || state.failed();
    let queued = |marks: crate::device::Marks| {
        let latches = state.copies_queued(marks);
        queued();
        latches
    };
    let job = StageJob {
        plan: &state.plan,
        sources,
        write_len: &write_len,
        failed: &failed,
        dispatch: &dispatch,
        hold,
        queued: &queued,
        snapshot: (snapshot && !hold).then_some(&state.snapshot),
    };
    let staged = if devices.is_empty() {
        host::stage_host(&state.shared.arena, &job, state.shared.cfg.copy_threads)
    } else {
        let cuda = state.shared.cuda();
        match cuda.prepare(&devices) {
            Ok(r) => {
                registration = r.unwrap_or_default();
                cuda.stage(&job, after)
            }
            Err(e) => Err(e),
        }
    };
    // Every copy queued has completed (or staging failed): no latch stays shut.
    state.open_latches();
    match staged {
        Ok(waited) => {
            let report = StagedReport {
                step,
                bytes: state.plan.file_len(),
                staging: state.started.elapsed(),
                backpressure: state.slot_wait + waited,
                registration,
                snapshot_bytes: state.snapshot.bytes(),
                snapshot_batched: state.snapshot.batched(),
            };
            tracing::debug!(step, staging = ?report.staging, backpressure = ?report.backpressure, "save staged");
            if state.provisional {
                // Recoverable and taken by its tier only once its caller confirms it.
                super::provisional::staged(state, report);
                return Ok(());
            }
            // A memory-only save is complete in the arena from here: recovery commits it.
            state.shared.arena.descriptor().staged(state.slot);
            if state.disk {
                state.staging_finished(Ok(report));
            } else {
                super::memory::staged(state, report);
            }
            Ok(())
        }
        Err(e) if !state.disk => {
            super::memory::failed(state, e);
            Err(())
        }
        Err(e) => {
            state.staging_finished(Err(e));
            // Let the commit thread clean up, so a retry of this step can start at once.
            state.wait_done();
            Err(())
        }
    }
}

/// The error of a save whose staging failed: the one its commit reports (the first error,
/// with path and errno) once everything it started has finished.
fn failed_save_error(state: Arc<SaveState>) -> Error {
    SaveHandle { state }
        .wait()
        .err()
        .unwrap_or_else(|| Error::Internal("staging failed without an error".into()))
}
