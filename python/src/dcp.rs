//! Extension calls used by `shmckpt.dcp` (the PyTorch Distributed Checkpoint backend).
//!
//! A DCP checkpoint written by `ShmckptWriter` is a committed shmckpt step directory
//! (`manifest.json` + `rank-K-of-W.safetensors`) plus DCP's `.metadata`. Saving goes
//! through the ordinary `Engine`; loading on another world size needs any rank's file, not
//! only the reader's own, which `Engine::load` does not offer: `read_rank_file` reads one
//! rank's file of a step directory through `shmckpt::restore` (the engine's reader:
//! O_DIRECT where the filesystem allows, every CRC-32C verified against the manifest),
//! sending the tensors it is given device destinations for straight to the device through
//! one process-wide ring of CUDA-registered read buffers (host destinations through the
//! same buffers, never registering them).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use shmckpt::restore::{DeviceRing, ReadOptions};
use shmckpt::{BackendKind, DeviceSlice};

use crate::{PyBuffer, core, lock, to_py};

/// `(name, dtype, shape, crc32c, absolute file offset, nbytes, Buffer or None)`.
type ReadTensor = (String, String, Vec<usize>, u32, u64, u64, Option<PyBuffer>);

/// The registered read buffers of device reads (made at the first one; the engine defaults, 12 × 32 MiB).
static RING: Mutex<Option<Arc<DeviceRing>>> = Mutex::new(None);

pub(crate) fn ring() -> shmckpt::Result<Arc<DeviceRing>> {
    let mut r = lock(&RING);
    if let Some(r) = &*r {
        return Ok(Arc::clone(r));
    }
    let made = Arc::new(DeviceRing::new(
        shmckpt::DEFAULT_DEVICE_READ,
        shmckpt::DEFAULT_DEVICE_READ_DEPTH,
    )?);
    *r = Some(Arc::clone(&made));
    Ok(made)
}

/// Read the file of `rank` in the committed step directory `dir` once, verifying the
/// header against the manifest and every tensor's CRC-32C. `device` lists `(tensor name,
/// capsule, device)` and `host` `(tensor name, capsule)`, each capsule a DLPack capsule of
/// a writable, C-contiguous CUDA tensor of that device or CPU tensor (as
/// `Engine.load_into_device` and `Engine.load_into` take them): those tensors are copied to
/// that memory (exactly their size) as the file is read, the others
/// come back in buffers of their own. Returns `(file name, metadata, [(name, dtype, shape,
/// crc32c, file offset, nbytes, Buffer or None)])` in file order (CRC and offset as the
/// manifest records them; `None` for a tensor copied to a destination). `step`: the step
/// the caller knows `dir` holds (a link or its name says so): a manifest of another step
/// is `CorruptError` naming both (`None`: any manifest, as for a DCP checkpoint directory,
/// which its trainer names).
#[pyfunction]
#[pyo3(signature = (dir, rank, *, direct_io=true, queue_depth=4, device=None, host=None, step=None))]
#[allow(clippy::too_many_arguments)]
fn read_rank_file(
    py: Python<'_>,
    dir: PathBuf,
    rank: u32,
    direct_io: bool,
    queue_depth: u32,
    device: Option<Vec<(String, Bound<'_, PyAny>, i32)>>,
    host: Option<Vec<(String, Bound<'_, PyAny>)>>,
    step: Option<u64>,
) -> PyResult<(
    String,
    std::collections::BTreeMap<String, String>,
    Vec<ReadTensor>,
)> {
    let opts = ReadOptions {
        backend: BackendKind::Auto,
        queue_depth: queue_depth.max(1),
        direct_io,
        arena: None,
        // A DCP checkpoint directory is named by its trainer (`step-100`,
        // `checkpoint-500`): its manifest's step is the writer's own number. A caller that
        // knows the step passes it, checked against the manifest the read used (below).
        any_dir_name: true,
    };
    // Each capsule's tensor, checked and owned (its memory allocated) until it drops.
    let device = crate::intake::device_dest(&device.unwrap_or_default())?;
    let mut host = crate::intake::host_dest(&host.unwrap_or_default())?;
    let loaded = py.detach(|| {
        if device.is_empty() && host.is_empty() {
            return shmckpt::restore::load_split_host(&dir, rank, &opts);
        }
        let ring = ring()?;
        let slices: Vec<(&str, DeviceSlice<'_>)> = device
            .iter()
            .filter_map(|(n, m)| {
                // SAFETY: CUDA memory kept allocated by `device` (checked by
                // `device_dest`: of its device, not overlapping another); the Python
                // caller synchronized the tensors' streams before the call and does not
                // use them meanwhile.
                unsafe { m.device_slice() }.map(|s| (n.as_str(), s))
            })
            .collect();
        // SAFETY: host memory kept allocated by `host` (checked by `host_dest`: writable,
        // not overlapping another), used by nobody else until the call returns.
        let mut bufs = unsafe { core::host_slices(&mut host) };
        // SAFETY: as above, for every range in `slices`.
        unsafe { ring.load_split(&dir, rank, &slices, &mut bufs, &opts) }
    });
    drop((device, host)); // (GIL held: a producer's deleter may take it)
    let loaded = loaded.map_err(|e| to_py(py, e))?;
    if let Some(step) = step {
        // The manifest the bytes were read and verified against: no window between a check
        // and the read for a directory swapped meanwhile.
        loaded
            .manifest
            .expect_step(step, &dir, "the caller's link")
            .map_err(|e| to_py(py, e))?;
    }
    let entry = loaded.entry;
    let mut tensors = Vec::with_capacity(entry.tensors.len());
    for (e, data) in entry.tensors.into_iter().zip(loaded.host) {
        let offset = entry.data_start.saturating_add(e.data_offsets[0]);
        let nbytes = e.len();
        let dtype = core::dtype_name(e.dtype).to_owned();
        tensors.push((
            e.name,
            dtype,
            e.shape,
            e.crc32c,
            offset,
            nbytes,
            data.map(PyBuffer::new),
        ));
    }
    Ok((entry.file, loaded.manifest.metadata, tensors))
}

/// `(file, data_start, [(tensor, begin, end, crc32c)])` of one rank file of an assembled
/// manifest (offsets relative to the data section, as in the manifest).
type AssembledFile = (String, u64, Vec<(String, u64, u64, u32)>);

/// Commit the ranks of one DCP save (`shmckpt::commit::assemble_ranks`): move rank K's
/// durable file from `sources[K]` (the partial directory of its part-only save) into the
/// new directory `out`
/// and write `out/manifest.json` (of step `step`, or N when `target` is named `step-N`).
/// Returns `(step, [(file, data_start, [(tensor, begin, end, crc32c)])])` in rank order.
#[pyfunction]
#[pyo3(signature = (sources, out, step, target, metadata))]
fn assemble_ranks(
    py: Python<'_>,
    sources: Vec<PathBuf>,
    out: PathBuf,
    step: u64,
    target: PathBuf,
    metadata: std::collections::BTreeMap<String, String>,
) -> PyResult<(u64, Vec<AssembledFile>)> {
    let m = py
        .detach(|| shmckpt::commit::assemble_ranks(&sources, &out, step, Some(&target), &metadata))
        .map_err(|e| to_py(py, e))?;
    let files = m
        .files
        .into_iter()
        .map(|f| {
            let tensors = f
                .tensors
                .into_iter()
                .map(|t| (t.name, t.data_offsets[0], t.data_offsets[1], t.crc32c))
                .collect();
            (f.file, f.data_start, tensors)
        })
        .collect();
    Ok((m.step, files))
}

/// The partial directories of `step` that part-only saves left in the engine roots
/// directly under `dir` (`shmckpt::commit::find_parts`; links not followed), sorted.
#[pyfunction]
fn find_parts(py: Python<'_>, dir: PathBuf, step: u64) -> PyResult<Vec<String>> {
    let found = py
        .detach(|| shmckpt::commit::find_parts(&dir, step))
        .map_err(|e| to_py(py, e))?;
    Ok(found
        .into_iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect())
}

/// `(name, bytes)` pairs as the commit protocol takes them.
fn borrowed(files: &[(String, Vec<u8>)]) -> Vec<(&str, &[u8])> {
    files
        .iter()
        .map(|(n, b)| (n.as_str(), b.as_slice()))
        .collect()
}

/// Write `files` (`(name, bytes)`: DCP's `.metadata`) durably into the assembled
/// directory `dir` and publish it as `target` with one rename; with `replace` (a marker
/// file name), a directory holding that file is replaced atomically
/// (`shmckpt::commit::publish_dir_replacing`).
#[pyfunction]
#[pyo3(signature = (dir, files, target, replace=None))]
fn publish_dir(
    py: Python<'_>,
    dir: PathBuf,
    files: Vec<(String, Vec<u8>)>,
    target: PathBuf,
    replace: Option<String>,
) -> PyResult<()> {
    py.detach(|| {
        shmckpt::commit::publish_dir_replacing(&dir, &borrowed(&files), &target, replace.as_deref())
    })
    .map_err(|e| to_py(py, e))
}

/// Write `files` durably into the assembled directory `dir`, then move its rank files,
/// `manifest.json` and, last, `files` into the existing directory `target`
/// (`shmckpt::commit::publish_into`: Megatron's checkpoint directory).
#[pyfunction]
fn publish_into(
    py: Python<'_>,
    dir: PathBuf,
    files: Vec<(String, Vec<u8>)>,
    target: PathBuf,
) -> PyResult<()> {
    py.detach(|| shmckpt::commit::publish_into(&dir, &borrowed(&files), &target))
        .map_err(|e| to_py(py, e))
}

/// The `__metadata__` of the file of `rank` in the committed step directory `dir`, read
/// after its header is checked against the manifest (tensors, and the header's CRC-32C
/// where the manifest records one). The file is opened without following a link. `step`
/// as for `read_rank_file`.
#[pyfunction]
#[pyo3(signature = (dir, rank, *, step=None))]
fn rank_file_metadata(
    py: Python<'_>,
    dir: PathBuf,
    rank: u32,
    step: Option<u64>,
) -> PyResult<std::collections::BTreeMap<String, String>> {
    py.detach(|| {
        let m = shmckpt::Manifest::read_any_name(&dir)?;
        if let Some(step) = step {
            m.expect_step(step, &dir, "the caller's link")?;
        }
        let entry =
            m.files
                .iter()
                .find(|f| f.rank == rank)
                .ok_or_else(|| shmckpt::Error::Corrupt {
                    path: dir.join(shmckpt::manifest::MANIFEST),
                    tensor: None,
                    reason: format!("the manifest has no file of rank {rank}"),
                })?;
        shmckpt::restore::read_file_metadata(&dir.join(&entry.file), entry)
    })
    .map_err(|e| to_py(py, e))
}

/// Free the registered read buffers of device reads (the next device read makes them
/// again).
#[pyfunction]
fn release_device_ring(py: Python<'_>) {
    py.detach(|| drop(lock(&RING).take()));
}

/// Add this file's functions to the extension module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(read_rank_file, m)?)?;
    m.add_function(wrap_pyfunction!(rank_file_metadata, m)?)?;
    m.add_function(wrap_pyfunction!(assemble_ranks, m)?)?;
    m.add_function(wrap_pyfunction!(find_parts, m)?)?;
    m.add_function(wrap_pyfunction!(publish_dir, m)?)?;
    m.add_function(wrap_pyfunction!(publish_into, m)?)?;
    m.add_function(wrap_pyfunction!(release_device_ring, m)?)
}
