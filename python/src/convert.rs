//! What the extension's modules hand to Python and check of what Python hands them: a
//! loaded checkpoint's tuple, destinations that must not overlap. In a file of their own
//! (as `util.rs`) so that the modules `lib.rs` imports do not import `lib.rs`.

use std::collections::BTreeMap;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::buffer::PyBuffer;
use crate::core;
use crate::dlpack::Memory;

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

/// Overlapping destinations would alias mutable memory: refuse them.
pub(crate) fn check_disjoint<'a>(
    dest: impl Iterator<Item = (&'a str, &'a Memory)>,
) -> PyResult<()> {
    let mut v: Vec<(u64, u64, &str)> = dest
        .filter(|(_, m)| m.len() > 0)
        .map(|(n, m)| (m.addr(), m.addr().saturating_add(m.len() as u64), n))
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
