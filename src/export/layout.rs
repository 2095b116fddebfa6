//! Where the elements of one saved piece of a tensor (a row-major block at `offsets` of
//! `sizes` inside the global shape) go in the global tensor: a series of contiguous runs.
//! A piece sharded along its first dimension (FSDP's rows) is one run; a piece sharded
//! along a later dimension (a column of tensor parallelism) is one run per row of the
//! dimensions before it.

/// A block of a global row-major tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Block {
    /// The global shape.
    global: Vec<u64>,
    /// The block's offsets in it.
    offsets: Vec<u64>,
    /// The block's sizes.
    sizes: Vec<u64>,
    /// Elements of one contiguous run.
    run: u64,
    /// How many leading dimensions enumerate the runs.
    outer: usize,
    /// Row-major strides of the global shape, in elements.
    strides: Vec<u64>,
}

impl Block {
    /// The block at `offsets` of `sizes` in `global`; `None` when it is not inside it or the
    /// counts overflow.
    pub(crate) fn new(global: &[u64], offsets: &[u64], sizes: &[u64]) -> Option<Block> {
        let n = global.len();
        if offsets.len() != n || sizes.len() != n {
            return None;
        }
        for d in 0..n {
            if offsets[d].checked_add(sizes[d])? > global[d] {
                return None;
            }
        }
        let mut strides = vec![1u64; n];
        for d in (0..n.saturating_sub(1)).rev() {
            strides[d] = strides[d + 1].checked_mul(global[d + 1])?;
        }
        global.iter().try_fold(1u64, |a, &g| a.checked_mul(g))?;
        // The last dimension where the block is narrower than the tensor: dimensions after
        // it are whole, so a run spans it and them.
        let split = (0..n).rev().find(|&d| sizes[d] != global[d]);
        let (outer, run) = match split {
            None => (0, sizes.iter().product()),
            Some(j) => (j, sizes[j..].iter().product()),
        };
        Some(Block {
            global: global.to_vec(),
            offsets: offsets.to_vec(),
            sizes: sizes.to_vec(),
            run,
            outer,
            strides,
        })
    }

    /// Elements in the block.
    pub(crate) fn len(&self) -> u64 {
        self.sizes.iter().product()
    }

    /// Elements in the global tensor.
    pub(crate) fn global_len(&self) -> u64 {
        self.global.iter().product()
    }

    /// Whether two blocks of the same tensor share an element.
    pub(crate) fn overlaps(&self, other: &Block) -> bool {
        (0..self.sizes.len()).all(|d| {
            let (a0, a1) = (self.offsets[d], self.offsets[d] + self.sizes[d]);
            let (b0, b1) = (other.offsets[d], other.offsets[d] + other.sizes[d]);
            a0 < b1 && b0 < a1
        }) && self.len() > 0
            && other.len() > 0
    }

    /// Call `f(global_element, block_element, count)` for each contiguous run that the
    /// block's elements `[first, first + count)` fill, in order.
    pub(crate) fn runs(
        &self,
        first: u64,
        count: u64,
        mut f: impl FnMut(u64, u64, u64) -> crate::Result<()>,
    ) -> crate::Result<()> {
        let mut e = first;
        let end = first + count;
        while e < end {
            let Some(r) = e.checked_div(self.run) else {
                return Ok(());
            };
            let w = e - r * self.run;
            let m = (self.run - w).min(end - e);
            // The run's start: its index `r` over the leading dimensions' sizes.
            let mut start = 0u64;
            let mut rest = r;
            for d in (0..self.outer).rev() {
                let i = rest % self.sizes[d];
                rest /= self.sizes[d];
                start += (self.offsets[d] + i) * self.strides[d];
            }
            if self.outer < self.offsets.len() {
                start += self.offsets[self.outer] * self.strides[self.outer];
            }
            f(start + w, e, m)?;
            e += m;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every element of every block lands where a naive index computation puts it, and a
    /// set of blocks tiling the tensor fills every element exactly once.
    #[test]
    fn runs_place_every_element_like_naive_indexing() {
        let global = [4u64, 6, 5];
        // Tiles: rows split 2+2, columns 3+3, last dim 5 whole / or split 2+3.
        let mut tiles = Vec::new();
        for (r0, rs) in [(0, 2), (2, 2)] {
            for (c0, cs) in [(0, 3), (3, 3)] {
                for (k0, ks) in [(0, 2), (2, 3)] {
                    tiles.push(([r0, c0, k0], [rs, cs, ks]));
                }
            }
        }
        let mut hit = vec![0u32; 120];
        for (o, s) in &tiles {
            let b = Block::new(&global, o, s).unwrap();
            let mut placed = vec![u64::MAX; b.len() as usize];
            // In two uneven spans, as pieces of a read arrive.
            let cut = b.len() / 3;
            for (first, count) in [(0, cut), (cut, b.len() - cut)] {
                b.runs(first, count, |g, e, m| {
                    for k in 0..m {
                        placed[(e + k) as usize] = g + k;
                    }
                    Ok(())
                })
                .unwrap();
            }
            let mut i = 0;
            for a in 0..s[0] {
                for c in 0..s[1] {
                    for k in 0..s[2] {
                        let want = ((o[0] + a) * 6 + (o[1] + c)) * 5 + (o[2] + k);
                        assert_eq!(placed[i], want);
                        hit[want as usize] += 1;
                        i += 1;
                    }
                }
            }
        }
        assert!(hit.iter().all(|&h| h == 1));
    }

    #[test]
    fn row_shards_are_one_run_and_blocks_are_checked() {
        let b = Block::new(&[8, 4], &[4, 0], &[4, 4]).unwrap();
        let mut runs = Vec::new();
        b.runs(0, 16, |g, e, m| {
            runs.push((g, e, m));
            Ok(())
        })
        .unwrap();
        assert_eq!(runs, vec![(16, 0, 16)]);
        assert!(Block::new(&[8, 4], &[5, 0], &[4, 4]).is_none());
        assert!(Block::new(&[8, 4], &[0], &[4]).is_none());
        let a = Block::new(&[8, 4], &[0, 0], &[4, 4]).unwrap();
        assert!(!a.overlaps(&b));
        assert!(a.overlaps(&Block::new(&[8, 4], &[3, 3], &[2, 1]).unwrap()));
        // A scalar is one run of one element.
        let s = Block::new(&[], &[], &[]).unwrap();
        let mut n = 0;
        s.runs(0, 1, |g, e, m| {
            assert_eq!((g, e, m), (0, 0, 1));
            n += 1;
            Ok(())
        })
        .unwrap();
        assert_eq!(n, 1);
    }
}
