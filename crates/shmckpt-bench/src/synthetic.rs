//! Deterministic synthetic tensors for the demo, benchmarks and tests.
//!
//! Content: tensor `k` of a state holds the little-endian `u64` words
//! `splitmix64(seed_word(k) + j)` for `j = 0, 1, ...`, truncated to its length, where
//! `seed_word(k) = (0x5348_4D43_4B50_5400 + seed) ^ (k << 32)`. The same formula is
//! implemented in `benches/anchors/anchors.py`, so other tools can check the bytes.

use serde::{Deserialize, Serialize};

use shmckpt::Dtype;

/// The splitmix64 finalizer (Steele, Lea, Flood 2014).
pub const fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// First word of tensor `k`'s stream.
pub const fn seed_word(k: u64, seed: u64) -> u64 {
    (0x5348_4D43_4B50_5400u64.wrapping_add(seed)) ^ (k << 32)
}

/// Fill `out` with the bytes of tensor `k` starting at byte `at` (a multiple of 8).
pub fn fill(out: &mut [u8], k: u64, seed: u64, at: u64) {
    debug_assert_eq!(at % 8, 0);
    let base = seed_word(k, seed).wrapping_add(at / 8);
    let mut words = out.chunks_exact_mut(8);
    let mut j = 0u64;
    for w in &mut words {
        w.copy_from_slice(&splitmix64(base.wrapping_add(j)).to_le_bytes());
        j += 1;
    }
    let rest = words.into_remainder();
    if !rest.is_empty() {
        let last = splitmix64(base.wrapping_add(j)).to_le_bytes();
        let n = rest.len();
        rest.copy_from_slice(&last[..n]);
    }
}

/// Fill `out` with tensor `k`'s bytes using up to `threads` threads.
pub fn fill_parallel(out: &mut [u8], k: u64, seed: u64, threads: usize) {
    const SPLIT: usize = 8 << 20;
    if threads <= 1 || out.len() < 2 * SPLIT {
        return fill(out, k, seed, 0);
    }
    let per = out.len().div_ceil(threads).next_multiple_of(8);
    std::thread::scope(|s| {
        for (i, part) in out.chunks_mut(per).enumerate() {
            s.spawn(move || fill(part, k, seed, (i * per) as u64));
        }
    });
}

/// One tensor of a synthetic state (no data).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayoutEntry {
    /// Name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
}

impl LayoutEntry {
    /// Byte length (0 when the shape is invalid for the dtype).
    pub fn len(&self) -> u64 {
        self.dtype.byte_len(&self.shape).unwrap_or(0)
    }

    /// True for zero-size tensors.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// `n` tensors of `dtype` splitting `total` bytes as evenly as whole elements allow.
pub fn uniform(total: u64, n: usize, dtype: Dtype) -> Vec<LayoutEntry> {
    let n = n.max(1);
    let esz = dtype.alignment();
    let per = (total / n as u64 / esz).max(1);
    (0..n)
        .map(|i| LayoutEntry {
            name: format!("layers.{i}.weight"),
            dtype,
            shape: vec![per as usize],
        })
        .collect()
}

/// The mixed state of the anchors benchmark: `n` tensors whose sizes follow
/// `w_i = 1 + (i * 2654435761) mod 97` and whose dtypes cycle through
/// BF16 F32 F16 BF16 I64 U8 F32 BF16, totalling about `total` bytes.
pub fn mixed(total: u64, n: usize) -> Vec<LayoutEntry> {
    const CYCLE: [Dtype; 8] = [
        Dtype::BF16,
        Dtype::F32,
        Dtype::F16,
        Dtype::BF16,
        Dtype::I64,
        Dtype::U8,
        Dtype::F32,
        Dtype::BF16,
    ];
    let w: Vec<u64> = (0..n as u64)
        .map(|i| 1 + (i * 2_654_435_761) % 97)
        .collect();
    let sum: u64 = w.iter().sum();
    (0..n)
        .map(|i| {
            let dtype = CYCLE[i % 8];
            let elems = (total as u128 * w[i] as u128 / sum as u128) as u64 / dtype.alignment();
            LayoutEntry {
                name: format!("layers.{i}.weight"),
                dtype,
                shape: vec![elems as usize],
            }
        })
        .collect()
}

/// The demo's model state: about 1 GiB in a few hundred tensors of mixed dtypes and
/// shapes, shaped like a small transformer with its optimizer bookkeeping.
pub fn demo_model() -> Vec<LayoutEntry> {
    let (hidden, ffn, vocab, layers) = (1024usize, 4096usize, 32_768usize, 26usize);
    let mut v = Vec::new();
    let mut push =
        |name: String, dtype: Dtype, shape: Vec<usize>| v.push(LayoutEntry { name, dtype, shape });
    push("embed.weight".into(), Dtype::BF16, vec![vocab, hidden]);
    for l in 0..layers {
        let p = format!("layers.{l}");
        for w in ["q", "k", "v", "o"] {
            push(
                format!("{p}.attn.{w}.weight"),
                Dtype::BF16,
                vec![hidden, hidden],
            );
        }
        push(
            format!("{p}.mlp.gate.weight"),
            Dtype::BF16,
            vec![ffn, hidden],
        );
        push(format!("{p}.mlp.up.weight"), Dtype::BF16, vec![ffn, hidden]);
        push(
            format!("{p}.mlp.down.weight"),
            Dtype::BF16,
            vec![hidden, ffn],
        );
        push(format!("{p}.attn_norm.weight"), Dtype::F32, vec![hidden]);
        push(format!("{p}.mlp_norm.weight"), Dtype::F32, vec![hidden]);
        push(format!("{p}.attn.q.scale"), Dtype::F8_E4M3, vec![hidden]);
        push(format!("{p}.attn.rotary.inv_freq"), Dtype::F64, vec![64]);
        push(format!("{p}.attn.mask_cache"), Dtype::BOOL, vec![7, 13]);
    }
    push("norm.weight".into(), Dtype::F32, vec![hidden]);
    push("lm_head.weight".into(), Dtype::F16, vec![vocab, hidden]);
    push("optimizer.step".into(), Dtype::I64, vec![]);
    push("optimizer.loss_scale".into(), Dtype::F32, vec![]);
    push("rng.state".into(), Dtype::U8, vec![5056]);
    push("tokens_seen".into(), Dtype::U64, vec![]);
    push("data.cursor".into(), Dtype::I32, vec![3]);
    push("empty.buffer".into(), Dtype::F32, vec![0, 16]);
    v
}

/// Host buffers holding `layout`'s deterministic content.
pub fn materialize(layout: &[LayoutEntry], seed: u64, threads: usize) -> Vec<Vec<u8>> {
    layout
        .iter()
        .enumerate()
        .map(|(k, e)| {
            let mut b = vec![0u8; e.len() as usize];
            fill_parallel(&mut b, k as u64, seed, threads);
            b
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_matches_reference_values() {
        assert_eq!(splitmix64(0), 0xE220_A839_7B1D_CDAF);
        assert_eq!(splitmix64(1), 0x910A_2DEC_8902_5CC1);
    }

    #[test]
    fn fill_is_position_independent() {
        let mut whole = vec![0u8; 1000];
        fill(&mut whole, 3, 9, 0);
        let mut tail = vec![0u8; 1000 - 64];
        fill(&mut tail, 3, 9, 64);
        assert_eq!(&whole[64..], &tail[..]);
        let mut par = vec![0u8; 40 << 20];
        fill_parallel(&mut par, 5, 1, 3);
        let mut seq = vec![0u8; 40 << 20];
        fill(&mut seq, 5, 1, 0);
        assert!(par == seq);
    }

    #[test]
    fn demo_model_is_about_a_gibibyte_of_hundreds_of_tensors() {
        let m = demo_model();
        let bytes: u64 = m.iter().map(LayoutEntry::len).sum();
        assert!((200..=400).contains(&m.len()), "{}", m.len());
        assert!((900 << 20..=1200 << 20).contains(&bytes), "{bytes}");
        let mixed = mixed(1 << 30, 1000);
        let total: u64 = mixed.iter().map(LayoutEntry::len).sum();
        assert!(total <= 1 << 30 && total > (1 << 30) - (1 << 20));
    }
}
