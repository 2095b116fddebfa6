//! Flash restore: at open, take over the arena a previous engine of the same root and rank
//! kept in `/dev/shm` (`EngineConfig::with_keep_in_memory`), adopt its committed image
//! (checked against the manifest once, then recorded as the arena's kept image), and serve
//! loads of that step from there.
//!
//! The previous arena is first read only through [`AttachedArena`] (no link followed,
//! owner uid checked, not mapped: `pread` and checked parsing), so nothing in it is trusted
//! before the checks. When its layout is this engine's, [`take_over`] maps it as this
//! engine's arena (same inode, whole and allocated, descriptor initialised anew) and checks
//! the image in place; otherwise its name is unlinked (the open descriptor keeps its
//! memory), this engine creates its own arena under the same stable name, and [`adopt`]
//! copies the image into it; the old descriptor is closed (the memory freed) once the image
//! is adopted or refused.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::manifest::FileEntry;
use crate::restore::{Checkpoint, CrcPiece, ReadSink, combine_crcs, file_crc_pieces, for_pieces};
use crate::slab::{SlabBuilder, SlabPool};
use crate::staging::descriptor::{SaveRecord, SlotView, chunk_state, slot_state};
use crate::staging::shm::SHM_MOUNT;
use crate::staging::{Arena, AttachedArena, ChunkLease};
use crate::tensor::{AlignedBytes, LoadedTensor};

/// A previous engine's committed image, attached read-only, until [`adopt`] consumes it;
/// or, with `staged`, its newest save that recovery left staged for this engine to hold
/// in memory ([`crate::recover::Deferred`]), until [`take_over`] takes it, with the older
/// saves left for this engine to recover behind its open (`behind`).
#[derive(Debug)]
pub(crate) struct KeptImage {
    att: AttachedArena,
    slot: SlotView,
    staged: Option<crate::recover::StagedStep>,
    behind: Vec<SlotView>,
}

impl KeptImage {
    /// Whether this is a staged save to hold in memory (not a committed image).
    pub(crate) fn is_staged(&self) -> bool {
        self.staged.is_some()
    }
}

/// What [`take_kept`] found.
pub(crate) struct Taken {
    /// The image to adopt, if one looks complete.
    pub image: Option<KeptImage>,
    /// Why there is none (logged already).
    pub reason: Option<String>,
    /// Whether the stable name is free for this engine's arena (with an image: once the
    /// image is taken over under it, or gives it up with [`KeptImage::release_name`]).
    pub name_free: bool,
}

/// Look at the kept arena `name` of `root` (canonical) and `rank`. `deferred`: the save
/// recovery left staged in it for this engine ([`crate::recover::on_open`]): found there
/// unchanged, it is the image to take over (the committed image, older, is then given up).
pub(crate) fn take_kept(
    name: &str,
    root: &Path,
    rank: u32,
    deferred: Option<&crate::recover::Deferred>,
) -> Taken {
    let path = Path::new(SHM_MOUNT).join(name);
    let none = |reason: String, name_free: bool| Taken {
        image: None,
        reason: Some(reason),
        name_free,
    };
    if std::fs::symlink_metadata(&path).is_err() {
        return none(format!("no kept arena {name}"), true);
    }
    // Read-only checks first; opened for writing only once they passed, and then the
    // same inode (`open_with`): the engine may take the segment over.
    let opts = crate::staging::attach::AttachOptions {
        write: true,
        allow_foreign: false,
    };
    let att = match AttachedArena::open_with(name, opts) {
        Ok(a) => a,
        Err(e @ Error::UnsafePath { .. }) => {
            let why = format!("kept arena {name} refused, left untouched: {e}");
            tracing::warn!("{why}");
            return none(why, false);
        }
        Err(e) => {
            let why = format!("kept arena {name} is unusable: {e}");
            tracing::warn!("{why}; removing it");
            let free = remove_own(name);
            return none(why, free);
        }
    };
    let h = att.header();
    let reason = if h.rank != rank {
        Some(format!(
            "kept arena {name} is of rank {}, not {rank}",
            h.rank
        ))
    } else if h.root != root {
        Some(format!(
            "kept arena {name} is of root {}, not {}",
            h.root.display(),
            root.display()
        ))
    } else {
        None
    };
    let mut image = None;
    let mut unrecovered = None;
    let mut staged: Option<crate::recover::StagedStep> = None;
    let mut staged_view = None;
    let reason = reason.or_else(|| {
        let mut best: Option<SlotView> = None;
        for s in 0..att.slot_count() {
            match att.try_slot(s) {
                Ok(v) if v.state == slot_state::KEPT => {
                    if best.as_ref().is_none_or(|b| b.step < v.step) {
                        best = Some(v);
                    }
                }
                Ok(v)
                    if v.state == slot_state::STAGED
                        && deferred.is_some_and(|d| d.name == name && d.view == v) =>
                {
                    staged = deferred.map(|d| d.staged.clone());
                    staged_view = Some(v);
                }
                // An older save left for this engine to recover behind its open.
                Ok(v)
                    if v.state == slot_state::STAGED
                        && deferred.is_some_and(|d| d.name == name && d.behind.contains(&v)) => {}
                Ok(v) if v.state == slot_state::STAGED => unrecovered = Some(v.step),
                Ok(_) => {}
                Err(e) => return Some(format!("kept arena {name}: {e}")),
            }
        }
        // The save left staged for this engine wins over the committed image (older).
        match staged_view.take().or(best) {
            Some(slot) => {
                image = Some(slot);
                None
            }
            None => Some(format!(
                "kept arena {name} holds no committed image (a save was in flight or failed)"
            )),
        }
    });
    if let Some(step) = unrecovered {
        // A staged save nobody recovered (recovery at open is off, or failed for it): the
        // arena is left as it is for `shmckpt recover`; taking it over would wipe its
        // descriptor, and removing it the save.
        let why = format!(
            "kept arena {name} holds step {step} staged and not recovered (recover_on_open is \
             off, or recovery failed): left for `shmckpt recover`; this engine keeps nothing \
             in memory"
        );
        tracing::warn!("{why}");
        return none(why, false);
    }
    match (image, reason) {
        (Some(slot), None) => {
            // The name stays: the engine takes the segment over under it, or frees it
            // (`KeptImage::release_name`) to copy the image into a new arena.
            tracing::info!(arena = %name, step = slot.step, staged = staged.is_some(), "kept arena attached for flash restore");
            let behind = match (&staged, deferred) {
                (Some(_), Some(d)) => d.behind.clone(),
                _ => Vec::new(),
            };
            Taken {
                image: Some(KeptImage {
                    att,
                    slot,
                    staged,
                    behind,
                }),
                reason: None,
                name_free: true,
            }
        }
        (_, reason) => {
            let why = reason.unwrap_or_default();
            tracing::warn!("{why}");
            none(why, unlink_kept(&att))
        }
    }
}

/// Remove a kept arena's name (the open descriptor keeps its memory while needed).
fn unlink_kept(att: &AttachedArena) -> bool {
    match att.unlink() {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(arena = %att.name(), error = %e, "could not remove the kept arena");
            false
        }
    }
}

impl KeptImage {
    /// Free the kept arena's name for a new arena (the image stays readable through the
    /// open descriptor until it is dropped). False when it could not be removed.
    pub(crate) fn release_name(&self) -> bool {
        unlink_kept(&self.att)
    }
}

/// Remove `/dev/shm/name` if it is this user's (never following a link).
fn remove_own(name: &str) -> bool {
    let path = Path::new(SHM_MOUNT).join(name);
    match std::fs::symlink_metadata(&path) {
        Ok(m) if m.uid() == rustix::process::geteuid().as_raw() => {
            std::fs::remove_file(&path).is_ok()
        }
        _ => false,
    }
}

/// A previous engine's committed image, copied into this engine's own arena at open and
/// checked there once: every tensor's CRC-32C equal to the manifest's. From then on the
/// chunks are this process's memory, held by the leases (nobody else writes them: another
/// process never maps this user's arena for writing, and the chunks are out of the pool),
/// so loads copy from them without checking again. The first save drops it.
#[derive(Debug)]
pub(crate) struct Adopted {
    /// File chunk `k` of the image in `leases[k]`.
    leases: Vec<ChunkLease>,
    step: u64,
    file_len: u64,
    data_start: u64,
    chunk_size: u64,
    /// This rank's manifest entry the image was checked against.
    entry: FileEntry,
}

/// The checks of a kept image's slot against this rank's manifest entry: complete, one
/// arena chunk per file chunk, tensors inside the data section and aligned.
pub(crate) fn check_slot(
    v: &SlotView,
    cs: u64,
    entry: &FileEntry,
) -> std::result::Result<(), String> {
    if v.file_len != entry.bytes || v.data_start != entry.data_start {
        return Err(format!(
            "the kept image describes a file of {} bytes with data at {}, the manifest {} at {}",
            v.file_len, v.data_start, entry.bytes, entry.data_start
        ));
    }
    if v.data_start > v.file_len {
        return Err("the kept image's data section starts past its end".into());
    }
    let n = v.file_len.div_ceil(cs);
    if v.chunks.len() as u64 != n {
        return Err(format!(
            "the kept image maps {} chunks, the file needs {n}",
            v.chunks.len()
        ));
    }
    if let Some(k) = v.chunks.iter().position(|c| c.0 != chunk_state::WRITTEN) {
        return Err(format!("chunk {k} of the kept image is not complete"));
    }
    let mut seen = std::collections::BTreeSet::new();
    if !v.chunks.iter().all(|&(_, i)| seen.insert(i)) {
        return Err("the kept image maps two file chunks to one arena chunk".into());
    }
    let data_len = v.file_len - v.data_start;
    usize::try_from(data_len).map_err(|_| "image larger than memory".to_owned())?;
    for t in &entry.tensors {
        let [b, e] = t.data_offsets;
        if b > e || e > data_len {
            return Err(format!("tensor {:?} lies outside the data section", t.name));
        }
        if !b.is_multiple_of(t.dtype.alignment()) {
            return Err(format!("tensor {:?} is not aligned in the file", t.name));
        }
    }
    Ok(())
}

/// Each `(dst, src)` of `jobs` (equal lengths) copied, the jobs dealt round-robin to
/// [`crate::util::threads_for`] threads.
fn copy_in_lanes(jobs: Vec<(&mut [u8], &[u8])>) {
    let threads = crate::util::threads_for(jobs.len());
    let mut lanes: Vec<Vec<_>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, j) in jobs.into_iter().enumerate() {
        lanes[i % threads].push(j);
    }
    std::thread::scope(|scope| {
        for lane in lanes {
            scope.spawn(move || {
                for (dst, src) in lane {
                    dst.copy_from_slice(src);
                }
            });
        }
    });
}

/// The disk's latest committed step must be the image's: this rank's manifest entry of it.
fn latest_entry(v: &SlotView, root: &Path, rank: u32) -> std::result::Result<FileEntry, String> {
    let step = v.step;
    let latest = crate::manifest::list_committed(root)
        .map_err(|e| format!("cannot list the committed steps: {e}"))?
        .pop();
    let latest_step = latest.as_ref().map(|c| c.step);
    let Some(info) = latest.filter(|c| c.step == step) else {
        return Err(format!(
            "stale: the kept image holds step {step}, the disk's latest committed step is {latest_step:?}"
        ));
    };
    let (_, entry) = crate::restore::rank_file(&info.dir, rank)
        .map_err(|e| format!("the manifest of step {step} cannot be read: {e}"))?;
    Ok(entry)
}

/// Puts file chunk `k` of a kept image into a buffer (or leaves it: already there).
type FillChunk<'a> = dyn Fn(usize, &mut [u8]) -> std::result::Result<(), String> + Sync + 'a;

/// On several threads, `fill` file chunk `k` of the image into `leases[k]` (the bytes of
/// the file, `cs` per chunk) and checksum its tensor pieces; then check every tensor's
/// CRC-32C against `tensors`, and the header's against `header_crc` (when the manifest has
/// one). The error says which tensor or chunk failed.
fn fill_and_verify(
    leases: &mut [ChunkLease],
    v: &SlotView,
    cs: u64,
    tensors: &[crate::manifest::TensorEntry],
    header_crc: Option<u32>,
    fill: &FillChunk<'_>,
) -> std::result::Result<(), String> {
    let threads = crate::util::threads_for(leases.len());
    let mut lanes: Vec<Vec<_>> = (0..threads).map(|_| Vec::new()).collect();
    for (k, lease) in leases.iter_mut().enumerate() {
        lanes[k % threads].push((k, lease));
    }
    let (file_len, data_start) = (v.file_len, v.data_start);
    let results: Vec<std::result::Result<Vec<ChunkCrcs>, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = lanes
            .into_iter()
            .map(|lane| {
                scope.spawn(move || {
                    let mut out = Vec::with_capacity(lane.len());
                    for (k, lease) in lane {
                        let fs = k as u64 * cs;
                        let fe = (fs + cs).min(file_len);
                        let buf = &mut lease.as_mut_slice()[..(fe - fs) as usize];
                        fill(k, buf)?;
                        out.push((k, file_crc_pieces(tensors, data_start, fs, buf)));
                    }
                    Ok(out)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a checksum thread panicked".into()))
            })
            .collect()
    });
    let mut by_chunk = Vec::new();
    for r in results {
        by_chunk.extend(r?);
    }
    by_chunk.sort_by_key(|(k, _)| *k);
    let crcs = combine_crcs(tensors.len(), by_chunk.into_iter().flat_map(|(_, p)| p));
    if let Some(want) = header_crc {
        let mut have = 0u32;
        for (k, lease) in leases.iter().enumerate() {
            let fs = k as u64 * cs;
            if fs >= data_start {
                break;
            }
            let fe = (fs + cs).min(data_start);
            have = crc32c::crc32c_append(have, &lease.as_slice()[..(fe - fs) as usize]);
        }
        if have != want {
            return Err(format!(
                "header: CRC-32C {have:08x} in memory, {want:08x} in the manifest (damaged image)"
            ));
        }
    }
    for (t, crc) in tensors.iter().zip(crcs) {
        if crc != t.crc32c {
            return Err(format!(
                "tensor {:?}: CRC-32C {crc:08x} in memory, {:08x} in the manifest (damaged image)",
                t.name, t.crc32c
            ));
        }
    }
    Ok(())
}

/// Record the verified image (file chunk `k` in `leases[k]`) in `arena`'s descriptor as its
/// kept image.
fn record(
    arena: &Arc<Arena>,
    leases: Vec<ChunkLease>,
    v: &SlotView,
    cs: u64,
    entry: FileEntry,
    how: &'static str,
) -> std::result::Result<Adopted, String> {
    let rec = SaveRecord {
        step: v.step,
        file_len: v.file_len,
        data_start: v.data_start,
        n_file_chunks: leases.len() as u64,
        partial_dir: &v.partial_dir,
        file_name: &v.file_name,
    };
    if arena.adopt_kept(&rec, &leases).is_none() {
        return Err("the arena cannot record the kept image".into());
    }
    tracing::info!(
        step = v.step,
        chunks = leases.len(),
        how,
        "kept image adopted (flash restore)"
    );
    Ok(Adopted {
        leases,
        step: v.step,
        file_len: v.file_len,
        data_start: v.data_start,
        chunk_size: cs,
        entry,
    })
}

/// Adopt `image` into `arena` (this engine's new, kept arena) by copying: check it against
/// the disk's latest committed step under `root` and this rank's manifest entry, copy
/// every chunk of its file into leases of `arena` on several threads, verify every
/// tensor's CRC-32C, and record it in `arena`'s descriptor as the kept image. `image` is
/// dropped on return (its segment, unlinked already, is freed now). The error is why it
/// could not be adopted (the leases taken are back in the pool then). Used when the kept
/// arena cannot be taken over ([`take_over`]).
pub(crate) fn adopt(
    image: KeptImage,
    arena: &Arc<Arena>,
    root: &Path,
    rank: u32,
) -> std::result::Result<Adopted, String> {
    let v = &image.slot;
    let entry = latest_entry(v, root, rank)?;
    let cs = image.att.header().geometry.chunk_size;
    check_slot(v, cs, &entry)?;
    if cs != arena.chunk_size() {
        return Err(format!(
            "the kept image has chunks of {cs} bytes, this engine's arena of {}",
            arena.chunk_size()
        ));
    }
    let n = v.chunks.len();
    if (arena.chunk_count() as usize) < n {
        return Err(format!(
            "the new arena is smaller than the kept image ({} chunks, the image needs {n})",
            arena.chunk_count()
        ));
    }
    let mut leases = Vec::with_capacity(n);
    for _ in 0..n {
        match arena.try_acquire() {
            Some(l) => leases.push(l),
            None => return Err("the new arena is smaller than the kept image".into()),
        }
    }
    let att = &image.att;
    let chunks = &v.chunks;
    fill_and_verify(
        &mut leases,
        v,
        cs,
        &entry.tensors,
        entry.header_crc32c,
        &|k, buf| {
            att.read_chunk(chunks[k].1, 0, buf)
                .ok_or_else(|| format!("chunk {k} of the kept image cannot be read"))
        },
    )?;
    record(arena, leases, v, cs, entry, "copied")
}

/// Take the kept arena itself over as this engine's arena (`spec`, named as it is), when
/// its layout is the one `spec` asks for: no new segment, no copy, no second arena's worth
/// of `/dev/shm`. The segment was opened for writing only after the read-only checks of
/// [`take_kept`], on the same inode; it must be a whole, allocated segment of
/// exactly the layout's size (never a `SIGBUS`). Its descriptor is initialised anew; then
/// the image's chunks are taken out of the pool and every tensor's CRC-32C checked there
/// against the disk's latest manifest, as [`adopt`] does after its copy.
///
/// Returns the arena and whether the image was adopted (the error: why not; the arena is
/// then an empty arena like a new one). [`NotTaken`] gives the image back, untouched, with
/// why the arena could not be taken over.
pub(crate) fn take_over(
    mut image: KeptImage,
    spec: &crate::staging::ArenaSpec,
    root: &Path,
    rank: u32,
) -> std::result::Result<TakenOver, Box<NotTaken>> {
    let not = |image, why: String| Box::new(NotTaken { image, why });
    // The descriptor `take_kept` opened for writing after its checks (the same inode).
    let file = match image.att.writable_file() {
        Ok(f) => f,
        Err(e) => return Err(not(image, format!("cannot open it for writing: {e}"))),
    };
    let geo = image.att.header().geometry;
    if let Some(st) = image.staged.take() {
        // The staged save's slot, and those to recover behind the open, stay `STAGED`.
        let keep: Vec<u32> = std::iter::once(image.slot.slot)
            .chain(image.behind.iter().map(|b| b.slot))
            .collect();
        return match Arena::take_over_keeping(spec, geo, file, &keep) {
            Ok(arena) => Ok(take_staged(arena, image, st)),
            Err(e) => {
                image.staged = Some(st);
                Err(not(image, e.to_string()))
            }
        };
    }
    let arena = match Arena::take_over(spec, geo, file) {
        Ok(a) => a,
        Err(e) => return Err(not(image, e.to_string())),
    };
    arena.enable_keep();
    let v = &image.slot;
    let adopted = (|| {
        let entry = latest_entry(v, root, rank)?;
        let cs = arena.chunk_size();
        check_slot(v, cs, &entry)?;
        let mut leases = Vec::with_capacity(v.chunks.len());
        take_chunks(&arena, v.chunks.iter().map(|c| c.1), &mut leases).map_err(|index| {
            format!("the kept image names arena chunk {index}, which the arena does not have")
        })?;
        fill_and_verify(
            &mut leases,
            v,
            cs,
            &entry.tensors,
            entry.header_crc32c,
            &|_, _| Ok(()),
        )?;
        record(&arena, leases, v, cs, entry, "taken over in place")
    })();
    Ok(TakenOver {
        arena,
        adopted,
        held: None,
        behind: None,
    })
}

/// [`take_over`] of a kept arena whose newest save recovery left staged for this engine
/// (`st`, read from `image`'s slot), `arena` the segment taken over with that save's slot
/// and those of `image.behind` kept `STAGED` in place ([`Arena::take_over_keeping`]: at no
/// instant is a save in no descriptor): the save's chunks are taken out of the pool and it
/// becomes [`TakenOver::held`], which the engine holds as its memory-only step; the older
/// saves' staged chunks are taken out too, for [`TakenOver::behind`]. The committed image
/// the arena may also hold (an older step) is given up.
fn take_staged(arena: Arc<Arena>, image: KeptImage, st: crate::recover::StagedStep) -> TakenOver {
    arena.enable_keep();
    let KeptImage {
        att,
        slot: v,
        behind,
        ..
    } = image;
    let held = hold_staged(&arena, &v, st);
    if let Err(why) = &held {
        // Unreachable after `staged_step`'s checks, short of another process of this user
        // writing the segment: the save is refused, its slot freed before its chunks.
        tracing::error!(step = v.step, reason = %why, "the staged save taken over cannot be held: it is lost");
    }
    let mut saves = Vec::new();
    for b in behind {
        let mut leases = Vec::new();
        let staged = b
            .chunks
            .iter()
            .filter(|c| c.0 == chunk_state::STAGED)
            .map(|c| c.1);
        if let Err(index) = take_chunks(&arena, staged, &mut leases) {
            // Unreachable (`recoverable_behind` checked the chunks distinct and in range):
            // the descriptor must not name chunks back in the pool.
            tracing::error!(
                step = b.step,
                index,
                "a staged save left to recover behind the open names a chunk that is not free: it is lost"
            );
            arena.release_slot(b.slot);
            drop(leases);
            continue;
        }
        saves.push(BehindSave { view: b, leases });
    }
    let behind = (!saves.is_empty()).then_some(Behind { att, saves });
    TakenOver {
        arena,
        adopted: Err("its newest save is held in memory instead".into()),
        held: Some(held),
        behind,
    }
}

/// Take arena chunks `indices` out of `arena`'s pool into `leases`, in order; `Err` with
/// the first index that is not free (the leases taken before it stay in `leases`, for the
/// caller to drop once no descriptor slot names them).
fn take_chunks(
    arena: &Arc<Arena>,
    indices: impl IntoIterator<Item = u32>,
    leases: &mut Vec<ChunkLease>,
) -> std::result::Result<(), u32> {
    for index in indices {
        leases.push(arena.take_chunk(index).ok_or(index)?);
    }
    Ok(())
}

/// The older saves of a kept arena taken over with its newest save held
/// ([`take_over_staged`]), which the engine recovers on a thread behind its open
/// (`crate::recover::recover_behind`), each slot `STAGED` in the descriptor and its staged
/// chunks held out of the pool until its recovery ends; `att` reads them (`pread`; its
/// header is the arena's as it was attached, before the take-over).
pub(crate) struct Behind {
    pub att: AttachedArena,
    pub saves: Vec<BehindSave>,
}

/// One save of [`Behind`]: its slot as read before the take-over, and its staged chunks.
pub(crate) struct BehindSave {
    pub view: SlotView,
    pub leases: Vec<ChunkLease>,
}

/// The chunks of staged slot `v` of `arena` (just taken over) out of the pool, its header
/// compared with the one checked before the take-over, and the plan of its file: the save
/// to hold in memory. On error the slot is freed (then the chunks go back to the pool).
fn hold_staged(
    arena: &Arc<Arena>,
    v: &SlotView,
    st: crate::recover::StagedStep,
) -> std::result::Result<StagedTaken, String> {
    let cs = arena.chunk_size();
    let mut leases = Vec::with_capacity(v.chunks.len());
    let mut problem = take_chunks(arena, v.chunks.iter().map(|c| c.1), &mut leases)
        .err()
        .map(|index| format!("arena chunk {index} is not free"));
    let header = st.plan.header();
    if problem.is_none() {
        let mut have = Vec::with_capacity(header.len());
        for l in &leases {
            let n = (header.len() - have.len()).min(cs as usize);
            if n == 0 {
                break;
            }
            have.extend_from_slice(&l.as_slice()[..n]);
        }
        if have != header {
            problem = Some("the staged header changed since it was checked".into());
        }
    }
    match problem {
        None => {
            tracing::info!(
                step = v.step,
                chunks = leases.len(),
                "a dead engine's staged save is held in memory (taken over in place)"
            );
            Ok(StagedTaken {
                step: v.step,
                slot: v.slot,
                plan: st.plan,
                metadata: st.metadata,
                image: Adopted::in_memory(leases, v.step, v.data_start, cs, st.entry),
            })
        }
        Some(why) => {
            arena.release_slot(v.slot);
            drop(leases);
            Err(why)
        }
    }
}

/// A dead engine's fully staged save, taken over in place: the engine holds it as its
/// memory-only step, in descriptor slot `slot` (`STAGED`).
pub(crate) struct StagedTaken {
    pub step: u64,
    pub slot: u32,
    pub plan: crate::plan::Plan,
    pub metadata: crate::manifest::Metadata,
    pub image: Adopted,
}

/// A kept arena taken over by [`take_over`].
pub(crate) struct TakenOver {
    /// This engine's arena now.
    pub arena: Arc<Arena>,
    /// Its image, adopted, or why not.
    pub adopted: std::result::Result<Adopted, String>,
    /// With a staged save taken over: that save to hold in memory, or why it could not be.
    pub held: Option<std::result::Result<StagedTaken, String>>,
    /// With it, the older saves to recover behind the open.
    pub behind: Option<Behind>,
}

/// Why [`take_over`] could not, with the image given back.
pub(crate) struct NotTaken {
    pub image: KeptImage,
    pub why: String,
}

impl Adopted {
    /// A memory-only save of this engine (`super::memory`), file chunk `k` in `leases[k]`:
    /// served like an adopted image. Its `entry` carries no checksums (0): the bytes never
    /// left this process's memory, and a memory-only step's checksums are computed when it
    /// goes to disk.
    pub(crate) fn in_memory(
        leases: Vec<ChunkLease>,
        step: u64,
        data_start: u64,
        chunk_size: u64,
        entry: FileEntry,
    ) -> Adopted {
        Adopted {
            leases,
            step,
            file_len: entry.bytes,
            data_start,
            chunk_size,
            entry,
        }
    }

    /// The leases, file chunk `k` in entry `k` (a memory-only step going to disk).
    pub(crate) fn into_leases(self) -> Vec<ChunkLease> {
        self.leases
    }

    /// The whole image (`dst` exactly its length) copied from its chunks, on up to 8
    /// threads. [`Error::Internal`] when `dst` is not the image's length.
    pub(crate) fn copy_to(&self, dst: &mut [u8]) -> Result<()> {
        if dst.len() as u64 != self.file_len {
            return Err(Error::Internal(format!(
                "an image of {} bytes copied into {} bytes",
                self.file_len,
                dst.len()
            )));
        }
        let cs = self.chunk_size as usize;
        let mut jobs: Vec<(&mut [u8], &[u8])> = Vec::with_capacity(self.leases.len());
        for (mine, l) in dst.chunks_mut(cs.max(1)).zip(&self.leases) {
            let n = mine.len();
            jobs.push((mine, &l.as_slice()[..n]));
        }
        copy_in_lanes(jobs);
        Ok(())
    }

    /// This rank's manifest entry of the image.
    pub(crate) fn entry(&self) -> &FileEntry {
        &self.entry
    }

    /// Whether the image can serve `step` (whose manifest entry of this rank is `entry`):
    /// the same step, still the disk's `latest`, and the same entry it was checked against
    /// at adoption. The error is why not.
    pub(crate) fn check(
        &self,
        step: u64,
        entry: &FileEntry,
        latest: Option<u64>,
    ) -> std::result::Result<(), String> {
        if self.step != step {
            return Err(format!(
                "the kept image holds step {}, not step {step}",
                self.step
            ));
        }
        if latest != Some(step) {
            return Err(format!(
                "stale: the kept image holds step {step}, the disk's latest committed step is {latest:?}"
            ));
        }
        if *entry != self.entry {
            return Err(format!(
                "the manifest of step {step} changed since the kept image was adopted"
            ));
        }
        Ok(())
    }

    /// The step the image holds.
    pub(crate) fn step(&self) -> u64 {
        self.step
    }

    /// The cheap check of the disk copy of the image's step, in the committed directory
    /// `dir`: this rank's file is a regular file (no link followed, never blocking) of the
    /// manifest's size whose header, every byte before the data section, equals the
    /// image's. The error says what is wrong. Reads `data_start` bytes.
    pub(crate) fn check_disk_copy(&self, dir: &Path) -> std::result::Result<(), String> {
        use std::os::fd::AsFd;
        use std::os::unix::fs::FileExt;
        let name = &self.entry.file;
        let path = dir.join(name);
        let file = crate::fsx::open_dir(dir)
            .and_then(|d| {
                crate::fsx::open_file(d.as_fd(), dir, name, false, crate::fsx::Create::No, None)
            })
            .map_err(|e| format!("the disk copy {} cannot be opened: {e}", path.display()))?;
        let len = file
            .metadata()
            .map_err(|e| format!("the disk copy {} cannot be examined: {e}", path.display()))?
            .len();
        if len != self.file_len {
            return Err(format!(
                "the disk copy {} is {len} bytes, the manifest says {}",
                path.display(),
                self.file_len
            ));
        }
        let mut want = Vec::new();
        let cs = self.chunk_size;
        for (k, l) in self.leases.iter().enumerate() {
            let fs = k as u64 * cs;
            if fs >= self.data_start {
                break;
            }
            let fe = (fs + cs).min(self.data_start);
            want.extend_from_slice(&l.as_slice()[..(fe - fs) as usize]);
        }
        let mut have = vec![0u8; want.len()];
        file.read_exact_at(&mut have, 0)
            .map_err(|e| format!("the disk copy {} cannot be read: {e}", path.display()))?;
        if let Some(at) = have.iter().zip(&want).position(|(a, b)| a != b) {
            return Err(format!(
                "the header of the disk copy {} differs from the kept image's at byte {at}",
                path.display()
            ));
        }
        Ok(())
    }

    /// Each file chunk's data bytes: `(offset in the data section, bytes)`, in file order.
    fn data_chunks(&self) -> impl Iterator<Item = (u64, &[u8])> {
        let cs = self.chunk_size;
        self.leases.iter().enumerate().filter_map(move |(k, l)| {
            let fs = k as u64 * cs;
            let fe = (fs + cs).min(self.file_len);
            let s = fs.max(self.data_start);
            (s < fe).then(|| {
                (
                    s - self.data_start,
                    &l.as_slice()[(s - fs) as usize..(fe - fs) as usize],
                )
            })
        })
    }

    /// Hand every tensor piece to `sink` (tensor index in file order, offset in the tensor,
    /// the bytes in the arena chunk), then `chunk_end` once (also before an error returns),
    /// so that no asynchronous copy from the chunks is left when the caller releases the
    /// image. The bytes were verified at adoption; the caller holds the image (and so its
    /// chunks, which no save can take meanwhile) until this returns.
    pub(crate) fn send(&self, sink: &mut dyn ReadSink) -> Result<()> {
        let tensors = &self.entry.tensors;
        for (dst, buf) in self.data_chunks() {
            if let Err(e) = for_pieces(tensors, dst, buf, |i, at, piece| sink.piece(i, at, piece)) {
                let _ = sink.chunk_end();
                return Err(e);
            }
        }
        sink.chunk_end()
    }

    /// The image's tensors copied into one slab (several threads), as a checkpoint of
    /// `dir` with `metadata`. The bytes were verified at adoption. The error is why it
    /// cannot (no memory).
    pub(crate) fn to_checkpoint(
        &self,
        dir: &Path,
        metadata: &crate::manifest::Metadata,
        pool: &Arc<SlabPool>,
    ) -> std::result::Result<Checkpoint, String> {
        let len = usize::try_from(self.file_len - self.data_start)
            .map_err(|_| "image larger than memory".to_owned())?;
        let mut slab = SlabBuilder::new(Some(pool), len).ok_or("cannot allocate the tensors")?;
        if let Some(mut region) = slab.carve(slab.capacity()) {
            let mut jobs = Vec::with_capacity(self.leases.len());
            let mut rest: &mut [u8] = &mut region.as_mut_slice()[..len];
            for (_, src) in self.data_chunks() {
                let (mine, tail) = std::mem::take(&mut rest).split_at_mut(src.len());
                rest = tail;
                jobs.push((mine, src));
            }
            copy_in_lanes(jobs);
        }
        let ranges: Vec<(usize, usize)> = self
            .entry
            .tensors
            .iter()
            .map(|t| (t.data_offsets[0] as usize, t.data_offsets[1] as usize))
            .collect();
        let views = slab.finish(&ranges).ok_or("tensor ranges overlap")?;
        let tensors = self
            .entry
            .tensors
            .iter()
            .zip(views)
            .map(|(t, view)| LoadedTensor {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                data: AlignedBytes::view(view),
            })
            .collect();
        Ok(Checkpoint {
            step: self.step,
            dir: dir.to_owned(),
            metadata: metadata.clone(),
            tensors,
        })
    }
}

/// A file chunk's index and the CRC-32C of each tensor piece in it.
type ChunkCrcs = (usize, Vec<CrcPiece>);
