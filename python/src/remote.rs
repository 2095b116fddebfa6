//! The remote tier's side of the extension: the bodies of `Engine.list_remote`,
//! `Engine.load_remote`, `Engine.load_into_device_remote`, `Engine.remote_file_metadata` and
//! `Engine.remote_manifest` (`SaveHandle.wait_remote` is in
//! `handle.rs`).

use std::collections::BTreeMap;

use pyo3::prelude::*;

use crate::convert::{Loaded, loaded};
use crate::{PyEngine, core, lock, to_py};

pub(crate) fn list_remote(e: &PyEngine, py: Python<'_>) -> PyResult<Vec<u64>> {
    let engine = e.get()?;
    py.detach(|| core::list_remote(&engine))
        .map_err(|err| to_py(py, err))
}

pub(crate) fn load_remote(e: &PyEngine, py: Python<'_>, step: Option<u64>) -> PyResult<Loaded> {
    let engine = e.get()?;
    let ck = py
        .detach(|| core::load_remote(&engine, step))
        .map_err(|err| to_py(py, err))?;
    *lock(&e.last_load) = Some(("remote", None));
    Ok(loaded(ck))
}

pub(crate) fn remote_manifest(e: &PyEngine, py: Python<'_>, step: u64) -> PyResult<String> {
    let engine = e.get()?;
    py.detach(|| core::remote_manifest_json(&engine, step))
        .map_err(|err| to_py(py, err))
}

/// What `Engine.load_into_device_remote` returns: `(step, bytes, staged, staging,
/// seconds)`.
pub(crate) type DeviceLoaded = (u64, u64, u64, u64, f64);

pub(crate) fn load_into_device_remote(
    e: &PyEngine,
    py: Python<'_>,
    step: Option<u64>,
    dest: Vec<(String, Bound<'_, PyAny>, i32)>,
) -> PyResult<DeviceLoaded> {
    let engine = e.get()?;
    // Each capsule's tensor, checked and owned (its memory allocated) until it drops.
    let dest = crate::intake::device_dest(&dest)?;
    let got = py.detach(|| {
        // SAFETY: each destination is the memory of a writable, C-contiguous CUDA tensor of
        // its device, kept allocated by `dest` for the call; none overlapping another.
        // Exclusive use during the call is the caller's contract (the Python wrapper
        // synchronized the destinations' streams and queues no work on them until the call
        // returns).
        unsafe { core::load_into_device_remote(&engine, step, &dest) }
    });
    drop(dest);
    let got = got.map_err(|err| to_py(py, err))?;
    *lock(&e.last_load) = Some(("remote", None));
    let r = (
        got.step,
        got.bytes,
        got.staged,
        got.staging,
        got.elapsed.as_secs_f64(),
    );
    *lock(&e.last_remote_device_load) = Some(r);
    Ok(r)
}

pub(crate) fn remote_file_metadata(
    e: &PyEngine,
    py: Python<'_>,
    step: u64,
) -> PyResult<BTreeMap<String, String>> {
    let engine = e.get()?;
    py.detach(|| core::remote_file_metadata(&engine, step))
        .map_err(|err| to_py(py, err))
}
