//! The bucket's device loads: the bodies of ranged GETs (memory the device cannot copy
//! from at the pinned rate) forwarded to device memory through two CUDA-registered
//! buffers of the engine's [`DeviceRing`] ([`Staged`], [`DeviceRing::staged_sink`]).
#![allow(unsafe_code)]

use crate::error::{Error, Result};
use crate::manifest::FileEntry;
use crate::restore::sink::DeviceSink;
use crate::restore::{DeviceRing, ReadSink};
use crate::tensor::DeviceSlice;

/// Forwards bytes that arrive in memory the device cannot copy from at the pinned rate
/// (HTTP bodies of ranged GETs) through two leased chunks of a staging arena (registered
/// with CUDA when `inner` is a [`DeviceSink`]): each piece is copied into the chunk being
/// filled; a full chunk is handed to `inner` (asynchronous copies for a device) and the
/// other chunk is filled meanwhile; a chunk is filled again only after `inner.chunk_end()`
/// (the stream synchronized). The load holds at most two chunks of staging, never a host
/// copy of the whole file. [`Staged::finish`] hands over the last chunk and waits; a
/// `Staged` dropped with copies in flight waits for them (and leaks its chunks if that
/// fails, so that their memory is never reused under a running copy).
pub(crate) struct Staged<S: ReadSink> {
    inner: S,
    chunks: Vec<crate::staging::ChunkLease>,
    cur: usize,
    fill: usize,
    /// Pieces in the chunk being filled: (tensor, offset in the tensor, offset in the
    /// chunk, length).
    pending: Vec<(usize, u64, usize, usize)>,
    /// The other chunk was handed to `inner` and `inner.chunk_end()` was not called since.
    in_flight: bool,
    forwarded: u64,
}

impl<S: ReadSink> Staged<S> {
    /// Stage through `chunks` (two leases of one arena, each at least one byte).
    pub(crate) fn new(inner: S, chunks: [crate::staging::ChunkLease; 2]) -> Result<Staged<S>> {
        if chunks.iter().any(|c| c.is_empty()) {
            return Err(Error::Config("staging chunks must not be empty".into()));
        }
        Ok(Staged {
            inner,
            chunks: chunks.into(),
            cur: 0,
            fill: 0,
            pending: Vec::new(),
            in_flight: false,
            forwarded: 0,
        })
    }

    /// Bytes handed to `inner` so far (every one from a staging chunk).
    pub(crate) fn forwarded(&self) -> u64 {
        self.forwarded
    }

    /// Staging memory this sink holds (its two chunks).
    pub(crate) fn staging_bytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.len() as u64).sum()
    }

    /// Hand the chunk being filled to `inner` (after the other chunk's use finished) and
    /// switch to the other chunk.
    fn flush(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        if self.in_flight {
            self.inner.chunk_end()?;
            self.in_flight = false;
        }
        let chunk = self.chunks[self.cur].as_slice();
        // From here until `inner.chunk_end()` returns, `chunk` may be read by copies in
        // flight: it is not written before the next flush's `chunk_end`.
        self.in_flight = true;
        for &(t, at, off, len) in &self.pending {
            // `off + len <= fill <= chunk.len()`: recorded by `piece`.
            self.inner.piece(t, at, &chunk[off..off + len])?;
            self.forwarded += len as u64;
        }
        self.pending.clear();
        self.cur ^= 1;
        self.fill = 0;
        Ok(())
    }

    /// Hand the last chunk to `inner` and wait until every use of the chunks finished.
    pub(crate) fn finish(&mut self) -> Result<()> {
        self.flush()?;
        self.inner.chunk_end()?;
        self.in_flight = false;
        Ok(())
    }
}

impl<S: ReadSink> ReadSink for Staged<S> {
    fn piece(&mut self, tensor: usize, at: u64, bytes: &[u8]) -> Result<()> {
        let mut done = 0usize;
        while done < bytes.len() {
            let cap = self.chunks[self.cur].len();
            if self.fill == cap {
                self.flush()?;
            }
            let n = (cap - self.fill).min(bytes.len() - done);
            let fill = self.fill;
            self.chunks[self.cur].as_mut_slice()[fill..fill + n]
                .copy_from_slice(&bytes[done..done + n]);
            let at = at
                .checked_add(done as u64)
                .ok_or_else(|| Error::Destination {
                    name: format!("#{tensor}"),
                    reason: "offset overflows".into(),
                })?;
            match self.pending.last_mut() {
                // Continues the previous piece (same tensor, adjacent in both): one copy.
                Some((t, a, o, l))
                    if *t == tensor && a.checked_add(*l as u64) == Some(at) && *o + *l == fill =>
                {
                    *l += n
                }
                _ => self.pending.push((tensor, at, fill, n)),
            }
            self.fill += n;
            done += n;
        }
        Ok(())
    }

    // The caller's bytes were copied into a chunk before `piece` returned: its buffers
    // may be reused at once.
}

impl<S: ReadSink> Drop for Staged<S> {
    fn drop(&mut self) {
        if self.in_flight && self.inner.chunk_end().is_err() {
            // Copies may still read the chunks: never give their memory back.
            std::mem::forget(std::mem::take(&mut self.chunks));
        }
    }
}

impl DeviceRing {
    /// A sink for bytes that arrive in memory of any kind (the bodies of ranged GETs):
    /// tensor `i` (file order) goes to `dest[i]` (exactly its size), each piece copied
    /// into one of two of the ring's CUDA-registered buffers and sent to the device from
    /// there ([`Staged`]: one buffer is filled while the other one's copies run). The
    /// ring serves no other load until the sink is dropped; call [`Staged::finish`] on
    /// [`RingSink::sink`] once every byte was given.
    ///
    /// # Safety
    /// Every destination must be device memory of its device, valid for writes of its
    /// length, and not accessed by anyone else until the returned sink is dropped.
    pub(crate) unsafe fn staged_sink(
        &self,
        entry: &FileEntry,
        dest: Vec<Option<DeviceSlice<'_>>>,
    ) -> Result<RingSink<'_>> {
        crate::restore::device::check_device_dest(entry, &dest)?;
        let busy = crate::util::lock(&self.busy);
        // SAFETY: forwarded from this function's contract (the sink lives no longer than
        // the returned value, which the caller keeps the destinations valid for).
        let device = unsafe { DeviceSink::new(&self.staging, dest)? };
        let arena = self.staging.arena();
        let (Some(a), Some(b)) = (arena.try_acquire(), arena.try_acquire()) else {
            return Err(Error::Config(
                "the device read buffers are in use by another load".into(),
            ));
        };
        Ok(RingSink {
            sink: Staged::new(device, [a, b])?,
            _busy: busy,
        })
    }
}

/// [`DeviceRing::staged_sink`]'s sink, holding the ring (dropped after the sink, which
/// waits for its copies).
pub(crate) struct RingSink<'r> {
    /// The sink.
    pub(crate) sink: Staged<DeviceSink>,
    _busy: std::sync::MutexGuard<'r, ()>,
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::staging::{Arena, ArenaSpec};

    /// A host stand-in for [`DeviceSink`] that holds on to every piece it is handed (as
    /// an asynchronous copy would) and checks, at each call, that no piece handed since
    /// the last `chunk_end` was overwritten; at `chunk_end` it "completes" the copies into
    /// `out` (tensor buffers, file order).
    pub(crate) struct Checked {
        pub(crate) out: Vec<Vec<u8>>,
        /// (tensor, at, source, the bytes when handed) since the last `chunk_end`.
        held: Vec<(usize, u64, *const u8, Vec<u8>)>,
        /// Source ranges ever handed (start address, length).
        pub(crate) sources: Vec<(usize, usize)>,
        pub(crate) chunk_ends: usize,
    }

    impl Checked {
        pub(crate) fn new(lens: &[usize]) -> Checked {
            Checked {
                out: lens.iter().map(|&n| vec![0xEE; n]).collect(),
                held: Vec::new(),
                sources: Vec::new(),
                chunk_ends: 0,
            }
        }

        fn check_held(&self) {
            for (t, at, p, want) in &self.held {
                // SAFETY: `p` points into a staging chunk leased by the `Staged` that
                // calls this sink and outlives it; this thread is the only one using it,
                // and no reference to that memory is alive during this read.
                let now = unsafe { std::slice::from_raw_parts(*p, want.len()) };
                assert_eq!(
                    now,
                    &want[..],
                    "tensor {t} at {at}: overwritten before chunk_end"
                );
            }
        }
    }

    impl ReadSink for Checked {
        fn piece(&mut self, tensor: usize, at: u64, bytes: &[u8]) -> Result<()> {
            self.check_held();
            self.sources.push((bytes.as_ptr() as usize, bytes.len()));
            self.held.push((tensor, at, bytes.as_ptr(), bytes.to_vec()));
            Ok(())
        }

        fn chunk_end(&mut self) -> Result<()> {
            self.check_held();
            for (t, at, _, b) in self.held.drain(..) {
                let at = at as usize;
                self.out[t][at..at + b.len()].copy_from_slice(&b);
            }
            self.chunk_ends += 1;
            Ok(())
        }
    }

    /// Two leased chunks of a fresh private arena of `chunk` bytes each.
    pub(crate) fn chunks(chunk: u64) -> [crate::staging::ChunkLease; 2] {
        let arena = Arena::create(&ArenaSpec {
            name: None,
            capacity: 2 * chunk,
            chunk_size: chunk,
            slots: 1,
            rank: 0,
            world_size: 1,
            root: std::path::PathBuf::new(),
        })
        .unwrap();
        [arena.try_acquire().unwrap(), arena.try_acquire().unwrap()]
    }

    /// Every handed source lies in one of the staging chunks.
    pub(crate) fn assert_from_chunks(c: &Checked, ranges: &[(usize, usize)]) {
        for &(p, n) in &c.sources {
            assert!(
                ranges.iter().any(|&(a, l)| p >= a && p + n <= a + l),
                "a piece of {n} bytes at {p:#x} was not handed from a staging chunk"
            );
        }
    }

    #[test]
    fn staged_pieces_reach_the_sink_from_the_chunks_exactly_and_in_order() {
        // Tensors of odd sizes, given in pieces of odd sizes, through 4 KiB chunks: pieces
        // straddle chunks, tensors straddle pieces, one tensor is empty.
        let lens = [10_000usize, 1, 0, 4096, 12_345];
        let data: Vec<Vec<u8>> = lens
            .iter()
            .enumerate()
            .map(|(t, &n)| (0..n).map(|i| (i * 31 + t * 7 + i / 251) as u8).collect())
            .collect();
        let ch = chunks(4096);
        let ranges: Vec<(usize, usize)> =
            ch.iter().map(|c| (c.as_ptr() as usize, c.len())).collect();
        let mut s = Staged::new(Checked::new(&lens), ch).unwrap();
        assert_eq!(s.staging_bytes(), 8192);
        for (t, d) in data.iter().enumerate() {
            let mut at = 0;
            for step in [1usize, 999, 5000, 3].iter().cycle() {
                if at >= d.len() {
                    break;
                }
                let n = (*step).min(d.len() - at);
                // Each piece from a buffer of its own, dropped at once (as a GET body).
                let body = d[at..at + n].to_vec();
                s.piece(t, at as u64, &body).unwrap();
                drop(body);
                s.chunk_end().unwrap();
                at += n;
            }
        }
        s.finish().unwrap();
        let total: usize = lens.iter().sum();
        assert_eq!(s.forwarded(), total as u64);
        assert_from_chunks(&s.inner, &ranges);
        assert_eq!(s.inner.out, data);
        // One chunk_end per hand-over after the first, and the last wait.
        assert_eq!(s.inner.chunk_ends, total.div_ceil(4096));
        // Adjacent pieces of one tensor go as one copy: at most two per chunk boundary
        // and tensor boundary.
        assert!(s.inner.sources.len() <= total.div_ceil(4096) + lens.len());
    }

    /// Forwards to a [`Checked`] the test keeps.
    pub(crate) struct ByRef<'a>(pub(crate) &'a mut Checked);

    impl ReadSink for ByRef<'_> {
        fn piece(&mut self, tensor: usize, at: u64, bytes: &[u8]) -> Result<()> {
            self.0.piece(tensor, at, bytes)
        }
        fn chunk_end(&mut self) -> Result<()> {
            self.0.chunk_end()
        }
    }

    #[test]
    fn a_staged_sink_dropped_mid_load_waits_for_its_copies() {
        let mut c = Checked::new(&[9000]);
        let mut s = Staged::new(ByRef(&mut c), chunks(4096)).unwrap();
        // One chunk handed over (its copy "in flight"), 904 bytes pending in the other.
        s.piece(0, 0, &[7u8; 5000]).unwrap();
        assert!(s.in_flight);
        drop(s);
        // The drop waited (chunk_end) for the handed chunk; the pending bytes were never
        // handed over.
        assert_eq!(c.chunk_ends, 1);
        assert_eq!(&c.out[0][..4096], &[7u8; 4096][..]);
        assert_eq!(&c.out[0][4096..], &[0xEE; 9000 - 4096][..]);
    }

    #[test]
    fn staged_needs_non_empty_chunks_and_finish_without_pieces_is_a_wait() {
        let mut c = Checked::new(&[0]);
        let mut s = Staged::new(ByRef(&mut c), chunks(4096)).unwrap();
        s.piece(0, 0, &[]).unwrap();
        s.finish().unwrap();
        assert_eq!(s.forwarded(), 0);
        drop(s);
        assert_eq!(c.chunk_ends, 1);
        assert!(c.sources.is_empty());
    }
}
