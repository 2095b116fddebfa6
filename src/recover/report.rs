//! What recovery returns.
#![forbid(unsafe_code)]

use std::path::PathBuf;

use super::{Owner, SlotState};
use crate::error::Error;

/// What recovery did with one slot.
#[derive(Debug)]
pub enum SlotOutcome {
    /// The save was rebuilt, made durable and committed.
    Committed {
        /// The committed directory.
        dir: PathBuf,
        /// Bytes of the file.
        bytes: u64,
        /// Chunks written from staging by recovery.
        from_staging: u64,
        /// Chunks that were already in the partial file.
        from_file: u64,
    },
    /// This rank's file is durable and its manifest part written, but other ranks of the
    /// checkpoint are missing, so it is not committed.
    AwaitingRanks {
        /// The partial directory.
        partial: PathBuf,
    },
    /// The step was already committed (the trainer died after the commit).
    AlreadyCommitted {
        /// The committed directory.
        dir: PathBuf,
    },
    /// The save cannot be restored (not fully staged, failed before the crash, bytes lost
    /// or inconsistent). Permanent: retrying does not help.
    Refused {
        /// Why.
        reason: String,
    },
    /// Left staged for the engine being opened (flash restore with
    /// `EngineConfig::with_keep_in_memory`), which takes the arena over and holds the save
    /// as its memory-only step, as the dead engine did: loads serve it from memory, a
    /// crash leaves it staged for the next open, and it reaches the disk with the engine's
    /// next disk save (which supersedes it) or at close. Only an engine's open reports it.
    Adopted,
    /// Left staged for the engine being opened (with [`SlotOutcome::Adopted`], for an older
    /// save of the same arena: a disk save that was in flight), which takes the arena over
    /// with it in place and recovers it on a thread after the open returns, with the same
    /// protocol (its outcome is logged; until it ends a save of that step is refused with
    /// `StepExists`; a crash before leaves it staged for the next open). Only an engine's
    /// open reports it.
    Behind,
    /// An I/O error, or an entry in the way that recovery never writes through (a link, a
    /// FIFO, a file where a directory belongs: [`Error::UnsafePath`]), stopped recovery of
    /// this save; the arena is kept so it can be retried once the cause is removed.
    Failed {
        /// The error.
        error: Error,
    },
}

/// One slot's recovery.
#[derive(Debug)]
pub struct SlotRecovery {
    /// Slot number.
    pub slot: u32,
    /// Step.
    pub step: u64,
    /// State the slot was in.
    pub state: SlotState,
    /// What happened.
    pub outcome: SlotOutcome,
}

/// What [`super::recover_arena`] did with one arena.
#[derive(Debug)]
pub struct RecoveryReport {
    /// Segment name.
    pub arena: String,
    /// Recorded owner.
    pub owner_pid: u32,
    /// Its status when recovery started.
    pub owner: Owner,
    /// The owner had shut down cleanly.
    pub closed: bool,
    /// Checkpoint root used.
    pub root: PathBuf,
    /// Rank.
    pub rank: u32,
    /// World size.
    pub world_size: u32,
    /// Every slot that was in use, oldest step first.
    pub slots: Vec<SlotRecovery>,
    /// Whether the arena was removed from `/dev/shm`.
    pub removed: bool,
    /// Why it was kept, when it was.
    pub kept: Option<String>,
}

impl RecoveryReport {
    /// Steps committed by this recovery.
    pub fn committed_steps(&self) -> Vec<u64> {
        self.slots
            .iter()
            .filter(|s| matches!(s.outcome, SlotOutcome::Committed { .. }))
            .map(|s| s.step)
            .collect()
    }

    /// The steps left staged for the opening engine, which holds them in memory
    /// ([`SlotOutcome::Adopted`]).
    pub fn adopted_steps(&self) -> Vec<u64> {
        self.slots
            .iter()
            .filter(|s| matches!(s.outcome, SlotOutcome::Adopted))
            .map(|s| s.step)
            .collect()
    }

    /// Whether any slot failed with an I/O error (a retry may succeed).
    pub fn has_failures(&self) -> bool {
        self.slots
            .iter()
            .any(|s| matches!(s.outcome, SlotOutcome::Failed { .. }))
    }
}
