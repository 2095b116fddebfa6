//! Tests of the engine's one fallback order over its tiers (`crate::engine`'s
//! `tiers.rs`: `latest_in`, `list_in`, `resolve_step`) with a bucket as the remote tier.

use std::sync::Arc;

use object_store::memory::InMemory;

use crate::engine::{Engine, StepSel, StepTiers, Tier, Tiers};
use crate::error::Error;
use crate::manifest::Metadata;
use crate::{Dtype, EngineConfig, LoadSource, Tensor};

/// An engine on `root` with `store` as its bucket (prefix `run1`); also used by
/// `tests_load.rs`.
pub(super) fn engine(root: &std::path::Path, store: Arc<InMemory>) -> Engine {
    EngineConfig::new(root)
        .with_staging_capacity(8 << 20)
        .with_chunk_size(1 << 20)
        .with_writer_threads(1)
        .with_direct_io(false)
        .with_backend(crate::BackendKind::Pwrite)
        .with_remote_store(store, "run1")
        .build()
        .unwrap()
}

/// `(step, on disk, in the bucket)` of each listed step (none in memory here).
fn tuples(list: Vec<StepTiers>) -> Vec<(u64, bool, bool)> {
    list.into_iter()
        .map(|t| {
            assert!(!t.memory, "{t:?}");
            (t.step, t.disk, t.bucket)
        })
        .collect()
}

/// Saves `step` (one tensor whose bytes depend on the step) and waits for the disk
/// and the bucket.
pub(super) fn save(e: &Engine, step: u64) {
    let data: Vec<u8> = (0..4096u32)
        .flat_map(|i| (i ^ step as u32).to_le_bytes())
        .collect();
    let t = [Tensor::host("w", Dtype::F32, vec![4096], &data)];
    let h = e.save(step, &t, &Metadata::new()).unwrap();
    let remote = h.remote().unwrap();
    h.wait().unwrap();
    remote.wait().unwrap();
}

#[test]
fn latest_and_list_follow_the_load_after_the_local_root_is_lost() {
    let dir = tempfile::tempdir().unwrap();
    let mem = Arc::new(InMemory::new());
    let e = engine(dir.path(), mem.clone());
    assert_eq!(e.latest_in(Tiers::All).unwrap(), None);
    save(&e, 1);
    save(&e, 2);
    assert_eq!(e.latest_in(Tiers::All).unwrap(), Some(2));
    assert_eq!(
        e.resolve_step(StepSel::Latest, Tiers::All).unwrap(),
        (2, Tier::Local)
    );
    assert_eq!(
        tuples(e.list_in(Tiers::All).unwrap()),
        vec![(1, true, true), (2, true, true)]
    );
    e.close();

    // The local root is lost: the disk's listing is empty, the bucket's is not.
    std::fs::remove_dir_all(dir.path()).unwrap();
    std::fs::create_dir(dir.path()).unwrap();
    let e = engine(dir.path(), mem);
    assert_eq!(e.latest().unwrap(), None);
    assert_eq!(e.latest_in(Tiers::Local).unwrap(), None);
    assert_eq!(e.latest_in(Tiers::All).unwrap(), Some(2));
    assert_eq!(e.latest_in(Tiers::Remote).unwrap(), Some(2));
    assert_eq!(
        e.resolve_step(StepSel::Latest, Tiers::All).unwrap(),
        (2, Tier::Remote)
    );
    assert_eq!(e.resolve_step(1, Tiers::All).unwrap(), (1, Tier::Remote));
    assert!(matches!(
        e.resolve_step(StepSel::Latest, Tiers::Local),
        Err(Error::NotFound { step: None, .. })
    ));
    let (ck, report) = e.load_with_report(StepSel::Latest).unwrap();
    assert_eq!((ck.step, report.source), (2, LoadSource::Remote));
    assert_eq!(
        tuples(e.list_in(Tiers::All).unwrap()),
        vec![(1, false, true), (2, false, true)]
    );
    assert_eq!(tuples(e.list_in(Tiers::Local).unwrap()), vec![]);
    assert_eq!(
        tuples(e.list_in(Tiers::Remote).unwrap()),
        vec![(1, false, true), (2, false, true)]
    );
    // A step saved again on the disk: the disk's newest is the latest.
    save(&e, 3);
    assert_eq!(e.latest_in(Tiers::All).unwrap(), Some(3));
    assert_eq!(
        e.resolve_step(StepSel::Latest, Tiers::All).unwrap(),
        (3, Tier::Local)
    );
    assert_eq!(
        tuples(e.list_in(Tiers::All).unwrap()).last(),
        Some(&(3, true, true))
    );
    e.close();
}

/// `remote_every`: every second disk save is uploaded; with `disk_every`, memory-only
/// saves never are, and the bucket's saves are disk saves too.
#[test]
fn the_bucket_takes_every_kth_disk_save_and_never_a_memory_only_one() {
    let dir = tempfile::tempdir().unwrap();
    let mem = Arc::new(InMemory::new());
    let e = EngineConfig::new(dir.path())
        .with_staging_capacity(8 << 20)
        .with_chunk_size(1 << 20)
        .with_writer_threads(1)
        .with_direct_io(false)
        .with_backend(crate::BackendKind::Pwrite)
        .with_remote_store(mem, "run1")
        .with_disk_cadence(crate::DiskCadence::Every(2))
        .with_remote_every(2)
        .build()
        .unwrap();
    // Saves 1..=6: disk saves 1, 3, 5 (every second save); of those the bucket takes
    // 1 and 5 (every second disk save).
    for step in 1..=6u64 {
        let data: Vec<u8> = (0..4096u32)
            .flat_map(|i| (i ^ step as u32).to_le_bytes())
            .collect();
        let t = [Tensor::host("w", Dtype::F32, vec![4096], &data)];
        let h = e.save(step, &t, &Metadata::new()).unwrap();
        let remote = h.remote();
        let r = h.wait().unwrap();
        assert_eq!(r.memory_only, step % 2 == 0, "step {step}: {r:?}");
        assert_eq!(remote.is_some(), matches!(step, 1 | 5), "step {step}");
        if let Some(p) = remote {
            p.wait().unwrap();
        }
    }
    let listed: Vec<(u64, bool, bool, bool)> = e
        .list_in(Tiers::All)
        .unwrap()
        .into_iter()
        .map(|t| (t.step, t.memory, t.disk, t.bucket))
        .collect();
    assert_eq!(
        listed,
        vec![
            (1, false, true, true),
            (3, false, true, false),
            (5, false, true, true),
            (6, true, false, false),
        ]
    );
    assert!(matches!(
        EngineConfig::new(dir.path()).with_remote_every(0).build(),
        Err(Error::Config(_))
    ));
    e.close();
}
