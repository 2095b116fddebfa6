//! Tensor descriptions handed to `save`, and owned tensors returned by `load`.

use std::borrow::Cow;
use std::marker::PhantomData;

use crate::dtype::Dtype;

/// Where a tensor's bytes live when `save` is called.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Source<'a> {
    /// Bytes in host memory (any host memory: pageable, pinned, mapped).
    Host(&'a [u8]),
    /// Bytes in CUDA device memory.
    Cuda(DeviceSlice<'a>),
}

impl Source<'_> {
    /// Number of bytes the source holds.
    pub fn len(&self) -> u64 {
        match self {
            Source::Host(b) => b.len() as u64,
            Source::Cuda(d) => d.len as u64,
        }
    }

    /// True when the source holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A range of CUDA device memory: a device pointer, its length and the device ordinal,
/// borrowed for `'a` from whatever owns the memory.
///
/// Safe code gets one only from an owner that outlives it
/// ([`DeviceBuffer::slice`](crate::cuda::DeviceBuffer::slice),
/// or, outside the crate, `shmckpt_ipc::cuda::IpcMapping::slice`), so a slice cannot
/// outlive its buffer:
///
/// ```compile_fail,E0505
/// # fn f(ctx: &std::sync::Arc<shmckpt::cuda::Context>) -> shmckpt::Result<()> {
/// let buf = shmckpt::cuda::DeviceBuffer::alloc(ctx, 16)?;
/// let slice = buf.slice();
/// drop(buf); // error: `buf` is still borrowed by `slice`
/// let _ = slice.len();
/// # Ok(()) }
/// ```
///
/// Memory owned elsewhere (a framework's tensor, a raw `CUdeviceptr` from FFI) is
/// described with the `unsafe` [`DeviceSlice::new`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSlice<'a> {
    ptr: u64,
    len: usize,
    device: i32,
    _owner: PhantomData<&'a ()>,
}

impl DeviceSlice<'_> {
    /// Describe `len` bytes of device memory at `ptr` on device ordinal `device`, for any
    /// lifetime the caller picks (`DeviceSlice<'static>` for FFI callers).
    ///
    /// # Safety
    /// - `ptr..ptr + len` must be memory allocated on device `device` in this process
    ///   (`cuMemAlloc`, a framework allocator, or memory mapped into it), valid for reads;
    /// - it must stay allocated until the `save` (or `load_into_device`) call that receives it
    ///   returns (for `save_async`, until the save is staged), and, for `load`, nothing else
    ///   may access it until then.
    #[allow(unsafe_code)]
    pub unsafe fn new(ptr: u64, len: usize, device: i32) -> Self {
        DeviceSlice {
            ptr,
            len,
            device,
            _owner: PhantomData,
        }
    }

    /// The device pointer (`CUdeviceptr`).
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the slice holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Device ordinal.
    pub fn device(&self) -> i32 {
        self.device
    }
}

/// One tensor to save: name, dtype, shape and where its bytes are.
#[derive(Debug, Clone)]
pub struct Tensor<'a> {
    /// Name, unique within a save.
    pub name: Cow<'a, str>,
    /// Element type.
    pub dtype: Dtype,
    /// Shape; empty for a scalar. A zero dimension makes a zero-size tensor.
    pub shape: Vec<usize>,
    /// Its bytes, row-major, little-endian as in memory.
    pub source: Source<'a>,
}

impl<'a> Tensor<'a> {
    /// A tensor whose bytes are in host memory.
    pub fn host(
        name: impl Into<Cow<'a, str>>,
        dtype: Dtype,
        shape: impl Into<Vec<usize>>,
        bytes: &'a [u8],
    ) -> Self {
        Tensor {
            name: name.into(),
            dtype,
            shape: shape.into(),
            source: Source::Host(bytes),
        }
    }

    /// A tensor whose bytes are in CUDA device memory.
    pub fn cuda(
        name: impl Into<Cow<'a, str>>,
        dtype: Dtype,
        shape: impl Into<Vec<usize>>,
        slice: DeviceSlice<'a>,
    ) -> Self {
        Tensor {
            name: name.into(),
            dtype,
            shape: shape.into(),
            source: Source::Cuda(slice),
        }
    }
}

/// A tensor's bytes, aligned for typed views of its dtype.
///
/// [`AlignedBytes::zeroed`] (and a clone) is aligned to 8. `load` returns tensors whose
/// bytes are views into one allocation per file (read there with O_DIRECT, no copy),
/// aligned to their dtype's element size (the file stores each tensor at a multiple of
/// it), so `cast` to the tensor's own element type always succeeds; the allocation is
/// freed, or kept by the engine for its next load, when the last view is dropped.
pub struct AlignedBytes {
    repr: Repr,
}

enum Repr {
    Owned { words: Vec<u64>, len: usize },
    View(crate::slab::SlabView),
}

impl AlignedBytes {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Self {
        AlignedBytes {
            repr: Repr::Owned {
                words: vec![0u64; len.div_ceil(8)],
                len,
            },
        }
    }

    /// A view into a load's slab.
    pub(crate) fn view(v: crate::slab::SlabView) -> Self {
        AlignedBytes {
            repr: Repr::View(v),
        }
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        match &self.repr {
            Repr::Owned { words, len } => &bytemuck::cast_slice(words)[..*len],
            Repr::View(v) => v.as_bytes(),
        }
    }

    /// The bytes, mutable.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.repr {
            Repr::Owned { words, len } => &mut bytemuck::cast_slice_mut(words)[..*len],
            Repr::View(v) => v.as_bytes_mut(),
        }
    }

    /// A typed view (`f32`, `u16` for bf16, ...). Fails when the length is not a multiple
    /// of `size_of::<T>()`.
    pub fn cast<T: bytemuck::Pod>(&self) -> Result<&[T], bytemuck::PodCastError> {
        bytemuck::try_cast_slice(self.as_bytes())
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        match &self.repr {
            Repr::Owned { len, .. } => *len,
            Repr::View(v) => v.len(),
        }
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Clone for AlignedBytes {
    fn clone(&self) -> Self {
        let mut c = AlignedBytes::zeroed(self.len());
        c.as_bytes_mut().copy_from_slice(self.as_bytes());
        c
    }
}

impl PartialEq for AlignedBytes {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for AlignedBytes {}

impl std::fmt::Debug for AlignedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBytes({} bytes)", self.len())
    }
}

/// A tensor read back by `load`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadedTensor {
    /// Name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Bytes, aligned to the dtype's element size.
    pub data: AlignedBytes,
}
