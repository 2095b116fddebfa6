//! Saves whose commit waits for the caller (`SaveOptions::confirm_commit`): the replica
//! divergence check of the Python package compares the published CRC-32Cs across ranks
//! and commits or refuses.

use shmckpt::manifest::{
    Manifest, partial_dir_name, rank_file_name, rank_manifest_name, step_dir_name,
};
use shmckpt::{BackendKind, Error, Metadata, SaveOptions};

use crate::common::{committed, real_dir, small_config, step_state};

/// One rank: the checksums published before the commit are the committed manifest's
/// entries; a refused save commits nothing and leaves no partial directory, and the
/// step can be saved again; a handle dropped undecided refuses its commit.
#[test]
fn confirmed_commits_refused_and_dropped_do_not() {
    let dir = real_dir("confirm");
    let root = dir.path();
    let engine = small_config(root, BackendKind::Pwrite).build().unwrap();
    let state = step_state(3);
    let opts = SaveOptions::new().confirm_commit();

    let h = engine
        .save_with(3, &state.tensors(), &Metadata::new(), &opts)
        .unwrap();
    let sums = h.wait_checksums().unwrap();
    assert!(!h.is_done(), "the commit waits for the caller");
    assert!(committed(root).is_empty());
    h.confirm_commit(Ok(()));
    let rep = h.wait().unwrap();
    assert_eq!(rep.dir, Some(root.join(step_dir_name(3))));
    let m = Manifest::read(&root.join(step_dir_name(3))).unwrap();
    assert_eq!(m.files[0].tensors, sums);

    let h = engine
        .save_with(4, &state.tensors(), &Metadata::new(), &opts)
        .unwrap();
    assert_eq!(h.wait_checksums().unwrap(), sums);
    h.confirm_commit(Err("rank 1 diverged".into()));
    match h.wait() {
        Err(Error::CommitRefused { step: 4, reason }) => assert_eq!(reason, "rank 1 diverged"),
        other => panic!("expected CommitRefused, got {other:?}"),
    }
    assert_eq!(committed(root), vec![3]);
    assert!(!root.join(partial_dir_name(4)).exists());

    let h = engine
        .save_with(4, &state.tensors(), &Metadata::new(), &opts)
        .unwrap();
    drop(h);
    engine.flush().unwrap_err();
    assert_eq!(committed(root), vec![3]);

    // Saved again, confirmed: committed; a save without the option publishes nothing.
    let h = engine
        .save_with(4, &state.tensors(), &Metadata::new(), &opts)
        .unwrap();
    h.confirm_commit(Ok(()));
    h.wait().unwrap();
    assert_eq!(committed(root), vec![3, 4]);
    let h = engine.save(5, &state.tensors(), &Metadata::new()).unwrap();
    assert!(matches!(h.checksums(), Some(Err(Error::Config(_)))));
    h.wait().unwrap();
    engine.close();
}

/// Two ranks of one root: rank 0 confirms, rank 1 refuses: the step is not committed
/// (rank 1's part is never written) and rank 1's file is gone.
#[test]
fn one_refusing_rank_keeps_the_step_uncommitted() {
    let dir = real_dir("confirm2");
    let root = dir.path();
    let engines: Vec<_> = (0..2)
        .map(|r| {
            small_config(root, BackendKind::Pwrite)
                .with_rank(r, 2)
                .build()
                .unwrap()
        })
        .collect();
    let state = step_state(9);
    let opts = SaveOptions::new().confirm_commit();
    let handles: Vec<_> = engines
        .iter()
        .map(|e| {
            e.save_with(9, &state.tensors(), &Metadata::new(), &opts)
                .unwrap()
        })
        .collect();
    let sums: Vec<_> = handles
        .iter()
        .map(|h| h.wait_checksums().unwrap())
        .collect();
    assert_eq!(sums[0], sums[1]);
    handles[0].confirm_commit(Ok(()));
    handles[1].confirm_commit(Err("diverged".into()));
    let mut it = handles.into_iter();
    let rep0 = it.next().unwrap().wait().unwrap();
    assert_eq!(rep0.dir, None);
    assert!(matches!(
        it.next().unwrap().wait(),
        Err(Error::CommitRefused { step: 9, .. })
    ));
    assert!(committed(root).is_empty());
    let partial = root.join(partial_dir_name(9));
    // Rank 0's file and part wait in the partial directory for a commit that never comes.
    assert!(partial.join(rank_file_name(0, 2)).is_file());
    assert!(partial.join(rank_manifest_name(0)).is_file());
    assert!(!partial.join(rank_file_name(1, 2)).exists());
    assert!(!partial.join(rank_manifest_name(1)).exists());
    for e in engines {
        e.close();
    }
}
