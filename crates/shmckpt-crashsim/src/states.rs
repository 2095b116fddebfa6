//! The states a power loss can leave, from a recorded [`Log`].
//!
//! The model (ext4/xfs-like, and more pessimistic where POSIX allows it):
//!
//! - A crash at point `k` cuts the log: operations `k..` never happened.
//! - **Directory operations** (create, mkdir, rename, unlink, rmdir) before an `fsync` of
//!   the directory they change (the destination's, for a rename) are durable. The others
//!   may each be lost: either as a suffix of the directory operations (the journal commits
//!   them in order, as ext4 and xfs do), or any subset of them (what POSIX allows). An
//!   operation whose source a lost operation should have made is lost too.
//! - **File data and size**: operations on a file before its last `fsync`/`fdatasync` are
//!   durable. Later writes may each be lost, kept, or torn at 4 KiB file blocks (any subset
//!   of their blocks), and are applied in any order; the size after the crash is the size
//!   after any prefix of the unsynced size changes (`ftruncate`, `fallocate`, extending
//!   writes); bytes never written read as zeros.
//! - Nothing else changes: a file whose entry was lost is unreachable, whatever its data.
//!
//! Every state is a function of (log, point, [`Variant`]), so a failure is reproduced from
//! those three.

use std::collections::{BTreeMap, HashMap};

use super::model::{Digest, Model};
use super::{Id, Log, Op};

/// 4 KiB: the unit a write can be torn at.
pub const BLOCK: u64 = 4096;

/// SplitMix64: a small seeded generator (reproducible, no dependency).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The next value.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// True with probability `num / den`.
    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }
}

/// Which of the states at a crash point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Variant {
    /// Only what was made durable: every unsynced write and un-fsynced directory
    /// operation is lost.
    Durable,
    /// Everything issued before the crash reached the disk.
    Everything,
    /// Chosen from this seed: directory operations lost as a suffix or as any subset,
    /// unsynced writes dropped, kept or torn, in any order, sizes cut anywhere.
    Random(u64),
}

/// The state a crash at `point` (operations `..point` issued) leaves, in `variant`.
pub fn crash_state(log: &Log, point: usize, variant: Variant) -> Model {
    let ops = &log.ops[..point];
    let mut last_sync: HashMap<Id, usize> = HashMap::new();
    for (i, o) in ops.iter().enumerate() {
        if let Some(id) = o.synced() {
            last_sync.insert(id, i);
        }
    }
    let durable = |i: usize, id: Id| last_sync.get(&id).is_some_and(|&j| j > i);
    let mut rng = match variant {
        Variant::Random(seed) => Some(Rng::new(seed)),
        _ => None,
    };

    // Directory operations.
    let dir_ops: Vec<(usize, bool)> = ops
        .iter()
        .enumerate()
        .filter_map(|(i, o)| o.dir_parent().map(|p| (i, durable(i, p))))
        .collect();
    let keep: Vec<bool> = match (&mut rng, variant) {
        (_, Variant::Durable) => dir_ops.iter().map(|&(_, c)| c).collect(),
        (_, Variant::Everything) => vec![true; dir_ops.len()],
        (Some(rng), _) => {
            if rng.chance(1, 2) {
                // In order: a suffix of the directory operations after the last durable
                // one is lost.
                let lo = dir_ops.iter().rposition(|&(_, c)| c).map_or(0, |p| p + 1);
                let cut = lo + rng.below((dir_ops.len() - lo + 1) as u64) as usize;
                (0..dir_ops.len())
                    .map(|p| dir_ops[p].1 || p < cut)
                    .collect()
            } else {
                dir_ops
                    .iter()
                    .map(|&(_, c)| c || rng.chance(1, 2))
                    .collect()
            }
        }
        (None, Variant::Random(_)) => unreachable!("a random variant has a generator"),
    };
    let mut m = log.base.clone();
    for (&(i, _), k) in dir_ops.iter().zip(keep) {
        if k {
            m.apply_dir_op(&ops[i]);
        }
    }

    // File data and sizes.
    let mut by_file: BTreeMap<Id, Vec<usize>> = BTreeMap::new();
    for (i, o) in ops.iter().enumerate() {
        if let Some(id) = o.data_target() {
            by_file.entry(id).or_default().push(i);
        }
    }
    for (id, idx) in by_file {
        let mut content = log.base.files.get(&id).cloned().unwrap_or_default();
        let (synced, unsynced): (Vec<usize>, Vec<usize>) =
            idx.into_iter().partition(|&i| durable(i, id));
        // How the contents are made (see `Model::origin`): the same words, the same bytes.
        let mut origin = Digest::default();
        origin.word(synced.len() as u64);
        for &i in &synced {
            apply_data(&mut content, &ops[i]);
        }
        match (&mut rng, variant) {
            (_, Variant::Durable) => origin.word(0),
            (_, Variant::Everything) => {
                origin.word(1);
                origin.word(unsynced.len() as u64);
                for &i in &unsynced {
                    apply_data(&mut content, &ops[i]);
                }
            }
            (Some(rng), _) => {
                origin.word(2);
                let mut size = content.len() as u64;
                let cut = rng.below(unsynced.len() as u64 + 1) as usize;
                for &i in &unsynced[..cut] {
                    size = match &ops[i] {
                        Op::Write { offset, data, .. } => size.max(offset + data.len() as u64),
                        Op::Fallocate { offset, len, .. } => size.max(offset + len),
                        Op::Truncate { len, .. } => *len,
                        _ => size,
                    };
                }
                origin.word(size);
                // The pieces of unsynced writes that reach the disk, in a random order.
                let mut pieces: Vec<(u64, &[u8])> = Vec::new();
                for &i in &unsynced {
                    let Op::Write { offset, data, .. } = &ops[i] else {
                        continue;
                    };
                    match rng.below(4) {
                        0 => {}
                        1 | 2 => pieces.push((*offset, data)),
                        _ => {
                            let end = offset + data.len() as u64;
                            let mut at = *offset;
                            while at < end {
                                let next = ((at / BLOCK) + 1) * BLOCK;
                                let piece_end = next.min(end);
                                if rng.chance(1, 2) {
                                    let s = (at - offset) as usize;
                                    let e = (piece_end - offset) as usize;
                                    pieces.push((at, &data[s..e]));
                                }
                                at = piece_end;
                            }
                        }
                    }
                }
                for j in (1..pieces.len()).rev() {
                    pieces.swap(j, rng.below(j as u64 + 1) as usize);
                }
                for (offset, data) in pieces {
                    // A piece is named by where its bytes are: (address, offset, length).
                    origin.word(data.as_ptr() as u64);
                    origin.word(offset);
                    origin.word(data.len() as u64);
                    write_at(&mut content, offset, data);
                }
                set_len(&mut content, size as usize);
            }
            (None, Variant::Random(_)) => unreachable!("a random variant has a generator"),
        }
        m.files.insert(id, content);
        m.origin.insert(id, origin.finish());
    }
    m
}

/// `content.resize(len, 0)`, fast in a debug build too (a zeroed allocation and one copy,
/// where `resize` fills byte by byte).
fn set_len(content: &mut Vec<u8>, len: usize) {
    if len <= content.len() {
        content.truncate(len);
    } else {
        let mut grown = vec![0u8; len];
        grown[..content.len()].copy_from_slice(content);
        *content = grown;
    }
}

fn write_at(content: &mut Vec<u8>, offset: u64, data: &[u8]) {
    let end = offset as usize + data.len();
    if content.len() < end {
        set_len(content, end);
    }
    content[offset as usize..end].copy_from_slice(data);
}

fn apply_data(content: &mut Vec<u8>, op: &Op) {
    match op {
        Op::Write { offset, data, .. } => write_at(content, *offset, data),
        Op::Truncate { len, .. } => set_len(content, *len as usize),
        Op::Fallocate { offset, len, .. } => {
            let end = (offset + len) as usize;
            if content.len() < end {
                set_len(content, end);
            }
        }
        _ => {}
    }
}

/// The crash states to check for a log: every crash point `0..=ops.len()`, each in
/// [`Variant::Durable`], [`Variant::Everything`] and `random` [`Variant::Random`]s whose
/// seeds derive from `seed`.
pub fn plan(log: &Log, seed: u64, random: usize) -> Vec<(usize, Variant)> {
    let mut rng = Rng::new(seed);
    let mut out = Vec::new();
    for point in 0..=log.ops.len() {
        out.push((point, Variant::Durable));
        out.push((point, Variant::Everything));
        for _ in 0..random {
            out.push((point, Variant::Random(rng.next_u64())));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// root/a.partial/f written, synced, renamed to root/a; the root never fsynced.
    fn log() -> Log {
        let mut base = Model::default();
        base.dirs.insert(0, BTreeMap::new());
        let data: Arc<[u8]> = Arc::from(vec![7u8; 3 * BLOCK as usize]);
        let ops = vec![
            Op::Mkdir {
                parent: 0,
                name: "a.partial".into(),
                id: 1,
            },
            Op::Create {
                parent: 1,
                name: "f".into(),
                id: 2,
            },
            Op::Write {
                id: 2,
                offset: 0,
                data,
            },
            Op::Fsync { id: 2 },
            Op::Fsync { id: 1 },
            Op::Rename {
                from_parent: 0,
                from: "a.partial".into(),
                to_parent: 0,
                to: "a".into(),
                id: 1,
            },
        ];
        Log { base, ops }
    }

    #[test]
    fn durable_variant_keeps_only_what_was_synced() {
        let l = log();
        // Nothing of the root was fsynced: the mkdir is lost, so nothing is reachable.
        let m = crash_state(&l, 6, Variant::Durable);
        assert_eq!(m.listing(), Vec::<String>::new());
        let m = crash_state(&l, 6, Variant::Everything);
        assert_eq!(
            m.listing(),
            vec!["a/".to_owned(), "a/f (12288 B)".to_owned()]
        );
        // Before the file's fsync, everything issued: the bytes are there.
        let m = crash_state(&l, 3, Variant::Everything);
        assert_eq!(m.files[&2], vec![7u8; 3 * BLOCK as usize]);
        let m = crash_state(&l, 3, Variant::Durable);
        assert_eq!(m.files[&2], Vec::<u8>::new());
    }

    #[test]
    fn random_variants_tear_writes_at_block_boundaries_only() {
        let l = log();
        let mut seen = std::collections::BTreeSet::new();
        for seed in 0..200 {
            let m = crash_state(&l, 3, Variant::Random(seed));
            let f = m.files.get(&2).cloned().unwrap_or_default();
            assert!(f.is_empty() || f.len() == 3 * BLOCK as usize, "{}", f.len());
            let blocks: Vec<u8> = f
                .chunks(BLOCK as usize)
                .map(|b| {
                    assert!(b.iter().all(|&x| x == b[0]), "a block is never torn inside");
                    b[0]
                })
                .collect();
            seen.insert(blocks);
        }
        // Lost, whole, and torn in the middle all occur.
        assert!(seen.contains(&vec![]));
        assert!(seen.contains(&vec![7, 7, 7]));
        assert!(seen.contains(&vec![7, 0, 7]));
        // Reproducible from the seed.
        assert_eq!(
            crash_state(&l, 6, Variant::Random(42)),
            crash_state(&l, 6, Variant::Random(42))
        );
    }
}
