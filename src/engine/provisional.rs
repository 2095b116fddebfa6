//! Provisional saves (`SaveOptions::provisional`): staged (and written, when the cadence
//! sends them to disk) like any save, taken by their tier only once their caller confirms
//! them. A disk save's commit thread waits for the decision (`finalize::persist`); a
//! memory-only save's staging report is parked in its progress until the decision, or the
//! decision waits there for the end of staging, whichever comes last acting on it.

use std::sync::Arc;

use crate::error::Error;

use super::memory;
use super::report::StagedReport;
use super::state::SaveState;

/// The caller's decision on `state` (`SaveHandle::confirm_commit`; the first one counts):
/// a provisional memory-only save staged before it is taken by the memory tier or dropped.
pub(super) fn decide(state: &Arc<SaveState>, decision: Result<(), String>) {
    if let Some(report) = state.confirm(decision.clone()) {
        decided(state, report, decision);
    }
}

/// A provisional save's staging ended with `report`: reported staged (its tensors may
/// change), then taken by its tier once its caller decides. A disk save goes on to the
/// commit thread; a memory-only one is parked unless the decision came first.
pub(super) fn staged(state: &Arc<SaveState>, report: StagedReport) {
    state.staging_finished(Ok(report));
    if state.disk {
        return;
    }
    if let Some(decision) = state.park(report) {
        decided(state, report, decision);
    }
}

/// A provisional memory-only save, staged and decided: confirmed, it is marked `STAGED`
/// (recovery commits it from here) and becomes the memory tier's newest step; refused, it
/// fails and its chunks go back.
fn decided(state: &Arc<SaveState>, report: StagedReport, decision: Result<(), String>) {
    match decision {
        Ok(()) => {
            state.shared.arena.descriptor().staged(state.slot);
            memory::take(state, report);
        }
        Err(reason) => memory::drop_staged(
            state,
            Error::CommitRefused {
                step: state.step,
                reason,
            },
        ),
    }
}
