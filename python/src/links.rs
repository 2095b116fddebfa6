//! Named links to committed steps (`latest`, `best`): publish, read, list, remove.

use pyo3::prelude::*;

use crate::{core, to_py};

/// Publish `root/name` as a link to committed checkpoint `step` (atomically, durably);
/// returns the step the name linked to before, if any. `NotFound` when `step` is not
/// committed, `UnsafePath` for a name that is not one path component, is shmckpt's own
/// (`step-*`, `.shmckpt*`) or is a directory.
#[pyfunction]
fn link_step(
    py: Python<'_>,
    root: std::path::PathBuf,
    name: String,
    step: u64,
) -> PyResult<Option<u64>> {
    py.detach(|| core::link_step(&root, &name, step))
        .map_err(|e| to_py(py, e))
}

/// The step `root/name` links to (directly, or through links to other names of `root`) or
/// is reserved for, `None` when it is missing or not such a name. Links are read, never
/// followed.
#[pyfunction]
fn linked_step(py: Python<'_>, root: std::path::PathBuf, name: String) -> PyResult<Option<u64>> {
    py.detach(|| core::linked_step(&root, &name))
        .map_err(|e| to_py(py, e))
}

/// Every step some name of `root` names (published or reserved), ascending.
#[pyfunction]
fn linked_steps(py: Python<'_>, root: std::path::PathBuf) -> PyResult<Vec<u64>> {
    py.detach(|| core::linked_steps(&root))
        .map_err(|e| to_py(py, e))
}

/// Reserve `root/name` for the save of `step` in flight, unless the name exists: a small
/// regular file that `link_step` replaces once the step is committed, so the name exists
/// at once. Returns whether it was made.
#[pyfunction]
fn reserve_name(
    py: Python<'_>,
    root: std::path::PathBuf,
    name: String,
    step: u64,
) -> PyResult<bool> {
    py.detach(|| core::reserve_name(&root, &name, step))
        .map_err(|e| to_py(py, e))
}

/// What `root/name` leads to: `(step, None)` for a link to `step-N` (directly or through
/// other names), `(step, reservation's name)` for a name reserved for a save not
/// published, `None` otherwise.
#[pyfunction]
fn resolve_name(
    py: Python<'_>,
    root: std::path::PathBuf,
    name: String,
) -> PyResult<Option<(u64, Option<String>)>> {
    py.detach(|| core::resolve_name(&root, &name))
        .map_err(|e| to_py(py, e))
}

/// Remove `root/name` (a link or a regular file), durably; returns the step it linked to.
/// The step itself stays (`Engine.remove`).
#[pyfunction]
fn unlink_name(py: Python<'_>, root: std::path::PathBuf, name: String) -> PyResult<Option<u64>> {
    py.detach(|| core::unlink_name(&root, &name))
        .map_err(|e| to_py(py, e))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(link_step, m)?)?;
    m.add_function(wrap_pyfunction!(linked_step, m)?)?;
    m.add_function(wrap_pyfunction!(linked_steps, m)?)?;
    m.add_function(wrap_pyfunction!(unlink_name, m)?)?;
    m.add_function(wrap_pyfunction!(reserve_name, m)?)?;
    m.add_function(wrap_pyfunction!(resolve_name, m)?)?;
    Ok(())
}
