//! Replica divergence: data-parallel ranks hold byte-identical copies of their replicated
//! tensors, so the CRC-32Cs a save computes anyway tell whether a rank's copy differs
//! (silent corruption by a faulty GPU or host) before a checkpoint preserves it. The
//! Python `Checkpointer(check_replicas=group)` gathers every rank's digests over its group
//! and asks [`compare`] which tensors diverge; `docs/guarantees.md` has the contract.

use std::collections::HashMap;

/// One rank's digest of one tensor of a save.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorDigest {
    /// The tensor's name in the checkpoint.
    pub name: String,
    /// Its element type's name.
    pub dtype: String,
    /// Its shape.
    pub shape: Vec<u64>,
    /// CRC-32C of its bytes.
    pub crc32c: u32,
}

/// A replicated tensor whose copies differ between ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Divergence {
    /// The tensor's name.
    pub tensor: String,
    /// The ranks (indices into [`compare`]'s input) whose copy differs from the one a
    /// strict majority holds; every rank when no CRC has a strict majority (two ranks, or
    /// a tie), since the faulty one cannot be told then.
    pub odd: Vec<usize>,
    /// Each rank's CRC-32C of the tensor, in input order.
    pub crcs: Vec<u32>,
    /// The CRC-32C a strict majority of the ranks holds, if one does.
    pub majority: Option<u32>,
}

/// The replicated tensors of `ranks` (each rank's digests of one save) whose copies
/// differ, sorted by name. A tensor is replicated when every rank holds a tensor of that
/// name with the same dtype and shape; the others (rank-specific state, shards of
/// different shapes) are not compared. A name a rank lists twice counts once (its first
/// digest). Fewer than two ranks: nothing to compare.
pub fn compare(ranks: &[Vec<TensorDigest>]) -> Vec<Divergence> {
    if ranks.len() < 2 {
        return Vec::new();
    }
    let maps: Vec<HashMap<&str, &TensorDigest>> = ranks
        .iter()
        .map(|r| {
            let mut m = HashMap::with_capacity(r.len());
            for d in r {
                m.entry(d.name.as_str()).or_insert(d);
            }
            m
        })
        .collect();
    let mut names: Vec<&str> = maps[0].keys().copied().collect();
    names.sort_unstable();
    let mut out = Vec::new();
    for name in names {
        let first = maps[0][name];
        let copies: Option<Vec<u32>> = maps
            .iter()
            .map(|m| {
                m.get(name)
                    .filter(|d| d.dtype == first.dtype && d.shape == first.shape)
                    .map(|d| d.crc32c)
            })
            .collect();
        let Some(crcs) = copies else { continue };
        if crcs.iter().all(|&c| c == crcs[0]) {
            continue;
        }
        let mut counts: HashMap<u32, usize> = HashMap::new();
        for &c in &crcs {
            *counts.entry(c).or_default() += 1;
        }
        let majority = counts
            .iter()
            .find(|&(_, &n)| n * 2 > crcs.len())
            .map(|(&c, _)| c);
        let odd = match majority {
            Some(m) => (0..crcs.len()).filter(|&i| crcs[i] != m).collect(),
            None => (0..crcs.len()).collect(),
        };
        out.push(Divergence {
            tensor: name.to_owned(),
            odd,
            crcs,
            majority,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(name: &str, shape: &[u64], crc: u32) -> TensorDigest {
        TensorDigest {
            name: name.into(),
            dtype: "float32".into(),
            shape: shape.to_vec(),
            crc32c: crc,
        }
    }

    #[test]
    fn identical_replicas_agree() {
        let r = vec![d("w", &[2], 7), d("b", &[1], 9)];
        assert_eq!(compare(&[r.clone(), r.clone(), r]), Vec::new());
    }

    #[test]
    fn majority_names_the_odd_rank() {
        let ok = vec![d("w", &[2], 7), d("b", &[1], 9)];
        let bad = vec![d("b", &[1], 9), d("w", &[2], 8)];
        assert_eq!(
            compare(&[ok.clone(), bad, ok]),
            vec![Divergence {
                tensor: "w".into(),
                odd: vec![1],
                crcs: vec![7, 8, 7],
                majority: Some(7),
            }]
        );
    }

    #[test]
    fn two_ranks_or_a_tie_name_every_rank() {
        let a = vec![d("w", &[2], 1)];
        let b = vec![d("w", &[2], 2)];
        assert_eq!(
            compare(&[a.clone(), b.clone()]),
            vec![Divergence {
                tensor: "w".into(),
                odd: vec![0, 1],
                crcs: vec![1, 2],
                majority: None,
            }]
        );
        let c = vec![d("w", &[2], 3)];
        assert_eq!(compare(&[a, b, c])[0].odd, vec![0, 1, 2]);
    }

    #[test]
    fn tensors_not_held_alike_by_every_rank_are_not_compared() {
        // Rank-specific names, a shard of another shape, another dtype.
        let a = vec![d("rng.0", &[4], 1), d("shard", &[3], 5), d("x", &[1], 6)];
        let mut other_dtype = d("x", &[1], 7);
        other_dtype.dtype = "bfloat16".into();
        let b = vec![d("rng.1", &[4], 2), d("shard", &[2], 6), other_dtype];
        assert_eq!(compare(&[a.clone(), b]), Vec::new());
        assert_eq!(compare(&[a]), Vec::new());
        assert_eq!(compare(&[]), Vec::new());
    }
}
