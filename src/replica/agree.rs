//! "Latest" across ranks with peer replicas: the rule that picks the step every rank loads
//! once each rank has told the others what it can load ([`LoadView`], gathered by the
//! transport). One rule for every rank: each one evaluates it on the same gathered views
//! and so reaches the same step without another exchange.
//!
//! A step is loadable by rank `q` from its own copy (its committed file, present and of the
//! manifest's size, or a memory-only step its engine holds), from the bucket, or from a
//! replica of it that one of `q`'s partners ([`super::plan`]) holds. The newest step every
//! rank can load is chosen; a newer one some rank cannot load is passed over. A step not
//! committed anywhere whose part some ranks wrote (recovered from their arenas after every
//! trainer died) and whose other ranks' images their partners hold as replicas of the
//! memory-only step can have its commit completed first ([`Choice::Complete`]: the caller
//! runs that collective and, if it fails, goes on to the next candidate).

use std::collections::{BTreeMap, BTreeSet, HashSet};

use crate::error::{Error, Result};

/// What one rank can load, as it tells the others before a load of "latest".
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadView {
    /// Steps it knows of: committed on its disk, or memory-only in its engine.
    pub known: Vec<u64>,
    /// Steps it can load from its own copy: its file present, a regular file of the
    /// manifest's size (every byte is checked by the load), or a memory-only step its
    /// engine holds.
    pub own: Vec<u64>,
    /// Replicas it holds of committed steps: `(source rank, step)`.
    pub held: Vec<(u32, u64)>,
    /// Steps committed in the bucket (none without one, or when not asked).
    pub bucket: Vec<u64>,
    /// Steps not committed whose part this rank wrote durably (its file with it).
    pub parts: Vec<u64>,
    /// Replicas it holds of steps not committed, each with its sender's manifest entry
    /// beside it: `(source rank, step)`.
    pub pending: Vec<(u32, u64)>,
    /// Steps committed on its disk.
    pub committed: Vec<u64>,
}

/// What [`candidates`] says of one step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Choice {
    /// Every rank can load it: the step to load.
    Load,
    /// Not committed on any rank, but completable: each `(rank, partner)` pair names a rank
    /// without its part and the partner whose replica of the memory-only step serves its
    /// image (every other rank has its part). Loadable once that commit is completed.
    Complete(Vec<(u32, u32)>),
    /// These ranks have neither their own copy, nor the bucket's, nor a partner's replica.
    Short(Vec<u32>),
}

/// A step [`candidates`] looked at, with what it says of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// The step.
    pub step: u64,
    /// Whether and how every rank can load it.
    pub choice: Choice,
}

/// The steps any rank knows of, in the bucket or as a part, newest first, each with
/// whether every rank can load it, up to and including the first one every rank can load
/// ([`Choice::Load`]). A caller loads the first [`Choice::Load`], or completes the commit
/// of a [`Choice::Complete`] first (going on to the next candidate if that fails); the
/// [`Choice::Short`] steps before it are passed over. `views[q]` is rank `q`'s, `plan[q]`
/// its partners ([`super::plan`]). [`Error::Config`] when they differ in length.
pub fn candidates(views: &[LoadView], plan: &[Vec<u32>]) -> Result<Vec<Candidate>> {
    if views.len() != plan.len() {
        return Err(Error::Config(format!(
            "{} ranks' views for a plan of {} ranks",
            views.len(),
            plan.len()
        )));
    }
    let sets: Vec<RankSets> = views.iter().map(RankSets::of).collect();
    // (source, step, holder) of every replica held, of committed and uncommitted steps.
    let mut holds = HashSet::new();
    let mut pend = HashSet::new();
    for (r, v) in views.iter().enumerate() {
        let r = rank(r)?;
        holds.extend(v.held.iter().map(|&(src, s)| (src, s, r)));
        pend.extend(v.pending.iter().map(|&(src, s)| (src, s, r)));
    }
    let committed_anywhere: BTreeSet<u64> = sets
        .iter()
        .flat_map(|s| s.committed.iter().copied())
        .collect();
    let steps: BTreeSet<u64> = views
        .iter()
        .flat_map(|v| v.known.iter().chain(&v.bucket).chain(&v.parts).copied())
        .collect();
    let mut out = Vec::new();
    for &s in steps.iter().rev() {
        let mut short = Vec::new();
        for (q, set) in sets.iter().enumerate() {
            let qr = rank(q)?;
            let by_replica = plan[q].iter().any(|&r| holds.contains(&(qr, s, r)));
            if !set.own.contains(&s) && !set.bucket.contains(&s) && !by_replica {
                short.push(qr);
            }
        }
        if short.is_empty() {
            out.push(Candidate {
                step: s,
                choice: Choice::Load,
            });
            return Ok(out);
        }
        let choice = match completable(s, &sets, plan, &pend, &committed_anywhere)? {
            Some(servers) => Choice::Complete(servers),
            None => Choice::Short(short),
        };
        out.push(Candidate { step: s, choice });
    }
    Ok(out)
}

/// The newest step any rank knows of or the bucket holds (parts of steps not committed
/// aside): what a load of "latest" asks for when no step is loadable by every rank (its
/// load then fails on the ranks that cannot, with the reason).
pub fn newest_known(views: &[LoadView]) -> Option<u64> {
    views
        .iter()
        .flat_map(|v| v.known.iter().chain(&v.bucket).copied())
        .max()
}

/// A view's step lists as sets.
struct RankSets {
    own: BTreeSet<u64>,
    bucket: BTreeSet<u64>,
    parts: BTreeSet<u64>,
    committed: BTreeSet<u64>,
}

impl RankSets {
    fn of(v: &LoadView) -> RankSets {
        RankSets {
            own: v.own.iter().copied().collect(),
            bucket: v.bucket.iter().copied().collect(),
            parts: v.parts.iter().copied().collect(),
            committed: v.committed.iter().copied().collect(),
        }
    }
}

fn rank(i: usize) -> Result<u32> {
    u32::try_from(i).map_err(|_| Error::Config("too many ranks".into()))
}

/// The partner serving each rank without a part of the uncommitted step `s`, when every
/// rank has its part or such a partner and some rank has a part; `None` otherwise, and
/// for a step committed on some rank (the rules of committed steps apply to it).
fn completable(
    s: u64,
    sets: &[RankSets],
    plan: &[Vec<u32>],
    pend: &HashSet<(u32, u64, u32)>,
    committed_anywhere: &BTreeSet<u64>,
) -> Result<Option<Vec<(u32, u32)>>> {
    if committed_anywhere.contains(&s) {
        return Ok(None);
    }
    let mut servers = BTreeMap::new();
    for (q, set) in sets.iter().enumerate() {
        if set.parts.contains(&s) {
            continue;
        }
        let qr = rank(q)?;
        match plan[q].iter().find(|&&r| pend.contains(&(qr, s, r))) {
            Some(&r) => {
                servers.insert(qr, r);
            }
            None => return Ok(None),
        }
    }
    Ok((!servers.is_empty() && servers.len() < sets.len()).then(|| servers.into_iter().collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(known: &[u64], own: &[u64]) -> LoadView {
        LoadView {
            known: known.to_vec(),
            own: own.to_vec(),
            committed: known.to_vec(),
            ..LoadView::default()
        }
    }

    /// Two machines of two ranks, one replica each: rank q's partner is on the other
    /// machine (0 <-> 2, 1 <-> 3).
    fn plan4() -> Vec<Vec<u32>> {
        vec![vec![2], vec![3], vec![0], vec![1]]
    }

    #[test]
    fn every_rank_with_its_own_copy_loads_the_newest() {
        let v = vec![view(&[1, 2], &[1, 2]); 4];
        let c = candidates(&v, &plan4()).unwrap();
        assert_eq!(
            c,
            vec![Candidate {
                step: 2,
                choice: Choice::Load
            }]
        );
    }

    #[test]
    fn a_lost_rank_loads_from_its_partners_replica() {
        let mut v = vec![view(&[1, 2], &[1, 2]); 4];
        // Rank 1's machine was replaced: its root is empty, rank 3 holds its replica of 2.
        v[1] = LoadView::default();
        v[3].held = vec![(1, 2)];
        let c = candidates(&v, &plan4()).unwrap();
        assert_eq!(
            c,
            vec![Candidate {
                step: 2,
                choice: Choice::Load
            }]
        );
        // A replica held by a rank that is not the partner does not count.
        v[3].held.clear();
        v[2].held = vec![(1, 2)];
        let c = candidates(&v, &plan4()).unwrap();
        let short = |step| Candidate {
            step,
            choice: Choice::Short(vec![1]),
        };
        assert_eq!(c, vec![short(2), short(1)]);
        assert_eq!(newest_known(&v), Some(2));
    }

    #[test]
    fn a_step_some_rank_cannot_load_is_passed_over() {
        let mut v = vec![view(&[1, 2, 3], &[1, 2, 3]); 4];
        v[2] = view(&[1, 2], &[1, 2]);
        v[0].held = vec![(2, 2)]; // of step 2, not 3
        let c = candidates(&v, &plan4()).unwrap();
        assert_eq!(
            c,
            vec![
                Candidate {
                    step: 3,
                    choice: Choice::Short(vec![2])
                },
                Candidate {
                    step: 2,
                    choice: Choice::Load
                }
            ]
        );
    }

    #[test]
    fn the_bucket_serves_a_rank_without_its_file() {
        let mut v = vec![view(&[5], &[5]); 2];
        v[1] = LoadView {
            bucket: vec![5, 6],
            ..LoadView::default()
        };
        let plan = vec![vec![1], vec![0]];
        let c = candidates(&v, &plan).unwrap();
        // Step 6: only in the bucket as rank 1 sees it; rank 0 did not list the bucket.
        assert_eq!(
            c,
            vec![
                Candidate {
                    step: 6,
                    choice: Choice::Short(vec![0])
                },
                Candidate {
                    step: 5,
                    choice: Choice::Load
                }
            ]
        );
        assert_eq!(newest_known(&v), Some(6));
    }

    #[test]
    fn an_uncommitted_step_with_parts_and_pending_replicas_is_completed() {
        // Step 4 memory-only when every trainer died: ranks 0 and 1 recovered their parts,
        // ranks 2 and 3 lost theirs; ranks 0 and 1 hold 2's and 3's images with entries.
        let mut v = vec![view(&[3], &[3]); 4];
        v[0].parts = vec![4];
        v[1].parts = vec![4];
        v[0].pending = vec![(2, 4)];
        v[1].pending = vec![(3, 4)];
        let c = candidates(&v, &plan4()).unwrap();
        assert_eq!(
            c,
            vec![
                Candidate {
                    step: 4,
                    choice: Choice::Complete(vec![(2, 0), (3, 1)])
                },
                Candidate {
                    step: 3,
                    choice: Choice::Load
                }
            ]
        );
        // One image missing: not completable, the ranks short named.
        v[1].pending.clear();
        let c = candidates(&v, &plan4()).unwrap();
        assert_eq!(c[0].choice, Choice::Short(vec![0, 1, 2, 3]));
        // Committed on some rank: the committed steps' rules, never a second commit.
        v[1].pending = vec![(3, 4)];
        v[2].committed = vec![3, 4];
        let c = candidates(&v, &plan4()).unwrap();
        assert!(matches!(c[0].choice, Choice::Short(_)), "{c:?}");
    }

    #[test]
    fn a_step_every_rank_has_as_a_part_is_not_completed_here() {
        // Every rank has its part: nothing to complete with replicas (the commit of parts
        // is the engine's), and no rank can load it yet.
        let mut v = vec![view(&[1], &[1]); 2];
        v[0].parts = vec![2];
        v[1].parts = vec![2];
        let plan = vec![vec![1], vec![0]];
        let c = candidates(&v, &plan).unwrap();
        assert_eq!(c[0].step, 2);
        assert_eq!(c[0].choice, Choice::Short(vec![0, 1]));
        assert_eq!(c[1].choice, Choice::Load);
        // Parts are never "latest" when nothing is loadable.
        assert_eq!(newest_known(&v), Some(1));
    }

    #[test]
    fn nothing_known_gives_no_candidate_and_mismatched_plans_are_refused() {
        assert_eq!(
            candidates(&[LoadView::default()], &[vec![]]).unwrap(),
            vec![]
        );
        assert_eq!(newest_known(&[LoadView::default()]), None);
        let e = candidates(&[LoadView::default()], &[]).unwrap_err();
        assert!(matches!(e, Error::Config(_)), "{e}");
    }
}
