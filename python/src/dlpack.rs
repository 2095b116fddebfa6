//! Memory handed over by Python as DLPack capsules, never as integer addresses.
//!
//! Every call of the extension that reads or writes a caller's tensor or array takes it as
//! a DLPack capsule (`torch.utils.dlpack.to_dlpack(t)`, `t.__dlpack__()`,
//! `a.__dlpack__()`): a `PyCapsule` named `"dltensor"` (DLPack 0.x, `DLManagedTensor`) or
//! `"dltensor_versioned"` (DLPack 1.x, `DLManagedTensorVersioned`). Pure Python cannot make
//! one (only C code, or `ctypes`, which can write any memory anyway), so a Python caller
//! cannot name memory it does not own: an integer, or any other object, is a `TypeError`.
//!
//! [`Memory::take`] checks the tensor before it uses anything of it: a device it knows
//! (host: `kDLCPU`, `kDLCUDAHost`; `kDLCUDA` and its ordinal), a dtype of whole bytes, a
//! shape of sizes >= 0 whose byte length (with the byte offset) is computed with checked
//! arithmetic, a C-contiguous layout (`strides` absent or exactly the packed ones), a
//! non-null address when it has bytes. It then consumes the capsule (renames it
//! `"used_dltensor[_versioned]"`, as the protocol asks: no one else can take it) and owns
//! the managed tensor, whose producer keeps the memory allocated until its deleter is
//! called: by [`Memory`]'s `Drop`, once the extension no longer uses the memory. A capsule
//! that fails a check is left as it is (its producer frees it with the capsule).

use std::ffi::{CStr, c_void};
use std::ptr::NonNull;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use shmckpt::DeviceSlice;

/// What a capsule's tensor says its elements are: the `DLDataType` (code, bits, lanes) and
/// the shape (sizes >= 0, checked).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Elements {
    pub(crate) code: u8,
    pub(crate) bits: u8,
    pub(crate) lanes: u16,
    pub(crate) shape: Vec<u64>,
}

/// `kDLInt`, `kDLUInt`, `kDLFloat`, `kDLBfloat`, `kDLComplex`, `kDLBool` (dlpack.h).
pub(crate) const KDL_INT: u8 = 0;
pub(crate) const KDL_UINT: u8 = 1;
pub(crate) const KDL_FLOAT: u8 = 2;
pub(crate) const KDL_BFLOAT: u8 = 4;
pub(crate) const KDL_COMPLEX: u8 = 5;
pub(crate) const KDL_BOOL: u8 = 6;

impl Elements {
    /// Whether these are the elements of a tensor of `dtype` and `shape` (what an engine
    /// tuple says of its memory): the DLPack type of `dtype` (a `BOOL` also as one-byte
    /// unsigned integers, as some producers export it) and the same shape; or, whatever
    /// the tuple's dtype, a one-dimensional array of bytes (`kDLUInt`, 8 bits: how the
    /// package hands over a tensor whose dtype DLPack cannot carry). A dtype without a
    /// standard DLPack type (the 4-, 6- and 8-bit floats) is not compared here: only its
    /// byte length is, by the caller. So a tuple whose dtype or shape was taken from other
    /// metadata than the tensor's (a stale cache) is refused instead of labelling the bytes
    /// wrongly, even when the byte lengths agree.
    pub(crate) fn fit(&self, dtype: shmckpt::Dtype, shape: &[usize]) -> bool {
        use shmckpt::Dtype as D;
        if self.lanes != 1 {
            return false;
        }
        let same_shape = || {
            self.shape.len() == shape.len()
                && self.shape.iter().zip(shape).all(|(&a, &b)| a == b as u64)
        };
        let bytes = self.code == KDL_UINT && self.bits == 8 && self.shape.len() == 1;
        let want: &[(u8, u8)] = match dtype {
            D::BOOL => &[(KDL_BOOL, 8), (KDL_UINT, 8)],
            D::U8 => &[(KDL_UINT, 8)],
            D::I8 => &[(KDL_INT, 8)],
            D::I16 => &[(KDL_INT, 16)],
            D::U16 => &[(KDL_UINT, 16)],
            D::F16 => &[(KDL_FLOAT, 16)],
            D::BF16 => &[(KDL_BFLOAT, 16)],
            D::I32 => &[(KDL_INT, 32)],
            D::U32 => &[(KDL_UINT, 32)],
            D::F32 => &[(KDL_FLOAT, 32)],
            D::C64 => &[(KDL_COMPLEX, 64)],
            D::F64 => &[(KDL_FLOAT, 64)],
            D::I64 => &[(KDL_INT, 64)],
            D::U64 => &[(KDL_UINT, 64)],
            D::F4
            | D::F6_E2M3
            | D::F6_E3M2
            | D::F8_E5M2
            | D::F8_E4M3
            | D::F8_E8M0
            | D::F8_E4M3FNUZ
            | D::F8_E5M2FNUZ => return true,
            // A dtype added to the core later: no DLPack type known here yet.
            _ => return true,
        };
        bytes || (want.contains(&(self.code, self.bits)) && same_shape())
    }
}

/// The device that a tensor's bytes are on: host memory or a CUDA ordinal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    Host,
    Cuda(i32),
}

/// `DLDevice` (dlpack.h).
#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

/// `DLDataType` (dlpack.h).
#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// `DLTensor` (dlpack.h; the same in 0.x and 1.x).
#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

/// `DLManagedTensor` (DLPack 0.x, capsule `"dltensor"`).
#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// `DLPackVersion` (DLPack 1.x).
#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

/// `DLManagedTensorVersioned` (DLPack 1.x, capsule `"dltensor_versioned"`).
#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

const KDL_CPU: i32 = 1;
const KDL_CUDA: i32 = 2;
const KDL_CUDA_HOST: i32 = 3;
/// `DLPACK_FLAG_BITMASK_READ_ONLY`.
const FLAG_READ_ONLY: u64 = 1;
/// The DLPack major version whose `DLManagedTensorVersioned` layout this file knows.
const MAJOR: u32 = 1;

const LEGACY: &CStr = c"dltensor";
const VERSIONED: &CStr = c"dltensor_versioned";
const USED_LEGACY: &CStr = c"used_dltensor";
const USED_VERSIONED: &CStr = c"used_dltensor_versioned";

/// The managed tensor a consumed capsule held: this extension calls its deleter, once.
enum Owner {
    Legacy(NonNull<DLManagedTensor>),
    Versioned(NonNull<DLManagedTensorVersioned>),
}

/// The memory of one DLPack tensor, checked (see the module's documentation) and owned:
/// its producer keeps it allocated until this value is dropped.
pub(crate) struct Memory {
    owner: Owner,
    addr: u64,
    len: usize,
    place: Place,
    readonly: bool,
    elements: Elements,
}

// SAFETY: `Memory` holds the address of a managed tensor that no one else owns (the capsule
// was consumed) and plain numbers. Its only use of the pointer is the deleter call in
// `Drop`, which the DLPack protocol lets the consumer make from any thread (a producer
// needing the GIL, such as numpy, takes it in the deleter). The memory it describes is
// read or written only through the `unsafe` accessors below, whose callers uphold their
// contracts whatever the thread.
unsafe impl Send for Memory {}
// SAFETY: shared references give only the numbers (`addr`, `len`, ...) and the `unsafe`
// accessors; nothing is mutated through `&Memory`.
unsafe impl Sync for Memory {}

impl Drop for Memory {
    fn drop(&mut self) {
        match self.owner {
            Owner::Legacy(m) => {
                // SAFETY: `m` is the managed tensor of a capsule this value consumed: it is
                // live (its deleter was not called) and owned by this value alone; the
                // deleter is called once, here, as the protocol asks of the consumer.
                unsafe {
                    if let Some(d) = (*m.as_ptr()).deleter {
                        d(m.as_ptr());
                    }
                }
            }
            Owner::Versioned(m) => {
                // SAFETY: as above, for a versioned managed tensor.
                unsafe {
                    if let Some(d) = (*m.as_ptr()).deleter {
                        d(m.as_ptr());
                    }
                }
            }
        }
    }
}

impl std::fmt::Debug for Memory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Memory")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("place", &self.place)
            .field("readonly", &self.readonly)
            .finish()
    }
}

/// What a checked `DLTensor` gives: address, byte length, place, elements.
fn extent(t: &DLTensor) -> Result<(u64, usize, Place, Elements), String> {
    let place = match t.device.device_type {
        KDL_CPU | KDL_CUDA_HOST => Place::Host,
        KDL_CUDA if t.device.device_id >= 0 => Place::Cuda(t.device.device_id),
        KDL_CUDA => return Err(format!("CUDA device ordinal {}", t.device.device_id)),
        other => {
            return Err(format!(
                "memory of DLPack device type {other} (only host and CUDA memory)"
            ));
        }
    };
    let ndim = usize::try_from(t.ndim).map_err(|_| format!("ndim {}", t.ndim))?;
    if ndim > 0 && t.shape.is_null() {
        return Err("a tensor with dimensions and no shape".into());
    }
    let shape: &[i64] = if ndim == 0 {
        &[]
    } else {
        // SAFETY: a producer's `DLTensor` (the capsule's name says it is one) has `ndim`
        // sizes at `shape`, non-null (checked), alive with the managed tensor, which the
        // capsule keeps alive while this function runs.
        unsafe { std::slice::from_raw_parts(t.shape, ndim) }
    };
    let strides: Option<&[i64]> = if t.strides.is_null() {
        None
    } else {
        // SAFETY: as for `shape`: `ndim` strides at a non-null `strides`.
        Some(unsafe { std::slice::from_raw_parts(t.strides, ndim) })
    };
    let sizes: Vec<u64> = shape
        .iter()
        .map(|&d| u64::try_from(d).map_err(|_| format!("a negative size in shape {shape:?}")))
        .collect::<Result<_, _>>()?;
    let numel = sizes
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d))
        .ok_or_else(|| format!("the size of shape {shape:?} overflows"))?;
    let bits = u64::from(t.dtype.bits) * u64::from(t.dtype.lanes);
    if bits == 0 {
        return Err(format!(
            "dtype (code {}, {} bits, {} lanes) has no size",
            t.dtype.code, t.dtype.bits, t.dtype.lanes
        ));
    }
    let total_bits = numel
        .checked_mul(bits)
        .ok_or_else(|| format!("the size of shape {shape:?} overflows"))?;
    if total_bits % 8 != 0 {
        return Err(format!(
            "{total_bits} bits are not whole bytes (dtype of {bits} bits)"
        ));
    }
    let len = usize::try_from(total_bits / 8)
        .map_err(|_| format!("the size of shape {shape:?} overflows"))?;
    if let Some(st) = strides
        && numel > 0
        && !packed(&sizes, st)
    {
        return Err(format!(
            "not C-contiguous (shape {shape:?}, strides {st:?}): pass a contiguous tensor"
        ));
    }
    let addr = (t.data as u64)
        .checked_add(t.byte_offset)
        .ok_or_else(|| "the byte offset overflows the address".to_string())?;
    if len > 0 && t.data.is_null() {
        return Err("a null address".into());
    }
    if addr.checked_add(len as u64).is_none() {
        return Err("the memory wraps around the address space".into());
    }
    let elements = Elements {
        code: t.dtype.code,
        bits: t.dtype.bits,
        lanes: t.dtype.lanes,
        shape: sizes,
    };
    Ok((addr, len, place, elements))
}

/// Whether `strides` (in elements) are the packed row-major strides of `sizes` (dimensions
/// of size 1 may have any stride).
fn packed(sizes: &[u64], strides: &[i64]) -> bool {
    let mut want: u64 = 1;
    for (&d, &s) in sizes.iter().zip(strides).rev() {
        if d != 1 && u64::try_from(s).ok() != Some(want) {
            return false;
        }
        want = want.saturating_mul(d);
    }
    true
}

impl Memory {
    /// Take the memory of `obj`, a DLPack capsule not consumed yet, for `what` (what error
    /// messages name it, made only for one): checked, then consumed and owned (see the
    /// module's documentation). `TypeError` for anything but a DLPack capsule, `ValueError`
    /// for a tensor that fails a check (the capsule is then left unconsumed).
    pub(crate) fn take(obj: &Bound<'_, PyAny>, what: impl Fn() -> String) -> PyResult<Memory> {
        let not_capsule = || {
            PyTypeError::new_err(format!(
                "{}: expected a DLPack capsule (torch.utils.dlpack.to_dlpack(t), \
                 t.__dlpack__() or a numpy array's __dlpack__()), not {}",
                what(),
                obj.get_type()
                    .name()
                    .map_or_else(|_| "?".to_owned(), |n| n.to_string())
            ))
        };
        let raw = obj.as_ptr();
        // SAFETY: `raw` is a live object (borrowed by `obj`) and the GIL is held.
        if unsafe { ffi::PyCapsule_CheckExact(raw) } == 0 {
            return Err(not_capsule());
        }
        // SAFETY: `raw` is a capsule (checked); the GIL is held. A capsule's name is a C
        // string its creator keeps alive as long as the capsule (or null).
        let name = unsafe { ffi::PyCapsule_GetName(raw) };
        if name.is_null() {
            return Err(not_capsule());
        }
        // SAFETY: a non-null capsule name is a NUL-terminated string alive with the capsule.
        let name = unsafe { CStr::from_ptr(name) };
        let versioned = if name == LEGACY {
            false
        } else if name == VERSIONED {
            true
        } else if name == USED_LEGACY || name == USED_VERSIONED {
            return Err(PyValueError::new_err(format!(
                "{}: this DLPack capsule was consumed already (make one per call)",
                what()
            )));
        } else {
            return Err(not_capsule());
        };
        let bad = |why: String| PyValueError::new_err(format!("{}: {why}", what()));
        let want = if versioned { VERSIONED } else { LEGACY };
        // SAFETY: `raw` is a capsule named `want` (checked); the GIL is held.
        let p = unsafe { ffi::PyCapsule_GetPointer(raw, want.as_ptr()) };
        let Some(p) = NonNull::new(p) else {
            return Err(PyErr::take(obj.py())
                .unwrap_or_else(|| bad("a DLPack capsule holding no tensor".into())));
        };
        let (owner, tensor, readonly) = if versioned {
            let m = p.cast::<DLManagedTensorVersioned>();
            // SAFETY: a capsule named "dltensor_versioned" holds a `DLManagedTensorVersioned`
            // (the DLPack protocol); its `version` field comes first in every DLPack 1.x
            // layout, and the capsule keeps it alive (not consumed yet).
            let (major, flags) = unsafe { ((*m.as_ptr()).version.major, (*m.as_ptr()).flags) };
            if major != MAJOR {
                return Err(bad(format!(
                    "DLPack major version {major} (this extension reads version {MAJOR})"
                )));
            }
            // SAFETY: as above, and the layout is version 1's (checked).
            let t = unsafe { &(*m.as_ptr()).dl_tensor };
            (Owner::Versioned(m), t, flags & FLAG_READ_ONLY != 0)
        } else {
            let m = p.cast::<DLManagedTensor>();
            // SAFETY: a capsule named "dltensor" holds a `DLManagedTensor` (the DLPack
            // protocol), alive while the capsule is not consumed.
            let t = unsafe { &(*m.as_ptr()).dl_tensor };
            (Owner::Legacy(m), t, false)
        };
        let (addr, len, place, elements) = extent(tensor).map_err(bad)?;
        let used = if versioned {
            USED_VERSIONED
        } else {
            USED_LEGACY
        };
        // SAFETY: `raw` is a capsule; `used` is a static string, alive as long as the
        // capsule. Renamed, its producer's destructor no longer frees the managed tensor:
        // `owner` (dropped by this value's `Drop`) is its one owner from here on.
        if unsafe { ffi::PyCapsule_SetName(raw, used.as_ptr()) } != 0 {
            return Err(PyErr::fetch(obj.py()));
        }
        Ok(Memory {
            owner,
            addr,
            len,
            place,
            readonly,
            elements,
        })
    }

    /// Address of the first byte (for overlap checks; never dereferenced from this number
    /// alone).
    pub(crate) fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Host memory or a CUDA device's.
    pub(crate) fn place(&self) -> Place {
        self.place
    }

    /// The element type and shape the capsule's tensor had.
    pub(crate) fn elements(&self) -> &Elements {
        &self.elements
    }

    /// Whether the producer marked the memory read-only (DLPack 1.x only: a 0.x capsule
    /// cannot say, and numpy refuses to export a read-only array through one).
    pub(crate) fn readonly(&self) -> bool {
        self.readonly
    }

    /// The bytes of host memory (empty for a CUDA tensor or no bytes).
    ///
    /// # Safety
    /// Nobody may write the memory while the returned slice is used (the Python caller
    /// does not change its tensor until the call, or the save it was given to, is staged).
    pub(crate) unsafe fn host_bytes(&self) -> &[u8] {
        if self.len == 0 || self.place != Place::Host {
            return &[];
        }
        // SAFETY: `addr..addr + len` is the checked extent of a host tensor whose producer
        // keeps it allocated while `self` lives (`len > 0`, so `addr` is non-null, and the
        // range does not wrap); no writer meanwhile is this function's contract.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }

    /// The bytes of host memory, writable (empty for a CUDA tensor or no bytes).
    ///
    /// # Safety
    /// Nobody else may read or write the memory while the returned slice is used, and no
    /// other [`Memory`] used meanwhile may overlap it.
    pub(crate) unsafe fn host_bytes_mut(&mut self) -> &mut [u8] {
        if self.len == 0 || self.place != Place::Host {
            return &mut [];
        }
        // SAFETY: as `host_bytes`; exclusive use is this function's contract.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len) }
    }

    /// The memory of a CUDA tensor as the crate's device slice (`None` for host memory).
    ///
    /// # Safety
    /// As [`DeviceSlice::new`] asks of a save or load it is given to: for a load, nothing
    /// else may access the memory until the load returns; for a save, nothing may write it
    /// until the save is staged. (That the range is device memory of its device and stays
    /// allocated while `self` lives is this value's own guarantee.)
    pub(crate) unsafe fn device_slice(&self) -> Option<DeviceSlice<'_>> {
        match self.place {
            Place::Cuda(d) => {
                // SAFETY: the checked extent of a `kDLCUDA` tensor of device `d`, kept
                // allocated by its producer while `self` (which the slice borrows) lives;
                // the rest is this function's contract.
                Some(unsafe { DeviceSlice::new(self.addr, self.len, d) })
            }
            Place::Host => None,
        }
    }
}

/// Host memory as destinations check it: `ValueError` unless on the host and writable.
pub(crate) fn writable_host(name: &str, m: &Memory) -> PyResult<()> {
    if m.place() != Place::Host {
        return Err(PyValueError::new_err(format!(
            "destination {name:?}: not host memory ({:?}); pass a CPU tensor or array",
            m.place()
        )));
    }
    if m.readonly() {
        return Err(PyValueError::new_err(format!(
            "destination {name:?}: the memory is read-only"
        )));
    }
    Ok(())
}

/// Device memory as destinations check it: `ValueError` unless on CUDA device `device`
/// and writable.
pub(crate) fn writable_device(name: &str, m: &Memory, device: i32) -> PyResult<()> {
    if m.place() != Place::Cuda(device) {
        return Err(PyValueError::new_err(format!(
            "destination {name:?}: not memory of CUDA device {device} ({:?})",
            m.place()
        )));
    }
    if m.readonly() {
        return Err(PyValueError::new_err(format!(
            "destination {name:?}: the memory is read-only"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{
        Elements, KDL_BFLOAT, KDL_BOOL, KDL_COMPLEX, KDL_FLOAT, KDL_INT, KDL_UINT, packed,
    };
    use shmckpt::Dtype;

    fn el(code: u8, bits: u8, lanes: u16, shape: &[u64]) -> Elements {
        Elements {
            code,
            bits,
            lanes,
            shape: shape.to_vec(),
        }
    }

    #[test]
    fn a_tuple_fits_only_its_tensors_type_and_shape_or_its_bytes() {
        // The DLPack type of each dtype with a standard one, with the same shape.
        let typed = [
            (Dtype::BOOL, KDL_BOOL, 8),
            (Dtype::BOOL, KDL_UINT, 8),
            (Dtype::U8, KDL_UINT, 8),
            (Dtype::I8, KDL_INT, 8),
            (Dtype::I16, KDL_INT, 16),
            (Dtype::U16, KDL_UINT, 16),
            (Dtype::F16, KDL_FLOAT, 16),
            (Dtype::BF16, KDL_BFLOAT, 16),
            (Dtype::I32, KDL_INT, 32),
            (Dtype::U32, KDL_UINT, 32),
            (Dtype::F32, KDL_FLOAT, 32),
            (Dtype::C64, KDL_COMPLEX, 64),
            (Dtype::F64, KDL_FLOAT, 64),
            (Dtype::I64, KDL_INT, 64),
            (Dtype::U64, KDL_UINT, 64),
        ];
        for (dt, code, bits) in typed {
            assert!(el(code, bits, 1, &[2, 3]).fit(dt, &[2, 3]), "{dt:?}");
            assert!(el(code, bits, 1, &[]).fit(dt, &[]), "{dt:?} 0-d");
            // Another shape of the same size, another rank, two lanes.
            assert!(!el(code, bits, 1, &[3, 2]).fit(dt, &[2, 3]), "{dt:?}");
            assert!(!el(code, bits, 1, &[6]).fit(dt, &[2, 3]) || (code, bits) == (KDL_UINT, 8));
            assert!(!el(code, bits, 2, &[2, 3]).fit(dt, &[2, 3]), "{dt:?} lanes");
        }
        // Another type of the same width: signedness, float against int, bf16 against f16.
        assert!(!el(KDL_INT, 32, 1, &[4]).fit(Dtype::F32, &[4]));
        assert!(!el(KDL_UINT, 32, 1, &[4]).fit(Dtype::I32, &[4]));
        assert!(!el(KDL_FLOAT, 16, 1, &[4]).fit(Dtype::BF16, &[4]));
        assert!(!el(KDL_INT, 8, 1, &[4]).fit(Dtype::BOOL, &[4]));
        // Any dtype as a one-dimensional array of bytes (the package's fallback); not as
        // bytes of another rank.
        assert!(el(KDL_UINT, 8, 1, &[24]).fit(Dtype::F32, &[2, 3]));
        assert!(!el(KDL_UINT, 8, 1, &[4, 6]).fit(Dtype::F32, &[2, 3]));
        assert!(!el(KDL_INT, 8, 1, &[24]).fit(Dtype::F32, &[2, 3]));
        // No standard DLPack type: not compared (the byte length is, by the caller).
        for dt in [Dtype::F8_E4M3, Dtype::F8_E5M2, Dtype::F4, Dtype::F6_E2M3] {
            assert!(el(KDL_FLOAT, 8, 1, &[7]).fit(dt, &[2, 3]), "{dt:?}");
        }
    }

    #[test]
    fn packed_strides_are_row_major() {
        assert!(packed(&[2, 3], &[3, 1]));
        assert!(!packed(&[2, 3], &[1, 2])); // column-major
        assert!(!packed(&[2, 3], &[6, 2])); // every other element
        assert!(packed(&[1, 3], &[999, 1])); // size-1 dimension: any stride
        assert!(!packed(&[3], &[-1])); // reversed
    }
}
