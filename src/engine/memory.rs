//! The memory tier (`EngineConfig::with_disk_cadence`): the one decision of which tiers
//! take a save ([`Cadence::decide`]), and the newest memory-only saves (at most
//! `EngineConfig::with_memory_steps`, default 1), held in the staging arena
//! ([`MemoryTier`]) until a newer save is durable.
//!
//! A memory-only save is staged like any save and its descriptor slot marked `STAGED`
//! (recovery after a crash of the process commits it from the arena), but its chunks are
//! kept by the save instead of going to the writers. Once staged, they become the memory
//! tier's image ([`flash::Adopted::in_memory`], served by loads like a kept image); the
//! oldest memory-only step beyond the limit is given up then (slot freed in the descriptor
//! first, then its chunks back to the pool). A disk save gives up the older ones once
//! committed (a newer step is then on disk), and the arena the oldest when staging runs out
//! of chunks (the reclaim hook), but never the newest: a memory-only step whose save
//! reported it staged is never given up before a newer step is loadable. When the arena
//! cannot hold the newest and the next save, the newest is written to disk first
//! ([`Engine::make_room_for`]). [`Engine::persist_memory`] (run by [`Engine::close`])
//! writes the held steps to disk from those chunks, oldest first.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::config::{DiskCadence, EngineConfig};
use crate::error::{Error, Result};
use crate::manifest::{self, Manifest, Metadata};
use crate::plan::Plan;
use crate::staging::{Arena, ChunkLease};

use super::flash::Adopted;
use super::report::{SaveReport, SaveTimings, StagedReport};
use super::state::{FileSlot, Progress, SaveState};
use super::{Engine, lock};

/// What decides the disk cadence: the saves since the last disk save and that save.
#[derive(Default)]
pub(super) struct Cadence {
    /// Memory-only saves since the last disk save; `None` before the engine's first.
    memory_since_disk: Option<u64>,
    /// Disk saves since the last upload; `None` before the engine's first.
    disk_since_bucket: Option<u64>,
    /// When the last disk save began.
    last_disk_start: Option<Instant>,
    /// The last disk save, to ask whether it has finished (gone: it has; weak, as the
    /// engine's shared state holds the cadence and each save holds the shared state).
    last_disk: std::sync::Weak<SaveState>,
}

impl Cadence {
    /// The one decision of which tiers take a save (every save is staged in memory):
    /// whether it goes to disk, and whether to the bucket too (only a disk save does).
    /// `forced`: the save must reach the disk (a part-only save, a commit held for its
    /// caller). `recovering`: a dead engine's saves are being recovered behind the open
    /// (their writes take the disk, as a disk save in flight would). Called under the
    /// staging gate, so saves are decided in the order they stage.
    pub(super) fn decide(&self, cfg: &EngineConfig, forced: bool, recovering: bool) -> SaveTiers {
        let disk = self.goes_to_disk(cfg, forced, recovering);
        let bucket = disk
            && self
                .disk_since_bucket
                .is_none_or(|m| m.saturating_add(1) >= cfg.remote_every);
        SaveTiers { disk, bucket }
    }

    /// Whether a save goes to disk ([`Cadence::decide`]).
    fn goes_to_disk(&self, cfg: &EngineConfig, forced: bool, recovering: bool) -> bool {
        if forced || cfg.every_save_to_disk() {
            return true;
        }
        let by_cadence = match cfg.disk_cadence {
            DiskCadence::Every(n) => self
                .memory_since_disk
                .is_none_or(|m| m.saturating_add(1) >= n),
            DiskCadence::WhenIdle => {
                !recovering && self.last_disk.upgrade().is_none_or(|s| s.is_done())
            }
        };
        let by_interval = cfg
            .disk_interval
            .is_some_and(|iv| self.last_disk_start.is_none_or(|t| t.elapsed() >= iv));
        by_cadence || by_interval
    }

    /// Record the decided save: a disk save restarts the count, an upload the count of
    /// disk saves.
    pub(super) fn record(&mut self, state: &Arc<SaveState>, tiers: SaveTiers) {
        if tiers.bucket {
            self.disk_since_bucket = Some(0);
        } else if tiers.disk {
            self.disk_since_bucket = Some(self.disk_since_bucket.unwrap_or(0) + 1);
        }
        if state.disk {
            self.memory_since_disk = Some(0);
            self.last_disk_start = Some(state.started);
            self.last_disk = Arc::downgrade(state);
        } else {
            self.memory_since_disk = Some(self.memory_since_disk.unwrap_or(0) + 1);
        }
    }
}

/// Which tiers take a save ([`Cadence::decide`]), besides the memory it is staged in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct SaveTiers {
    /// The local disk (else memory only).
    pub(super) disk: bool,
    /// The bucket (with a remote tier; only ever with `disk`).
    pub(super) bucket: bool,
}

/// A memory-only step, its chunks held in the arena.
pub(super) struct MemoryStep {
    pub(super) step: u64,
    /// The save's sequence number (`Arena::begin_save`): saves begun later are newer.
    seq: u64,
    /// Its descriptor slot (`STAGED`: recovery commits it after a crash).
    slot: u32,
    plan: Plan,
    pub(super) metadata: Metadata,
    staged: StagedReport,
    /// File chunk `k` in its `k`-th lease, served like a kept image.
    pub(super) image: Adopted,
}

/// The memory tier of an engine: at most `memory_steps` memory-only steps
/// ([`EngineConfig::with_memory_steps`]), oldest first.
pub(super) struct MemoryTier {
    held: Mutex<Vec<MemoryStep>>,
    limit: usize,
}

impl MemoryTier {
    /// A tier holding at most `limit` steps (at least 1).
    pub(super) fn new(limit: usize) -> MemoryTier {
        MemoryTier {
            held: Mutex::new(Vec::new()),
            limit: limit.max(1),
        }
    }

    /// The held steps, oldest first, locked: loads copy from them while the guard lives (a
    /// save that gives one up waits for them; loads never wait for saves).
    pub(super) fn lock(&self) -> MutexGuard<'_, Vec<MemoryStep>> {
        lock(&self.held)
    }

    /// The staging chunks the held steps occupy (0 when none is held).
    pub(super) fn chunks(&self, chunk_size: u64) -> u64 {
        self.lock()
            .iter()
            .map(|m| m.plan.chunk_count(chunk_size))
            .fold(0, u64::saturating_add)
    }

    /// The newest step held, if any.
    pub(super) fn newest(&self) -> Option<u64> {
        self.lock().last().map(|m| m.step)
    }

    /// The steps held, oldest first.
    pub(super) fn steps(&self) -> Vec<u64> {
        self.lock().iter().map(|m| m.step).collect()
    }

    /// Whether `step` is held.
    pub(super) fn holds(&self, step: u64) -> bool {
        self.lock().iter().any(|m| m.step == step)
    }

    /// Hold `m` among the memory-only steps in the order their saves began (the newest
    /// last: a provisional save confirmed after a later save was taken goes before it),
    /// giving up the oldest beyond the limit.
    fn install(&self, arena: &Arena, m: MemoryStep) {
        let gone: Vec<MemoryStep> = {
            let mut g = self.lock();
            let at = g.partition_point(|h| h.seq < m.seq);
            g.insert(at, m);
            let over = g.len().saturating_sub(self.limit);
            g.drain(..over).collect()
        };
        for old in gone {
            tracing::debug!(
                step = old.step,
                limit = self.limit,
                "memory-only step given up: newer memory-only saves are staged"
            );
            release(arena, old);
        }
    }

    /// A dead engine's staged save, taken over with its arena at open
    /// ([`super::flash::take_over`]): held as this engine's memory-only step, older than
    /// every save of this engine (sequence 0; saves begin at 1), so the first disk save to
    /// commit gives it up, as it would have in the dead engine.
    pub(super) fn hold_adopted(&self, arena: &Arena, t: super::flash::StagedTaken) {
        let staged = StagedReport {
            step: t.step,
            bytes: t.plan.file_len(),
            staging: Duration::ZERO,
            backpressure: Duration::ZERO,
            registration: Duration::ZERO,
            snapshot_bytes: 0,
            snapshot_batched: false,
        };
        self.install(
            arena,
            MemoryStep {
                step: t.step,
                seq: 0,
                slot: t.slot,
                plan: t.plan,
                metadata: t.metadata,
                staged,
                image: t.image,
            },
        );
    }

    /// A disk save begun as `seq` committed: the memory-only steps held that are older are
    /// given up (a newer step is on disk).
    pub(super) fn committed(&self, arena: &Arena, seq: u64) {
        let gone: Vec<MemoryStep> = {
            let mut g = self.lock();
            let older = g.iter().take_while(|m| m.seq < seq).count();
            g.drain(..older).collect()
        };
        for old in gone {
            tracing::debug!(
                step = old.step,
                "memory-only step given up: a newer step is committed"
            );
            release(arena, old);
        }
    }

    /// Give the oldest held step up when a newer one is held (staging ran out of chunks, or
    /// the arena cannot hold the held steps and the next save). Returns its step. Never the
    /// newest: a memory-only step whose save reported it staged stays recoverable until a
    /// newer step is ([`Engine::make_room_for`]).
    pub(super) fn give_up_superseded(&self, arena: &Arena) -> Option<u64> {
        let old = {
            let mut g = self.lock();
            if g.len() < 2 {
                return None;
            }
            g.remove(0)
        };
        let step = old.step;
        release(arena, old);
        Some(step)
    }

    /// Give held step `step` up (the step was removed). Whether it was held.
    pub(super) fn give_up(&self, arena: &Arena, step: u64) -> bool {
        let old = {
            let mut g = self.lock();
            let Some(at) = g.iter().position(|m| m.step == step) else {
                return false;
            };
            g.remove(at)
        };
        release(arena, old);
        true
    }

    /// Take the oldest held step out to write it to disk (its slot stays taken).
    fn take_oldest(&self) -> Option<MemoryStep> {
        let mut g = self.lock();
        (!g.is_empty()).then(|| g.remove(0))
    }
}

/// Free a memory-only step: the descriptor slot first (recovery no longer names its
/// chunks), then the chunks back to the pool.
fn release(arena: &Arena, m: MemoryStep) {
    arena.release_slot(m.slot);
    drop(m.image);
}

/// A memory-only save ended staging successfully: its chunks become the memory tier's
/// newest step, then the save is reported staged and done (memory only, not durable).
pub(super) fn staged(state: &Arc<SaveState>, report: StagedReport) {
    match hold(state, report) {
        Ok(result) => {
            tracing::debug!(step = state.step, "memory-only save staged");
            state.staging_finished(Ok(report));
            state.complete(Ok(result));
        }
        Err(e) => failed(state, e),
    }
}

/// A provisional memory-only save, reported staged before, confirmed by its caller
/// (`SaveOptions::provisional`): its chunks become the memory tier's newest step, then
/// the save is done.
pub(super) fn take(state: &Arc<SaveState>, report: StagedReport) {
    match hold(state, report) {
        Ok(result) => {
            tracing::debug!(step = state.step, "provisional memory-only save confirmed");
            state.complete(Ok(result));
        }
        Err(e) => drop_staged(state, e),
    }
}

/// Install a staged memory-only save's chunks as the memory tier's newest step; its
/// report. Fails (nothing installed) when a chunk is missing.
fn hold(state: &Arc<SaveState>, report: StagedReport) -> Result<SaveReport> {
    let leases: Option<Vec<ChunkLease>> = std::mem::take(&mut *lock(&state.memory))
        .into_iter()
        .collect();
    let Some(leases) = leases else {
        return Err(Error::Internal(
            "a memory-only save was staged with chunks missing".into(),
        ));
    };
    let cs = state.shared.arena.chunk_size();
    let entry = state.file_entry(&vec![0; state.plan.entries().len()]);
    let image = Adopted::in_memory(leases, state.step, state.plan.data_start(), cs, entry);
    let m = MemoryStep {
        step: state.step,
        seq: state.keep_seq,
        slot: state.slot,
        plan: state.plan.clone(),
        metadata: state.metadata.clone(),
        staged: report,
        image,
    };
    state.shared.memory.install(&state.shared.arena, m);
    Ok(SaveReport {
        step: state.step,
        dir: None,
        file: std::path::PathBuf::new(),
        bytes: state.plan.file_len(),
        tensors: state.plan.entries().len(),
        timings: SaveTimings {
            staging: report.staging,
            backpressure: report.backpressure,
            durable: Duration::ZERO,
            committed: None,
        },
        backend: state.shared.backend,
        direct_io: false,
        memory_only: true,
        retired: Vec::new(),
    })
}

/// A memory-only save failed while staging: its slot freed (before its chunks return to
/// the pool), the failure reported. No commit thread is involved.
pub(super) fn failed(state: &Arc<SaveState>, e: Error) {
    state.shared.arena.release_slot(state.slot);
    lock(&state.memory).clear();
    state.staging_finished(Err(e));
    let err = lock(&state.progress)
        .error
        .clone()
        .unwrap_or_else(|| Arc::new(Error::Internal("memory-only save failed".into())));
    state.complete(Err(err));
}

/// A memory-only save reported staged that no tier takes (a provisional save refused,
/// `SaveOptions::provisional`): its slot freed (before its chunks return to the pool),
/// the save done with `e`.
pub(super) fn drop_staged(state: &Arc<SaveState>, e: Error) {
    state.shared.arena.release_slot(state.slot);
    lock(&state.memory).clear();
    tracing::debug!(step = state.step, error = %e, "memory-only save dropped");
    state.complete(Err(Arc::new(e)));
}

impl Engine {
    /// Write the held memory-only steps ([`EngineConfig::with_disk_cadence`],
    /// [`EngineConfig::with_memory_steps`]) to disk from their staging chunks, oldest
    /// first, each as a disk save of that step (file, `fdatasync`, manifest, commit,
    /// retention), waiting for each commit; their reports, oldest first (empty when none
    /// is held). The first failure stops it (the steps not yet written stay held).
    /// [`Engine::close`] calls it, so a clean exit loses no step that was saved. The
    /// bucket and the replicas do not take them.
    pub fn persist_memory(&self) -> Result<Vec<SaveReport>> {
        let mut reports = Vec::new();
        while let Some(r) = self.persist_oldest()? {
            reports.push(r);
        }
        Ok(reports)
    }

    /// Write the oldest held memory-only step to disk ([`Engine::persist_memory`]).
    fn persist_oldest(&self) -> Result<Option<SaveReport>> {
        // Saves are decided and staged one at a time: none stages while this one starts.
        self.shared.gate.enter();
        let started = self.persist_start();
        self.shared.gate.leave();
        match started? {
            None => Ok(None),
            Some(state) => {
                state.wait_done();
                let r = lock(&state.progress).result.clone();
                match r {
                    Some(Ok(rep)) => Ok(Some(rep)),
                    Some(Err(e)) => Err(Error::SaveFailed {
                        step: state.step,
                        source: e,
                    }),
                    None => Err(Error::Internal("a save ended without a result".into())),
                }
            }
        }
    }

    /// With the gate held: hand the oldest held memory-only step to the writers and the commit
    /// thread, as a disk save whose bytes are staged already.
    fn persist_start(&self) -> Result<Option<Arc<SaveState>>> {
        let Some(tx) = self.commit_tx.as_ref() else {
            return Err(Error::Shutdown("engine closed".into()));
        };
        let jobs = self.jobs()?;
        let Some(m) = self.shared.memory.take_oldest() else {
            return Ok(None);
        };
        let cfg = &self.shared.cfg;
        let step = m.step;
        lock(&self.shared.inflight).insert(step);
        let file_name = manifest::rank_file_name(cfg.rank, cfg.world_size);
        let partial = cfg.root.join(manifest::partial_dir_name(step));
        let n_chunks = m.plan.chunk_count(self.shared.arena.chunk_size());
        let state = Arc::new(SaveState {
            shared: Arc::clone(&self.shared),
            step,
            plan: m.plan,
            metadata: m.metadata,
            file: FileSlot {
                path: partial.join(&file_name),
                ..FileSlot::default()
            },
            partial,
            file_name,
            part_only: false,
            confirm: false,
            provisional: false,
            slot: m.slot,
            keep_seq: m.seq,
            started: Instant::now(),
            slot_wait: Duration::ZERO,
            failed: std::sync::atomic::AtomicBool::new(false),
            progress: Mutex::new(Progress {
                staging_done: true,
                staged: Some(Ok(m.staged)),
                ..Progress::default()
            }),
            changed: Condvar::new(),
            crcs: Mutex::new(vec![Vec::new(); n_chunks as usize]),
            upload: None,
            snapshot: crate::device::SnapshotRequest::default(),
            held: Arc::default(),
            disk: true,
            memory: Mutex::new(Vec::new()),
        });
        let st = Arc::clone(&state);
        if let Err(e) = std::thread::Builder::new()
            .name("shmckpt-open".into())
            .spawn(move || st.open_file())
        {
            state.file_opened(Err(Error::Shutdown(format!(
                "cannot spawn the file-opening thread: {e}"
            ))));
        }
        // Every chunk is dispatched before the commit thread sees the save (it finalizes a
        // save once every dispatched chunk finished).
        let cs = self.shared.arena.chunk_size();
        let mut gone = false;
        for (k, lease) in m.image.into_leases().into_iter().enumerate() {
            if gone {
                // The writers are gone (the save fails): the descriptor must not name a
                // chunk that goes back to the pool.
                state
                    .shared
                    .arena
                    .descriptor()
                    .chunk_lost(state.slot, k as u64);
                drop(lease);
                continue;
            }
            let len = state.plan.chunk_range(k as u64, cs);
            let len = (len.end - len.start) as usize;
            let write_len = state.write_len(len);
            gone = SaveState::dispatch(&state, &jobs, lease, k as u64, len, write_len).is_err();
        }
        *lock(&self.last_save) = Some(Arc::clone(&state));
        if tx.send(Arc::clone(&state)).is_err() {
            return Err(Error::Shutdown("engine closed".into()));
        }
        tracing::info!(step, "writing a held memory-only step to disk");
        Ok(Some(state))
    }

    /// With the gate held, before a save of `n_chunks` chunks is staged: when the arena
    /// cannot hold the held memory-only steps and that save at once, the older held steps
    /// are given up (the newest supersedes them) and, if it still cannot, the newest is
    /// written to disk first (its chunks return to the pool as they are written, and the
    /// new save's staging waits for them, as for any disk save draining). Giving the newest
    /// up instead would leave nothing newer than the last disk step recoverable until the
    /// new save is staged, although its save reported it staged.
    pub(super) fn make_room_for(&self, n_chunks: u64) -> Result<()> {
        let arena = &self.shared.arena;
        let fits = || {
            let held = self.shared.memory.chunks(arena.chunk_size());
            held == 0 || held.saturating_add(n_chunks) <= arena.chunk_count()
        };
        while !fits() {
            if self.shared.memory.give_up_superseded(arena).is_some() {
                continue;
            }
            tracing::warn!(
                step = ?self.memory_step(),
                "staging_capacity cannot hold the memory-only step and the next save: the memory-only step goes to disk first (give staging_capacity room for two saves to keep memory-only saves from waiting for the disk)"
            );
            self.persist_start()?;
            break;
        }
        Ok(())
    }

    /// This rank's manifest entry of the held memory-only step `step` (its tensors'
    /// checksums 0: see [`Engine::copy_memory_image`]), or `None` when it is not held.
    pub fn memory_entry(&self, step: u64) -> Option<crate::manifest::FileEntry> {
        let g = self.shared.memory.lock();
        g.iter()
            .find(|m| m.step == step)
            .map(|m| m.image.entry().clone())
    }

    /// Copy the image of the held memory-only step `step` into `dst` (exactly its length),
    /// under the memory tier's lock: no save can give the step up (and its chunks back to
    /// the pool) while its bytes are copied; a save that would give one up waits for the
    /// copy (at memory bandwidth, on up to 8 threads), a save that gives none up never
    /// does. `entry` is what [`Engine::memory_entry`] returned: if the step was given up
    /// since (or saved again under the same number, with another layout), nothing is
    /// copied and the error says so ([`Error::NotFound`]), so a copy is always of the step
    /// `entry` describes. The peer replicas send memory-only steps from such a copy
    /// (`shmckpt::replica::Outgoing::memory_step`).
    pub fn copy_memory_image(
        &self,
        step: u64,
        entry: &crate::manifest::FileEntry,
        dst: &mut [u8],
    ) -> Result<()> {
        let g = self.shared.memory.lock();
        let gone = || Error::NotFound {
            what: format!("memory-only step {step} (given up)"),
            step: Some(step),
            root: self.shared.cfg.root.clone(),
        };
        let m = g.iter().find(|m| m.step == step).ok_or_else(gone)?;
        if m.image.entry() != entry {
            return Err(gone());
        }
        m.image.copy_to(dst)
    }

    /// The newest memory-only step held, if any.
    pub(super) fn memory_step(&self) -> Option<u64> {
        self.shared.memory.newest()
    }

    /// The manifest a memory-only step would have with this rank alone (its tensors'
    /// checksums are 0: computed when the step goes to disk).
    pub(super) fn memory_manifest(&self, step: u64) -> Option<(Manifest, Metadata)> {
        let g = self.shared.memory.lock();
        let m = g.iter().find(|m| m.step == step)?;
        let entry = m.image.entry().clone();
        let mut header_meta = m.metadata.clone();
        let cfg = &self.shared.cfg;
        header_meta.insert(crate::plan::META_STEP.to_owned(), step.to_string());
        header_meta.insert(crate::plan::META_RANK.to_owned(), cfg.rank.to_string());
        header_meta.insert(
            crate::plan::META_WORLD.to_owned(),
            cfg.world_size.to_string(),
        );
        Some((
            Manifest {
                format_version: manifest::FORMAT_VERSION,
                step,
                world_size: cfg.world_size,
                created_unix_ms: crate::util::unix_ms(),
                total_bytes: entry.bytes,
                metadata: m.metadata.clone(),
                files: vec![entry],
            },
            header_meta,
        ))
    }
}
