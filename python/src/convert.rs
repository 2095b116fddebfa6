//! What the extension's modules hand to Python and check of what Python hands them: a
//! loaded checkpoint's tuple, host and device destination ranges. In a file of their own
//! (as `util.rs`) so that the modules `lib.rs` imports do not import `lib.rs`.

use std::collections::BTreeMap;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::buffer::PyBuffer;
use crate::core;

/// A loaded checkpoint as `Engine.load` returns it.
pub(crate) type Loaded = (
    u64,
    String,
    BTreeMap<String, String>,
    Vec<(String, String, Vec<usize>, PyBuffer)>,
);

/// A loaded checkpoint as `load` and `load_remote` return it: `(step, dir, metadata,
/// [(name, dtype, shape, Buffer)])`, each tensor's bytes owned by its buffer.
pub(crate) fn loaded(ck: shmckpt::Checkpoint) -> Loaded {
    let tensors = ck
        .tensors
        .into_iter()
        .map(|t| {
            let dtype = core::dtype_name(t.dtype).to_owned();
            (t.name, dtype, t.shape, PyBuffer::new(t.data))
        })
        .collect();
    (
        ck.step,
        ck.dir.to_string_lossy().into_owned(),
        ck.metadata,
        tensors,
    )
}

/// Host destinations `(name, address, nbytes)`: none may overlap another
/// ([`check_disjoint`]) or have a null address and bytes (`core::host_slices` makes slices
/// of them).
pub(crate) fn check_host_ranges(dest: &[(String, u64, usize)]) -> PyResult<()> {
    check_disjoint(dest.iter().map(|(n, p, l)| (n.as_str(), *p, *l)))?;
    if let Some((n, _, _)) = dest.iter().find(|(_, p, l)| *p == 0 && *l > 0) {
        return Err(PyValueError::new_err(format!(
            "destination {n:?} has a null address"
        )));
    }
    Ok(())
}

/// Overlapping destinations would alias mutable memory: refuse them.
pub(crate) fn check_disjoint<'a>(
    ranges: impl Iterator<Item = (&'a str, u64, usize)>,
) -> PyResult<()> {
    let mut v: Vec<(u64, u64, &str)> = ranges
        .filter(|(_, _, l)| *l > 0)
        .map(|(n, p, l)| (p, p.saturating_add(l as u64), n))
        .collect();
    v.sort_unstable();
    for w in v.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(PyValueError::new_err(format!(
                "destinations {:?} and {:?} overlap in memory",
                w[0].2, w[1].2
            )));
        }
    }
    Ok(())
}
