//! Extension calls used by `shmckpt.replicas` (peer replicas, `docs/replicas.md`): the
//! partner plan, replica names, and the checked reads and writes of images, all in the
//! crate's `shmckpt::replica`. The transport (torch.distributed) is the Python module's.
//! Every call that reads or writes an image releases the GIL.

use std::collections::BTreeMap;
use std::path::PathBuf;

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::PyDict;
use shmckpt::replica::{Incoming, IncomingState, Outgoing, PreparedArena};

use crate::buffer::array_interface;
use crate::{PyBuffer, to_py};

/// For each rank, the ranks that hold its replicas (`nodes[r]`: rank r's machine).
#[pyfunction]
fn replica_plan(py: Python<'_>, nodes: Vec<String>, replicas: u32) -> PyResult<Vec<Vec<u32>>> {
    shmckpt::replica::plan(&nodes, replicas).map_err(|e| to_py(py, e))
}

/// One rank's view before a load of "latest" (`shmckpt::replica::agree::LoadView`), in the
/// order `shmckpt.replicas` gathers it: `(known, own, held, bucket, parts, pending,
/// committed)`.
type ViewTuple = (
    Vec<u64>,
    Vec<u64>,
    Vec<(u32, u64)>,
    Vec<u64>,
    Vec<u64>,
    Vec<(u32, u64)>,
    Vec<u64>,
);

/// One candidate step: `(step, "load" | "complete" | "short", servers, short)`, with the
/// `(rank, partner)` pairs of a commit to complete, or the ranks that cannot load it.
type CandidateTuple = (u64, &'static str, Vec<(u32, u32)>, Vec<u32>);

/// The step every rank loads for "latest" (`shmckpt::replica::agree`): the candidates,
/// newest first up to the first every rank can load, and the newest step any rank knows
/// of (what is asked for when no candidate is loadable).
#[pyfunction]
fn replica_latest(
    py: Python<'_>,
    views: Vec<ViewTuple>,
    plan: Vec<Vec<u32>>,
) -> PyResult<(Vec<CandidateTuple>, Option<u64>)> {
    use shmckpt::replica::agree::{Choice, LoadView, candidates, newest_known};
    let views: Vec<LoadView> = views
        .into_iter()
        .map(
            |(known, own, held, bucket, parts, pending, committed)| LoadView {
                known,
                own,
                held,
                bucket,
                parts,
                pending,
                committed,
            },
        )
        .collect();
    let cands = candidates(&views, &plan).map_err(|e| to_py(py, e))?;
    let out = cands
        .into_iter()
        .map(|c| match c.choice {
            Choice::Load => (c.step, "load", Vec::new(), Vec::new()),
            Choice::Complete(servers) => (c.step, "complete", servers, Vec::new()),
            Choice::Short(ranks) => (c.step, "short", Vec::new(), ranks),
        })
        .collect();
    Ok((out, newest_known(&views)))
}

/// The `/dev/shm` name of the replica of `rank`'s image of `step` of `root`.
#[pyfunction]
fn replica_name(py: Python<'_>, root: PathBuf, rank: u32, step: u64) -> PyResult<String> {
    shmckpt::replica::replica_name(&root, rank, step).map_err(|e| to_py(py, e))
}

/// The tag replica names carry for `root`.
#[pyfunction]
fn replica_tag(py: Python<'_>, root: PathBuf) -> PyResult<String> {
    shmckpt::replica::tag_of(&root).map_err(|e| to_py(py, e))
}

/// `rank`'s committed file of `step`, read and checked against the manifest.
#[pyfunction]
fn replica_read_committed(
    py: Python<'_>,
    root: PathBuf,
    step: u64,
    rank: u32,
) -> PyResult<PyBuffer> {
    py.detach(|| shmckpt::replica::read_committed(&root, step, rank))
        .map(PyBuffer::new)
        .map_err(|e| to_py(py, e))
}

/// Check `data` as `rank`'s image of `step` and store it as a replica; returns its name.
#[pyfunction]
fn replica_store(
    py: Python<'_>,
    root: PathBuf,
    step: u64,
    rank: u32,
    data: PyBackedBytes,
) -> PyResult<String> {
    py.detach(|| shmckpt::replica::store(&root, step, rank, &data))
        .map_err(|e| to_py(py, e))
}

/// This user's replica of `rank`'s image of `step`, checked in full.
#[pyfunction]
fn replica_load(py: Python<'_>, root: PathBuf, step: u64, rank: u32) -> PyResult<PyBuffer> {
    py.detach(|| shmckpt::replica::load(&root, step, rank))
        .map(PyBuffer::new)
        .map_err(|e| to_py(py, e))
}

/// Check `data` as `rank`'s image of `step` and write it back as that rank's file.
#[pyfunction]
fn replica_restore_file(
    py: Python<'_>,
    root: PathBuf,
    step: u64,
    rank: u32,
    data: PyBackedBytes,
) -> PyResult<String> {
    py.detach(|| shmckpt::replica::restore_file(&root, step, rank, &data))
        .map(|p| p.display().to_string())
        .map_err(|e| to_py(py, e))
}

/// A tensor of a sealed image: `(name, dtype, shape, start, end)`.
type ImageTensor = (String, String, Vec<usize>, usize, usize);

/// An image received from a peer straight into its final memory (`shmckpt::replica::Incoming`):
/// a replica arena in `/dev/shm`, or private memory restoring a lost rank. Exposed to numpy
/// through `__array_interface__` (numpy keeps this object, and so the mapping, alive as the
/// array's base): writable until `seal()`; a sealed replica is read-only (its mapping too:
/// a write through an older view faults), a sealed restore is its holder's memory again.
#[pyclass(module = "shmckpt._shmckpt", name = "ReplicaImage", frozen)]
pub(crate) struct PyReplicaImage {
    inner: Mutex<Incoming>,
    /// Address and length of the mapping, taken at construction (the mapping lives as long
    /// as `inner`, which lives as long as this object).
    ptr: usize,
    len: usize,
    /// Whether views handed out now may write (updated by `seal`).
    writable: AtomicBool,
}

impl PyReplicaImage {
    fn new(inc: Incoming) -> Self {
        let (ptr, len) = (inc.as_mut_ptr() as usize, inc.len());
        PyReplicaImage {
            inner: Mutex::new(inc),
            ptr,
            len,
            writable: AtomicBool::new(true),
        }
    }

    /// A replica served to the rank that lost it: checked in place, read-only.
    fn sealed(inc: Incoming) -> Self {
        let img = Self::new(inc);
        img.writable.store(false, Ordering::Release);
        img
    }
}

#[pymethods]
impl PyReplicaImage {
    /// Length in bytes (the manifest's).
    #[getter]
    fn nbytes(&self) -> usize {
        self.len
    }

    /// `"open"`, `"sealed"` or `"refused"`.
    #[getter]
    fn state(&self) -> &'static str {
        match self.inner.lock().unwrap_or_else(|p| p.into_inner()).state() {
            IncomingState::Open => "open",
            IncomingState::Sealed => "sealed",
            IncomingState::Refused => "refused",
        }
    }

    /// The numpy array interface: a 1-D uint8 view of the image (writable while open).
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        array_interface(
            py,
            self.ptr,
            self.len,
            !self.writable.load(Ordering::Acquire),
        )
    }

    fn __len__(&self) -> usize {
        self.len
    }

    /// The image's tensors as the manifest entry it was checked against describes them:
    /// `[(name, dtype, shape, start, end)]`, `start..end` the tensor's bytes in the image.
    /// Only once sealed (`ConfigError` otherwise): the ranges were checked then.
    fn tensors(&self, py: Python<'_>) -> PyResult<Vec<ImageTensor>> {
        let inc = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if inc.state() != IncomingState::Sealed {
            return Err(to_py(
                py,
                shmckpt::Error::Config(
                    "the image is not sealed: its tensors are not checked".into(),
                ),
            ));
        }
        let e = inc.entry();
        e.tensors
            .iter()
            .map(|t| {
                let [b, end] = t.data_offsets;
                let at = |o: u64| {
                    e.data_start
                        .checked_add(o)
                        .and_then(|v| usize::try_from(v).ok())
                        .filter(|&v| v <= self.len)
                };
                match (at(b), at(end)) {
                    (Some(b), Some(end)) if b <= end => Ok((
                        t.name.clone(),
                        crate::core::dtype_name(t.dtype).to_owned(),
                        t.shape.clone(),
                        b,
                        end,
                    )),
                    _ => Err(to_py(
                        py,
                        shmckpt::Error::Corrupt {
                            path: PathBuf::from(&e.file),
                            tensor: Some(t.name.clone()),
                            reason: "lies outside the image".into(),
                        },
                    )),
                }
            })
            .collect()
    }

    /// Whether this is a restore's private memory (not a replica arena).
    #[getter]
    fn restore(&self) -> bool {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_restore()
    }

    /// While open, every write into `[0, end)` finished: freeze those bytes read-only
    /// (rounded down to a page), check what they complete (the header, each tensor wholly
    /// inside) and, for a restore, write them to the rank's temporary file (GIL
    /// released), so the check and the write-back overlap the transfer; `seal()` checks
    /// the rest and only then publishes. Raises when the bytes do not match the
    /// manifest (`seal()` then refuses the image) or a write failed.
    fn received(&self, py: Python<'_>, end: usize) -> PyResult<()> {
        py.detach(|| {
            self.inner
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .received(end)
        })
        .map_err(|e| to_py(py, e))
    }

    /// Tensors of the image checked so far (by `received()` or `seal()`).
    #[getter]
    fn checked_tensors(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .checked_tensors()
    }

    /// Check the received image against the committed manifest and publish it (GIL
    /// released): a replica under its name in `/dev/shm` (returns its path), a restore
    /// written back as the rank's file (returns the file's path). Every write into the
    /// image must be finished. On failure nothing is published (an unsealed or refused
    /// image is never listed or served) and the error says why.
    /// `keep_older`: leave this user's older replicas of the same root and rank in place
    /// (`replica_remove_older` removes them later).
    #[pyo3(signature = (keep_older=false))]
    fn seal(&self, py: Python<'_>, keep_older: bool) -> PyResult<String> {
        self.writable.store(false, Ordering::Release);
        let res = py.detach(|| {
            let mut inc = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            let res = if keep_older {
                inc.seal_keeping_older()
            } else {
                inc.seal()
            };
            let restore_ok = res.is_ok() && inc.is_restore();
            (res, restore_ok)
        });
        let (res, restore_ok) = res;
        if restore_ok {
            self.writable.store(true, Ordering::Release);
        }
        res.map(|p| p.display().to_string())
            .map_err(|e| to_py(py, e))
    }

    /// A sealed pending restore (`replica_receive_pending`): write its part beside its file
    /// in the step's partial directory and commit the step when every part is there (the
    /// one commit protocol). Returns the committed directory, or None while a part is
    /// missing; on failure its part and file are taken out again.
    fn commit_pending(&self, py: Python<'_>) -> PyResult<Option<String>> {
        py.detach(|| {
            let inc = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            inc.commit_pending()
        })
        .map(|d| d.map(|p| p.display().to_string()))
        .map_err(|e| to_py(py, e))
    }

    /// Take a sealed pending restore's file (and part) out of the partial directory again.
    fn withdraw_pending(&self, py: Python<'_>) {
        py.detach(|| {
            let inc = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            inc.withdraw_pending();
        });
    }
}

/// `rank`'s committed file of a step, read into memory piece by piece as it is sent
/// (`shmckpt::replica::Outgoing`): `read_range(start, end)` reads a piece (GIL released);
/// numpy views the memory read-only through `__array_interface__` (keeping this object, and
/// so the memory, alive). Only the pieces read hold the file's bytes.
#[pyclass(module = "shmckpt._shmckpt", name = "ReplicaSource", frozen)]
pub(crate) struct PyReplicaSource {
    inner: Mutex<Outgoing>,
    ptr: usize,
    len: usize,
}

#[pymethods]
impl PyReplicaSource {
    /// Length in bytes (the manifest's).
    #[getter]
    fn nbytes(&self) -> usize {
        self.len
    }

    /// The numpy array interface: a read-only 1-D uint8 view of the image's memory.
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        array_interface(py, self.ptr, self.len, true)
    }

    fn __len__(&self) -> usize {
        self.len
    }

    /// Read bytes `[start, end)` of the file (GIL released), never what was read before:
    /// the bytes between the last read and `start` are skipped (left zero). A held
    /// image's sender reads only the pieces staging gave back.
    fn read_range(&self, py: Python<'_>, start: usize, end: usize) -> PyResult<()> {
        py.detach(|| {
            self.inner
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .read_range(start, end)
        })
        .map_err(|e| to_py(py, e))
    }
}

/// `rank`'s committed file of `step`, opened (checked: no link, regular, the manifest's
/// size, its header) to be read as it is sent (see `ReplicaSource`).
#[pyfunction]
fn replica_source(
    py: Python<'_>,
    root: PathBuf,
    step: u64,
    rank: u32,
) -> PyResult<PyReplicaSource> {
    py.detach(|| Outgoing::open(&root, step, rank))
        .map(|o| PyReplicaSource {
            ptr: o.as_ptr() as usize,
            len: o.len(),
            inner: Mutex::new(o),
        })
        .map_err(|e| to_py(py, e))
}

/// The held memory-only step `step` of `engine` as a replica source (see `ReplicaSource`):
/// its image copied out of staging (GIL released; `shmckpt::replica::Outgoing::memory_step`)
/// and this rank's manifest entry with the checksums computed from that copy, as JSON (the
/// receivers check the image against it). `NotFoundError` when the step is not held.
#[pyfunction]
fn replica_memory_source(
    py: Python<'_>,
    engine: PyRef<'_, crate::PyEngine>,
    step: u64,
) -> PyResult<(PyReplicaSource, String)> {
    let engine = engine.get()?;
    let o = py
        .detach(|| Outgoing::memory_step(&engine, step))
        .map_err(|e| to_py(py, e))?;
    let entry = serde_json::to_string(o.entry().expect("a memory-only step's entry"))
        .map_err(|e| to_py(py, shmckpt::Error::Internal(format!("entry to JSON: {e}"))))?;
    Ok((
        PyReplicaSource {
            ptr: o.as_ptr() as usize,
            len: o.len(),
            inner: Mutex::new(o),
        },
        entry,
    ))
}

/// A new replica arena for `rank`'s image of the memory-only `step` (see `ReplicaImage`),
/// checked by `seal()` against `entry`, the JSON manifest entry its sender computed
/// (`replica_memory_source`); `prepared` when given (made for this step and rank).
#[pyfunction]
#[pyo3(signature = (root, step, rank, entry, prepared=None))]
fn replica_receive_memory(
    py: Python<'_>,
    root: PathBuf,
    step: u64,
    rank: u32,
    entry: &str,
    prepared: Option<&PyPreparedArena>,
) -> PyResult<PyReplicaImage> {
    let entry: shmckpt::manifest::FileEntry = serde_json::from_str(entry).map_err(|e| {
        to_py(
            py,
            shmckpt::Error::Config(format!(
                "rank {rank}'s entry of memory-only step {step} is not a manifest entry: {e}"
            )),
        )
    })?;
    let prep = prepared.and_then(|p| p.inner.lock().unwrap_or_else(|p| p.into_inner()).take());
    py.detach(|| Incoming::replica_of_memory_step(&root, step, rank, entry, prep))
        .map(PyReplicaImage::new)
        .map_err(|e| to_py(py, e))
}

/// A replica arena made before its step is committed (`replica_prepare`): `len` bytes of
/// `/dev/shm` allocated for `rank`'s image of `step`, never listed or served; handed to
/// `replica_receive(..., prepared=...)` once the step is committed, removed if dropped
/// unused.
#[pyclass(name = "PreparedArena", module = "shmckpt._shmckpt")]
pub struct PyPreparedArena {
    inner: Mutex<Option<PreparedArena>>,
}

#[pymethods]
impl PyPreparedArena {
    /// Its size in bytes (0 once handed to `replica_receive`).
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map_or(0, |p| p.len())
    }
}

/// A replica arena of `len` bytes for `rank`'s image of `step` of `root`, made before the
/// step is committed (GIL released; see `PreparedArena`).
#[pyfunction]
fn replica_prepare(
    py: Python<'_>,
    root: PathBuf,
    step: u64,
    rank: u32,
    len: usize,
) -> PyResult<PyPreparedArena> {
    py.detach(|| PreparedArena::new(&root, step, rank, len))
        .map(|p| PyPreparedArena {
            inner: Mutex::new(Some(p)),
        })
        .map_err(|e| to_py(py, e))
}

/// A new replica arena for `rank`'s image of the committed `step` (see `ReplicaImage`):
/// `prepared` when given (made by `replica_prepare` for this step and rank, resized to the
/// manifest's size if its guess was wrong), else a new one.
#[pyfunction]
#[pyo3(signature = (root, step, rank, prepared=None))]
fn replica_receive(
    py: Python<'_>,
    root: PathBuf,
    step: u64,
    rank: u32,
    prepared: Option<&PyPreparedArena>,
) -> PyResult<PyReplicaImage> {
    let prep = match prepared {
        None => None,
        Some(p) => Some(
            p.inner
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take()
                .ok_or_else(|| {
                    to_py(
                        py,
                        shmckpt::Error::Config("this prepared arena was used already".into()),
                    )
                })?,
        ),
    };
    if let Some(p) = &prep
        && (p.step(), p.rank()) != (step, rank)
    {
        return Err(to_py(
            py,
            shmckpt::Error::Config(format!(
                "an arena prepared for rank {} of step {}, not rank {rank} of step {step}",
                p.rank(),
                p.step()
            )),
        ));
    }
    py.detach(|| match prep {
        Some(p) => Incoming::replica_prepared(p, &root),
        None => Incoming::replica(&root, step, rank),
    })
    .map(PyReplicaImage::new)
    .map_err(|e| to_py(py, e))
}

/// Private memory receiving `rank`'s image of the committed `step` to restore it (see
/// `ReplicaImage`: `seal()` checks it and writes the rank's file back).
#[pyfunction]
fn replica_receive_restore(
    py: Python<'_>,
    root: PathBuf,
    step: u64,
    rank: u32,
) -> PyResult<PyReplicaImage> {
    py.detach(|| Incoming::restore(&root, step, rank))
        .map(PyReplicaImage::new)
        .map_err(|e| to_py(py, e))
}

/// This user's replica of `rank`'s image of `step`, mapped read-only and checked in full
/// in place (a sealed `ReplicaImage`: sent to the rank that lost it without a copy).
#[pyfunction]
fn replica_serve(py: Python<'_>, root: PathBuf, step: u64, rank: u32) -> PyResult<PyReplicaImage> {
    py.detach(|| Incoming::serve(&root, step, rank))
        .map(PyReplicaImage::sealed)
        .map_err(|e| to_py(py, e))
}

/// This user's replica of `rank`'s image of the memory-only `step`, not committed yet,
/// mapped read-only and checked in full in place against the entry kept beside it (a sealed
/// `ReplicaImage`, sent to the rank that lost it so the step's commit can be completed).
#[pyfunction]
fn replica_serve_memory(
    py: Python<'_>,
    root: PathBuf,
    step: u64,
    rank: u32,
) -> PyResult<PyReplicaImage> {
    py.detach(|| Incoming::serve_memory(&root, step, rank))
        .map(PyReplicaImage::sealed)
        .map_err(|e| to_py(py, e))
}

/// The entry kept beside this user's replica of `rank`'s image of the memory-only `step`
/// (JSON), read back and checked (`shmckpt::replica::memory_entry`).
#[pyfunction]
fn replica_memory_entry(py: Python<'_>, root: PathBuf, step: u64, rank: u32) -> PyResult<String> {
    py.detach(|| shmckpt::replica::memory_entry(&root, step, rank))
        .map(|e| serde_json::to_string(&e).expect("manifest entries serialize"))
        .map_err(|e| to_py(py, e))
}

/// Private memory receiving `rank`'s image of the uncommitted `step` (world of
/// `world_size`) from a partner's replica of the memory-only step, checked against
/// `entry` (the partner's, JSON): `seal()` checks it and writes the rank's file into the
/// step's partial directory; `commit_pending()` then writes its part and commits.
#[pyfunction]
fn replica_receive_pending(
    py: Python<'_>,
    root: PathBuf,
    step: u64,
    rank: u32,
    world_size: u32,
    entry: &str,
) -> PyResult<PyReplicaImage> {
    let entry: shmckpt::manifest::FileEntry = serde_json::from_str(entry).map_err(|e| {
        to_py(
            py,
            shmckpt::Error::Config(format!(
                "rank {rank}'s entry of step {step} is not a manifest entry: {e}"
            )),
        )
    })?;
    py.detach(|| Incoming::restore_pending(&root, step, rank, world_size, entry))
        .map(PyReplicaImage::new)
        .map_err(|e| to_py(py, e))
}

/// Every replica in `/dev/shm`: `(name, root tag, source rank, step, bytes, owner uid)`.
#[pyfunction]
fn replica_list() -> Vec<(String, String, u32, u64, u64, u32)> {
    shmckpt::replica::list()
        .into_iter()
        .map(|r| {
            (
                r.name,
                r.root_tag,
                r.source_rank,
                r.step,
                r.bytes,
                r.owner_uid,
            )
        })
        .collect()
}

/// Remove this user's replica `name` from `/dev/shm`.
#[pyfunction]
fn replica_remove(py: Python<'_>, name: &str) -> PyResult<()> {
    shmckpt::replica::remove(name).map_err(|e| to_py(py, e))
}

/// This rank's manifest part of `step` (JSON), for a commit through the process group
/// (node-local roots; `shmckpt::commit::own_part`).
#[pyfunction]
fn group_own_part(py: Python<'_>, root: PathBuf, step: u64, rank: u32) -> PyResult<Vec<u8>> {
    py.detach(|| shmckpt::commit::own_part(&root, step, rank))
        .map_err(|e| to_py(py, e))
}

/// The steps not committed whose partial directory holds this rank's durable part and
/// its file (`shmckpt::commit::pending_steps`).
#[pyfunction]
fn pending_steps(py: Python<'_>, root: PathBuf, rank: u32) -> PyResult<Vec<u64>> {
    py.detach(|| shmckpt::commit::pending_steps(&root, rank))
        .map_err(|e| to_py(py, e))
}

/// Commit `step` in this machine's `root` from every rank's part
/// (`shmckpt::commit::commit_with_parts`); returns the committed directory.
#[pyfunction]
fn group_commit(
    py: Python<'_>,
    root: PathBuf,
    step: u64,
    rank: u32,
    parts: Vec<PyBackedBytes>,
    metadata: BTreeMap<String, String>,
) -> PyResult<String> {
    let borrowed: Vec<&[u8]> = parts.iter().map(|p| &p[..]).collect();
    py.detach(|| shmckpt::commit::commit_with_parts(&root, step, rank, &borrowed, &metadata))
        .map(|p| p.display().to_string())
        .map_err(|e| to_py(py, e))
}

/// Publish a peer's committed manifest of `step` in this machine's `root`
/// (`shmckpt::commit::adopt_manifest`); returns the step directory.
#[pyfunction]
fn group_adopt_manifest(
    py: Python<'_>,
    root: PathBuf,
    step: u64,
    manifest: PyBackedBytes,
) -> PyResult<String> {
    py.detach(|| shmckpt::commit::adopt_manifest(&root, step, &manifest))
        .map(|p| p.display().to_string())
        .map_err(|e| to_py(py, e))
}

/// Retention in this machine's `root` after a commit through the group (node-local
/// roots): keep the newest `keep` committed steps, delete the others
/// (`shmckpt::commit::apply_retention`, the engine's own retention); returns the deleted
/// steps.
#[pyfunction]
fn group_apply_retention(py: Python<'_>, root: PathBuf, keep: usize) -> PyResult<Vec<u64>> {
    py.detach(|| shmckpt::commit::apply_retention(&root, keep))
        .map_err(|e| to_py(py, e))
}

/// Set the committed `step` of `root` aside (`shmckpt::commit::set_aside`: renamed to
/// `step-N.aside-<unix ms>`, not listed or loaded, nothing deleted, its number free to save
/// again); returns the new directory, or None when the step is not committed there.
#[pyfunction]
fn group_set_aside(py: Python<'_>, root: PathBuf, step: u64) -> PyResult<Option<String>> {
    py.detach(|| shmckpt::commit::set_aside(&root, step))
        .map(|d| d.map(|d| d.display().to_string()))
        .map_err(|e| to_py(py, e))
}

/// Remove this user's replicas of `rank`'s images of `root` other than `step`'s (GIL
/// released).
/// With `keep`, that step's replica stays too (a memory-only step's replica does not
/// replace the newest committed step's).
#[pyfunction]
#[pyo3(signature = (root, rank, step, keep=None))]
fn replica_remove_older(
    py: Python<'_>,
    root: PathBuf,
    rank: u32,
    step: u64,
    keep: Option<u64>,
) -> PyResult<()> {
    py.detach(|| shmckpt::replica::remove_older_keeping(&root, rank, step, keep))
        .map_err(|e| to_py(py, e))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(replica_remove_older, m)?)?;
    m.add_function(wrap_pyfunction!(group_set_aside, m)?)?;
    m.add_function(wrap_pyfunction!(group_own_part, m)?)?;
    m.add_function(wrap_pyfunction!(pending_steps, m)?)?;
    m.add_function(wrap_pyfunction!(group_commit, m)?)?;
    m.add_function(wrap_pyfunction!(group_adopt_manifest, m)?)?;
    m.add_function(wrap_pyfunction!(group_apply_retention, m)?)?;
    m.add_function(wrap_pyfunction!(replica_plan, m)?)?;
    m.add_function(wrap_pyfunction!(replica_latest, m)?)?;
    m.add_function(wrap_pyfunction!(replica_name, m)?)?;
    m.add_function(wrap_pyfunction!(replica_tag, m)?)?;
    m.add_function(wrap_pyfunction!(replica_read_committed, m)?)?;
    m.add_function(wrap_pyfunction!(replica_store, m)?)?;
    m.add_function(wrap_pyfunction!(replica_prepare, m)?)?;
    m.add_class::<PyPreparedArena>()?;
    m.add_function(wrap_pyfunction!(replica_receive, m)?)?;
    m.add_function(wrap_pyfunction!(replica_serve, m)?)?;
    m.add_function(wrap_pyfunction!(replica_serve_memory, m)?)?;
    m.add_function(wrap_pyfunction!(replica_memory_entry, m)?)?;
    m.add_function(wrap_pyfunction!(replica_receive_pending, m)?)?;
    m.add_function(wrap_pyfunction!(replica_source, m)?)?;
    m.add_function(wrap_pyfunction!(replica_memory_source, m)?)?;
    m.add_function(wrap_pyfunction!(replica_receive_memory, m)?)?;
    m.add_class::<PyReplicaSource>()?;
    m.add_function(wrap_pyfunction!(replica_receive_restore, m)?)?;
    m.add_class::<PyReplicaImage>()?;
    m.add_function(wrap_pyfunction!(replica_load, m)?)?;
    m.add_function(wrap_pyfunction!(replica_restore_file, m)?)?;
    m.add_function(wrap_pyfunction!(replica_list, m)?)?;
    m.add_function(wrap_pyfunction!(replica_remove, m)?)
}
