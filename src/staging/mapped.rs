//! An arena's mapping with its descriptor initialised: the one place that turns the
//! segment's base address into the descriptor and chunk addresses (checked offsets).
#![allow(unsafe_code)]

use std::ptr::NonNull;

use super::descriptor::{Descriptor, Geometry};
use super::shm::Segment;
use crate::error::{Error, Result};

/// A segment whose first `geo.data_offset` bytes hold an initialised descriptor.
#[derive(Debug)]
pub struct Mapped {
    seg: Segment,
    geo: Geometry,
}

impl Mapped {
    /// Initialise the descriptor of the freshly created, zero-filled segment `seg` (not
    /// shared with anyone yet: its name is fresh, `O_EXCL`, or it is anonymous).
    pub fn init(
        seg: Segment,
        geo: Geometry,
        rank: u32,
        world_size: u32,
        root: &[u8],
    ) -> Result<Mapped> {
        Mapped::describe(seg, geo, rank, world_size, root, false)
    }

    /// Take over `seg`, a kept arena of this user whose geometry is `geo` (checked by the
    /// caller against its descriptor and size): its descriptor is zeroed and initialised
    /// anew for this engine; the data region, which holds the kept image, is left as it
    /// is. The segment's previous owner is gone: every engine using a kept arena's name
    /// holds the root and rank lock, which the caller holds; `shmckpt shm list` only reads
    /// it with `pread`.
    pub fn take_over(
        seg: Segment,
        geo: Geometry,
        rank: u32,
        world_size: u32,
        root: &[u8],
    ) -> Result<Mapped> {
        Mapped::describe(seg, geo, rank, world_size, root, true)
    }

    /// Take over `seg`, a dead engine's kept arena of this user whose geometry and root are
    /// `geo` and `root` (checked by the caller against its descriptor and size), keeping
    /// the saves in slots `keep` exactly where they are: unlike [`Mapped::take_over`]
    /// nothing is zeroed (each stays `STAGED` in the descriptor at every instant, so a
    /// crash during the take-over leaves it recoverable);
    /// the descriptor is claimed for this process (`Descriptor::claim`) and every other
    /// slot marked free. The same conditions on the previous owner as for
    /// [`Mapped::take_over`].
    pub fn take_over_keeping(
        seg: Segment,
        geo: Geometry,
        root: &[u8],
        keep: &[u32],
    ) -> Result<Mapped> {
        Mapped::check_fits(&seg, geo, root)?;
        if let Some(k) = keep.iter().find(|&&k| k >= geo.n_slots) {
            return Err(Error::Config(format!(
                "slot {k} to keep is past the arena's {} slots",
                geo.n_slots
            )));
        }
        let map = Mapped { seg, geo };
        let d = map.descriptor();
        d.claim(std::process::id());
        for s in (0..geo.n_slots).filter(|s| !keep.contains(s)) {
            d.free(s);
        }
        Ok(map)
    }

    /// That `seg` is at least `geo`'s length and `geo` was made for `root`.
    fn check_fits(seg: &Segment, geo: Geometry, root: &[u8]) -> Result<()> {
        if (seg.mapped_len() as u64) < geo.total_len || geo.root_len != root.len() as u64 {
            return Err(Error::Config(format!(
                "segment of {} bytes does not fit geometry {:?}",
                seg.mapped_len(),
                geo
            )));
        }
        Ok(())
    }

    /// Check that `seg` fits `geo` and `root`, zero its descriptor region when `zero` (a
    /// segment taken over; a new one is zero-filled already), and initialise it.
    fn describe(
        seg: Segment,
        geo: Geometry,
        rank: u32,
        world_size: u32,
        root: &[u8],
        zero: bool,
    ) -> Result<Mapped> {
        Mapped::check_fits(&seg, geo, root)?;
        if zero {
            // SAFETY: `data_offset <= total_len <= mapped_len` (checked above, and by
            // `Geometry`); the mapping is writable and stays alive for this call.
            unsafe { std::ptr::write_bytes(seg.as_ptr(), 0, geo.data_offset as usize) };
        }
        // SAFETY: the segment is page aligned, writable and at least `geo.total_len` bytes
        // long (checked above); its descriptor region is zero-filled (a new segment, or
        // zeroed just above); `geo` was made for this root (checked above); nobody else
        // uses the descriptor during this call (a fresh segment, or one whose previous
        // owner is gone: `take_over`); and it stays mapped for as long as the returned
        // descriptor (dropped at once) is used.
        let _ = unsafe {
            Descriptor::init(
                seg.as_ptr(),
                geo,
                std::process::id(),
                rank,
                world_size,
                root,
            )
        };
        Ok(Mapped { seg, geo })
    }

    /// The segment.
    pub fn segment(&self) -> &Segment {
        &self.seg
    }

    /// The descriptor, borrowed from the mapping.
    pub fn descriptor(&self) -> Descriptor<'_> {
        // SAFETY: the descriptor at the start of the segment was initialised with
        // `self.geo`: by `init`/`take_over`, or, for `take_over_keeping`, by the dead engine
        // whose header the caller parsed and checked (magic, version, this geometry) before
        // mapping it; the segment stays mapped while `self` lives, which the returned value
        // borrows.
        unsafe { Descriptor::from_mapping(self.seg.as_ptr(), self.geo) }
    }

    /// The data region: first chunk's address and total data bytes.
    pub fn data_region(&self) -> (*mut u8, usize) {
        // SAFETY: data_offset < total_len <= mapping length (Geometry, checked in `init`).
        let p = unsafe { self.seg.as_ptr().add(self.geo.data_offset as usize) };
        (p, (self.geo.n_chunks * self.geo.chunk_size) as usize)
    }

    /// Address of chunk `index` (`None` when out of range).
    pub fn chunk_ptr(&self, index: u32) -> Option<NonNull<u8>> {
        if u64::from(index) >= self.geo.n_chunks {
            return None;
        }
        let (base, _) = self.data_region();
        // SAFETY: index < n_chunks, so the chunk lies inside the data region.
        NonNull::new(unsafe { base.add(index as usize * self.geo.chunk_size as usize) })
    }
}
