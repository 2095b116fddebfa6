//! Which tier a load reads a step from: the one fallback order of every load, of
//! [`Engine::latest_in`] and of [`Engine::list_in`], so that "the latest step" is the same
//! step whoever asks.

use super::{Engine, StepSel, lock};
use crate::error::{Error, Result};
use crate::manifest::CheckpointInfo;

/// The tiers a load, [`Engine::latest_in`] or [`Engine::list_in`] looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tiers {
    /// Memory or the local disk, else the bucket (the remote tier, when the engine has
    /// one): what every load does by default.
    All,
    /// Memory or the local disk only (the kept image in memory serves only a step the
    /// disk lists).
    Local,
    /// The bucket only.
    Remote,
}

/// The tier a step resolved to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    /// Memory (the kept image) or the local disk: the engine picks when it loads.
    Local,
    /// The bucket.
    Remote,
}

/// A step [`Engine::list_in`] lists, with the tiers that hold it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct StepTiers {
    /// The step.
    pub step: u64,
    /// In shared memory: a memory-only save of this engine
    /// ([`EngineConfig::with_disk_cadence`](crate::EngineConfig::with_disk_cadence)), or
    /// the image flash restore adopted at open.
    pub memory: bool,
    /// Committed on the local disk.
    pub disk: bool,
    /// Committed in the bucket (the remote tier).
    pub bucket: bool,
}

/// Where a load reads: the memory tier's step, the disk's committed step, or the bucket's step (`disk`: why the
/// disk could not serve it, `None` when only the bucket was asked).
pub(super) enum Resolved {
    /// A memory-only step of this engine (`super::memory`), not on the disk.
    Memory(u64),
    Local(CheckpointInfo),
    #[cfg(feature = "s3")]
    Bucket {
        step: u64,
        disk: Option<Error>,
    },
}

impl Engine {
    /// The one fallback order: with [`Tiers::Remote`] the bucket's step (its latest for
    /// [`StepSel::Latest`]); otherwise the disk's committed step when the disk holds it
    /// ("latest": the disk's newest, whenever the disk holds any committed step, even when
    /// the bucket holds a newer one), else, with [`Tiers::All`] and a remote tier, the
    /// bucket's. [`Error::NotFound`] when no tier asked holds it.
    pub(super) fn resolve_in(&self, which: StepSel, tiers: Tiers) -> Result<Resolved> {
        self.resolve_with(which, tiers, true)
    }

    /// [`Engine::resolve_in`]; with `memory` and [`Tiers::All`] or [`Tiers::Local`], first
    /// the memory tier's step (a memory-only save of this engine): "latest" when it is
    /// newer than the disk's newest, or the step asked for.
    pub(super) fn resolve_with(
        &self,
        which: StepSel,
        tiers: Tiers,
        memory: bool,
    ) -> Result<Resolved> {
        if memory
            && tiers != Tiers::Remote
            && let Some(m) = self.memory_step()
        {
            match which {
                StepSel::Latest if self.disk_latest()?.is_none_or(|d| m > d) => {
                    return Ok(Resolved::Memory(m));
                }
                StepSel::Step(s) if self.shared.memory.holds(s) => {
                    return Ok(Resolved::Memory(s));
                }
                _ => {}
            }
        }
        if tiers == Tiers::Remote {
            #[cfg(feature = "s3")]
            return Ok(Resolved::Bucket {
                step: self.resolve_remote(which)?,
                disk: None,
            });
            #[cfg(not(feature = "s3"))]
            return Err(Error::Config(
                "this engine has no remote tier (with_remote)".into(),
            ));
        }
        match self.resolve(which) {
            Ok(info) => Ok(Resolved::Local(info)),
            #[cfg(feature = "s3")]
            Err(e @ Error::NotFound { .. }) if tiers == Tiers::All && self.remote().is_some() => {
                Ok(Resolved::Bucket {
                    step: self.resolve_remote(which)?,
                    disk: Some(e),
                })
            }
            Err(e) => Err(e),
        }
    }

    /// The step a load of `which` from `tiers` reads, and its tier (the same rule as
    /// every load: see [`Tiers`]). [`Error::NotFound`] when no tier asked holds it;
    /// [`Error::Config`] for [`Tiers::Remote`] without a remote tier.
    pub fn resolve_step(&self, which: impl Into<StepSel>, tiers: Tiers) -> Result<(u64, Tier)> {
        Ok(match self.resolve_in(which.into(), tiers)? {
            Resolved::Memory(step) => (step, Tier::Local),
            Resolved::Local(info) => (info.step, Tier::Local),
            #[cfg(feature = "s3")]
            Resolved::Bucket { step, .. } => (step, Tier::Remote),
        })
    }

    /// The step a load of "latest" from `tiers` reads, or `None` when no tier asked holds
    /// a committed step. With the default [`Tiers::All`], a lost local root does not
    /// hide the bucket's steps.
    pub fn latest_in(&self, tiers: Tiers) -> Result<Option<u64>> {
        match self.resolve_step(StepSel::Latest, tiers) {
            Ok((step, _)) => Ok(Some(step)),
            Err(Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The steps a load from `tiers` can read, oldest first, each with the tiers that hold
    /// it ([`StepTiers`]). [`Tiers::All`]: the memory tier's step, the disk's steps and the
    /// bucket's (a load of a step reads memory, then the disk, then the bucket);
    /// [`Tiers::Local`]: memory and the disk. [`Error::Config`] for [`Tiers::Remote`]
    /// without a remote tier.
    pub fn list_in(&self, tiers: Tiers) -> Result<Vec<StepTiers>> {
        let disk: Vec<u64> = if tiers == Tiers::Remote {
            Vec::new()
        } else {
            self.list()?.into_iter().map(|c| c.step).collect()
        };
        #[cfg(feature = "s3")]
        let bucket: Vec<u64> = match tiers {
            Tiers::Local => Vec::new(),
            Tiers::All if self.remote().is_none() => Vec::new(),
            _ => self.list_remote()?,
        };
        #[cfg(not(feature = "s3"))]
        let bucket: Vec<u64> = if tiers == Tiers::Remote {
            return Err(Error::Config(
                "this engine has no remote tier (with_remote)".into(),
            ));
        } else {
            Vec::new()
        };
        let mut memory = Vec::new();
        if tiers != Tiers::Remote {
            memory.extend(self.shared.memory.steps());
            memory.extend(lock(&self.shared.adopted).as_ref().map(|a| a.step()));
        }
        let mut all: std::collections::BTreeMap<u64, StepTiers> = Default::default();
        let sets = [(memory, 0), (disk, 1), (bucket, 2)];
        for (steps, tier) in sets {
            for step in steps {
                let e = all.entry(step).or_insert(StepTiers {
                    step,
                    memory: false,
                    disk: false,
                    bucket: false,
                });
                match tier {
                    0 => e.memory = true,
                    1 => e.disk = true,
                    _ => e.bucket = true,
                }
            }
        }
        Ok(all.into_values().collect())
    }
}

#[cfg(all(test, feature = "s3"))]
pub(super) mod tests {
    use std::sync::Arc;

    use object_store::memory::InMemory;

    use super::*;
    use crate::manifest::Metadata;
    use crate::{Dtype, EngineConfig, LoadSource, Tensor};

    /// An engine on `root` with `store` as its bucket (prefix `run1`); also used by
    /// `load_tests.rs`.
    pub(in crate::engine) fn engine(root: &std::path::Path, store: Arc<InMemory>) -> Engine {
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
    pub(in crate::engine) fn save(e: &Engine, step: u64) {
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

    #[test]
    fn without_a_remote_tier_only_the_disk_is_seen() {
        let dir = tempfile::tempdir().unwrap();
        let e = EngineConfig::new(dir.path())
            .with_staging_capacity(8 << 20)
            .with_chunk_size(1 << 20)
            .with_direct_io(false)
            .with_backend(crate::BackendKind::Pwrite)
            .build()
            .unwrap();
        assert_eq!(e.latest_in(Tiers::All).unwrap(), None);
        assert!(matches!(e.latest_in(Tiers::Remote), Err(Error::Config(_))));
        assert!(matches!(e.list_in(Tiers::Remote), Err(Error::Config(_))));
        let data = vec![7u8; 64];
        let t = [Tensor::host("w", Dtype::U8, vec![64], &data)];
        e.save(4, &t, &Metadata::new()).unwrap().wait().unwrap();
        assert_eq!(e.latest_in(Tiers::All).unwrap(), Some(4));
        assert_eq!(
            tuples(e.list_in(Tiers::All).unwrap()),
            vec![(4, true, false)]
        );
        e.close();
    }
}
