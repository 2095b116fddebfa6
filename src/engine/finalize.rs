//! The end of a save, on the commit thread: make the file durable, write the manifest,
//! commit, retire older checkpoints; or clean up after a failure.

use std::sync::Arc;
use std::time::Duration;

use crate::commit::{self};
use crate::error::{Error, Result};
use crate::io::pool::WriteSink;
use crate::manifest::FileEntry;
use crate::tier::LocalOutcome;

use super::lock;
use super::report::{SaveReport, SaveTimings};
use super::state::SaveState;

/// Runs on the commit thread once a save has settled. Returns the save's result and the
/// checkpoints its retention took out of the root, whose files the caller deletes once the
/// result is reported (deleting gigabytes can take seconds).
pub(super) fn finalize(
    st: &SaveState,
) -> (std::result::Result<SaveReport, Arc<Error>>, commit::Retired) {
    let failure = {
        let mut p = lock(&st.progress);
        if st.failed() {
            Some(p.error.take().unwrap_or_else(|| {
                Arc::new(Error::Internal(
                    "staging failed before the save was complete".into(),
                ))
            }))
        } else {
            None
        }
    };
    let (result, retired, entry) = match failure {
        Some(e) => (Err(e), commit::Retired::default(), None),
        None => match persist(st) {
            Ok((report, retired, entry)) => (Ok(report), retired, Some(entry)),
            Err(e) => (Err(Arc::new(e)), commit::Retired::default(), None),
        },
    };
    remote_copy(st, &result, entry);
    // Closed before anything is reported (and before a failed save's file is removed):
    // deleting the checkpoint later frees its blocks in the deleting thread, never in a
    // later save of this engine.
    st.close_file();
    if result.is_err() {
        commit::abort_partial(&st.partial, st.shared.cfg.rank, &st.file_name);
    }
    // Held for replication (`with_replica_hold`) when the image is whole in the arena: its
    // chunks are taken here, before the save is reported done.
    let cfg = &st.shared.cfg;
    let hold =
        (cfg.replica_hold && st.shared.files).then(|| (&*st.shared.held, st.plan.file_len()));
    if let Some(image) =
        st.shared
            .arena
            .finish_slot_holding(st.slot, st.keep_seq, result.is_ok(), hold)
    {
        st.held.set(image);
    }
    if let Err(e) = &result {
        tracing::error!(step = st.step, error = %e, "save failed; nothing committed");
    }
    // A newer step is on disk: the memory tier's older step is given up.
    if result.as_ref().is_ok_and(|r| r.dir.is_some()) {
        st.shared.memory.committed(&st.shared.arena, st.keep_seq);
    }
    (result, retired)
}

/// Tell the save's copy to the tier beyond the disk (started with the save) how the save
/// ended locally: committed, with where its file is (the tier opens it now, before
/// retention or another rank can move it), or failed (nothing of the step may reach the
/// tier).
fn remote_copy(
    st: &SaveState,
    result: &std::result::Result<SaveReport, Arc<Error>>,
    entry: Option<FileEntry>,
) {
    let Some(upload) = &st.upload else {
        return;
    };
    let outcome = match (result, entry) {
        (Ok(report), Some(entry)) => LocalOutcome::Committed {
            entry,
            // With several ranks, another rank may rename the partial directory at any
            // time: the file is then in the committed one.
            file: st.shared.files.then(|| {
                [
                    report.file.clone(),
                    st.shared
                        .cfg
                        .root
                        .join(crate::manifest::step_dir_name(st.step))
                        .join(&st.file_name),
                ]
            }),
        },
        (Err(e), _) => LocalOutcome::Failed(Arc::clone(e)),
        (Ok(_), None) => LocalOutcome::Failed(Arc::new(Error::Internal(
            "committed save without a file entry".into(),
        ))),
    };
    upload.local_outcome(outcome);
}

fn persist(st: &SaveState) -> Result<(SaveReport, commit::Retired, FileEntry)> {
    let cfg = &st.shared.cfg;
    let target = if !st.shared.files {
        None // no file: every chunk is checksummed and held for the upload
    } else {
        let t = st
            .file_target()
            .ok_or_else(|| Error::Internal("the checkpoint file was never opened".into()))?;
        t.finish(st.plan.file_len())?;
        Some(t)
    };
    let durable = st.started.elapsed();
    let entry = st.file_entry(&st.tensor_crcs());
    // A commit held for its caller (`SaveOptions::confirm_commit`): refused, nothing of
    // this rank's step is written beyond its file, which `finalize` removes.
    if st.confirm || st.provisional {
        st.await_confirmation(&entry.tensors)?;
    }
    if st.provisional {
        // Confirmed: recoverable from here, when every chunk of its map is staged or
        // written (a failed write marks its chunk lost and the save failed).
        if st.failed() {
            return Err(Error::Internal(
                "a write of the save failed while its commit was decided".into(),
            ));
        }
        st.shared.arena.descriptor().staged(st.slot);
    }
    let dir = match target {
        // The part, durable next to its file; the caller commits the step.
        Some(_) if st.part_only => {
            commit::write_part(&cfg.root, st.step, &st.partial, &entry)?;
            None
        }
        Some(_) => commit::commit(
            &cfg.root,
            st.step,
            cfg.world_size,
            &st.partial,
            entry.clone(),
            &st.metadata,
        )?,
        None => None,
    };
    let committed = dir.as_ref().map(|_| st.started.elapsed());
    let mut retired = commit::Retired::default();
    if let (Some(keep), Some(_)) = (cfg.keep_last, &dir) {
        match commit::retire_old(&cfg.root, keep) {
            Ok(r) => retired = r,
            Err(e) => tracing::warn!(error = %e, "retention failed; older checkpoints kept"),
        }
    }
    let (staging, backpressure) = match &lock(&st.progress).staged {
        Some(Ok(s)) => (s.staging, s.backpressure),
        _ => (Duration::ZERO, Duration::ZERO),
    };
    let file = match &dir {
        Some(d) => d.join(&st.file_name),
        None => st.partial.join(&st.file_name),
    };
    let report = SaveReport {
        step: st.step,
        dir,
        file,
        bytes: st.plan.file_len(),
        tensors: st.plan.entries().len(),
        timings: SaveTimings {
            staging,
            backpressure,
            durable,
            committed,
        },
        backend: st.shared.backend,
        direct_io: target.as_ref().is_some_and(|t| t.is_direct()),
        memory_only: false,
        retired: retired.steps.clone(),
    };
    Ok((report, retired, entry))
}
