//! `shmckpt._shmckpt`: the bytes-level Python extension over the Rust engine.
//!
//! Tensors arrive as `(name, dtype, shape, DLPack capsule, nbytes, device)` tuples, never
//! as addresses (`dlpack.rs`): the extension owns each capsule's tensor, so its memory stays
//! allocated for as long as the engine reads or writes it; the Python package
//! (`shmckpt/*.py`) keeps the tensors unmodified for as long as this module says. Every
//! blocking call releases the GIL; waits run in short slices with `check_signals` between
//! them, so Ctrl-C raises `KeyboardInterrupt` while the engine carries on (a save in flight
//! still finishes or fails cleanly).
//!
//! All calls into the `shmckpt` crate are in `core.rs`.

mod bucket;
mod buffer;
mod config;
mod convert;
mod core;
mod dcp;
mod divergence;
mod dlpack;
mod export;
mod handle;
mod held;
mod intake;
mod links;
mod order;
mod prepared;
mod ranged;
mod remote;
mod replica;
mod util;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use shmckpt::Engine;

use crate::buffer::PyBuffer;
use crate::convert::loaded;
use crate::core::{EngineOpts, RawTensor};
use crate::dlpack::{Memory, Place};
use crate::handle::{Kept, PySaveHandle};
use crate::order::afters;
use crate::prepared::PyPrepared;
// Used through `crate::` by the other modules, which `lib.rs` (`PyEngine`) imports.
use crate::util::{SLICE, lock, to_py};

fn err(e: shmckpt::Error) -> PyErr {
    Python::attach(|py| to_py(py, e))
}

/// The engine of one rank: owns the staging arena, the writers and the commit thread.
#[pyclass(module = "shmckpt._shmckpt", name = "Engine", frozen)]
struct PyEngine {
    /// The engine until `close` takes it. Every call clones the `Arc` for its duration.
    inner: Mutex<Option<Arc<Engine>>>,
    /// The settings it was opened with (the staging capacity as first opened).
    opts: EngineOpts,
    /// `staging_capacity` was not given: a save that needs more staging reopens the engine
    /// with a larger arena ([`PyEngine::grow`]).
    auto_staging: bool,
    /// Held through the whole of `close`: a second `close` returns only once the first
    /// has closed the engine.
    closing: Mutex<()>,
    /// Which path served the last load (`"disk"` or `"memory"`) and why memory could not.
    last_load: Mutex<Option<core::Served>>,
    /// What the last device load from the bucket did.
    last_remote_device_load: Mutex<Option<remote::DeviceLoaded>>,
}

impl PyEngine {
    fn get(&self) -> PyResult<Arc<Engine>> {
        lock(&self.inner).clone().ok_or_else(|| {
            err(shmckpt::Error::Shutdown(
                "the engine was closed (Checkpointer.close)".into(),
            ))
        })
    }

    /// Replace the engine by one whose staging holds `needed` bytes
    /// ([`shmckpt::auto_staging_capacity`]): checked against `/dev/shm` first, then the
    /// engine is closed (every save in flight is committed first) and opened again with
    /// the same settings. If the new one cannot be opened, the previous capacity is
    /// reopened and the error returned. Concurrent calls of other threads wait on `inner`.
    fn grow(&self, needed: u64) -> shmckpt::Result<()> {
        let mut slot = lock(&self.inner);
        let Some(cur) = slot.as_ref() else {
            return Err(shmckpt::Error::Shutdown(
                "the engine was closed (Checkpointer.close)".into(),
            ));
        };
        let old_cap = core::staging_capacity(cur);
        if old_cap >= needed {
            return Ok(()); // another thread grew it meanwhile
        }
        let cap = core::auto_capacity(cur, &self.opts, needed)?;
        let Some(mut shared) = slot.take() else {
            return Ok(()); // (checked above; the lock is held)
        };
        // Calls of other threads that took the engine before this lock finish first.
        let engine = loop {
            match Arc::try_unwrap(shared) {
                Ok(e) => break e,
                Err(s) => {
                    shared = s;
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        };
        core::close(engine);
        let mut opts = self.opts.clone();
        opts.staging_capacity = Some(cap);
        match core::open(opts) {
            Ok(e) => {
                *slot = Some(Arc::new(e));
                Ok(())
            }
            Err(e) => {
                let mut back = self.opts.clone();
                back.staging_capacity = Some(old_cap);
                if let Ok(b) = core::open(back) {
                    *slot = Some(Arc::new(b));
                }
                Err(e)
            }
        }
    }
}

type TensorTuple<'py> = (String, String, Vec<usize>, Bound<'py, PyAny>, usize, i32);

/// The tensors of a save: each tuple's memory taken from its DLPack capsule (`None` for a
/// tensor of no bytes) and checked against the tuple's byte length, device (-1: host
/// memory), dtype and shape (`Elements::fit`). An integer, or any object but a capsule, is
/// a `TypeError`.
fn raw_tensors(list: Vec<TensorTuple<'_>>) -> PyResult<Vec<RawTensor>> {
    list.into_iter()
        .map(|(name, dtype, shape, obj, len, device)| {
            let dt = core::dtype(&dtype).ok_or_else(|| {
                PyValueError::new_err(format!("tensor {name:?}: unknown dtype {dtype:?}"))
            })?;
            let mem = if obj.is_none() {
                if len > 0 {
                    return Err(PyValueError::new_err(format!(
                        "tensor {name:?}: {len} bytes and no memory (None)"
                    )));
                }
                None
            } else {
                let m = Memory::take(&obj, || format!("tensor {name:?}"))?;
                let place = if device < 0 {
                    Place::Host
                } else {
                    Place::Cuda(device)
                };
                if m.len() != len || m.place() != place {
                    return Err(PyValueError::new_err(format!(
                        "tensor {name:?}: the tuple says {len} bytes on {place:?}, its memory \
                         is {} bytes on {:?}",
                        m.len(),
                        m.place()
                    )));
                }
                let e = m.elements();
                if !e.fit(dt, &shape) {
                    return Err(PyValueError::new_err(format!(
                        "tensor {name:?}: the tuple says {dtype} {shape:?}, its memory holds \
                         DLPack type (code {}, {} bits, {} lanes) of shape {:?}",
                        e.code, e.bits, e.lanes, e.shape
                    )));
                }
                Some(m)
            };
            Ok(RawTensor {
                name,
                dtype: dt,
                shape,
                mem,
            })
        })
        .collect()
}

#[pymethods]
impl PyEngine {
    /// Open an engine for checkpoints under `root` (an existing, writable directory, or
    /// one it creates with `create_root: True`), with the settings of `config`, one dict
    /// (`config::KEYS`; missing keys and `None` take the Rust defaults), converted once in
    /// `config::engine_opts`. Without `staging_capacity` the arena opens at
    /// `AUTO_STAGING_INITIAL` (64 MiB; the 2 GiB default with `keep_in_memory`) and a save
    /// that needs more reopens the engine with an arena sized from that save.
    #[new]
    #[pyo3(signature = (root, config=None))]
    fn new(
        py: Python<'_>,
        root: std::path::PathBuf,
        config: Option<&Bound<'_, pyo3::types::PyDict>>,
    ) -> PyResult<Self> {
        let (opts, auto_staging) = config::engine_opts(root, config)?;
        let engine = py
            .detach(|| core::open(opts.clone()))
            .map_err(|e| to_py(py, e))?;
        Ok(PyEngine {
            inner: Mutex::new(Some(Arc::new(engine))),
            opts,
            auto_staging,
            closing: Mutex::new(()),
            last_load: Mutex::new(None),
            last_remote_device_load: Mutex::new(None),
        })
    }

    /// Save `tensors` (tuples `(name, dtype, shape, memory, nbytes, device)`: `memory` a
    /// DLPack capsule of the tensor's contiguous bytes, `None` when `nbytes` is 0; device -1
    /// for host memory) as `step`, with string `metadata`. `after` lists
    /// `(device, "stream" | "event", torch.cuda.Stream | torch.cuda.Event)` (exactly those
    /// types, the event recorded; kept until the save is staged): each device's copies
    /// start after that stream's queued work or that event.
    ///
    /// `blocking=True` returns once every byte is staged. `blocking=False` returns at
    /// once: the handle keeps the capsules' tensors (so their memory) until the save is
    /// staged; the caller must keep every tensor unmodified, and every stream or event
    /// alive (the handle keeps them), until the handle reports the save staged. `hold=True` (with
    /// `blocking=False`) returns once every device copy is queued and the `"stream"`
    /// streams of `after` wait for them on the device: work queued there afterwards may
    /// modify the tensors. `snapshot=True` (with `blocking=False`, not `hold`): the save
    /// takes a device snapshot of what it has not copied yet when its handle's
    /// `request_snapshot()` is called (`SaveOptions::snapshot_on_request`).
    /// `part_only=True` (with `blocking=True`): write this rank's file and manifest part
    /// in `step-N.partial/` without committing the step (`SaveOptions::part_only`; the
    /// DCP writer commits every rank's part with `assemble_ranks`). `confirm=True`: the
    /// commit waits for the handle's `confirm_commit` once its `checksums()` are known
    /// (`SaveOptions::confirm_commit`). `provisional=True`: no tier takes the save (it is
    /// not listed, loadable or recoverable) until the handle's `confirm_commit` confirms
    /// it; refused, it fails with `CommitRefused` (`SaveOptions::provisional`).
    ///
    /// `tensors` may also be a `PreparedTensors` (`prepare`): the save takes them (started
    /// or not) and reads no tuple.
    #[pyo3(signature = (step, tensors, metadata, after, blocking, hold=false, snapshot=false, part_only=false, confirm=false, provisional=false))]
    #[allow(clippy::too_many_arguments)]
    fn save(
        &self,
        py: Python<'_>,
        step: u64,
        tensors: &Bound<'_, PyAny>,
        metadata: BTreeMap<String, String>,
        after: Vec<(i32, String, Bound<'_, PyAny>)>,
        blocking: bool,
        hold: bool,
        snapshot: bool,
        part_only: bool,
        confirm: bool,
        provisional: bool,
    ) -> PyResult<PySaveHandle> {
        if part_only && !blocking {
            return Err(to_py(
                py,
                shmckpt::Error::Config("part_only=True needs blocking=True".into()),
            ));
        }
        let commit = core::Commit {
            part_only,
            confirm,
            provisional,
        };
        let raw = match tensors.cast::<PyPrepared>() {
            Ok(p) => p.get().take()?,
            Err(_) => raw_tensors(tensors.extract()?)?,
        };
        let mut engine = self.get()?;
        let (after, order) = afters(after)?;
        let res = py.detach(|| {
            let mut grown = false;
            loop {
                let r = if blocking {
                    // SAFETY: `raw` owns every tensor's memory (DLPack) for the whole call;
                    // every stream or event is the handle of a torch object (`afters`) that
                    // `order` keeps alive for the call; the Python caller
                    // (shmckpt.checkpointer) does not write the tensors until it returns.
                    unsafe { core::save(&engine, step, &raw, &metadata, &after, commit) }
                } else {
                    // SAFETY: `raw` and `order` (the torch streams and events whose handles
                    // `after` holds, `afters`) go into the returned handle, which keeps them
                    // until the save is staged (also when dropped before: `PySaveHandle`'s
                    // `Drop`). The Python caller orders
                    // every writer of the tensors after staging (guard), gives copies it
                    // owns, or (with `hold`) passes only tensors whose writers run on the
                    // held streams.
                    unsafe {
                        core::save_async(
                            &engine, step, &raw, &metadata, &after, hold, snapshot, commit,
                        )
                    }
                };
                match r {
                    // Nothing was staged: size the arena from this save and try once more.
                    Err(shmckpt::Error::TooLarge { needed, .. }) if self.auto_staging && !grown => {
                        drop(engine);
                        self.grow(needed)?;
                        grown = true;
                        engine = lock(&self.inner).clone().ok_or_else(|| {
                            shmckpt::Error::Shutdown("the engine was closed".into())
                        })?;
                    }
                    r => return r,
                }
            }
        });
        let h = res.map_err(|e| to_py(py, e))?;
        // A blocking save is staged: its memory is given back here (GIL held).
        let keep = if blocking {
            drop(raw);
            None
        } else {
            Some(Kept {
                tensors: raw,
                order,
            })
        };
        Ok(PySaveHandle {
            keep: Mutex::new(keep),
            step,
            remote: core::remote_progress(&h),
            held: h.held_image(),
            remote_result: Mutex::new(None),
            inner: Mutex::new(Some(h)),
            result: Mutex::new(None),
        })
    }

    /// Check `tensors` (engine tuples, as `save` takes them) as `save` does and take their
    /// memory from their capsules, for one later `save(step, prepared, ...)`, whose call
    /// then only starts the save. Nothing is saved or started here; the memory stays
    /// referenced until that save has staged it (or `release()`).
    fn prepare(&self, tensors: Vec<TensorTuple<'_>>) -> PyResult<PyPrepared> {
        Ok(PyPrepared::new(raw_tensors(tensors)?))
    }

    /// Load this rank's tensors of `step` (`None`: the latest) into owned buffers,
    /// verifying every checksum. Returns `(step, dir, metadata, [(name, dtype, shape,
    /// Buffer)])`. With a remote tier, a step the disk does not hold, or holds damaged
    /// (the bucket holding the same bytes), is read from the bucket unless `bucket` is
    /// false.
    #[pyo3(signature = (step=None, bucket=true))]
    #[allow(clippy::type_complexity)]
    fn load(
        &self,
        py: Python<'_>,
        step: Option<u64>,
        bucket: bool,
    ) -> PyResult<(
        u64,
        String,
        BTreeMap<String, String>,
        Vec<(String, String, Vec<usize>, PyBuffer)>,
    )> {
        let engine = self.get()?;
        let (ck, served) = py
            .detach(|| core::load(&engine, step, bucket))
            .map_err(|e| to_py(py, e))?;
        *lock(&self.last_load) = Some(served);
        Ok(loaded(ck))
    }

    /// Load into host memory: `dest` lists `(name, capsule)`, one per tensor of the
    /// checkpoint, each a DLPack capsule (`torch.utils.dlpack.to_dlpack` of a CPU tensor, a
    /// numpy array's `__dlpack__()`) of writable, C-contiguous host memory of exactly the
    /// tensor's size, none overlapping another. Returns the step.
    #[pyo3(signature = (step, dest))]
    fn load_into(
        &self,
        py: Python<'_>,
        step: Option<u64>,
        dest: Vec<(String, Bound<'_, PyAny>)>,
    ) -> PyResult<u64> {
        let engine = self.get()?;
        // Each capsule's tensor, checked and owned (its memory allocated) until it drops.
        let mut dest = intake::host_dest(&dest)?;
        let r = py.detach(|| {
            // SAFETY: each destination is the memory of a writable, C-contiguous host
            // tensor, kept allocated by `dest`, none overlapping another (checked by
            // `host_dest`). Exclusive use during the call is the caller's contract, as for
            // any numpy call that releases the GIL: the Python wrapper does not touch the
            // destinations until this returns.
            unsafe { core::load_into_host(&engine, step, &mut dest) }
        });
        drop(dest); // (GIL held: a producer's deleter may take it)
        r.map_err(|e| to_py(py, e))
    }

    /// Load into device memory: `dest` lists `(name, capsule, device)`, each a DLPack
    /// capsule (`torch.utils.dlpack.to_dlpack` of a CUDA tensor) of writable,
    /// C-contiguous memory of CUDA device `device`, exactly the tensor's size. The caller
    /// makes sure no queued device work uses the memory. Returns the step. `bucket` as for
    /// `load`.
    #[pyo3(signature = (step, dest, bucket=true))]
    fn load_into_device(
        &self,
        py: Python<'_>,
        step: Option<u64>,
        dest: Vec<(String, Bound<'_, PyAny>, i32)>,
        bucket: bool,
    ) -> PyResult<u64> {
        let engine = self.get()?;
        let dest = intake::device_dest(&dest)?;
        let r = py.detach(|| {
            // SAFETY: each destination is the memory of a writable, C-contiguous CUDA
            // tensor of its device, kept allocated by `dest`, none overlapping another
            // (checked by `device_dest`). Exclusive use during the call is the caller's
            // contract: the Python wrapper synchronized the destinations' streams before
            // the call and queues no work on them until it returns.
            unsafe { core::load_into_device(&engine, step, &dest, bucket) }
        });
        drop(dest);
        let (step, served) = r.map_err(|e| to_py(py, e))?;
        *lock(&self.last_load) = Some(served);
        Ok(step)
    }

    /// Which path served the last `load` or `load_into_device` of this engine:
    /// `("disk", reason)`, the reason saying why shared memory could not serve it when
    /// flash restore (`keep_in_memory`) is on, or `("memory", problem)`, the problem being
    /// what the check of the disk copy's size and header found wrong (`None`: nothing).
    /// `None` before the first load.
    fn last_load_source(&self) -> Option<(String, Option<String>)> {
        lock(&self.last_load)
            .as_ref()
            .map(|(s, r)| ((*s).to_owned(), r.clone()))
    }

    /// The steps recovery at open committed from dead engines' staging arenas, oldest
    /// first (`recover_on_open`, on by default).
    fn recovered(&self) -> PyResult<Vec<u64>> {
        let engine = self.get()?;
        Ok(core::recovered(&engine))
    }

    /// Where the open spent its time: seconds per phase (`recovery`, `clean`, `arena`,
    /// `writers`, `total`), in that order.
    fn open_timings(&self) -> PyResult<Vec<(&'static str, f64)>> {
        let engine = self.get()?;
        Ok(core::open_timings(&engine))
    }

    /// Staging arenas of dead engines of this root and rank left holding saves to recover
    /// (recovery at open off, or failed for them): kept for `shmckpt recover`.
    fn unrecovered(&self) -> PyResult<Vec<String>> {
        let engine = self.get()?;
        Ok(core::unrecovered(&engine))
    }

    /// Committed steps in the bucket of the remote tier, oldest first.
    fn list_remote(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        remote::list_remote(self, py)
    }

    /// Load this rank's tensors of a step in the bucket (`None`: its latest), as `load`.
    #[pyo3(signature = (step=None))]
    fn load_remote(&self, py: Python<'_>, step: Option<u64>) -> PyResult<convert::Loaded> {
        remote::load_remote(self, py, step)
    }

    /// Load this rank's tensors of a step in the bucket into device memory (`dest` as
    /// `load_into_device`), through registered staging buffers (no host copy of the
    /// object). The caller makes sure no queued device work uses the memory. Returns
    /// `(step, bytes, staged, staging, seconds)`.
    #[pyo3(signature = (step, dest))]
    fn load_into_device_remote(
        &self,
        py: Python<'_>,
        step: Option<u64>,
        dest: Vec<(String, Bound<'_, PyAny>, i32)>,
    ) -> PyResult<remote::DeviceLoaded> {
        remote::load_into_device_remote(self, py, step, dest)
    }

    /// What the last `load_into_device_remote` of this engine did: `(step, bytes, staged,
    /// staging, seconds)` (`staged`: data bytes that went to the device through the
    /// registered staging buffers; `staging`: the bytes of those buffers), `None` before
    /// the first.
    fn last_remote_device_load(&self) -> Option<remote::DeviceLoaded> {
        *lock(&self.last_remote_device_load)
    }

    /// This rank's file metadata of a step committed in the bucket (its header checked).
    fn remote_file_metadata(
        &self,
        py: Python<'_>,
        step: u64,
    ) -> PyResult<BTreeMap<String, String>> {
        remote::remote_file_metadata(self, py, step)
    }

    /// The manifest (JSON) of a step committed in the bucket.
    fn remote_manifest(&self, py: Python<'_>, step: u64) -> PyResult<String> {
        remote::remote_manifest(self, py, step)
    }

    /// Committed checkpoints, oldest first: `[(step, dir)]`.
    fn list(&self, py: Python<'_>) -> PyResult<Vec<(u64, String)>> {
        let engine = self.get()?;
        let l = py
            .detach(|| core::list(&engine))
            .map_err(|e| to_py(py, e))?;
        Ok(l.into_iter()
            .map(|(s, d)| (s, d.to_string_lossy().into_owned()))
            .collect())
    }

    /// The newest committed step, or `None`.
    fn latest(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        let engine = self.get()?;
        py.detach(|| core::latest(&engine))
            .map_err(|e| to_py(py, e))
    }

    /// The step a load of `step` (`None`: the latest) with `source` (`None`, `"local"`,
    /// `"remote"`: as `Checkpointer.load`) reads, and where from (`"local"` or
    /// `"remote"`): the engine's one fallback order. `NotFound` when no tier asked holds it.
    #[pyo3(signature = (step=None, source=None))]
    fn resolve(
        &self,
        py: Python<'_>,
        step: Option<u64>,
        source: Option<&str>,
    ) -> PyResult<(u64, String)> {
        let tiers = tiers_of(source)?;
        let engine = self.get()?;
        py.detach(|| core::resolve_step(&engine, step, tiers))
            .map(|(s, t)| (s, t.to_owned()))
            .map_err(|e| to_py(py, e))
    }

    /// The step a load of "latest" with `source` reads, or `None` when no tier asked holds
    /// a committed step.
    #[pyo3(signature = (source=None))]
    fn latest_in(&self, py: Python<'_>, source: Option<&str>) -> PyResult<Option<u64>> {
        let tiers = tiers_of(source)?;
        let engine = self.get()?;
        py.detach(|| core::latest_in(&engine, tiers))
            .map_err(|e| to_py(py, e))
    }

    /// The committed steps a load with `source` can read, oldest first, each with the
    /// tiers holding it: `[(step, ["disk", "bucket"])]`.
    #[pyo3(signature = (source=None))]
    fn list_in(&self, py: Python<'_>, source: Option<&str>) -> PyResult<Vec<(u64, Vec<String>)>> {
        let tiers = tiers_of(source)?;
        let engine = self.get()?;
        let l = py
            .detach(|| core::list_in(&engine, tiers))
            .map_err(|e| to_py(py, e))?;
        Ok(l.into_iter()
            .map(|(s, t)| (s, t.into_iter().map(str::to_owned).collect()))
            .collect())
    }

    /// The `__metadata__` of this rank's file of `step` (`None`: the latest), read after
    /// its header is checked against the manifest (tensors, header CRC-32C).
    #[pyo3(signature = (step=None))]
    fn file_metadata(
        &self,
        py: Python<'_>,
        step: Option<u64>,
    ) -> PyResult<BTreeMap<String, String>> {
        let engine = self.get()?;
        py.detach(|| core::file_metadata(&engine, step))
            .map_err(|e| to_py(py, e))
    }

    /// The manifest of `step` (`None`: the latest) as a JSON string.
    #[pyo3(signature = (step=None))]
    fn manifest(&self, py: Python<'_>, step: Option<u64>) -> PyResult<String> {
        let engine = self.get()?;
        py.detach(|| core::manifest_json(&engine, step))
            .map_err(|e| to_py(py, e))
    }

    /// Set up CUDA for `devices` now (registration of the staging arena). Returns the
    /// registration time in seconds if this call registered.
    fn prepare_cuda(&self, py: Python<'_>, devices: Vec<i32>) -> PyResult<Option<f64>> {
        let engine = self.get()?;
        py.detach(|| core::prepare_cuda(&engine, &devices))
            .map(|d| d.map(|d| d.as_secs_f64()))
            .map_err(|e| to_py(py, e))
    }

    /// Set up CUDA for `devices` now and register the staging arena on a background
    /// thread, once the arena is allocated (a device save started before waits for it).
    fn prepare_cuda_background(&self, py: Python<'_>, devices: Vec<i32>) -> PyResult<()> {
        let engine = self.get()?;
        py.detach(|| core::prepare_cuda_background(&engine, &devices))
            .map_err(|e| to_py(py, e))
    }

    /// True once the staging arena is wholly allocated and no background registration is
    /// running.
    fn staging_ready(&self) -> PyResult<bool> {
        let engine = self.get()?;
        Ok(core::staging_ready(&engine))
    }

    /// Block (GIL released) until the staging arena is wholly allocated and registered.
    fn wait_staging_ready(&self, py: Python<'_>) -> PyResult<()> {
        let engine = self.get()?;
        py.detach(|| core::wait_staging_ready(&engine))
            .map_err(|e| to_py(py, e))
    }

    /// Wait for every save in flight to be committed or to fail.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let engine = self.get()?;
        py.detach(|| core::flush(&engine)).map_err(|e| to_py(py, e))
    }

    /// Finish the saves in flight, stop the threads and remove the staging segment.
    /// Returns only once every save this engine started is committed or failed, also
    /// when another thread is inside a call of this engine (`close` waits for that call
    /// to return; calls that begin after `close` raise `ShutdownError`) or closing it
    /// too. Idempotent.
    fn close(&self, py: Python<'_>) {
        py.detach(|| {
            let _one = lock(&self.closing);
            let Some(mut shared) = lock(&self.inner).take() else {
                return;
            };
            // Calls that got the engine before it was taken still hold a reference; each
            // ends (a save stages, a load reads, a flush waits for saves already begun).
            let mut nap = Duration::from_micros(50);
            let engine = loop {
                match Arc::try_unwrap(shared) {
                    Ok(e) => break e,
                    Err(again) => {
                        shared = again;
                        std::thread::sleep(nap);
                        nap = (nap * 2).min(Duration::from_millis(5));
                    }
                }
            };
            core::close(engine);
        });
    }

    /// Delete committed checkpoint `step` (renamed out of the listing durably, then its
    /// files deleted); a step still being saved is refused with `NotFound`.
    fn remove(&self, py: Python<'_>, step: u64) -> PyResult<()> {
        let engine = self.get()?;
        py.detach(|| core::remove(&engine, step))
            .map_err(|e| to_py(py, e))
    }

    /// True once `close` was called.
    #[getter]
    fn closed(&self) -> bool {
        lock(&self.inner).is_none()
    }

    /// Bytes per staging chunk.
    #[getter]
    fn chunk_size(&self) -> PyResult<u64> {
        Ok(core::chunk_size(&*self.get()?))
    }

    /// Bytes of a save's device copies queued ahead of their completion (0: all at once).
    #[getter]
    fn copy_ahead(&self) -> PyResult<u64> {
        Ok(self.get()?.config().copy_ahead())
    }

    /// Whether a guarded optimizer step waits for a save's device copies on a stream latch
    /// (its thread going on at once) instead of on the host until they are queued.
    #[getter]
    fn stream_latches(&self) -> PyResult<bool> {
        Ok(self.get()?.config().stream_latches())
    }

    /// Whether the staging thread sleeps while it waits for device copies instead of
    /// spinning.
    #[getter]
    fn blocking_sync(&self) -> PyResult<bool> {
        Ok(self.get()?.config().blocking_sync())
    }

    /// `(shm_name, staging_capacity, backend, root)`.
    fn describe(&self) -> PyResult<(String, u64, String, String)> {
        let engine = self.get()?;
        let (n, c, b, r) = core::describe(&engine);
        Ok((n, c, b, r.to_string_lossy().into_owned()))
    }
}

/// The dtype names (safetensors spelling) the engine knows.
#[pyfunction]
fn dtypes() -> Vec<&'static str> {
    core::all_dtype_names()
}

#[pymodule]
fn _shmckpt(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEngine>()?;
    m.add_class::<PySaveHandle>()?;
    m.add_class::<PyPrepared>()?;
    m.add_class::<PyBuffer>()?;
    m.add_class::<bucket::PyBucket>()?;
    m.add_function(wrap_pyfunction!(dtypes, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    dcp::register(m)?;
    divergence::register(m)?;
    export::register(m)?;
    links::register(m)?;
    ranged::register(m)?;
    replica::register(m)?;
    held::register(m)?;
    Ok(())
}

/// `source=` (as `Checkpointer.load` takes it) as the engine's tiers, else `ValueError`.
fn tiers_of(source: Option<&str>) -> PyResult<shmckpt::Tiers> {
    core::tiers(source).ok_or_else(|| {
        PyValueError::new_err(format!(
            "source must be None, 'local' or 'remote', not {:?}",
            source.unwrap_or_default()
        ))
    })
}
