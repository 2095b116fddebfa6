//! `read_rank_ranges`: only the requested tensors of one rank file
//! (`shmckpt::restore::load_ranges`, through the device read ring of `dcp.rs` when some go
//! to device memory), used by `shmckpt.dcp.ShmckptReader` so that a rank reads the bytes
//! of its load plan and not whole files.

use std::collections::BTreeMap;
use std::path::PathBuf;

use pyo3::prelude::*;
use shmckpt::BackendKind;
use shmckpt::restore::{RangeDest, RangeRequest, RangedOptions, ReadOptions};

use crate::{PyBuffer, core, to_py};

/// `(name, dtype, shape, crc32c, absolute file offset, nbytes, Buffer or None)`.
type ReadTensor = (String, String, Vec<usize>, u32, u64, u64, Option<PyBuffer>);

/// `(file name, metadata, tensors, stats)`.
type RangesRead = (
    String,
    BTreeMap<String, String>,
    Vec<ReadTensor>,
    BTreeMap<&'static str, u64>,
);

/// Read only the tensors requested of the file of `rank` in the committed checkpoint
/// directory `dir`: `names` come back in buffers of their own; `host` lists `(tensor name,
/// capsule, begin)`: bytes `[begin, begin + nbytes)` of the tensor go to the host memory of
/// the DLPack capsule (a writable, C-contiguous CPU tensor of `nbytes` bytes); `device`
/// lists `(tensor name, capsule, device)`: the whole tensor goes to that CUDA tensor's
/// memory (through the registered read ring). Each tensor is read
/// whole, once, and its CRC-32C verified against the manifest; neighbouring tensors at
/// most `gap` bytes apart (`None`: `shmckpt::restore::DEFAULT_GAP`, 128 KiB) are read
/// together. Returns `(file name, metadata, [(name, dtype,
/// shape, crc32c, file offset, nbytes, Buffer or None)] of each requested tensor in file
/// order, {"bytes", "reads", "tensors", "direct_io"})`.
#[pyfunction]
#[pyo3(signature = (dir, rank, names, *, direct_io=true, queue_depth=4, gap=None, device=None, host=None))]
#[allow(clippy::too_many_arguments)]
fn read_rank_ranges(
    py: Python<'_>,
    dir: PathBuf,
    rank: u32,
    names: Vec<String>,
    direct_io: bool,
    queue_depth: u32,
    gap: Option<u64>,
    device: Option<Vec<(String, Bound<'_, PyAny>, i32)>>,
    host: Option<Vec<(String, Bound<'_, PyAny>, u64)>>,
) -> PyResult<RangesRead> {
    let opts = RangedOptions {
        read: ReadOptions {
            backend: BackendKind::Auto,
            queue_depth: queue_depth.max(1),
            direct_io,
            arena: None,
            // A DCP checkpoint directory is named by its trainer: its manifest's step is
            // the writer's own number.
            any_dir_name: true,
        },
        gap: gap.unwrap_or(shmckpt::restore::DEFAULT_GAP),
    };
    // Each capsule's tensor, checked and owned (its memory allocated) until it drops.
    let device = crate::intake::device_dest(&device.unwrap_or_default())?;
    let host = host.unwrap_or_default();
    let begins: Vec<u64> = host.iter().map(|(_, _, b)| *b).collect();
    let host_objs: Vec<(String, Bound<'_, PyAny>)> =
        host.into_iter().map(|(n, o, _)| (n, o)).collect();
    let mut host_dest = crate::intake::host_dest(&host_objs)?;
    let loaded = py
        .detach(|| {
            // SAFETY: host memory kept allocated by `host_dest` (checked by `host_dest`:
            // writable, not overlapping another); the Python caller does not use the
            // destination tensors until the call returns.
            let mut bufs = unsafe { core::host_slices(&mut host_dest) };
            let mut requests: Vec<RangeRequest<'_>> = names
                .iter()
                .map(|n| RangeRequest::owned(n.as_str()))
                .collect();
            for ((name, buf), begin) in bufs.iter_mut().zip(&begins) {
                let end =
                    begin
                        .checked_add(buf.len() as u64)
                        .ok_or(shmckpt::Error::Destination {
                            name: (*name).to_owned(),
                            reason: "byte range overflows".into(),
                        })?;
                requests.push(RangeRequest {
                    name,
                    range: Some((*begin, end)),
                    dest: RangeDest::Host(buf),
                });
            }
            if device.is_empty() {
                return shmckpt::restore::load_ranges(&dir, rank, &mut requests, &opts);
            }
            for (n, m) in &device {
                // SAFETY: CUDA memory kept allocated by `device` (checked by `device_dest`:
                // of its device, not overlapping another); the Python caller synchronized
                // the tensors' streams before the call and does not use them meanwhile.
                if let Some(slice) = unsafe { m.device_slice() } {
                    requests.push(RangeRequest {
                        name: n.as_str(),
                        range: None,
                        dest: RangeDest::Device(slice),
                    });
                }
            }
            let ring = crate::dcp::ring()?;
            // SAFETY: as above, for every device range.
            unsafe { ring.load_ranges(&dir, rank, &mut requests, &opts) }
        })
        .map_err(|e| to_py(py, e))?;
    // The tensors asked for, in file order; the bytes of those in `names`.
    let mut buffers: BTreeMap<&str, PyBuffer> = BTreeMap::new();
    for (name, data) in names.iter().zip(loaded.owned) {
        if let Some(data) = data {
            buffers.insert(name.as_str(), PyBuffer::new(data));
        }
    }
    let asked: std::collections::BTreeSet<&str> = names
        .iter()
        .map(String::as_str)
        .chain(host_dest.iter().map(|(n, _)| n.as_str()))
        .chain(device.iter().map(|(n, _)| n.as_str()))
        .collect();
    let entry = loaded.entry;
    let mut tensors = Vec::with_capacity(asked.len());
    for e in entry.tensors {
        if !asked.contains(e.name.as_str()) {
            continue;
        }
        let offset = entry.data_start.saturating_add(e.data_offsets[0]);
        let nbytes = e.len();
        let dtype = core::dtype_name(e.dtype).to_owned();
        let data = buffers.remove(e.name.as_str());
        tensors.push((e.name, dtype, e.shape, e.crc32c, offset, nbytes, data));
    }
    let s = loaded.stats;
    let stats = BTreeMap::from([
        ("bytes", s.bytes),
        ("reads", s.reads),
        ("tensors", s.tensors as u64),
        ("direct_io", u64::from(s.direct_io)),
    ]);
    Ok((entry.file, loaded.manifest.metadata, tensors, stats))
}

/// Add this file's functions to the extension module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(read_rank_ranges, m)?)
}
