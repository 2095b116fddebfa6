//! Extension calls used by `shmckpt.replicas` (peer replicas, `docs/replicas.md`): the
//! partner plan, replica names, and the checked reads and writes of images, all in the
//! crate's `shmckpt::replica`. The transport (torch.distributed) is the Python module's.
//! Every call that reads or writes an image releases the GIL.

use std::collections::BTreeMap;
use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;

use crate::{PyBuffer, to_py};

/// For each rank, the ranks that hold its replicas (`nodes[r]`: rank r's machine).
#[pyfunction]
fn replica_plan(py: Python<'_>, nodes: Vec<String>, replicas: u32) -> PyResult<Vec<Vec<u32>>> {
    shmckpt::replica::plan(&nodes, replicas).map_err(|e| to_py(py, e))
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

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(group_own_part, m)?)?;
    m.add_function(wrap_pyfunction!(group_commit, m)?)?;
    m.add_function(wrap_pyfunction!(group_adopt_manifest, m)?)?;
    m.add_function(wrap_pyfunction!(replica_plan, m)?)?;
    m.add_function(wrap_pyfunction!(replica_name, m)?)?;
    m.add_function(wrap_pyfunction!(replica_tag, m)?)?;
    m.add_function(wrap_pyfunction!(replica_read_committed, m)?)?;
    m.add_function(wrap_pyfunction!(replica_store, m)?)?;
    m.add_function(wrap_pyfunction!(replica_load, m)?)?;
    m.add_function(wrap_pyfunction!(replica_restore_file, m)?)?;
    m.add_function(wrap_pyfunction!(replica_list, m)?)?;
    m.add_function(wrap_pyfunction!(replica_remove, m)?)
}
