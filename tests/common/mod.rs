//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use shmckpt::synthetic::{self, LayoutEntry};
use shmckpt::{BackendKind, Dtype, EngineConfig, Tensor};

/// A fresh directory on the real filesystem that holds `target/` (not tmpfs: O_DIRECT and
/// io_uring must meet a real block device). Removed on drop.
pub fn real_dir(tag: &str) -> tempfile::TempDir {
    let base = Path::new(env!("CARGO_TARGET_TMPDIR"));
    std::fs::create_dir_all(base).unwrap();
    let d = tempfile::Builder::new()
        .prefix(&format!("{tag}-"))
        .tempdir_in(base)
        .unwrap();
    let st = rustix::fs::statfs(d.path()).unwrap();
    assert_ne!(
        st.f_type as i64,
        0x0102_1994,
        "test directory {} is on tmpfs; the tests need a real filesystem",
        d.path().display()
    );
    d
}

/// Both write backends; every round-trip test runs on each.
pub const BACKENDS: [BackendKind; 2] = [BackendKind::IoUring, BackendKind::Pwrite];

/// A small engine config: 64 KiB chunks so that multi-chunk paths are exercised.
pub fn small_config(root: &Path, backend: BackendKind) -> EngineConfig {
    EngineConfig::new(root)
        .with_backend(backend)
        .with_staging_capacity(16 << 20)
        .with_chunk_size(64 << 10)
        .with_queue_depth(4)
        .with_writer_threads(2)
}

/// Owned bytes plus their layout.
pub struct State {
    pub layout: Vec<LayoutEntry>,
    pub data: Vec<Vec<u8>>,
}

impl State {
    pub fn new(layout: Vec<LayoutEntry>, seed: u64) -> State {
        let data = synthetic::materialize(&layout, seed, 2);
        State { layout, data }
    }

    pub fn tensors(&self) -> Vec<Tensor<'_>> {
        self.layout
            .iter()
            .zip(&self.data)
            .map(|(e, d)| Tensor::host(e.name.as_str(), e.dtype, e.shape.clone(), d))
            .collect()
    }

    pub fn bytes(&self) -> u64 {
        self.data.iter().map(|d| d.len() as u64).sum()
    }
}

/// One tensor of every dtype, with odd shapes, plus a scalar and zero-size tensors.
pub fn every_dtype() -> Vec<LayoutEntry> {
    let mut v: Vec<LayoutEntry> = Dtype::ALL
        .iter()
        .enumerate()
        .map(|(i, &d)| LayoutEntry {
            name: format!("t.{}", d.as_str().to_lowercase()),
            dtype: d,
            // Sub-byte dtypes need whole bytes: 8 elements per row.
            shape: vec![3 + i, 8],
        })
        .collect();
    v.push(LayoutEntry {
        name: "scalar.f64".into(),
        dtype: Dtype::F64,
        shape: vec![],
    });
    v.push(LayoutEntry {
        name: "scalar.bool".into(),
        dtype: Dtype::BOOL,
        shape: vec![],
    });
    v.push(LayoutEntry {
        name: "empty.f32".into(),
        dtype: Dtype::F32,
        shape: vec![0],
    });
    v.push(LayoutEntry {
        name: "empty.2d".into(),
        dtype: Dtype::BF16,
        shape: vec![5, 0],
    });
    v
}

/// Read `file` with the safetensors crate and compare every tensor with `state`.
pub fn assert_safetensors_equal(file: &Path, state: &State) {
    let bytes = std::fs::read(file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .unwrap_or_else(|e| panic!("{} does not parse: {e:?}", file.display()));
    assert_eq!(st.len(), state.layout.len());
    for (e, d) in state.layout.iter().zip(&state.data) {
        let v = st.tensor(&e.name).unwrap();
        assert_eq!(format!("{:?}", v.dtype()), e.dtype.as_str(), "{}", e.name);
        assert_eq!(v.shape(), &e.shape[..], "{}", e.name);
        assert!(v.data() == &d[..], "bytes of {} differ", e.name);
    }
    let (n, _) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!(
        (8 + n) % 4096,
        0,
        "data section must start at a 4096 boundary"
    );
}

/// Compare a loaded checkpoint with `state`, byte for byte.
pub fn assert_loaded_equal(ck: &shmckpt::Checkpoint, state: &State) {
    assert_eq!(ck.tensors.len(), state.layout.len());
    for (e, d) in state.layout.iter().zip(&state.data) {
        let t = ck
            .get(&e.name)
            .unwrap_or_else(|| panic!("{} missing", e.name));
        assert_eq!(t.dtype, e.dtype);
        assert_eq!(t.shape, e.shape);
        assert!(t.data.as_bytes() == &d[..], "bytes of {} differ", e.name);
    }
}

pub fn path_of(dir: &Path, rel: &str) -> PathBuf {
    dir.join(rel)
}
