//! One save in flight: its progress, its file, and the writers' side of it.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::commit::{self};
use crate::device::{Latches, Marks};
use crate::error::{Error, Result};
use crate::io::align_up;
use crate::io::file::FileTarget;
use crate::io::pool::{ChunkInfo, Outcome, WriteSink};
use crate::manifest::Metadata;
use crate::plan::{PieceSource, Plan};
use crate::staging::ChunkLease;

use super::report::{SaveReport, StagedReport};
use super::{Shared, lock};

#[derive(Default)]
pub(super) struct Progress {
    pub(super) dispatched: u64,
    pub(super) finished: u64,
    pub(super) staging_done: bool,
    pub(super) staged: Option<std::result::Result<StagedReport, Arc<Error>>>,
    pub(super) error: Option<Arc<Error>>,
    pub(super) result: Option<std::result::Result<SaveReport, Arc<Error>>>,
    pub(super) done: bool,
    /// Every host byte copied and every device copy queued (`SaveHandle::hold_stream`).
    pub(super) queued: bool,
    /// One event per device, recorded after that device's copies of this save.
    pub(super) marks: Marks,
    /// Devices whose copies are ordered after an event recorded at the call: a stream of
    /// theirs may wait on a latch before the copies are queued (`SaveWatch::hold_stream`).
    pub(super) latchable: Vec<i32>,
    /// The latches streams wait on until the copies are queued; opened behind them, or
    /// from the host when staging ends without (`stage_and_finish`).
    pub(super) latches: Latches,
    /// The tensors' entries with their CRC-32Cs, once the file is durable, published for
    /// a save whose commit waits for its caller (`SaveOptions::confirm_commit`).
    pub(super) checksums: Option<Vec<crate::manifest::TensorEntry>>,
    /// The caller's decision on that commit: go ahead, or refuse (why).
    pub(super) confirmed: Option<std::result::Result<(), String>>,
    /// A provisional memory-only save staged before its caller decided it
    /// (`SaveOptions::provisional`): its staging report, until the decision.
    pub(super) parked: Option<StagedReport>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) enum FileState {
    #[default]
    Pending,
    Ready,
    Failed,
}

/// The save's file, opened by the opener thread while staging runs, and closed by the
/// commit thread as soon as the save has ended (see `SaveState::close_file`).
#[derive(Debug, Default)]
pub(super) struct FileSlot {
    pub(super) target: Mutex<Option<Arc<FileTarget>>>,
    pub(super) state: Mutex<FileState>,
    pub(super) changed: Condvar,
    /// Where the file is being written (known before it exists, for errors).
    pub(super) path: PathBuf,
}

/// One save in flight; shared by the caller's handle, the writers and the commit thread.
pub(crate) struct SaveState {
    pub(super) shared: Arc<Shared>,
    pub(super) step: u64,
    pub(super) plan: Plan,
    pub(super) metadata: Metadata,
    pub(super) file: FileSlot,
    pub(super) partial: PathBuf,
    pub(super) file_name: String,
    /// Write the part and stop (`SaveOptions::part_only`).
    pub(super) part_only: bool,
    /// Hold the commit until the caller confirms it (`SaveOptions::confirm_commit`).
    pub(super) confirm: bool,
    /// Taken by its tier only once the caller confirms it (`SaveOptions::provisional`).
    pub(super) provisional: bool,
    pub(super) slot: u32,
    /// Sequence number from `Arena::begin_save` (flash restore).
    pub(super) keep_seq: u64,
    pub(super) started: Instant,
    /// Time spent waiting for the staging gate and a descriptor slot.
    pub(super) slot_wait: Duration,
    pub(super) failed: AtomicBool,
    pub(super) progress: Mutex<Progress>,
    pub(super) changed: Condvar,
    /// Per file chunk: (entry, crc32c, length) of each tensor piece in it.
    pub(super) crcs: Mutex<Vec<Vec<(u32, u32, u64)>>>,
    /// The save's copy to the tier beyond the disk (`crate::tier`), when that tier takes
    /// it: offered its written chunks, told its local outcome.
    pub(super) upload: Option<Arc<dyn crate::tier::TierSave>>,
    /// Its device snapshot request (`SaveOptions::snapshot_on_request`).
    pub(super) snapshot: crate::device::SnapshotRequest,
    /// Its committed image held for replication (`EngineConfig::with_replica_hold`).
    pub(super) held: Arc<crate::staging::held::HeldCell>,
    /// Whether the save goes to disk (`EngineConfig::with_disk_cadence`); a memory-only
    /// save keeps its chunks in `memory` instead of handing them to the writers.
    pub(super) disk: bool,
    /// A memory-only save's staged chunks, file chunk `k` in entry `k`, until the memory
    /// tier takes them (`super::memory`).
    pub(super) memory: Mutex<Vec<Option<ChunkLease>>>,
}

impl SaveState {
    /// The first error of a failed save, for `flush`; `None` if it succeeded.
    pub(super) fn failure(&self) -> Option<Error> {
        let p = lock(&self.progress);
        match (&p.result, &p.error) {
            (Some(Err(e)), _) | (None, Some(e)) => Some(Error::SaveFailed {
                step: self.step,
                source: Arc::clone(e),
            }),
            _ => None,
        }
    }

    /// Publish the save's checksummed tensor entries and wait for its caller's decision
    /// (`SaveOptions::confirm_commit`): `Err(CommitRefused)` when refused.
    pub(super) fn await_confirmation(
        &self,
        tensors: &[crate::manifest::TensorEntry],
    ) -> Result<()> {
        let mut p = lock(&self.progress);
        p.checksums = Some(tensors.to_vec());
        self.changed.notify_all();
        loop {
            match &p.confirmed {
                Some(Ok(())) => return Ok(()),
                Some(Err(reason)) => {
                    return Err(Error::CommitRefused {
                        step: self.step,
                        reason: reason.clone(),
                    });
                }
                None => p = self.changed.wait(p).unwrap_or_else(|e| e.into_inner()),
            }
        }
    }

    /// Record the caller's decision on the commit (the first one counts; the commit thread
    /// waiting for it goes on). Returns the staging report of a provisional memory-only
    /// save staged before it (`park`), for the caller to act on the decision
    /// (`super::provisional::decide`).
    pub(super) fn confirm(
        &self,
        decision: std::result::Result<(), String>,
    ) -> Option<StagedReport> {
        let mut p = lock(&self.progress);
        if p.confirmed.is_some() {
            return None;
        }
        p.confirmed = Some(decision);
        self.changed.notify_all();
        p.parked.take()
    }

    /// A provisional memory-only save's staging ended with `report`: the caller's decision
    /// when it came first, else `None` with the report parked for `confirm`.
    pub(super) fn park(&self, report: StagedReport) -> Option<std::result::Result<(), String>> {
        let mut p = lock(&self.progress);
        if p.confirmed.is_none() {
            p.parked = Some(report);
        }
        p.confirmed.clone()
    }

    /// Staged chunks are always zero-padded to 4096; the writer writes the padding only
    /// when the file is open with O_DIRECT.
    pub(super) fn write_len(&self, len: usize) -> usize {
        align_up(len as u64) as usize
    }

    /// Runs on the opener thread: create the partial directory and the file, reserve its
    /// space. Failures fail the save (the handle reports them).
    pub(super) fn open_file(&self) {
        let cfg = &self.shared.cfg;
        // With several ranks, another rank's failed save of this step removes the partial
        // directory if its file was the only entry (`commit::abort_partial`), which can
        // fall between the directory's creation and this rank's file's: then both are
        // made again (each other rank fails this save at most once).
        let mut attempts = cfg.world_size.max(1);
        let r = loop {
            let r = commit::prepare_partial(
                &cfg.root,
                self.step,
                cfg.rank,
                &self.file_name,
                cfg.world_size,
            )
            .and_then(|partial| FileTarget::create(&partial.join(&self.file_name), cfg.direct_io));
            match r {
                Err(e) if attempts > 1 && e.raw_os_error() == Some(libc::ENOENT) => {
                    attempts -= 1;
                    tracing::debug!(step = self.step, error = %e, "the partial directory vanished; making it again");
                }
                r => break r,
            }
        }
        .and_then(|t| {
            t.preallocate(align_up(self.plan.file_len()))?;
            Ok(t)
        });
        self.file_opened(r);
    }

    /// A remote-only save writes no file: the opener's part is done at once.
    pub(super) fn no_file_opened(&self) {
        *lock(&self.file.state) = FileState::Ready;
        self.file.changed.notify_all();
        self.changed.notify_all();
    }

    pub(super) fn file_opened(&self, r: Result<FileTarget>) {
        let ok = match r {
            Ok(t) => {
                *lock(&self.file.target) = Some(Arc::new(t));
                true
            }
            Err(e) => {
                self.failed.store(true, Ordering::Release);
                let mut p = lock(&self.progress);
                if p.error.is_none() {
                    p.error = Some(Arc::new(e));
                }
                false
            }
        };
        *lock(&self.file.state) = if ok {
            FileState::Ready
        } else {
            FileState::Failed
        };
        self.file.changed.notify_all();
        self.changed.notify_all();
    }

    /// The open file, waiting for the opener; `None` if opening failed or the file was
    /// closed (`close_file`).
    pub(super) fn file_target(&self) -> Option<Arc<FileTarget>> {
        let mut s = lock(&self.file.state);
        while *s == FileState::Pending {
            s = self.file.changed.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        drop(s);
        lock(&self.file.target).clone()
    }

    /// Close the save's file (once the opener is done). Runs on the commit thread when the
    /// save has settled and the file is durable or given up, before the result is
    /// reported: no descriptor of the engine outlives the save. Whoever holds the last
    /// descriptor of a deleted file pays for freeing its blocks when closing it (seconds
    /// for gigabytes on a filesystem mounted with `discard`): held until the next save
    /// replaced this one, it made the caller of that save pay (docs/benchmarks.md).
    pub(super) fn close_file(&self) {
        let _ = self.file_target();
        let file = lock(&self.file.target).take();
        drop(file);
    }

    /// Every host byte is copied and every device copy queued; `marks` complete with them.
    /// Returns the latches to open behind the copies (no stream waits on a new one now).
    pub(super) fn copies_queued(&self, marks: Marks) -> Latches {
        let mut p = lock(&self.progress);
        p.queued = true;
        p.marks = marks;
        let latches = std::mem::take(&mut p.latches);
        drop(p);
        self.changed.notify_all();
        latches
    }

    /// Staging ended: open every latch still shut, from the host (the copies queued have
    /// completed, or the save failed), and take no new one.
    pub(super) fn open_latches(&self) {
        let mut p = lock(&self.progress);
        p.latchable.clear();
        let latches = std::mem::take(&mut p.latches);
        drop(p);
        drop(latches);
    }

    pub(super) fn staging_finished(&self, r: std::result::Result<StagedReport, Error>) {
        let mut p = lock(&self.progress);
        match r {
            Ok(rep) => p.staged = Some(Ok(rep)),
            Err(e) => {
                self.failed.store(true, Ordering::Release);
                let e = Arc::new(e);
                // A write error that made staging stop is the root cause: keep it.
                if p.error.is_none() {
                    p.error = Some(Arc::clone(&e));
                }
                p.staged = Some(Err(p.error.clone().unwrap_or(e)));
            }
        }
        p.staging_done = true;
        drop(p);
        self.shared.gate.leave();
        self.changed.notify_all();
    }

    /// Block until staging ended and every dispatched chunk finished.
    pub(super) fn wait_settled(&self) {
        let mut p = lock(&self.progress);
        while !(p.staging_done && p.finished == p.dispatched) {
            p = self.changed.wait(p).unwrap_or_else(|e| e.into_inner());
        }
        drop(p);
        // The opener must be done too, so a failed save's file can be removed.
        let _ = self.file_target();
    }

    /// Whether the save has ended (committed or failed; a memory-only save once staged).
    pub(super) fn is_done(&self) -> bool {
        lock(&self.progress).done
    }

    /// This rank's manifest entry of the save's file, with the tensors' CRC-32Cs `crcs`
    /// (in the plan's order).
    pub(super) fn file_entry(&self, crcs: &[u32]) -> crate::manifest::FileEntry {
        let data_start = self.plan.data_start();
        crate::manifest::FileEntry {
            rank: self.shared.cfg.rank,
            file: self.file_name.clone(),
            bytes: self.plan.file_len(),
            data_start,
            header_crc32c: Some(crc32c::crc32c(self.plan.header())),
            object: None,
            session: self.shared.cfg.session.clone(),
            tensors: self
                .plan
                .entries()
                .iter()
                .zip(crcs)
                .map(|(e, &crc)| crate::manifest::TensorEntry {
                    name: e.name.clone(),
                    dtype: e.dtype,
                    shape: e.shape.clone(),
                    data_offsets: e.data_offsets(data_start),
                    crc32c: crc,
                })
                .collect(),
        }
    }

    pub(super) fn wait_done(&self) {
        let mut p = lock(&self.progress);
        while !p.done {
            p = self.changed.wait(p).unwrap_or_else(|e| e.into_inner());
        }
    }

    pub(super) fn complete(&self, r: std::result::Result<SaveReport, Arc<Error>>) {
        lock(&self.shared.inflight).remove(&self.step);
        let mut p = lock(&self.progress);
        p.result = Some(r);
        p.done = true;
        drop(p);
        self.changed.notify_all();
    }

    pub(super) fn tensor_crcs(&self) -> Vec<u32> {
        let mut acc: Vec<Option<u32>> = vec![None; self.plan.entries().len()];
        for chunk in lock(&self.crcs).iter() {
            for &(e, crc, len) in chunk {
                let a = &mut acc[e as usize];
                *a = Some(match *a {
                    None => crc,
                    Some(prev) => crc32c::crc32c_combine(prev, crc, len as usize),
                });
            }
        }
        acc.into_iter().map(|c| c.unwrap_or(0)).collect()
    }
}

impl SaveState {
    /// Record file chunk `chunk` as staged and queue its write (a memory-only save keeps
    /// the chunk instead: the memory tier takes them all once staged).
    pub(super) fn dispatch(
        state: &Arc<SaveState>,
        jobs: &crossbeam_channel::Sender<crate::io::pool::WriteJob>,
        lease: ChunkLease,
        chunk: u64,
        len: usize,
        write_len: usize,
    ) -> Result<()> {
        let cs = state.shared.arena.chunk_size();
        state
            .shared
            .arena
            .descriptor()
            .chunk_staged(state.slot, chunk, lease.index());
        if !state.disk {
            let mut held = lock(&state.memory);
            match held.get_mut(chunk as usize) {
                Some(slot) => *slot = Some(lease),
                None => return Err(Error::Internal(format!("file chunk {chunk} out of range"))),
            }
            return Ok(());
        }
        lock(&state.progress).dispatched += 1;
        let job = crate::io::pool::WriteJob {
            sink: Arc::clone(state) as Arc<dyn WriteSink>,
            lease,
            info: ChunkInfo {
                chunk,
                offset: chunk * cs,
                len,
                write_len,
            },
        };
        if let Err(e) = jobs.send(job) {
            let job = e.0;
            let err = Error::Shutdown("writer pool is gone".into());
            job.sink.finished(&job.info, None, Outcome::Failed(err));
            return Err(Error::Shutdown("writer pool is gone".into()));
        }
        Ok(())
    }
}

impl WriteSink for SaveState {
    fn target(&self) -> Option<Arc<FileTarget>> {
        self.file_target()
    }

    fn path(&self) -> &Path {
        &self.file.path
    }

    fn failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    fn finished(&self, chunk: &ChunkInfo, bytes: Option<&[u8]>, outcome: Outcome) {
        self.record(chunk, bytes, outcome);
        self.count_finished();
    }

    fn finished_lease(&self, chunk: &ChunkInfo, lease: ChunkLease, outcome: Outcome) {
        let written = self.record(chunk, Some(lease.as_slice()), outcome);
        match &self.upload {
            // Held for the upload (which takes it into a part at once) before the chunk
            // counts as finished: the commit thread reports the local outcome only after
            // every chunk finished.
            Some(u) if written => u.offer(chunk.chunk, lease, chunk.len),
            // Back in the arena's pool before the chunk counts as finished: the commit
            // holds the image for replication by taking its chunks out of the pool
            // (`Arena::finish_slot_holding`), and a chunk still leased here then is read
            // back from the file instead (seen on a loaded 2-core VM: a whole image sent
            // from the file).
            _ => drop(lease),
        }
        self.count_finished();
    }

    fn no_file(&self) -> bool {
        !self.shared.files
    }
}

impl SaveState {
    fn count_finished(&self) {
        let mut p = lock(&self.progress);
        p.finished += 1;
        drop(p);
        self.changed.notify_all();
    }

    /// A chunk's write ended: checksum it, record it in the descriptor, or record the
    /// failure. Returns whether it was written and the save has not failed.
    fn record(&self, chunk: &ChunkInfo, bytes: Option<&[u8]>, outcome: Outcome) -> bool {
        let mut failure = None;
        let written = matches!((&outcome, bytes), (Outcome::Written, Some(_)));
        match (outcome, bytes) {
            (Outcome::Written, Some(bytes)) => {
                // Checksum the staged bytes of each tensor piece, off the caller's path.
                let cs = self.shared.arena.chunk_size();
                let parts: Vec<(u32, u32, u64)> = self
                    .plan
                    .pieces(self.plan.chunk_range(chunk.chunk, cs))
                    .into_iter()
                    .filter_map(|p| match p.source {
                        PieceSource::Tensor { entry, .. } => Some((
                            entry as u32,
                            crc32c::crc32c(&bytes[p.dst..p.dst + p.len]),
                            p.len as u64,
                        )),
                        PieceSource::Header { .. } => None,
                    })
                    .collect();
                lock(&self.crcs)[chunk.chunk as usize] = parts;
                self.shared
                    .arena
                    .descriptor()
                    .chunk_written(self.slot, chunk.chunk);
            }
            (Outcome::Written, None) => {
                failure = Some(Error::Internal("chunk written without its bytes".into()))
            }
            (Outcome::Failed(e), _) => failure = Some(e),
            (Outcome::Skipped, _) => {}
        }
        if failure.is_some() || self.failed() {
            // The lease drops after this returns and its arena chunk may be refilled by
            // another save: the descriptor must not point recovery at it any more.
            self.shared
                .arena
                .descriptor()
                .chunk_lost(self.slot, chunk.chunk);
        }
        let mut p = lock(&self.progress);
        let ok = failure.is_none() && written;
        if let Some(e) = failure {
            self.failed.store(true, Ordering::Release);
            if p.error.is_none() {
                p.error = Some(Arc::new(e));
            }
        }
        ok && !self.failed()
    }
}
