//! Device tensors on a machine without a CUDA driver: a clear error, never a panic. (On a
//! machine with a driver this file checks nothing and says so; the GPU tests cover it.)

use crate::common;

use shmckpt::cuda;
use shmckpt::{DeviceSlice, Dtype, Engine, Error, Metadata, Tensor};

#[test]
fn device_tensor_without_driver_is_a_clear_error() {
    if cuda::driver_present() {
        eprintln!("SKIPPED: a CUDA driver is present; tests/gpu.rs covers this machine");
        return;
    }
    let dir = common::real_dir("nogpu");
    let engine =
        Engine::open(common::small_config(dir.path(), shmckpt::BackendKind::Auto)).unwrap();
    // SAFETY: never dereferenced: the engine fails before any CUDA call.
    let slice = unsafe { DeviceSlice::new(0x1000, 16, 0) };
    let err = engine
        .save(
            1,
            &[Tensor::cuda("w", Dtype::F32, vec![4], slice)],
            &Metadata::new(),
        )
        .unwrap_err();
    match &err {
        Error::Cuda { call, code, detail } => {
            assert_eq!((call.as_str(), *code), ("cuInit", None));
            assert!(detail.contains("no CUDA driver"), "{detail}");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(matches!(engine.prepare_cuda(&[0]), Err(Error::Cuda { .. })));
    assert!(matches!(cuda::init(), Err(Error::Cuda { .. })));
    assert!(matches!(cuda::Context::new(0), Err(Error::Cuda { .. })));
    // Nothing was written, and host saves still work.
    assert!(engine.list().unwrap().is_empty());
    assert!(!dir.path().join("step-1.partial").exists());
    let data = [1u8, 2, 3];
    engine
        .save(
            1,
            &[Tensor::host("h", Dtype::U8, vec![3], &data)],
            &Metadata::new(),
        )
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(engine.load(1).unwrap().tensors[0].data.as_bytes(), &data);
}
