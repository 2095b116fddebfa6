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
            let newest = match which {
                StepSel::Latest => self.disk_latest()?.is_none_or(|d| m > d),
                StepSel::Step(s) => s == m,
            };
            if newest {
                return Ok(Resolved::Memory(m));
            }
        }
        if tiers == Tiers::Remote {
            return Ok(Resolved::Bucket {
                step: self.resolve_remote(which)?,
                disk: None,
            });
        }
        match self.resolve(which) {
            Ok(info) => Ok(Resolved::Local(info)),
            Err(e @ Error::NotFound { .. })
                if tiers == Tiers::All && self.remote_tier().is_some() =>
            {
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
        let bucket: Vec<u64> = match tiers {
            Tiers::Local => Vec::new(),
            Tiers::All if self.remote_tier().is_none() => Vec::new(),
            _ => self.tier_list()?,
        };
        let mut memory = Vec::new();
        if tiers != Tiers::Remote {
            memory.extend(self.memory_step());
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::Metadata;
    use crate::{Dtype, EngineConfig, Tensor};

    /// `(step, on disk, in the bucket)` of each listed step (none in memory here).
    fn tuples(list: Vec<StepTiers>) -> Vec<(u64, bool, bool)> {
        list.into_iter()
            .map(|t| {
                assert!(!t.memory, "{t:?}");
                (t.step, t.disk, t.bucket)
            })
            .collect()
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
