//! The opt-in device snapshot of a save still copying when its caller needs its tensors
//! back ([`crate::SaveOptions::snapshot_on_request`]).
//!
//! A non-blocking save of device tensors queues its device-to-host copies a bounded amount
//! ahead (`LOOKAHEAD_BYTES`) instead of all at once, and allocates, when it starts, a
//! transient device buffer for all of its device bytes. When the caller asks for a
//! snapshot (`SaveHandle::request_snapshot`, e.g. before an optimizer step that overwrites
//! the tensors), the staging thread copies every device byte it has not queued yet into
//! the buffer (`cuMemcpyDtoDAsync`, at device-memory speed), publishes the event after
//! those copies as the point from which the caller's tensors are no longer read, and
//! copies the rest to the host from the buffer. The buffer comes from a memory pool of the
//! engine's own (outside any framework's caching allocator), allocated and freed in the
//! order of the copy stream, and the pool is trimmed to zero as soon as its copies
//! completed, so the memory goes back to the device.
//!
//! This file holds the safe part: the request flag, and the layout of the remaining
//! bytes in the buffers (one per device). The copies are in `pipeline.rs`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::error::{Error, Result};

/// Device copies a snapshot-mode save keeps queued ahead of completion: what a snapshot
/// request still waits for (about 5 ms at 55 GB/s), besides the device-to-device copy.
pub(crate) const LOOKAHEAD_BYTES: u64 = 256 << 20;

/// Alignment of each tensor's range inside a snapshot buffer.
pub(crate) const ALIGN: u64 = 256;

/// A save's snapshot request and what it cost.
#[derive(Debug, Default)]
pub struct SnapshotRequest {
    requested: AtomicBool,
    bytes: AtomicU64,
    batched: AtomicBool,
}

impl SnapshotRequest {
    /// Ask the staging thread for a snapshot (idempotent).
    pub fn request(&self) {
        self.requested.store(true, Ordering::Release);
    }

    /// Whether a snapshot was asked for.
    pub fn is_requested(&self) -> bool {
        self.requested.load(Ordering::Acquire)
    }

    /// Device bytes the snapshot allocated (its peak: one snapshot per save); 0 when none
    /// was taken.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Acquire)
    }

    pub(crate) fn set_bytes(&self, n: u64) {
        self.bytes.store(n, Ordering::Release);
    }

    /// Whether the snapshot queued its device-to-device copies in one driver call per
    /// device (`cuMemcpyBatchAsync`), not one per tensor; `false` when none was taken.
    pub fn batched(&self) -> bool {
        self.batched.load(Ordering::Acquire)
    }

    pub(crate) fn set_batched(&self, b: bool) {
        self.batched.store(b, Ordering::Release);
    }
}

/// Where one input's remaining bytes live in its device's snapshot buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Placed {
    /// The device (and buffer).
    pub(crate) device: i32,
    /// Offset of byte `from` of the input in the buffer.
    pub(crate) offset: u64,
    /// First byte of the input held.
    pub(crate) from: u64,
    /// One past the last byte held.
    pub(crate) end: u64,
}

/// The snapshot's layout: per input, its range and place; per device, the buffer's size.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Layout {
    pub(crate) inputs: BTreeMap<usize, Placed>,
    pub(crate) totals: BTreeMap<i32, u64>,
}

fn overflow() -> Error {
    Error::Internal("snapshot layout overflows u64".into())
}

impl Layout {
    /// Lay out `pieces`, `(input, device, at, len)` of every device piece not yet queued:
    /// each input's bytes from its lowest `at` to its highest end, inputs one after the
    /// other in each device's buffer, each at a multiple of [`ALIGN`].
    pub(crate) fn new(pieces: impl IntoIterator<Item = (usize, i32, u64, u64)>) -> Result<Layout> {
        let mut ranges: BTreeMap<usize, (i32, u64, u64)> = BTreeMap::new();
        for (input, device, at, len) in pieces {
            if len == 0 {
                continue;
            }
            let end = at.checked_add(len).ok_or_else(overflow)?;
            let r = ranges.entry(input).or_insert((device, at, end));
            if r.0 != device {
                return Err(Error::Internal(format!(
                    "snapshot: input {input} on devices {} and {device}",
                    r.0
                )));
            }
            r.1 = r.1.min(at);
            r.2 = r.2.max(end);
        }
        let mut l = Layout::default();
        for (input, (device, from, end)) in ranges {
            let total = l.totals.entry(device).or_insert(0);
            let offset = *total;
            let next = offset.checked_add(end - from).ok_or_else(overflow)?;
            *total = next.checked_next_multiple_of(ALIGN).ok_or_else(overflow)?;
            l.inputs.insert(
                input,
                Placed {
                    device,
                    offset,
                    from,
                    end,
                },
            );
        }
        Ok(l)
    }

    /// Bytes of all buffers.
    pub(crate) fn bytes(&self) -> u64 {
        self.totals.values().sum()
    }

    /// Device and buffer offset of `len` bytes at `at` of `input`, when the snapshot holds
    /// all of them.
    pub(crate) fn locate(&self, input: usize, at: u64, len: u64) -> Option<(i32, u64)> {
        let p = self.inputs.get(&input)?;
        let end = at.checked_add(len)?;
        (at >= p.from && end <= p.end).then(|| (p.device, p.offset + (at - p.from)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_takes_each_inputs_remaining_range_aligned_per_device() {
        // input 0: its tail from byte 100 (two pieces); input 1: whole, 300 bytes on
        // device 0; input 2: 10 bytes on device 1; an empty piece is ignored.
        let l = Layout::new([
            (0, 0, 100, 50),
            (0, 0, 150, 1000),
            (1, 0, 0, 300),
            (2, 1, 0, 10),
            (3, 1, 0, 0),
        ])
        .unwrap();
        assert_eq!(
            l.inputs[&0],
            Placed {
                device: 0,
                offset: 0,
                from: 100,
                end: 1150
            }
        );
        assert_eq!(
            l.inputs[&1],
            Placed {
                device: 0,
                offset: 1280,
                from: 0,
                end: 300
            }
        );
        assert_eq!(
            l.inputs[&2],
            Placed {
                device: 1,
                offset: 0,
                from: 0,
                end: 10
            }
        );
        assert!(!l.inputs.contains_key(&3));
        assert_eq!(l.totals, BTreeMap::from([(0, 1280 + 512), (1, 256)]));
        assert_eq!(l.bytes(), 2048);
        assert_eq!(l.locate(0, 100, 50), Some((0, 0)));
        assert_eq!(l.locate(0, 150, 1000), Some((0, 50)));
        assert_eq!(l.locate(1, 10, 20), Some((0, 1290)));
        // Bytes the snapshot does not hold: before its range, past it, another input.
        assert_eq!(l.locate(0, 0, 100), None);
        assert_eq!(l.locate(0, 1100, 51), None);
        assert_eq!(l.locate(3, 0, 1), None);
        assert_eq!(l.locate(0, u64::MAX, 2), None);
    }

    #[test]
    fn layout_refuses_overflow_and_an_input_on_two_devices() {
        assert!(matches!(
            Layout::new([(0, 0, u64::MAX, 1)]),
            Err(Error::Internal(_))
        ));
        assert!(matches!(
            Layout::new([(0, 0, 0, 8), (0, 1, 8, 8)]),
            Err(Error::Internal(_))
        ));
        assert!(matches!(
            Layout::new([(0, 0, 0, u64::MAX - 10), (1, 0, 0, 100)]),
            Err(Error::Internal(_))
        ));
        assert_eq!(Layout::new([]).unwrap(), Layout::default());
    }

    #[test]
    fn a_request_is_sticky_and_bytes_start_at_zero() {
        let r = SnapshotRequest::default();
        assert!(!r.is_requested());
        assert_eq!(r.bytes(), 0);
        assert!(!r.batched());
        r.request();
        r.request();
        assert!(r.is_requested());
        r.set_bytes(4096);
        assert_eq!(r.bytes(), 4096);
    }
}
