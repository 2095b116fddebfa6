//! Extension calls used by `shmckpt.dcp` (the PyTorch Distributed Checkpoint backend).
//!
//! A DCP checkpoint written by `ShmckptWriter` is a committed shmckpt step directory
//! (`manifest.json` + `rank-K-of-W.safetensors`) plus DCP's `.metadata`. Saving goes
//! through the ordinary `Engine`; loading on another world size needs any rank's file, not
//! only the reader's own, which `Engine::load` does not offer: `read_rank_file` reads one
//! rank's file of a step directory through `shmckpt::restore` (the engine's reader:
//! O_DIRECT where the filesystem allows, every CRC-32C verified against the manifest).

use std::path::PathBuf;

use pyo3::prelude::*;
use shmckpt::BackendKind;
use shmckpt::restore::{ReadOptions, load_owned, rank_file};

use crate::{PyBuffer, core, to_py};

/// `(name, dtype, shape, crc32c, absolute file offset, Buffer)`.
type ReadTensor = (String, String, Vec<usize>, u32, u64, PyBuffer);

/// Read the file of `rank` in the committed step directory `dir` into owned buffers,
/// verifying the header against the manifest and every tensor's CRC-32C. Returns
/// `(file name, metadata, [(name, dtype, shape, crc32c, file offset, Buffer)])` in file
/// order (CRC and offset as the manifest records them).
#[pyfunction]
#[pyo3(signature = (dir, rank, *, direct_io=true, queue_depth=4))]
fn read_rank_file(
    py: Python<'_>,
    dir: PathBuf,
    rank: u32,
    direct_io: bool,
    queue_depth: u32,
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
    };
    let (entry, ck) = py
        .detach(|| {
            let (_, entry) = rank_file(&dir, rank)?;
            let ck = load_owned(&dir, rank, &opts)?;
            Ok::<_, shmckpt::Error>((entry, ck))
        })
        .map_err(|e| to_py(py, e))?;
    let mut tensors = Vec::with_capacity(ck.tensors.len());
    for t in ck.tensors {
        // Both lists come from one parse of the same manifest (read twice): match by name.
        let Some(e) = entry.tensors.iter().find(|e| e.name == t.name) else {
            return Err(to_py(
                py,
                shmckpt::Error::Corrupt {
                    path: dir.join(&entry.file),
                    tensor: Some(t.name.clone()),
                    reason: "the manifest changed while the file was read".into(),
                },
            ));
        };
        let offset = entry.data_start.saturating_add(e.data_offsets[0]);
        let dtype = core::dtype_name(t.dtype).to_owned();
        tensors.push((
            t.name,
            dtype,
            t.shape,
            e.crc32c,
            offset,
            PyBuffer::new(t.data),
        ));
    }
    Ok((entry.file, ck.metadata, tensors))
}

/// Add this file's functions to the extension module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(read_rank_file, m)?)
}
