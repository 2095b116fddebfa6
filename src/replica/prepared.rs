//! A replica arena made before its step is committed ([`PreparedArena`]), received into
//! by [`super::Incoming::replica_prepared`].

use std::os::fd::AsFd;
use std::path::Path;

use super::{REPLICA_PREFIX, euid, tag_of};
use crate::error::{Error, Result};
use crate::fsx::{self, Create};
use crate::staging::shm::SHM_MOUNT;

/// A replica arena made before its step is committed, sized by a guess (the source's last
/// image): the slow part of receiving a replica, allocating its pages, then runs while the
/// step's save still drains, not after it. A new regular file of this user in `/dev/shm`
/// under the step's temporary replica name (`<replica name>.tmp<pid>`, created without
/// following a link, never over an existing file), allocated up front (a full `/dev/shm`
/// is an error here, never a `SIGBUS` later), never listed or served; removed when dropped
/// unused. [`super::Incoming::replica_prepared`] receives into it.
#[derive(Debug)]
pub struct PreparedArena {
    pub(super) file: std::fs::File,
    pub(super) tmp: String,
    pub(super) name: String,
    pub(super) tag: String,
    pub(super) step: u64,
    pub(super) rank: u32,
    pub(super) len: usize,
    /// Handed to an [`Incoming`] (which removes the file from then on).
    taken: bool,
}

impl PreparedArena {
    /// An arena of `len` bytes (at least 1) for `rank`'s image of `step` of `root`.
    pub fn new(root: &Path, step: u64, rank: u32, len: usize) -> Result<PreparedArena> {
        if len == 0 {
            return Err(Error::Config("a replica arena of 0 bytes".into()));
        }
        let tag = tag_of(root)?;
        let name = format!("{REPLICA_PREFIX}{tag}.r{rank}.s{step}");
        let tmp = format!("{name}.tmp{}", std::process::id());
        let dir = Path::new(SHM_MOUNT);
        let dfd = fsx::open_dir(dir)?;
        // A temporary file of this process under that name is a leftover of an earlier
        // receive that did not finish (this process maps one at a time per name).
        fsx::unlink_in(dfd.as_fd(), dir, &tmp)?;
        let file = fsx::open_file(dfd.as_fd(), dir, &tmp, true, Create::New, Some(euid()))?;
        let prep = PreparedArena {
            file,
            tmp,
            name,
            tag,
            step,
            rank,
            len,
            taken: false,
        };
        prep.allocate(&dir.join(&prep.tmp))?; // dropped (removed) on failure
        Ok(prep)
    }

    /// The step it was made for.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The source rank it was made for.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never: an arena has at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(super) fn allocate(&self, path: &Path) -> Result<()> {
        rustix::fs::fallocate(
            &self.file,
            rustix::fs::FallocateFlags::empty(),
            0,
            self.len as u64,
        )
        .map_err(|e| Error::io("fallocate", path, e.into()))
    }

    /// Its names, handed over with the file (no longer removed by this value's drop).
    pub(super) fn take(&mut self) -> (String, String, String) {
        self.taken = true;
        (
            std::mem::take(&mut self.tmp),
            std::mem::take(&mut self.name),
            std::mem::take(&mut self.tag),
        )
    }
}

impl Drop for PreparedArena {
    fn drop(&mut self) {
        if !self.taken
            && let Err(e) = remove_tmp(&self.tmp)
        {
            tracing::warn!(file = %self.tmp, error = %e, "could not remove an unused replica arena");
        }
    }
}

/// Remove this process's temporary replica file `tmp` from `/dev/shm`.
pub(super) fn remove_tmp(tmp: &str) -> Result<()> {
    let dir = Path::new(SHM_MOUNT);
    let dfd = fsx::open_dir(dir)?;
    fsx::unlink_in(dfd.as_fd(), dir, tmp)
}
