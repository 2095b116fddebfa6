//! Images received from a peer straight into their final memory: a replica arena in
//! `/dev/shm` ([`Incoming::replica`]) or private memory for a lost rank's restore
//! ([`Incoming::restore`]). The transport writes the bytes through [`Incoming::as_mut_ptr`];
//! then [`Incoming::seal`] makes the mapping read-only (no write through any pointer handed
//! out can follow), checks the image against the committed manifest of its step (the
//! checks of [`super::verify_image`]) and only then publishes it: the replica renamed to
//! its name in `/dev/shm`, or the rank's file written back from the memory. A failed check
//! removes it; an image that was never sealed is never listed, served or written.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use rustix::mm::{MapFlags, MprotectFlags, ProtFlags};

use super::check::ImageCheck;
use super::prepared::{PreparedArena, remove_tmp};
use super::{check_bytes, committed_entry, euid, open_sized, remove_stale, tag_of, write_atomic};
use crate::error::{Error, Result};
use crate::fsx::{self, Create};
use crate::manifest::FileEntry;
use crate::staging::shm::SHM_MOUNT;

/// Where a sealed image goes.
#[derive(Debug)]
enum Target {
    /// A replica: the temporary file `tmp` in `/dev/shm` (mapped shared), renamed to
    /// `name` once sealed; `tag` is the root's.
    Replica {
        tmp: String,
        name: String,
        tag: String,
        /// A memory-only step's replica: its entry is written beside it when sealed
        /// ([`super::memory_entry`]).
        keep_entry: bool,
    },
    /// A lost rank's image of a step not committed yet (its partial directory holds the
    /// other ranks' parts), from a partner's replica of the memory-only step: written as
    /// the rank's file in the partial directory once sealed, then committed
    /// ([`Incoming::commit_pending`]).
    Pending { world_size: u32 },
    /// A lost rank's image (private anonymous memory), written back as its file once sealed.
    Restore,
    /// A replica this rank holds, mapped read-only to be sent ([`Incoming::serve`]).
    Served,
}

/// Where an [`Incoming`] stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IncomingState {
    /// Being received: writable, not checked, not published.
    Open,
    /// Checked and published.
    Sealed,
    /// Its check (or its publication) failed: removed, never served.
    Refused,
}

/// An image being received from a peer (see the module). The mapping lives until the value
/// drops; an unsealed replica's temporary file is removed then.
#[derive(Debug)]
pub struct Incoming {
    ptr: NonNull<u8>,
    /// Bytes mapped (the image's length).
    map_len: usize,
    /// The image's length (the manifest's).
    len: usize,
    target: Target,
    state: IncomingState,
    root: PathBuf,
    step: u64,
    rank: u32,
    entry: FileEntry,
    /// A restore's file written while the image arrives ([`Incoming::received`]).
    early: Option<EarlyWrite>,
    /// Bytes `[0, frozen)` are read-only and checked as far as they go
    /// ([`Incoming::received`]).
    frozen: usize,
    /// The image's check, made as its bytes arrive.
    check: ImageCheck,
    /// A pending restore's user metadata, from its checked header once sealed.
    user_meta: Option<crate::manifest::Metadata>,
}

/// The temporary file of a restore written piece by piece as the image arrives.
#[derive(Debug)]
struct EarlyWrite {
    dir: PathBuf,
    tmp: String,
    file: std::fs::File,
    /// Bytes `[0, written)` are frozen (read-only) and written to the file.
    written: usize,
}

/// Write the mapping's bytes `[start, end)` at `ptr` to `file` at the same offsets.
/// The kernel reads the memory (no Rust reference is made).
///
/// # Safety
/// `ptr..ptr + end` must be mapped and readable for the whole call.
unsafe fn pwrite_range(
    file: &std::fs::File,
    ptr: *const u8,
    start: usize,
    end: usize,
    path: &Path,
) -> Result<()> {
    let mut at = start;
    while at < end {
        let want = (end - at).min(1 << 30);
        // SAFETY: `at + want <= end`: readable memory by this function's contract.
        let n = unsafe {
            libc::pwrite(
                std::os::fd::AsRawFd::as_raw_fd(file),
                ptr.add(at).cast::<c_void>(),
                want,
                at as libc::off_t,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::io_at("write", path, at as u64, e));
        }
        if n == 0 {
            return Err(Error::io_at(
                "write",
                path,
                at as u64,
                std::io::Error::other("wrote nothing"),
            ));
        }
        at += n as usize;
    }
    Ok(())
}

// SAFETY: `Incoming` owns its mapping; the pointer is not tied to the thread that made it,
// and Rust reads the bytes only in `seal` (`&mut self`), after the mapping is read-only.
unsafe impl Send for Incoming {}

impl Incoming {
    /// The image of `len` bytes mapped at `ptr` (the whole mapping), of rank `at.2`'s file
    /// of step `at.1` of root `at.0`, described by `entry`: every constructor's one
    /// literal.
    fn mapped(
        ptr: NonNull<u8>,
        len: usize,
        target: Target,
        state: IncomingState,
        at: (&Path, u64, u32),
        entry: FileEntry,
    ) -> Incoming {
        let (root, step, rank) = at;
        Incoming {
            ptr,
            map_len: len,
            len,
            target,
            state,
            root: root.to_owned(),
            step,
            rank,
            check: ImageCheck::new(&entry),
            entry,
            early: None,
            frozen: 0,
            user_meta: None,
        }
    }

    /// A new replica arena for `rank`'s image of the committed `step` of `root`: a new
    /// regular file of this user in `/dev/shm` (`<replica name>.tmp<pid>`, created without
    /// following a link, never over an existing file), exactly the manifest's size,
    /// allocated up front (a full `/dev/shm` is an error here, never a `SIGBUS` later) and
    /// mapped for writing. Not listed or served until [`Incoming::seal`] publishes it.
    pub fn replica(root: &Path, step: u64, rank: u32) -> Result<Incoming> {
        let (_, entry) = committed_entry(root, step, rank)?;
        let len = image_len(&entry)?;
        Incoming::receive_into(PreparedArena::new(root, step, rank, len)?, root, entry)
    }

    /// [`Incoming::replica`] into an arena made before the step was committed
    /// ([`PreparedArena::new`], allocated while the step's save was still draining): its
    /// step and rank are the arena's, its size is made the manifest's (grown and allocated,
    /// or shrunk, when the guess was wrong).
    pub fn replica_prepared(prep: PreparedArena, root: &Path) -> Result<Incoming> {
        let (_, entry) = committed_entry(root, prep.step, prep.rank)?;
        if tag_of(root)? != prep.tag {
            return Err(Error::Config(format!(
                "a replica arena made for another root than {}",
                root.display()
            )));
        }
        Incoming::receive_into(prep, root, entry)
    }

    /// A new replica arena for `rank`'s image of the memory-only `step` of `root`, which
    /// has no committed manifest yet: checked against `entry` instead, the entry its
    /// sender computed from the bytes it sends ([`super::Outgoing::memory_step`], received
    /// from the peer: its size and layout bound what is received, and the seal checks the
    /// header and every tensor's CRC-32C against it exactly as against a committed
    /// manifest). Into `prep` when given (made for this step and rank, resized to
    /// `entry`'s size). Once sealed it is a replica like any: served and loaded only once
    /// the step is committed, checked again against that manifest ([`Incoming::serve`],
    /// [`super::load`]).
    pub fn replica_of_memory_step(
        root: &Path,
        step: u64,
        rank: u32,
        entry: FileEntry,
        prep: Option<PreparedArena>,
    ) -> Result<Incoming> {
        if entry.rank != rank {
            return Err(Error::Config(format!(
                "the entry of rank {}'s image given for rank {rank}'s",
                entry.rank
            )));
        }
        let prep = match prep {
            Some(p) => {
                if tag_of(root)? != p.tag || (p.step, p.rank) != (step, rank) {
                    return Err(Error::Config(format!(
                        "a replica arena made for another root, step or rank than {}, step {step}, rank {rank}",
                        root.display()
                    )));
                }
                p
            }
            None => PreparedArena::new(root, step, rank, image_len(&entry)?)?,
        };
        let mut inc = Incoming::receive_into(prep, root, entry)?;
        if let Target::Replica { keep_entry, .. } = &mut inc.target {
            *keep_entry = true;
        }
        Ok(inc)
    }

    /// `prep` (made for `root`, its step and rank) given the size of `entry`, that rank's
    /// committed entry, and mapped to receive the image.
    fn receive_into(mut prep: PreparedArena, root: &Path, entry: FileEntry) -> Result<Incoming> {
        let (step, rank) = (prep.step, prep.rank);
        let len = image_len(&entry)?;
        let path = Path::new(SHM_MOUNT).join(&prep.tmp);
        if len != prep.len {
            rustix::fs::ftruncate(&prep.file, len as u64)
                .map_err(|e| Error::io("ftruncate", &path, e.into()))?;
            prep.len = len;
            prep.allocate(&path)?;
        }
        // SAFETY: a new shared mapping with a null hint aliases no existing memory; the
        // file is this process's new file (made by `PreparedArena::new`, held open since),
        // allocated for `len` bytes above or there.
        let raw = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &prep.file,
                0,
            )
        }
        .map_err(|e| Error::io("mmap", &path, e.into()))?;
        let ptr = NonNull::new(raw.cast::<u8>())
            .ok_or_else(|| Error::io("mmap", &path, std::io::Error::other("null")))?;
        // From here the arena's file is the `Incoming`'s (removed by its drop unless sealed).
        let (tmp, name, tag) = prep.take();
        Ok(Incoming::mapped(
            ptr,
            len,
            Target::Replica {
                tmp,
                name,
                tag,
                keep_entry: false,
            },
            IncomingState::Open,
            (root, step, rank),
            entry,
        ))
    }

    /// This user's replica of `rank`'s image of the committed `step` of `root`, to send to
    /// the rank that lost it: the regular file of this user under its name in `/dev/shm`
    /// (opened without following a link), exactly the manifest's size, mapped read-only
    /// (the mapping is shared: as a kept arena taken over, this user's file is trusted not
    /// to be truncated by another process while mapped) and checked in place against the
    /// manifest (every check of [`super::verify_image`]). Sealed already: nothing to
    /// publish, and nothing in this process can write it. An error when there is none or
    /// it does not match: a replica that fails the check is never served.
    pub fn serve(root: &Path, step: u64, rank: u32) -> Result<Incoming> {
        let (_, entry) = committed_entry(root, step, rank)?;
        Incoming::serve_against(root, step, rank, entry)
    }

    /// This user's replica of `rank`'s image of the memory-only `step` of `root`, which is
    /// not committed, to send to the rank that lost it so that the step can be committed:
    /// as [`Incoming::serve`], checked in place against the entry kept beside it
    /// ([`super::memory_entry`]: its sender's, which it was checked against when stored)
    /// instead of a committed manifest. [`Error::StepExists`] once the step is committed
    /// (then [`Incoming::serve`] checks it against that manifest).
    pub fn serve_memory(root: &Path, step: u64, rank: u32) -> Result<Incoming> {
        if root
            .join(crate::manifest::step_dir_name(step))
            .symlink_metadata()
            .is_ok()
        {
            return Err(Error::StepExists {
                step,
                root: root.to_owned(),
            });
        }
        let entry = super::memory_entry(root, step, rank)?;
        Incoming::serve_against(root, step, rank, entry)
    }

    fn serve_against(root: &Path, step: u64, rank: u32, entry: FileEntry) -> Result<Incoming> {
        let len = image_len(&entry)?;
        let name = super::replica_name(root, rank, step)?;
        let (file, path) = open_sized(Path::new(SHM_MOUNT), &name, Some(euid()), &entry)?;
        // SAFETY: a new read-only shared mapping with a null hint aliases no existing
        // memory; the file is a regular file of this user of exactly `len` bytes (checked
        // above on the open descriptor).
        let raw = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ,
                MapFlags::SHARED,
                &file,
                0,
            )
        }
        .map_err(|e| Error::io("mmap", &path, e.into()))?;
        let ptr = NonNull::new(raw.cast::<u8>())
            .ok_or_else(|| Error::io("mmap", &path, std::io::Error::other("null")))?;
        let inc = Incoming::mapped(
            ptr,
            len,
            Target::Served,
            IncomingState::Sealed,
            (root, step, rank),
            entry,
        );
        // SAFETY: the mapping is `len` bytes, read-only, alive while `inc` is; nothing in
        // this process writes it (it is mapped nowhere else writable here).
        let bytes = unsafe { std::slice::from_raw_parts(inc.ptr.as_ptr(), len) };
        check_bytes(bytes, &inc.entry, &path)?;
        Ok(inc)
    }

    /// Private memory for `rank`'s image of the committed `step` of `root`, received from a
    /// partner to restore a lost rank: [`Incoming::seal`] checks it and writes it back as
    /// the rank's file; the memory then belongs to its holder (the load can serve the
    /// tensors from it).
    pub fn restore(root: &Path, step: u64, rank: u32) -> Result<Incoming> {
        let (_, entry) = committed_entry(root, step, rank)?;
        let len = image_len(&entry)?;
        let ptr = super::anonymous_map(len)?;
        Ok(Incoming::mapped(
            ptr,
            len,
            Target::Restore,
            IncomingState::Open,
            (root, step, rank),
            entry,
        ))
    }

    /// Private memory for `rank`'s image of `step` of `root`, a step not committed yet
    /// whose partial directory holds the other ranks' parts (recovered from their arenas),
    /// received from a partner's replica of the memory-only step to complete its commit.
    /// `entry` is the partner's entry of it ([`super::memory_entry`], sent with the
    /// offer: not trusted, it must be `rank`'s, of its file name in a world of
    /// `world_size`, and pass every manifest entry's checks). [`Incoming::seal`] checks the
    /// image against it (size, header, every CRC-32C) and against the header's own
    /// metadata (this step, rank and world size), then writes it durably as the rank's
    /// file in the partial directory; [`Incoming::commit_pending`] then writes its part
    /// and commits the step with the one commit protocol.
    pub fn restore_pending(
        root: &Path,
        step: u64,
        rank: u32,
        world_size: u32,
        entry: FileEntry,
    ) -> Result<Incoming> {
        let what = PathBuf::from(format!("<entry of rank {rank}, step {step} from a peer>"));
        super::check_pending_entry(&entry, rank, &what)?;
        if rank >= world_size || entry.file != crate::manifest::rank_file_name(rank, world_size) {
            return Err(Error::corrupt(
                &what,
                None,
                format!(
                    "names file {:?}, not rank {rank} of {world_size}'s",
                    entry.file
                ),
            ));
        }
        pending_dir(root, step)?;
        let len = image_len(&entry)?;
        let ptr = super::anonymous_map(len)?;
        Ok(Incoming::mapped(
            ptr,
            len,
            Target::Pending { world_size },
            IncomingState::Open,
            (root, step, rank),
            entry,
        ))
    }

    /// A sealed pending restore ([`Incoming::restore_pending`]): its part written beside
    /// its file in the step's partial directory and the step committed if every part is
    /// there ([`crate::commit::commit`], the one commit protocol: the rank finding every
    /// part merges them and publishes `step-N`). Returns the committed directory, or
    /// `None` while some rank's part is missing. On failure this rank's part and file are
    /// taken out of the partial directory (`crate::commit::withdraw_rank`), so no part
    /// names a file that is not there.
    pub fn commit_pending(&self) -> Result<Option<PathBuf>> {
        let (Target::Pending { world_size }, IncomingState::Sealed, Some(meta)) =
            (&self.target, self.state, &self.user_meta)
        else {
            return Err(Error::Config(
                "commit_pending() is for a sealed pending restore".into(),
            ));
        };
        let partial = pending_dir(&self.root, self.step)?;
        let res = crate::commit::commit(
            &self.root,
            self.step,
            *world_size,
            &partial,
            self.entry.clone(),
            meta,
        );
        if res.is_err() {
            self.withdraw_pending();
        }
        res
    }

    /// Take a sealed pending restore's file (and its part, if written) out of the step's
    /// partial directory again: the step could not be completed on every rank.
    pub fn withdraw_pending(&self) {
        if matches!(self.target, Target::Pending { .. }) {
            let partial = self.root.join(crate::manifest::partial_dir_name(self.step));
            crate::commit::withdraw_rank(&partial, self.rank, &self.entry.file);
        }
    }

    /// The first byte of the mapping (page aligned). Writable while [`IncomingState::Open`]
    /// (and, for a restore, once sealed); a write to a sealed or served replica faults.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The image's length in bytes (the manifest's).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the image is empty (never, for a real safetensors file).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether this is a restore's private memory ([`Incoming::restore`],
    /// [`Incoming::restore_pending`]), not a replica.
    pub fn is_restore(&self) -> bool {
        matches!(self.target, Target::Restore | Target::Pending { .. })
    }

    /// Where the image stands.
    pub fn state(&self) -> IncomingState {
        self.state
    }

    /// The manifest entry the image is checked against.
    pub fn entry(&self) -> &FileEntry {
        &self.entry
    }

    /// While open, every byte before `end` received (every write into `[0, end)`
    /// finished; a later write there faults): freeze those bytes read-only (rounded down
    /// to a page, or the whole image), check what they complete (the header, each tensor
    /// wholly inside: its CRC-32C against the manifest's), and for a restore write them
    /// to its file. So the check, and a restore's write-back,
    /// overlap the transfer, and [`Incoming::seal`] checks only the rest. An error means
    /// the image does not match its manifest (the seal will refuse it) or a write failed.
    pub fn received(&mut self, end: usize) -> Result<()> {
        if self.state != IncomingState::Open || matches!(self.target, Target::Served) {
            return Err(Error::Config(
                "received() is for an image being received".into(),
            ));
        }
        let page = rustix::param::page_size();
        let end = if end >= self.len {
            self.len
        } else {
            end - end % page
        };
        if end > self.frozen {
            // `frozen` is 0 or a page boundary (or `len`, excluded: `end > frozen`), so the
            // range starts page aligned; the kernel rounds its length up to whole pages,
            // inside the mapping (`end <= len <= map_len`).
            // SAFETY: `ptr + frozen .. ptr + end` lies in this value's own mapping; making
            // it read-only invalidates no Rust reference (none is made to it).
            unsafe {
                rustix::mm::mprotect(
                    self.ptr.as_ptr().add(self.frozen).cast::<c_void>(),
                    end - self.frozen,
                    MprotectFlags::READ,
                )
            }
            .map_err(|e| Error::io("mprotect", Path::new("(replica image)"), e.into()))?;
            self.frozen = end;
        }
        // SAFETY: `[0, frozen)` is mapped (`frozen <= len <= map_len`) and read-only in
        // this process since the mprotect above (or an earlier call), so nothing here
        // writes it while this borrow lives (a write faults).
        let prefix = unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.frozen) };
        let what = PathBuf::from(format!(
            "<image of rank {} of step {} from a peer>",
            self.rank, self.step
        ));
        self.check.advance(prefix, &self.entry, &what)?;
        if matches!(self.target, Target::Restore) {
            self.write_through(end)?;
        }
        Ok(())
    }

    /// Tensors of the image checked so far ([`Incoming::received`], [`Incoming::seal`]).
    pub fn checked_tensors(&self) -> usize {
        self.check.checked()
    }

    /// A restore's bytes `[written, end)`, frozen already ([`Incoming::received`]: `end` is
    /// at most `frozen`), written to the rank's temporary file in the step's directory
    /// (created new, never through a link, on the first call), so the write-back overlaps
    /// the transfer; [`Incoming::seal`] writes the rest, checks the whole image and only
    /// then renames the file into place (a failure removes it).
    fn write_through(&mut self, end: usize) -> Result<()> {
        debug_assert!(matches!(self.target, Target::Restore) && end <= self.frozen);
        if self.early.is_none() {
            let (dir, entry) = self.still_committed()?;
            let tmp = format!(".{}.tmp{}", entry.file, std::process::id());
            let dfd = fsx::open_dir(&dir)?;
            super::remove_dead_tmps(dfd.as_fd(), &dir, &entry.file);
            fsx::unlink_in(dfd.as_fd(), &dir, &tmp)?;
            let file = fsx::open_file(dfd.as_fd(), &dir, &tmp, true, Create::New, Some(euid()))?;
            self.early = Some(EarlyWrite {
                dir,
                tmp,
                file,
                written: 0,
            });
        }
        let early = self.early.as_mut().expect("made above");
        let start = early.written;
        if end <= start {
            return Ok(());
        }
        let path = early.dir.join(&early.tmp);
        // SAFETY: `end <= frozen <= len`: mapped and readable (read-only since `received`).
        unsafe { pwrite_range(&early.file, self.ptr.as_ptr(), start, end, &path) }?;
        // Start writing these pages to the disk now, so the seal's fsync waits only for the
        // rest (a hint: its failure is the fsync's to report).
        let _ = crate::util::sync_file_range(
            &early.file,
            start as u64,
            (end - start) as u64,
            libc::SYNC_FILE_RANGE_WRITE,
        );
        early.written = end;
        Ok(())
    }

    fn protect(&self, flags: MprotectFlags) -> Result<()> {
        // SAFETY: `ptr..ptr + map_len` is this value's own mapping, alive until drop; changing
        // its protection invalidates no Rust reference (none is live across this call).
        unsafe { rustix::mm::mprotect(self.ptr.as_ptr().cast::<c_void>(), self.map_len, flags) }
            .map_err(|e| Error::io("mprotect", Path::new("(replica image)"), e.into()))
    }

    /// Check the received image and publish it (see the module): the mapping is made
    /// read-only first, so nothing can change the bytes between the check and the
    /// publication; then every check of [`super::verify_image`]. A replica is then renamed
    /// to its name in `/dev/shm` (this user's older replicas of the same root and rank
    /// removed) and its name returned; a restore's image is written back as the rank's
    /// file (temporary name, fsync, rename, directory fsync), the memory made writable
    /// again for its holder, and the file's path returned. On any failure nothing is
    /// published: the replica's temporary file is removed, the state is
    /// [`IncomingState::Refused`], and the error says why. Once only.
    ///
    /// The caller must have finished every write into the image (a write after this call
    /// faults).
    pub fn seal(&mut self) -> Result<PathBuf> {
        self.seal_with(true)
    }

    /// [`Incoming::seal`], leaving this user's older replicas of the same root and rank in
    /// place (the replication removes them with [`super::remove_older`] once the step is
    /// known to be k-safe, out of its time to k-safe: freeing a large replica's pages
    /// takes a while).
    pub fn seal_keeping_older(&mut self) -> Result<PathBuf> {
        self.seal_with(false)
    }

    fn seal_with(&mut self, remove_older: bool) -> Result<PathBuf> {
        if self.state != IncomingState::Open {
            return Err(Error::Config(format!(
                "the image of rank {} of step {} was sealed already ({:?})",
                self.rank, self.step, self.state
            )));
        }
        self.state = IncomingState::Refused;
        let res = self.seal_inner(remove_older);
        if res.is_err() {
            if let Target::Replica { tmp, .. } = &self.target {
                let _ = remove_tmp(tmp);
            }
            self.remove_early();
        }
        if res.is_ok() {
            self.state = IncomingState::Sealed;
        }
        res
    }

    fn seal_inner(&mut self, remove_older: bool) -> Result<PathBuf> {
        self.protect(MprotectFlags::READ)?;
        // SAFETY: the mapping is `map_len >= len` bytes, alive while `self` is; it is
        // read-only now, so no pointer handed out can write it while this borrow lives (a
        // write faults); nothing in this process maps the file again (its temporary name
        // is this process's, created new).
        let bytes = unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) };
        let what = PathBuf::from(format!(
            "<image of rank {} of step {} from a peer>",
            self.rank, self.step
        ));
        self.check.finish(bytes, &self.entry, &what)?;
        match &self.target {
            Target::Replica {
                tmp,
                name,
                tag,
                keep_entry,
            } => {
                let dir = Path::new(SHM_MOUNT);
                let dfd = fsx::open_dir(dir)?;
                if *keep_entry {
                    // Beside the replica before it is published under its name: a load
                    // completing the step's commit needs both (each checked).
                    super::write_memory_entry(name, &self.entry)?;
                }
                rustix::fs::renameat(dfd.as_fd(), tmp.as_str(), dfd.as_fd(), name.as_str())
                    .map_err(|e| {
                        if *keep_entry {
                            let _ = fsx::unlink_in(dfd.as_fd(), dir, &super::entry_name(name));
                        }
                        Error::io("rename", dir.join(name), e.into())
                    })?;
                if remove_older {
                    remove_stale(tag, self.rank, self.step, None);
                }
                Ok(dir.join(name))
            }
            Target::Served => Err(Error::Config("a served replica is not sealed again".into())),
            Target::Pending { world_size } => {
                let meta = header_metadata(bytes, &self.entry, self.step, *world_size, &what)?;
                let dir = pending_dir(&self.root, self.step)?;
                let tmp = format!(".{}.tmp{}", self.entry.file, std::process::id());
                let path = write_atomic(&dir, &self.entry.file, &tmp, bytes, true)?;
                self.user_meta = Some(meta);
                // The memory is its holder's from here on: Rust never reads it again.
                self.protect(MprotectFlags::READ | MprotectFlags::WRITE)?;
                Ok(path)
            }
            Target::Restore => {
                let (dir, entry) = self.still_committed()?;
                let path = match self.early.take() {
                    None => {
                        let tmp = format!(".{}.tmp{}", entry.file, std::process::id());
                        write_atomic(&dir, &entry.file, &tmp, bytes, true)?
                    }
                    Some(early) => {
                        // The bytes before `written` are in the file already (frozen
                        // before they were written, so they are the bytes just checked).
                        let tmp_path = early.dir.join(&early.tmp);
                        let done = (|| {
                            // SAFETY: `len` bytes mapped, read-only now.
                            unsafe {
                                pwrite_range(
                                    &early.file,
                                    self.ptr.as_ptr(),
                                    early.written,
                                    self.len,
                                    &tmp_path,
                                )
                            }?;
                            early
                                .file
                                .sync_all()
                                .map_err(|e| Error::io("fsync", &tmp_path, e))?;
                            let dfd = fsx::open_dir(&early.dir)?;
                            rustix::fs::renameat(
                                dfd.as_fd(),
                                early.tmp.as_str(),
                                dfd.as_fd(),
                                entry.file.as_str(),
                            )
                            .map_err(|e| {
                                Error::io("rename", early.dir.join(&entry.file), e.into())
                            })?;
                            rustix::fs::fsync(&dfd)
                                .map_err(|e| Error::io("fsync", &early.dir, e.into()))?;
                            Ok(early.dir.join(&entry.file))
                        })();
                        if done.is_err() {
                            self.early = Some(early);
                        }
                        done?
                    }
                };
                // The memory is its holder's from here on: Rust never reads it again.
                self.protect(MprotectFlags::READ | MprotectFlags::WRITE)?;
                Ok(path)
            }
        }
    }
}

/// `root/step-N.partial` of a step that is not committed (nothing named `step-N`): a real
/// directory (never through a link). [`Error::StepExists`] once committed.
fn pending_dir(root: &Path, step: u64) -> Result<PathBuf> {
    let rfd = fsx::open_dir(root)?;
    if fsx::entry_kind(rfd.as_fd(), root, &crate::manifest::step_dir_name(step))?.is_some() {
        return Err(Error::StepExists {
            step,
            root: root.to_owned(),
        });
    }
    let name = crate::manifest::partial_dir_name(step);
    fsx::open_subdir(rfd.as_fd(), root, &name)?;
    Ok(root.join(name))
}

/// The user metadata of `bytes`' header (checked already against `entry`: its length and
/// CRC-32C), which must name `entry`'s rank, `step` and `world_size` as every save's
/// header does (a peer's image of another step or world is refused).
fn header_metadata(
    bytes: &[u8],
    entry: &FileEntry,
    step: u64,
    world_size: u32,
    what: &Path,
) -> Result<crate::manifest::Metadata> {
    use crate::plan::{META_RANK, META_STEP, META_WORLD, RESERVED_PREFIX};
    let start = super::check::mem_len(entry.data_start, what)?;
    let json = bytes
        .get(8..start)
        .ok_or_else(|| Error::corrupt(what, None, "the header is shorter than 8 bytes"))?;
    #[derive(serde::Deserialize)]
    struct Header {
        #[serde(rename = "__metadata__", default)]
        metadata: Option<std::collections::BTreeMap<String, String>>,
    }
    // Trailing padding spaces are JSON whitespace; tensors' fields are ignored here.
    let h: Header = serde_json::from_slice(json)
        .map_err(|e| Error::corrupt(what, None, format!("the header is not valid: {e}")))?;
    let system = h.metadata.unwrap_or_default();
    for (k, want) in [
        (META_STEP, step.to_string()),
        (META_RANK, entry.rank.to_string()),
        (META_WORLD, world_size.to_string()),
    ] {
        if system.get(k) != Some(&want) {
            return Err(Error::corrupt(
                what,
                None,
                format!("the header says {k} = {:?}, not {want:?}", system.get(k)),
            ));
        }
    }
    Ok(system
        .into_iter()
        .filter(|(k, _)| !k.starts_with(RESERVED_PREFIX))
        .collect())
}

/// The image's length in memory: the manifest's, never 0 (a safetensors file has a header).
pub(super) fn image_len(entry: &FileEntry) -> Result<usize> {
    let what = Path::new(&entry.file);
    match super::check::mem_len(entry.bytes, what)? {
        0 => Err(Error::corrupt(
            what,
            None,
            "the manifest says the file is empty",
        )),
        n => Ok(n),
    }
}

impl Incoming {
    /// The step's directory and this rank's entry, committed now as when the image began
    /// (a restore writes its file back only into the step it was received for).
    fn still_committed(&self) -> Result<(PathBuf, FileEntry)> {
        let (dir, entry) = committed_entry(&self.root, self.step, self.rank)?;
        if entry != self.entry {
            return Err(Error::corrupt(
                &dir,
                None,
                format!(
                    "the manifest of step {} changed while the image was received",
                    self.step
                ),
            ));
        }
        Ok((dir, entry))
    }

    /// Remove a restore's temporary file written early, if any.
    fn remove_early(&mut self) {
        if let Some(e) = self.early.take()
            && let Ok(dfd) = fsx::open_dir(&e.dir)
        {
            let _ = fsx::unlink_in(dfd.as_fd(), &e.dir, &e.tmp);
        }
    }
}

impl Drop for Incoming {
    fn drop(&mut self) {
        self.remove_early();
        if self.state != IncomingState::Sealed
            && let Target::Replica { tmp, .. } = &self.target
            && let Err(e) = remove_tmp(tmp)
        {
            tracing::warn!(file = %tmp, error = %e, "could not remove an unsealed replica");
        }
        // SAFETY: the mapping is this value's own and nothing borrows it past `self`
        // (holders of the raw pointer keep `self` alive: the binding's views own it).
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast::<c_void>(), self.map_len) };
    }
}
