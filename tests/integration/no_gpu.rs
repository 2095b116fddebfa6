//! Device tensors on a machine without a CUDA driver: a clear error, never a panic. (On a
//! machine with a driver this file checks nothing and says so, a failure under
//! `SHMCKPT_REQUIRE_NO_GPU=1`, which `.ci/run` sets; the GPU tests cover it.)

use crate::common;

use shmckpt::cuda;
use shmckpt::{DeviceSlice, Dtype, Engine, Error, Metadata, Tensor};

#[test]
fn device_tensor_without_driver_is_a_clear_error() {
    if cuda::driver_present() {
        common::skip(
            common::REQUIRE_NO_GPU,
            "a CUDA driver is present; cli/tests/gpu.rs covers this machine",
        );
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
    // The background registration reports the missing driver at the call, spawns nothing.
    assert!(matches!(
        engine.prepare_cuda_background(&[0]),
        Err(Error::Cuda { .. })
    ));
    assert!(engine.staging_ready());
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

#[test]
fn split_load_without_device_destinations_is_host_only_and_exact() {
    let dir = common::real_dir("split");
    let engine =
        Engine::open(common::small_config(dir.path(), shmckpt::BackendKind::Auto)).unwrap();
    let state = common::step_state(3);
    common::save_committed(&engine, 3, &state);
    let step_dir = dir.path().join(shmckpt::manifest::step_dir_name(3));
    let opts = shmckpt::restore::ReadOptions::default();
    let got = shmckpt::restore::load_split_host(&step_dir, 0, &opts).unwrap();
    assert_eq!(got.manifest.step, 3);
    assert_eq!(got.entry.tensors.len(), state.layout.len());
    for (t, bytes) in got.entry.tensors.iter().zip(&got.host) {
        let i = state.layout.iter().position(|e| e.name == t.name).unwrap();
        assert_eq!(
            bytes.as_ref().unwrap().as_bytes(),
            &state.data[i][..],
            "{}",
            t.name
        );
    }
    // The ring needs no driver to be made; with no device destinations it reads the
    // same bytes.
    let ring = shmckpt::restore::DeviceRing::new(1 << 20, 2).unwrap();
    assert_eq!(ring.bytes(), (1 << 20) * (2 + 4));
    assert_eq!((ring.read_size(), ring.depth()), (1 << 20, 2));
    // SAFETY: no device ranges.
    let again = unsafe { ring.load_split(&step_dir, 0, &[], &mut [], &opts) }.unwrap();
    assert_eq!(again.host, got.host);
    // Caller host buffers for two tensors: filled in place (never touching CUDA), the
    // others returned.
    let mut w = vec![0u8; state.data[0].len()];
    let mut rng = vec![0u8; state.data[3].len()];
    let mut host: Vec<(&str, &mut [u8])> = vec![("layer.0.weight", &mut w), ("rng", &mut rng)];
    // SAFETY: no device ranges.
    let part = unsafe { ring.load_split(&step_dir, 0, &[], &mut host, &opts) }.unwrap();
    assert_eq!(w, state.data[0]);
    assert_eq!(rng, state.data[3]);
    for (t, bytes) in part.entry.tensors.iter().zip(&part.host) {
        let i = state.layout.iter().position(|e| e.name == t.name).unwrap();
        match bytes {
            Some(b) => {
                assert!(i == 1 || i == 2, "{} returned", t.name);
                assert_eq!(b.as_bytes(), &state.data[i][..], "{}", t.name);
            }
            None => assert!(i == 0 || i == 3, "{} not returned", t.name),
        }
    }
    // A caller buffer of the wrong size is refused before anything is read.
    let mut short = vec![0u8; 10];
    let mut bad: Vec<(&str, &mut [u8])> = vec![("rng", &mut short)];
    // SAFETY: no device ranges.
    let err = unsafe { ring.load_split(&step_dir, 0, &[], &mut bad, &opts) }.unwrap_err();
    assert!(
        matches!(&err, Error::Destination { name, reason } if name == "rng" && reason.contains("holds 10 bytes")),
        "{err:?}"
    );
}

#[test]
fn split_load_refuses_bad_device_destinations_before_any_device_call() {
    let dir = common::real_dir("split-bad");
    let engine =
        Engine::open(common::small_config(dir.path(), shmckpt::BackendKind::Auto)).unwrap();
    let state = common::step_state(4);
    common::save_committed(&engine, 4, &state);
    let step_dir = dir.path().join(shmckpt::manifest::step_dir_name(4));
    let opts = shmckpt::restore::ReadOptions::default();
    let ring = shmckpt::restore::DeviceRing::new(1 << 20, 2).unwrap();
    let bias_len = 1000 * 2;
    let cases: [(&str, usize, &str); 3] = [
        ("nope", 16, "not in the checkpoint"),
        ("layer.0.bias", bias_len - 2, "device buffer holds"),
        ("layer.0.bias", bias_len, "twice"),
    ];
    for (name, len, why) in cases {
        // SAFETY: never dereferenced: every case fails before a device call.
        let d = unsafe { DeviceSlice::new(0x1000, len, 0) };
        let dest: Vec<(&str, DeviceSlice<'_>)> = if why == "twice" {
            vec![(name, d), (name, d)]
        } else {
            vec![(name, d)]
        };
        // SAFETY: as above.
        let err = unsafe { ring.load_split(&step_dir, 0, &dest, &mut [], &opts) }.unwrap_err();
        match &err {
            Error::Destination { name: n, reason } => {
                assert_eq!(n, name);
                assert!(reason.contains(why), "{why}: {reason}");
            }
            other => panic!("{why}: unexpected {other:?}"),
        }
    }
    if cuda::driver_present() {
        common::skip(
            common::REQUIRE_NO_GPU,
            "the driver check: a CUDA driver is present; cli/tests/gpu.rs covers it",
        );
        return;
    }
    // A well-formed destination on a machine without a driver: a clear error, no panic.
    // SAFETY: never dereferenced: the load fails at cuInit.
    let d = unsafe { DeviceSlice::new(0x1000, bias_len, 0) };
    // SAFETY: as above.
    let err = unsafe { ring.load_split(&step_dir, 0, &[("layer.0.bias", d)], &mut [], &opts) }
        .unwrap_err();
    assert!(matches!(err, Error::Cuda { .. }), "{err:?}");
}

#[test]
fn device_read_settings_are_checked() {
    let dir = common::real_dir("devread");
    for (size, depth, what) in [
        (1000, 4, "multiple of 4096"),
        (512 << 10, 4, "between 1 MiB"),
        (2 << 30, 4, "between 1 MiB"),
        (16 << 20, 0, "1..=64"),
        (16 << 20, 65, "1..=64"),
    ] {
        let cfg = common::small_config(dir.path(), shmckpt::BackendKind::Auto)
            .with_device_read(size, depth);
        match Engine::open(cfg) {
            Err(Error::Config(m)) => assert!(m.contains(what), "{what}: {m}"),
            other => panic!("{size}x{depth}: unexpected {other:?}"),
        }
        match shmckpt::restore::DeviceRing::new(size, depth) {
            Err(Error::Config(m)) => assert!(m.contains(what), "{what}: {m}"),
            other => panic!("{size}x{depth}: unexpected {other:?}"),
        }
    }
    let cfg =
        common::small_config(dir.path(), shmckpt::BackendKind::Auto).with_device_read(32 << 20, 2);
    assert!(Engine::open(cfg).is_ok());
}
