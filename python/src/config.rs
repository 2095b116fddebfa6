//! `Engine(root, config)`: the engine settings cross from Python once, as one mapping.
//!
//! The Python package groups its settings (`shmckpt.config`: `Tuning`, `RemoteTier`,
//! `Replicas`, `Cadence`) and flattens them into one dict of the keys below
//! (`EngineSettings` of the stub); it is converted here into [`EngineOpts`], which
//! `core::open` turns into the crate's `EngineConfig`. A missing key, or `None`, takes the
//! default; a key not listed is a `TypeError` naming it (a typo is never ignored).

use std::path::PathBuf;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::core::{self, EngineOpts};

/// `disk_every`: an int or a string.
pub struct DiskEveryArg(core::DiskEvery);

impl<'a, 'py> FromPyObject<'a, 'py> for DiskEveryArg {
    type Error = PyErr;

    fn extract(ob: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(n) = ob.extract::<u64>() {
            return Ok(DiskEveryArg(core::DiskEvery::N(n)));
        }
        if let Ok(s) = ob.extract::<String>() {
            return Ok(DiskEveryArg(core::DiskEvery::Mode(s)));
        }
        Err(PyValueError::new_err(
            "disk_every must be a number >= 1 or \"auto\"",
        ))
    }
}

/// The keys `Engine(root, config)` reads (`EngineSettings` of the stub): any other key
/// of the mapping is refused.
pub const KEYS: &[&str] = &[
    "rank",
    "world_size",
    "staging_capacity",
    "chunk_size",
    "writer_threads",
    "queue_depth",
    "copy_threads",
    "copy_ahead",
    "stream_latches",
    "blocking_sync",
    "direct_io",
    "keep_last",
    "shm_name",
    "max_inflight_saves",
    "recover_on_open",
    "keep_in_memory",
    "create_root",
    "remote",
    "remote_keep_last",
    "remote_max_pending",
    "remote_only",
    "session",
    "remote_part_size",
    "remote_concurrency",
    "remote_request_timeout",
    "remote_complete_timeout",
    "replica_hold",
    "disk_every",
    "disk_interval_s",
    "remote_every",
    "memory_steps",
];

/// The `TypeError` of a key `Engine(root, config)` does not read.
fn unknown(key: &str) -> PyErr {
    PyTypeError::new_err(format!(
        "unknown engine setting {key:?}; the settings are {}",
        KEYS.join(", ")
    ))
}

/// `config` (a dict, or `None` for every default) as the settings of an engine of `root`,
/// and whether its staging sizes itself (`staging_capacity` not given: the arena opens at
/// `core::auto_initial_capacity` and a save that needs more reopens it). A value of the
/// wrong type is a `TypeError` (or `OverflowError`) naming its key.
pub fn engine_opts(
    root: PathBuf,
    config: Option<&Bound<'_, PyDict>>,
) -> PyResult<(EngineOpts, bool)> {
    let mut o = EngineOpts {
        root,
        world_size: 1,
        ..Default::default()
    };
    let mut disk_every: Option<DiskEveryArg> = None;
    for (k, v) in config
        .map(|d| d.iter().collect::<Vec<_>>())
        .unwrap_or_default()
    {
        let key: String = k.extract().map_err(|_| {
            PyTypeError::new_err(format!("engine setting keys are strings, not {k}"))
        })?;
        if !KEYS.contains(&key.as_str()) {
            return Err(unknown(&key));
        }
        if v.is_none() {
            continue; // the default
        }
        let named = |e: PyErr| -> PyErr {
            Python::attach(|py| {
                let t = e.get_type(py);
                PyErr::from_type(t, format!("engine setting {key:?}: {}", e.value(py)))
            })
        };
        macro_rules! set {
            ($field:expr) => {
                $field = v.extract().map_err(named)?
            };
        }
        macro_rules! some {
            ($field:expr) => {
                $field = Some(v.extract().map_err(named)?)
            };
        }
        match key.as_str() {
            "rank" => set!(o.rank),
            "world_size" => set!(o.world_size),
            "staging_capacity" => some!(o.staging_capacity),
            "chunk_size" => some!(o.chunk_size),
            "writer_threads" => some!(o.writer_threads),
            "queue_depth" => some!(o.queue_depth),
            "copy_threads" => some!(o.copy_threads),
            "copy_ahead" => some!(o.copy_ahead),
            "stream_latches" => some!(o.stream_latches),
            "blocking_sync" => some!(o.blocking_sync),
            "direct_io" => some!(o.direct_io),
            "keep_last" => some!(o.keep_last),
            "shm_name" => some!(o.shm_name),
            "max_inflight_saves" => some!(o.max_inflight_saves),
            "recover_on_open" => some!(o.recover_on_open),
            "keep_in_memory" => some!(o.keep_in_memory),
            "create_root" => some!(o.create_root),
            "remote" => some!(o.remote),
            "remote_keep_last" => some!(o.remote_keep_last),
            "remote_max_pending" => some!(o.remote_max_pending),
            "remote_only" => set!(o.remote_only),
            "session" => some!(o.session),
            "remote_part_size" => some!(o.remote_part_size),
            "remote_concurrency" => some!(o.remote_concurrency),
            "remote_request_timeout" => some!(o.remote_request_timeout),
            "remote_complete_timeout" => some!(o.remote_complete_timeout),
            "replica_hold" => set!(o.replica_hold),
            "disk_every" => disk_every = Some(v.extract().map_err(named)?),
            "disk_interval_s" => some!(o.disk_interval),
            "remote_every" => some!(o.remote_every),
            "memory_steps" => some!(o.memory_steps),
            _ => return Err(unknown(&key)),
        }
    }
    o.disk_cadence = core::disk_cadence(disk_every.map(|d| d.0)).map_err(PyValueError::new_err)?;
    let auto_staging = o.staging_capacity.is_none();
    if auto_staging {
        o.staging_capacity = Some(core::auto_initial_capacity(o.keep_in_memory == Some(true)));
    }
    Ok((o, auto_staging))
}
