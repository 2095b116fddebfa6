//! Replica divergence: data-parallel ranks hold byte-identical copies of their replicated
//! tensors, so the CRC-32Cs a save computes anyway tell whether a rank's copy differs
//! (silent corruption by a faulty GPU or host) before a checkpoint preserves it. The
//! Python `Checkpointer(check_replicas=group)` gathers every rank's digests over its group
//! and asks [`compare`] which tensors diverge (the DCP writer's `check_replicas` too);
//! `shmckpt verify --replicas` asks [`check_checkpoint`] about a committed checkpoint's
//! rank files. `docs/guarantees.md` has the contract.

use std::collections::HashMap;
use std::path::Path;

use crate::dtype::Dtype;
use crate::error::Result;
use crate::manifest::Manifest;

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
        let Some((odd, majority)) = judge(&crcs) else {
            continue;
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

/// A tensor that two or more rank files of one committed checkpoint hold alike (same
/// name, dtype and shape, and in a DCP checkpoint the same offsets in its global tensor)
/// whose copies' CRC-32Cs, as the manifest records them, differ: [`check_checkpoint`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileDivergence {
    /// The tensor's name in the rank files (`name@o1,o2,...` for a DCP piece that does not
    /// start at the origin of its global tensor).
    pub tensor: String,
    /// Its element type.
    pub dtype: Dtype,
    /// Its shape.
    pub shape: Vec<usize>,
    /// The ranks holding it, in rank order.
    pub ranks: Vec<u32>,
    /// Each holder's CRC-32C of it, in the order of `ranks`.
    pub crcs: Vec<u32>,
    /// The ranks whose copy differs from the one a strict majority of the holders has;
    /// every holder when no CRC has a strict majority (two holders, a tie).
    pub odd: Vec<u32>,
    /// The CRC-32C a strict majority of the holders has, if one does.
    pub majority: Option<u32>,
}

/// What [`check_checkpoint`] compared and found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaReport {
    /// The checkpoint's step.
    pub step: u64,
    /// Tensors held alike by two or more rank files (each counted once).
    pub compared: usize,
    /// Those whose copies differ, sorted by name.
    pub divergences: Vec<FileDivergence>,
}

/// The ranks whose CRC differs from the strict majority's (every one when there is none)
/// and that majority; `None` when every CRC is the same.
fn judge(crcs: &[u32]) -> Option<(Vec<usize>, Option<u32>)> {
    if crcs.iter().all(|&c| c == crcs[0]) {
        return None;
    }
    let mut counts: HashMap<u32, usize> = HashMap::new();
    for &c in crcs {
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
    Some((odd, majority))
}

/// Compare the copies of every tensor that two or more files of `manifest` hold under the
/// same name, dtype, shape and offsets (`offsets[i]`: file `i`'s tensors' offsets in their
/// global tensors, from a DCP rank file's header; `None` for a plain rank file, whose
/// tensors are whole). A name a file lists twice counts once (its first entry).
pub fn compare_files(
    manifest: &Manifest,
    offsets: &[Option<HashMap<String, Vec<u64>>>],
) -> ReplicaReport {
    // (name, dtype, shape, offsets) -> [(rank, crc)], in first-seen order.
    type Key<'a> = (&'a str, Dtype, &'a [usize], Vec<u64>);
    let mut held: Vec<(Key<'_>, Vec<(u32, u32)>)> = Vec::new();
    let mut index: HashMap<Key<'_>, usize> = HashMap::new();
    for (fi, f) in manifest.files.iter().enumerate() {
        let mut seen = std::collections::HashSet::new();
        for t in &f.tensors {
            if !seen.insert(t.name.as_str()) {
                continue;
            }
            let offs = offsets
                .get(fi)
                .and_then(Option::as_ref)
                .and_then(|m| m.get(&t.name))
                .cloned()
                .unwrap_or_default();
            let key: Key<'_> = (t.name.as_str(), t.dtype, t.shape.as_slice(), offs);
            match index.get(&key) {
                Some(&i) => held[i].1.push((f.rank, t.crc32c)),
                None => {
                    index.insert(key.clone(), held.len());
                    held.push((key, vec![(f.rank, t.crc32c)]));
                }
            }
        }
    }
    let mut compared = 0;
    let mut divergences = Vec::new();
    for ((name, dtype, shape, offs), copies) in held {
        if copies.len() < 2 {
            continue;
        }
        compared += 1;
        let crcs: Vec<u32> = copies.iter().map(|&(_, c)| c).collect();
        let Some((odd, majority)) = judge(&crcs) else {
            continue;
        };
        let tensor = if offs.iter().any(|&o| o != 0) && !name.contains('@') {
            let o: Vec<String> = offs.iter().map(u64::to_string).collect();
            format!("{name}@{}", o.join(","))
        } else {
            name.to_owned()
        };
        divergences.push(FileDivergence {
            tensor,
            dtype,
            shape: shape.to_vec(),
            ranks: copies.iter().map(|&(r, _)| r).collect(),
            crcs,
            odd: odd.into_iter().map(|i| copies[i].0).collect(),
            majority,
        });
    }
    divergences.sort_by(|a, b| a.tensor.cmp(&b.tensor));
    ReplicaReport {
        step: manifest.step,
        compared,
        divergences,
    }
}

/// The replica divergence check of a committed checkpoint directory `dir` (a `step-N`
/// directory, or a DCP checkpoint): [`compare_files`] over its manifest, with each DCP
/// rank file's offsets read from its header (checked against the manifest). It compares
/// the CRC-32Cs the manifest records; that each file's bytes match them is what a full
/// verification checks (`shmckpt verify` does both).
pub fn check_checkpoint(dir: &Path) -> Result<ReplicaReport> {
    let named_step = dir
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(crate::manifest::parse_step_dir)
        .is_some();
    let manifest = if named_step {
        Manifest::read(dir)?
    } else {
        Manifest::read_any_name(dir)?
    };
    let offsets = manifest
        .files
        .iter()
        .map(|f| {
            let path = dir.join(&f.file);
            let meta = crate::restore::read_file_metadata(&path, f)?;
            crate::export::dcp_offsets(&path, &meta)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(compare_files(&manifest, &offsets))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::{FileEntry, TensorEntry};

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

    fn entry(rank: u32, tensors: &[(&str, Dtype, &[usize], u32)]) -> FileEntry {
        FileEntry {
            rank,
            file: format!("rank-{rank}.safetensors"),
            bytes: 0,
            data_start: 0,
            header_crc32c: None,
            object: None,
            session: None,
            tensors: tensors
                .iter()
                .map(|&(name, dtype, shape, crc32c)| TensorEntry {
                    name: name.into(),
                    dtype,
                    shape: shape.to_vec(),
                    data_offsets: [0, 0],
                    crc32c,
                })
                .collect(),
        }
    }

    fn manifest(files: Vec<FileEntry>) -> Manifest {
        Manifest {
            format_version: crate::manifest::FORMAT_VERSION,
            step: 7,
            world_size: files.len() as u32,
            created_unix_ms: 0,
            total_bytes: 0,
            metadata: Default::default(),
            files,
        }
    }

    #[test]
    fn files_holding_a_tensor_alike_are_compared() {
        let w: &[usize] = &[2, 3];
        let m = manifest(vec![
            entry(0, &[("w", Dtype::F32, w, 7), ("rng", Dtype::U8, &[4], 1)]),
            entry(1, &[("w", Dtype::F32, w, 7), ("rng", Dtype::U8, &[4], 2)]),
            entry(2, &[("w", Dtype::F32, w, 9), ("rng", Dtype::U8, &[4], 1)]),
            // Held by rank 3 only under this dtype, shape: not compared.
            entry(3, &[("w", Dtype::BF16, w, 5), ("b", Dtype::F32, &[1], 3)]),
        ]);
        let none = vec![None; 4];
        let r = compare_files(&m, &none);
        assert_eq!(r.step, 7);
        assert_eq!(r.compared, 2);
        assert_eq!(
            r.divergences,
            vec![
                FileDivergence {
                    tensor: "rng".into(),
                    dtype: Dtype::U8,
                    shape: vec![4],
                    ranks: vec![0, 1, 2],
                    crcs: vec![1, 2, 1],
                    odd: vec![1],
                    majority: Some(1),
                },
                FileDivergence {
                    tensor: "w".into(),
                    dtype: Dtype::F32,
                    shape: vec![2, 3],
                    ranks: vec![0, 1, 2],
                    crcs: vec![7, 7, 9],
                    odd: vec![2],
                    majority: Some(7),
                },
            ]
        );
        // Two holders that differ: no majority, both named.
        let two = manifest(vec![
            entry(0, &[("w", Dtype::F32, w, 1)]),
            entry(1, &[("w", Dtype::F32, w, 2)]),
        ]);
        let d = &compare_files(&two, &[None, None]).divergences[0];
        assert_eq!((d.odd.clone(), d.majority), (vec![0, 1], None));
    }

    #[test]
    fn dcp_pieces_at_other_offsets_are_not_replicas() {
        let s: &[usize] = &[2, 3];
        let m = manifest(vec![
            entry(0, &[("w", Dtype::F32, s, 1), ("b", Dtype::F32, &[3], 4)]),
            entry(1, &[("w", Dtype::F32, s, 2), ("b", Dtype::F32, &[3], 4)]),
            entry(2, &[("w", Dtype::F32, s, 3), ("b", Dtype::F32, &[3], 5)]),
        ]);
        let offs = |o: u64| {
            Some(HashMap::from([
                ("w".to_owned(), vec![o, 0]),
                ("b".to_owned(), vec![0]),
            ]))
        };
        // Rows 0-1 on ranks 0 and 1 (HSDP replicas that differ), rows 2-3 on rank 2.
        let r = compare_files(&m, &[offs(0), offs(0), offs(2)]);
        assert_eq!(r.compared, 2);
        let names: Vec<_> = r.divergences.iter().map(|d| d.tensor.as_str()).collect();
        assert_eq!(names, ["b", "w"]);
        assert_eq!(r.divergences[1].ranks, vec![0, 1]);
        assert_eq!(r.divergences[0].odd, vec![2]);
        // Named with its offsets when not at the origin.
        let r = compare_files(&m, &[offs(2), offs(2), offs(0)]);
        let w = r.divergences.iter().find(|d| d.ranks == [0, 1]).unwrap();
        assert_eq!(w.tensor, "w@2,0");
    }

    /// A committed checkpoint of three ranks whose rank 2 holds another `model.w` (its
    /// file consistent with its manifest): named, with each rank's CRC.
    #[test]
    fn a_committed_checkpoint_names_the_odd_rank() {
        use crate::{Engine, EngineConfig, Metadata, Tensor};
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        let engines: Vec<Engine> = (0..3)
            .map(|r| {
                Engine::open(
                    EngineConfig::new(&root)
                        .with_create_root(true)
                        .with_rank(r, 3)
                        .with_staging_capacity(4 << 20)
                        .with_chunk_size(1 << 20),
                )
                .unwrap()
            })
            .collect();
        let good: Vec<u8> = (0..24u8).collect();
        let mut bad = good.clone();
        bad[5] ^= 0x10;
        let handles: Vec<_> = engines
            .iter()
            .enumerate()
            .map(|(r, e)| {
                let w = if r == 2 { &bad } else { &good };
                let rng = [r as u8; 4];
                let t = [
                    Tensor::host("model.w", Dtype::F32, vec![2, 3], w),
                    Tensor::host(format!("rng.{r}"), Dtype::U8, vec![4], &rng),
                ];
                e.save(3, &t, &Metadata::new()).unwrap()
            })
            .collect();
        for h in handles {
            h.wait().unwrap();
        }
        drop(engines);
        let r = check_checkpoint(&root.join("step-3")).unwrap();
        assert_eq!((r.step, r.compared), (3, 1));
        assert_eq!(r.divergences.len(), 1);
        let d = &r.divergences[0];
        assert_eq!(d.tensor, "model.w");
        assert_eq!(d.ranks, vec![0, 1, 2]);
        let (g, b) = (crc32c::crc32c(&good), crc32c::crc32c(&bad));
        assert_eq!(d.crcs, vec![g, g, b]);
        assert_eq!((d.odd.clone(), d.majority), (vec![2], Some(g)));
    }
}
