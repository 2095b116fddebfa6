//! Exact-byte round trips through the real write paths (io_uring and pwrite) on a real
//! filesystem.

use crate::common;

use common::*;
use shmckpt::{Dtype, Engine, Error, Metadata, StepSel};
use shmckpt_bench::synthetic::{self, LayoutEntry};

#[test]
fn every_dtype_scalar_and_zero_size_round_trip_on_both_backends() {
    for backend in BACKENDS {
        let dir = real_dir("dtypes");
        let engine = Engine::open(small_config(dir.path(), backend)).unwrap();
        let state = State::new(every_dtype(), 1);
        let meta: Metadata = [("run".to_owned(), "unit \"test\" é".to_owned())].into();
        let h = engine.save(5, &state.tensors(), &meta).unwrap();
        let report = h.wait().unwrap();
        assert_eq!(report.backend, engine.backend());
        let expected = match backend {
            shmckpt::BackendKind::Pwrite => shmckpt::Backend::Pwrite,
            _ => shmckpt::Backend::IoUring,
        };
        assert_eq!(engine.backend(), expected);
        let ckdir = report.dir.clone().unwrap();
        assert_eq!(ckdir, dir.path().join("step-5"));
        assert_safetensors_equal(&report.file, &state);
        let ck = engine.load(StepSel::Latest).unwrap();
        assert_eq!(ck.step, 5);
        assert_eq!(ck.metadata, meta);
        assert_loaded_equal(&ck, &state);
        // The safetensors header carries the step and the user metadata.
        let bytes = std::fs::read(&report.file).unwrap();
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let m = header.metadata().clone().unwrap();
        assert_eq!(m["shmckpt.step"], "5");
        assert_eq!(m["run"], "unit \"test\" é");
    }
}

#[test]
fn empty_tensor_list_is_a_valid_checkpoint() {
    let dir = real_dir("empty");
    let engine = Engine::open(small_config(dir.path(), shmckpt::BackendKind::Auto)).unwrap();
    let r = engine
        .save(0, &[], &Metadata::new())
        .unwrap()
        .wait()
        .unwrap();
    let state = State::new(Vec::new(), 0);
    assert_safetensors_equal(&r.file, &state);
    assert!(engine.load(0).unwrap().tensors.is_empty());
}

#[test]
fn thousands_of_small_tensors_round_trip_on_both_backends() {
    for backend in BACKENDS {
        let dir = real_dir("many");
        let engine = Engine::open(small_config(dir.path(), backend)).unwrap();
        let layout: Vec<LayoutEntry> = (0..3000)
            .map(|i| LayoutEntry {
                name: format!("block.{i}.p"),
                dtype: [Dtype::F32, Dtype::U8, Dtype::BF16, Dtype::I64][i % 4],
                shape: vec![1 + (i * 7919) % 61],
            })
            .collect();
        let state = State::new(layout, 2);
        let r = save_committed(&engine, 1, &state);
        assert!(r.bytes > 64 << 10, "spans several chunks");
        assert_safetensors_equal(&r.file, &state);
        assert_loaded_equal(&engine.load(1).unwrap(), &state);
        // load_into caller buffers, in a different order than the file.
        let mut bufs: Vec<Vec<u8>> = state.data.iter().map(|d| vec![0u8; d.len()]).collect();
        let mut dest: Vec<(&str, &mut [u8])> = state
            .layout
            .iter()
            .zip(bufs.iter_mut())
            .rev()
            .map(|(e, b)| (e.name.as_str(), b.as_mut_slice()))
            .collect();
        assert_eq!(load_into(&engine, 1, &mut dest).unwrap(), 1);
        assert!(bufs == state.data);
    }
}

#[test]
fn one_gibibyte_tensor_round_trips() {
    let dir = real_dir("big");
    let cfg = shmckpt::EngineConfig::new(dir.path())
        .with_backend(shmckpt::BackendKind::IoUring)
        .with_staging_capacity((1 << 30) + (16 << 20));
    let engine = Engine::open(cfg).unwrap();
    let layout = vec![
        LayoutEntry {
            name: "tiny".into(),
            dtype: Dtype::U8,
            shape: vec![3],
        },
        LayoutEntry {
            name: "huge".into(),
            dtype: Dtype::BF16,
            shape: vec![1 << 29],
        },
    ];
    let state = State::new(layout, 3);
    let r = save_committed(&engine, 9, &state);
    assert_eq!(r.bytes, 4096 + (1 << 30) + 3);
    assert!(r.direct_io, "a real filesystem takes O_DIRECT");
    let mut huge = vec![0u8; 1 << 30];
    let mut tiny = [0u8; 3];
    load_into(
        &engine,
        9,
        &mut [("huge", &mut huge[..]), ("tiny", &mut tiny[..])],
    )
    .unwrap();
    assert!(huge == state.data[1], "1 GiB tensor differs");
    assert_eq!(&tiny[..], &state.data[0][..]);
    drop(huge);
    assert_safetensors_equal(&r.file, &state);
}

#[test]
fn caller_may_overwrite_tensors_as_soon_as_save_returns() {
    for backend in BACKENDS {
        let dir = real_dir("overwrite");
        // Slow the drain down: one writer, depth 1, small chunks.
        let cfg = small_config(dir.path(), backend)
            .with_writer_threads(1)
            .with_queue_depth(1);
        let engine = Engine::open(cfg).unwrap();
        let layout = synthetic::uniform(8 << 20, 16, Dtype::F32);
        let mut state = State::new(layout, 4);
        let original: Vec<Vec<u8>> = state.data.clone();
        let h = engine.save(1, &state.tensors(), &Metadata::new()).unwrap();
        for d in &mut state.data {
            d.fill(0xEE);
        }
        h.wait().unwrap();
        let saved = State {
            layout: state.layout.clone(),
            data: original,
        };
        assert_loaded_equal(&engine.load(1).unwrap(), &saved);
    }
}

#[test]
fn a_finished_save_holds_no_descriptor_of_its_file() {
    // Whoever closes the last descriptor of a deleted file frees its blocks (seconds for
    // gigabytes on a filesystem mounted with `discard`). The engine once kept the file of
    // its last save open until the next save replaced it, so deleting a checkpoint made
    // the next `save` call pay for it: 2.5-3x the staging time here, seconds on the H200.
    for backend in BACKENDS {
        let dir = real_dir("closed");
        let root = dir.path();
        let engine = Engine::open(small_config(root, backend)).unwrap();
        for step in 1..=3u64 {
            let state = step_state(step);
            let handle = engine
                .save(step, &state.tensors(), &Metadata::new())
                .unwrap();
            let report = handle.wait().unwrap();
            // The report (and the engine's record of its last save) are still held.
            assert_eq!(
                descriptors_under(root),
                Vec::<String>::new(),
                "{backend:?} step {step}"
            );
            assert_safetensors_equal(&report.file, &state);
            std::fs::remove_dir_all(report.dir.unwrap()).unwrap();
            assert_eq!(
                descriptors_under(root),
                Vec::<String>::new(),
                "{backend:?} step {step}"
            );
        }
        assert_eq!(committed(root), Vec::<u64>::new());
    }
}

#[test]
fn back_to_back_saves_each_hold_their_own_step() {
    for backend in BACKENDS {
        let dir = real_dir("b2b");
        // Staging holds barely one save: the next one must wait for chunks to drain.
        let cfg = small_config(dir.path(), backend)
            .with_staging_capacity(3 << 20)
            .with_writer_threads(1)
            .with_queue_depth(2);
        let engine = Engine::open(cfg).unwrap();
        let layout = synthetic::uniform(2 << 20, 7, Dtype::BF16);
        let mut handles = Vec::new();
        let mut states = Vec::new();
        for step in 0..6u64 {
            let state = State::new(layout.clone(), 100 + step);
            handles.push(
                engine
                    .save(step, &state.tensors(), &Metadata::new())
                    .unwrap(),
            );
            states.push(state);
        }
        let reports: Vec<_> = handles.into_iter().map(|h| h.wait().unwrap()).collect();
        assert!(
            reports
                .iter()
                .any(|r| r.timings.backpressure > std::time::Duration::ZERO),
            "later saves should have waited for staging space"
        );
        for (step, state) in states.iter().enumerate() {
            assert_loaded_equal(&engine.load(step as u64).unwrap(), state);
        }
        assert_eq!(engine.latest().unwrap(), Some(5));
    }
}

#[test]
fn bad_input_is_refused_and_writes_nothing() {
    let dir = real_dir("bad");
    let engine = Engine::open(small_config(dir.path(), shmckpt::BackendKind::Auto)).unwrap();
    let data = vec![0u8; 16];
    let t = |name: &'static str, shape: Vec<usize>| {
        shmckpt::Tensor::host(name, Dtype::F32, shape, &data)
    };
    let m = Metadata::new();
    let cases: Vec<(Vec<shmckpt::Tensor<'_>>, &str)> = vec![
        (vec![t("", vec![4])], "empty name"),
        (vec![t("a", vec![4]), t("a", vec![4])], "duplicate"),
        (vec![t("a", vec![5])], "size mismatch"),
        (vec![t("a", vec![usize::MAX, 2])], "overflow"),
    ];
    for (tensors, what) in cases {
        let err = engine.save(1, &tensors, &m).unwrap_err();
        match (what, &err) {
            ("empty name", Error::EmptyName { .. })
            | ("duplicate", Error::DuplicateName { .. })
            | ("size mismatch", Error::SizeMismatch { .. })
            | ("overflow", Error::ShapeOverflow { .. }) => {}
            _ => panic!("{what}: unexpected {err:?}"),
        }
    }
    let long = "x".repeat(shmckpt::MAX_NAME_LEN + 1);
    let err = engine
        .save(
            1,
            &[shmckpt::Tensor::host(
                long.as_str(),
                Dtype::F32,
                vec![4],
                &data,
            )],
            &m,
        )
        .unwrap_err();
    assert!(matches!(err, Error::InvalidName { .. }), "{err:?}");
    let big = vec![0u8; 17 << 20];
    let err = engine
        .save(
            1,
            &[shmckpt::Tensor::host(
                "big",
                Dtype::U8,
                vec![big.len()],
                &big,
            )],
            &m,
        )
        .unwrap_err();
    match err {
        Error::TooLarge { needed, capacity } => {
            assert_eq!(capacity, 16 << 20);
            assert!(needed > capacity);
            assert!(
                err_text(&Error::TooLarge { needed, capacity }).contains(&capacity.to_string())
            );
        }
        other => panic!("unexpected {other:?}"),
    }
    // Nothing was written: no directories besides the lock file.
    let entries: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| !n.starts_with(".shmckpt-rank-"))
        .collect();
    assert!(entries.is_empty(), "bad input left {entries:?}");
    // An existing step is refused too.
    engine
        .save(1, &[t("ok", vec![4])], &m)
        .unwrap()
        .wait()
        .unwrap();
    let err = engine.save(1, &[t("ok", vec![4])], &m).unwrap_err();
    assert!(matches!(err, Error::StepExists { step: 1, .. }), "{err:?}");
}

fn err_text(e: &Error) -> String {
    e.to_string()
}

/// Child role of `missing_or_unwritable_root_is_refused` when run as root (who ignores
/// directory permissions): in a private mount namespace, `$SHMCKPT_TEST_RO_ROOT` is made
/// read-only by a read-only bind mount of itself.
fn child_read_only_root() {
    let ro = std::env::var("SHMCKPT_TEST_RO_ROOT").unwrap();
    run_tool("mount", &["--bind", &ro, &ro]).unwrap();
    run_tool("mount", &["-o", "remount,bind,ro", &ro, &ro]).unwrap();
    assert!(std::fs::File::create(std::path::Path::new(&ro).join("probe")).is_err());
    let err = Engine::open(shmckpt::EngineConfig::new(&ro)).unwrap_err();
    assert!(matches!(err, Error::RootNotWritable { .. }), "{err:?}");
    println!("READ-ONLY-ROOT: {err}");
}

#[test]
fn missing_or_unwritable_root_is_refused() {
    if run_role(&[("child_read_only_root", child_read_only_root)]) {
        return;
    }
    let dir = real_dir("root");
    let missing = dir.path().join("nope");
    let err = Engine::open(shmckpt::EngineConfig::new(&missing)).unwrap_err();
    assert!(matches!(err, Error::RootMissing { .. }), "{err:?}");
    let ro = dir.path().join("ro");
    std::fs::create_dir(&ro).unwrap();
    let mut perm = std::fs::metadata(&ro).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o555);
    std::fs::set_permissions(&ro, perm).unwrap();
    let writable = std::fs::File::create(ro.join("probe")).is_ok();
    if writable {
        // Root ignores permissions: a read-only bind mount, in a private mount namespace.
        let Some(mut cmd) = child_command_in_mount_ns("child_read_only_root") else {
            return;
        };
        let out = cmd.env("SHMCKPT_TEST_RO_ROOT", &ro).output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success(),
            "child failed ({:?}):\n{text}",
            out.status
        );
        assert!(
            relay_markers(&text, &["READ-ONLY-ROOT"]),
            "the child did not run:\n{text}"
        );
    } else {
        let err = Engine::open(shmckpt::EngineConfig::new(&ro)).unwrap_err();
        assert!(matches!(err, Error::RootNotWritable { .. }), "{err:?}");
    }
}

#[test]
fn create_root_makes_the_root_and_its_parents_or_says_why_not() {
    let dir = real_dir("mkroot");
    let root = dir.path().join("a").join("b").join("c");
    // Off by default: a missing root is refused and nothing is created.
    let err = Engine::open(small_config(&root, shmckpt::BackendKind::Auto)).unwrap_err();
    assert!(matches!(err, Error::RootMissing { .. }), "{err:?}");
    assert!(!dir.path().join("a").exists());
    // On: created with its parents, and used.
    let engine =
        Engine::open(small_config(&root, shmckpt::BackendKind::Auto).with_create_root(true))
            .unwrap();
    assert!(root.is_dir());
    let state = State::new(every_dtype(), 3);
    save_committed(&engine, 1, &state);
    drop(engine);
    assert_eq!(
        shmckpt::manifest::list_committed(&root).unwrap().len(),
        1,
        "the checkpoint is under the created root"
    );
    // An existing root is fine with the option on.
    drop(
        Engine::open(small_config(&root, shmckpt::BackendKind::Auto).with_create_root(true))
            .unwrap(),
    );
    // A regular file in the way: RootCreateFailed with the OS error, the file untouched.
    let file = dir.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    for (path, errno) in [
        (file.join("sub"), libc_enotdir()),
        (file.clone(), libc_eexist()),
    ] {
        let err =
            Engine::open(small_config(&path, shmckpt::BackendKind::Auto).with_create_root(true))
                .unwrap_err();
        match &err {
            Error::RootCreateFailed { path: p, .. } => assert_eq!(p, &path),
            other => panic!("expected RootCreateFailed, got {other:?}"),
        }
        assert_eq!(err.raw_os_error(), Some(errno), "{err}");
        assert_eq!(
            err.to_string(),
            format!(
                "cannot create checkpoint root {}: {}",
                path.display(),
                std::io::Error::from_raw_os_error(errno)
            )
        );
    }
    assert_eq!(std::fs::read(&file).unwrap(), b"x");
}

#[test]
fn remove_deletes_one_committed_step_and_nothing_else() {
    let dir = real_dir("remove");
    let root = dir.path();
    let engine = Engine::open(small_config(root, shmckpt::BackendKind::Auto)).unwrap();
    let states: Vec<State> = (1..=3).map(|s| State::new(every_dtype(), s)).collect();
    for (i, st) in states.iter().enumerate() {
        save_committed(&engine, i as u64 + 1, st);
    }
    engine.remove(2).unwrap();
    let steps: Vec<u64> = engine.list().unwrap().iter().map(|c| c.step).collect();
    assert_eq!(steps, vec![1, 3]);
    assert!(!root.join("step-2").exists() && !root.join("step-2.trash").exists());
    // The others are intact, byte for byte.
    for (step, st) in [(1u64, &states[0]), (3, &states[2])] {
        let ck = engine.load(step).unwrap();
        for (e, d) in st.layout.iter().zip(&st.data) {
            assert!(
                ck.get(&e.name).unwrap().data.as_bytes() == &d[..],
                "{step} {}",
                e.name
            );
        }
    }
    // Not committed: NotFound, and a link under a step name is never followed or removed.
    assert!(matches!(engine.remove(2), Err(Error::NotFound { .. })));
    let outside = real_dir("remove-outside");
    std::fs::create_dir(outside.path().join("keep")).unwrap();
    std::fs::write(
        outside
            .path()
            .join("keep")
            .join(shmckpt::manifest::MANIFEST),
        b"{}",
    )
    .unwrap();
    std::os::unix::fs::symlink(outside.path().join("keep"), root.join("step-9")).unwrap();
    assert!(matches!(engine.remove(9), Err(Error::NotFound { .. })));
    assert!(
        std::fs::symlink_metadata(root.join("step-9"))
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert!(
        outside
            .path()
            .join("keep")
            .join(shmckpt::manifest::MANIFEST)
            .is_file()
    );
}

fn libc_enotdir() -> i32 {
    rustix::io::Errno::NOTDIR.raw_os_error()
}

fn libc_eexist() -> i32 {
    rustix::io::Errno::EXIST.raw_os_error()
}

#[test]
fn partial_directories_are_never_listed_or_loaded_and_are_cleaned_on_open() {
    let dir = real_dir("partial");
    {
        let engine = Engine::open(small_config(dir.path(), shmckpt::BackendKind::Auto)).unwrap();
        let state = State::new(every_dtype(), 5);
        save_committed(&engine, 1, &state);
    }
    // Fake interrupted saves of steps 2 and 3: partial directories with a full copy of
    // step 1 inside, step 3's with its manifest too (durable: the partial-part rule keeps
    // it until a step >= 3 is committed).
    let fake = |step: u64, with_manifest: bool| {
        let partial = dir.path().join(format!("step-{step}.partial"));
        std::fs::create_dir(&partial).unwrap();
        for f in std::fs::read_dir(dir.path().join("step-1")).unwrap() {
            let f = f.unwrap();
            if with_manifest || f.file_name() != "manifest.json" {
                std::fs::copy(f.path(), partial.join(f.file_name())).unwrap();
            }
        }
        partial
    };
    let (bare, durable) = (fake(2, false), fake(3, true));
    let listed = shmckpt::manifest::list_committed(dir.path()).unwrap();
    assert_eq!(listed.iter().map(|c| c.step).collect::<Vec<_>>(), [1]);
    let engine = Engine::open(small_config(dir.path(), shmckpt::BackendKind::Auto)).unwrap();
    assert!(
        !bare.exists(),
        "opening the root removes stale partial directories"
    );
    assert!(
        durable.join("manifest.json").is_file(),
        "a durable part is kept"
    );
    assert_eq!(engine.latest().unwrap(), Some(1));
    assert!(matches!(engine.load(2), Err(Error::NotFound { .. })));
    assert!(matches!(engine.load(3), Err(Error::NotFound { .. })));
    save_committed(&engine, 4, &State::new(every_dtype(), 6));
    drop(engine);
    drop(Engine::open(small_config(dir.path(), shmckpt::BackendKind::Auto)).unwrap());
    assert!(
        !durable.exists(),
        "step 4 is committed: step 3's part is stale"
    );
}

#[test]
fn retention_keeps_the_newest_n_after_each_commit() {
    let dir = real_dir("retain");
    let engine =
        Engine::open(small_config(dir.path(), shmckpt::BackendKind::Auto).with_keep_last(Some(2)))
            .unwrap();
    let state = State::new(every_dtype(), 6);
    let mut retired = Vec::new();
    for step in [10, 20, 30, 40] {
        let report = save_committed(&engine, step, &state);
        // Reported committed: the retired step is already out of the root's listing (its
        // files are deleted after the report, on the commit thread).
        let steps: Vec<u64> = engine.list().unwrap().iter().map(|c| c.step).collect();
        assert_eq!(steps.first(), Some(&step.saturating_sub(10).max(10)));
        assert!(
            report
                .retired
                .iter()
                .all(|r| !dir.path().join(format!("step-{r}")).exists())
        );
        retired.push(report.retired);
    }
    assert_eq!(retired, [vec![], vec![], vec![10], vec![20]]);
    let steps: Vec<u64> = engine.list().unwrap().iter().map(|c| c.step).collect();
    assert_eq!(steps, [30, 40]);
    assert!(!dir.path().join("step-10").exists());
    assert_loaded_equal(&engine.load(30).unwrap(), &state);
    // Once the engine is closed, the retired files are gone too (no trash left behind).
    engine.close();
    let mut left: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("step-"))
        .collect();
    left.sort();
    assert_eq!(left, ["step-30", "step-40"]);
}

#[test]
fn two_ranks_commit_one_directory() {
    let dir = real_dir("ranks");
    let e0 =
        Engine::open(small_config(dir.path(), shmckpt::BackendKind::Auto).with_rank(0, 2)).unwrap();
    let e1 =
        Engine::open(small_config(dir.path(), shmckpt::BackendKind::Auto).with_rank(1, 2)).unwrap();
    let s0 = State::new(synthetic::uniform(1 << 20, 3, Dtype::F32), 7);
    let s1 = State::new(synthetic::uniform(1 << 19, 5, Dtype::I8), 8);
    let h0 = e0.save(3, &s0.tensors(), &Metadata::new()).unwrap();
    let r0 = h0.wait().unwrap();
    assert!(r0.dir.is_none(), "rank 1 has not written yet");
    assert!(
        e0.latest().unwrap().is_none(),
        "not committed until every rank wrote"
    );
    let r1 = save_committed(&e1, 3, &s1);
    assert_eq!(r1.dir.unwrap(), dir.path().join("step-3"));
    let m = e0.manifest(3).unwrap();
    assert_eq!(m.files.len(), 2);
    assert_loaded_equal(&e0.load(3).unwrap(), &s0);
    assert_loaded_equal(&e1.load(3).unwrap(), &s1);
    // A second engine of the same rank is refused.
    let err = Engine::open(small_config(dir.path(), shmckpt::BackendKind::Auto).with_rank(1, 2))
        .unwrap_err();
    assert!(matches!(err, Error::RootLocked { rank: 1, .. }), "{err:?}");
}

/// A run resumed from an older step never commits a step mixing two runs: rank 0 of a dead
/// run left its durable part of step 4 (rank 1 died before its save of 4 was staged). The
/// new run resumes from step 3 on both ranks; rank 0's load withdraws its stale part, so
/// the new rank 1's save of step 4 does not merge with it (before: committed at once with
/// the dead run's file of rank 0, and the new rank 0's save of 4 failed with StepExists),
/// and step 4 holds exactly the new run's bytes of both ranks.
#[test]
fn a_resume_withdraws_the_dead_runs_parts_of_newer_steps() {
    let dir = real_dir("resume-parts");
    let root = dir.path();
    let cfg = |r| small_config(root, shmckpt::BackendKind::Auto).with_rank(r, 2);
    let old = [
        State::new(synthetic::uniform(1 << 20, 3, Dtype::F32), 40),
        State::new(synthetic::uniform(1 << 19, 5, Dtype::I8), 41),
    ];
    let new = [
        State::new(synthetic::uniform(1 << 20, 3, Dtype::F32), 50),
        State::new(synthetic::uniform(1 << 19, 5, Dtype::I8), 51),
    ];
    {
        let (e0, e1) = (Engine::open(cfg(0)).unwrap(), Engine::open(cfg(1)).unwrap());
        e0.save(3, &old[0].tensors(), &Metadata::new())
            .unwrap()
            .wait()
            .unwrap();
        save_committed(&e1, 3, &old[1]);
        // The dead run: rank 0's part of step 4 is durable, rank 1's save never came.
        let r0 = e0
            .save(4, &old[0].tensors(), &Metadata::new())
            .unwrap()
            .wait()
            .unwrap();
        assert!(r0.dir.is_none());
        e0.close();
        e1.close();
    }
    assert!(
        root.join("step-4.partial")
            .join("rank-00000.manifest.json")
            .exists()
    );
    let (e0, e1) = (Engine::open(cfg(0)).unwrap(), Engine::open(cfg(1)).unwrap());
    assert_eq!(
        (e0.latest().unwrap(), e1.latest().unwrap()),
        (Some(3), Some(3))
    );
    assert_loaded_equal(&e0.load(3).unwrap(), &old[0]);
    assert_loaded_equal(&e1.load(3).unwrap(), &old[1]);
    assert!(
        !root
            .join("step-4.partial")
            .join("rank-00000.manifest.json")
            .exists()
    );
    // The new run saves step 4: rank 1 first, then rank 0, which commits it.
    let r1 = e1
        .save(4, &new[1].tensors(), &Metadata::new())
        .unwrap()
        .wait()
        .unwrap();
    assert!(
        r1.dir.is_none(),
        "rank 1 must not commit with the dead run's part of rank 0"
    );
    let r0 = save_committed(&e0, 4, &new[0]);
    assert_eq!(r0.dir.unwrap(), root.join("step-4"));
    assert_loaded_equal(&e0.load(4).unwrap(), &new[0]);
    assert_loaded_equal(&e1.load(4).unwrap(), &new[1]);
    // Once an engine saved, a load of an older step leaves the newer steps' parts alone.
    let h = e1
        .save(5, &new[1].tensors(), &Metadata::new())
        .unwrap()
        .wait()
        .unwrap();
    assert!(h.dir.is_none());
    assert_loaded_equal(&e1.load(3).unwrap(), &old[1]);
    assert!(
        root.join("step-5.partial")
            .join("rank-00001.manifest.json")
            .exists()
    );
}

/// A new run that saves a step number its dead predecessor left uncommitted, before (or
/// without) any load: with sessions, a rank's save never commits with the dead run's part
/// of another rank. The dead run (session "dead"): rank 1's part of step 4 is durable,
/// rank 0's save never came; nothing is committed, so the new run (session "new") loads
/// nothing and nothing withdraws that part. Rank 0 saves step 4 first: not committed (it
/// was, with rank 1's file of the dead run, and rank 1's own save then failed with
/// StepExists). Rank 1's save commits it; step 4 holds exactly the new run's bytes, and
/// its manifest and files name the new session.
#[test]
fn a_new_runs_save_never_commits_with_a_dead_runs_part() {
    let dir = real_dir("session-parts");
    let root = dir.path();
    let cfg = |r, session: &str| {
        small_config(root, shmckpt::BackendKind::Auto)
            .with_rank(r, 2)
            .with_session(Some(session.to_owned()))
    };
    let old = State::new(synthetic::uniform(1 << 19, 5, Dtype::I8), 41);
    let new = [
        State::new(synthetic::uniform(1 << 20, 3, Dtype::F32), 50),
        State::new(synthetic::uniform(1 << 19, 5, Dtype::I8), 51),
    ];
    {
        let (e0, e1) = (
            Engine::open(cfg(0, "dead")).unwrap(),
            Engine::open(cfg(1, "dead")).unwrap(),
        );
        let r1 = e1
            .save(4, &old.tensors(), &Metadata::new())
            .unwrap()
            .wait()
            .unwrap();
        assert!(r1.dir.is_none());
        e0.close();
        e1.close();
    }
    let stale = root.join("step-4.partial").join("rank-00001.manifest.json");
    let part: shmckpt::manifest::FileEntry =
        serde_json::from_slice(&std::fs::read(&stale).unwrap()).unwrap();
    assert_eq!(part.session.as_deref(), Some("dead"));
    let (e0, e1) = (
        Engine::open(cfg(0, "new")).unwrap(),
        Engine::open(cfg(1, "new")).unwrap(),
    );
    assert_eq!((e0.latest().unwrap(), e1.latest().unwrap()), (None, None));
    let r0 = e0
        .save(4, &new[0].tensors(), &Metadata::new())
        .unwrap()
        .wait()
        .unwrap();
    assert!(
        r0.dir.is_none(),
        "rank 0 must not commit with the dead run's part of rank 1"
    );
    assert_eq!(committed(root), Vec::<u64>::new());
    let r1 = save_committed(&e1, 4, &new[1]);
    assert_eq!(r1.dir.unwrap(), root.join("step-4"));
    assert_loaded_equal(&e0.load(4).unwrap(), &new[0]);
    assert_loaded_equal(&e1.load(4).unwrap(), &new[1]);
    let m = e0.manifest(4).unwrap();
    let sessions: Vec<_> = m.files.iter().map(|f| f.session.as_deref()).collect();
    assert_eq!(sessions, [Some("new"), Some("new")]);
    for f in &m.files {
        let bytes = std::fs::read(root.join("step-4").join(&f.file)).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let system = meta.metadata().clone().unwrap();
        assert_eq!(
            system.get("shmckpt.session").map(String::as_str),
            Some("new")
        );
    }
}

/// A link named like a partial directory is never followed (it is foreign): a resume's
/// withdrawal and the listing of steps a load could complete pass over
/// `step-4.partial -> elsewhere`, whose valid part and file of rank 0 stay byte for byte.
/// The withdrawal listed partial directories by name and checked the part through the
/// link: it deleted both.
#[test]
fn a_resume_never_withdraws_through_a_linked_partial_directory() {
    let dir = real_dir("linked-partial");
    let root = dir.path();
    let cfg = |r| small_config(root, shmckpt::BackendKind::Auto).with_rank(r, 2);
    let st = [
        State::new(synthetic::uniform(1 << 19, 3, Dtype::F32), 60),
        State::new(synthetic::uniform(1 << 19, 3, Dtype::F32), 61),
    ];
    {
        let (e0, e1) = (Engine::open(cfg(0)).unwrap(), Engine::open(cfg(1)).unwrap());
        let h = e0.save(3, &st[0].tensors(), &Metadata::new()).unwrap();
        save_committed(&e1, 3, &st[1]);
        h.wait().unwrap();
        e0.close();
        e1.close();
    }
    let other = real_dir("linked-partial-target");
    let elsewhere = other.path();
    let m = shmckpt::manifest::Manifest::parse(
        &std::fs::read(root.join("step-3/manifest.json")).unwrap(),
        &root.join("step-3/manifest.json"),
    )
    .unwrap();
    let entry = &m.files[0];
    let part_bytes = serde_json::to_vec(entry).unwrap();
    let file_bytes = std::fs::read(root.join("step-3").join(&entry.file)).unwrap();
    let part = elsewhere.join("rank-00000.manifest.json");
    std::fs::write(&part, &part_bytes).unwrap();
    std::fs::write(elsewhere.join(&entry.file), &file_bytes).unwrap();
    std::os::unix::fs::symlink(elsewhere, root.join("step-4.partial")).unwrap();

    let e0 = Engine::open(cfg(0)).unwrap();
    assert_loaded_equal(&e0.load(3).unwrap(), &st[0]);
    assert_eq!(
        shmckpt::commit::pending_steps(root, 0).unwrap(),
        Vec::<u64>::new()
    );
    e0.close();
    assert!(
        std::fs::symlink_metadata(root.join("step-4.partial"))
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert_eq!(std::fs::read(&part).unwrap(), part_bytes);
    assert_eq!(
        std::fs::read(elsewhere.join(&entry.file)).unwrap(),
        file_bytes
    );
}

/// A session is 1 to 128 ASCII letters, digits, `-`, `_` or `.`: anything else is refused
/// when the engine opens, before anything is created.
#[test]
fn a_malformed_session_is_refused_at_open() {
    let dir = real_dir("session-bad");
    for bad in ["", "a/b", "s p", "é", &"x".repeat(129)] {
        let cfg =
            small_config(dir.path(), shmckpt::BackendKind::Auto).with_session(Some(bad.to_owned()));
        match Engine::open(cfg) {
            Err(shmckpt::Error::Config(msg)) => assert!(msg.contains("session"), "{msg}"),
            other => panic!("session {bad:?}: {:?}", other.map(|_| ())),
        }
    }
    let ok = small_config(dir.path(), shmckpt::BackendKind::Auto)
        .with_session(Some(format!("{}-_.Z9", "a".repeat(123))));
    Engine::open(ok).unwrap().close();
}

#[test]
fn owned_async_save_stages_in_the_background_and_flush_reports_success() {
    let dir = real_dir("owned");
    let engine = Engine::open(small_config(dir.path(), shmckpt::BackendKind::Auto)).unwrap();
    let state = step_state(3);
    let owned: Vec<shmckpt::OwnedTensor> = state
        .layout
        .iter()
        .zip(&state.data)
        .map(|(e, d)| shmckpt::OwnedTensor {
            name: e.name.clone(),
            dtype: e.dtype,
            shape: e.shape.clone(),
            data: shmckpt::OwnedData::Host(d.clone()),
        })
        .collect();
    let h = engine.save_async_owned(3, owned, &Metadata::new()).unwrap();
    let staged = h.wait_staged().unwrap();
    assert_eq!(h.staged(), Some(staged));
    assert_eq!(staged.step, 3);
    engine.flush().unwrap();
    assert!(h.is_done());
    let r = h.wait().unwrap();
    assert_eq!(r.bytes, staged.bytes);
    assert_step_is_exact(dir.path(), 3);
}

/// Backpressure is part of the stall: with several copy threads all waiting for the
/// chunks a previous save still occupies, their overlapping waits count once (issue 10,
/// finding 10: the demo printed a backpressure larger than its stall).
#[test]
fn backpressure_never_exceeds_the_stall_with_parallel_copy_threads() {
    let dir = real_dir("backpressure");
    let engine = Engine::open(
        small_config(dir.path(), shmckpt::BackendKind::Pwrite)
            .with_staging_capacity(68 << 20)
            .with_chunk_size(1 << 20)
            .with_writer_threads(1)
            .with_queue_depth(1)
            .with_copy_threads(4),
    )
    .unwrap();
    // Above the 64 MiB parallel-copy threshold and almost the whole arena: the second save
    // can only stage as the first one's chunks are written, so every copy thread waits.
    let state = |seed| {
        State::new(
            vec![LayoutEntry {
                name: "w".into(),
                dtype: Dtype::U8,
                shape: vec![66 << 20],
            }],
            seed,
        )
    };
    let (s1, s2) = (state(11), state(12));
    let h1 = engine.save(1, &s1.tensors(), &Metadata::new()).unwrap();
    let h2 = engine.save(2, &s2.tensors(), &Metadata::new()).unwrap();
    let st = h2.staged().unwrap();
    assert!(st.backpressure > std::time::Duration::ZERO, "{st:?}");
    assert!(st.backpressure <= st.staging, "{st:?}");
    h1.wait().unwrap();
    let r = h2.wait().unwrap();
    assert!(
        r.timings.backpressure <= r.timings.staging,
        "{:?}",
        r.timings
    );
    assert_eq!(r.timings.backpressure, st.backpressure);
    assert_loaded_equal(&engine.load(2).unwrap(), &s2);
}

/// Host `load` reads straight into one allocation whose ranges are the tensors: the bytes
/// are exact, every tensor is aligned to its element size, each tensor is its own mutable
/// buffer, and the allocation comes back to the engine for the next
/// load when the tensors are dropped (and the next load is exact in reused memory).
#[test]
fn load_views_are_exact_aligned_disjoint_and_their_memory_is_reused() {
    let e = |name: &str, dtype, shape: &[usize]| LayoutEntry {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
    };
    // U8 tensors of 3 and 5 bytes put `odd` at data offset ...+3 and `half` (F16) at +8+4099.
    let layout = vec![
        e("big", Dtype::F32, &[3 << 20]),
        e("three", Dtype::U8, &[3]),
        e("odd", Dtype::U8, &[5]),
        e("half", Dtype::F16, &[3]),
        e("tail", Dtype::U8, &[4099]),
    ];
    for backend in BACKENDS {
        let dir = real_dir("views");
        let engine = Engine::open(small_config(dir.path(), backend)).unwrap();
        let s1 = State::new(layout.clone(), 1);
        let s2 = State::new(layout.clone(), 2);
        save_committed(&engine, 1, &s1);
        save_committed(&engine, 2, &s2);
        assert_eq!(engine.load_buffer_bytes(), 0);
        let mut ck = engine.load(1).unwrap();
        assert_loaded_equal(&ck, &s1);
        for t in &ck.tensors {
            let align = t.dtype.alignment() as usize;
            assert_eq!(t.data.as_bytes().as_ptr() as usize % align, 0, "{}", t.name);
        }
        assert_eq!(ck.get("half").unwrap().data.cast::<u16>().unwrap().len(), 3);
        // Writing one tensor leaves the others (neighbours in the same allocation) alone.
        assert_eq!(ck.tensors[0].name, "big");
        ck.tensors[0].data.as_bytes_mut().fill(0xEE);
        let c = ck.clone();
        assert_eq!(c, ck);
        assert!(c.tensors[0].data.as_bytes().iter().all(|&b| b == 0xEE));
        for (e, d) in s1.layout.iter().zip(&s1.data) {
            let got = ck.get(&e.name).unwrap().data.as_bytes();
            if e.name == "big" {
                assert!(got.len() == d.len() && got.iter().all(|&b| b == 0xEE));
            } else {
                assert_eq!(got, &d[..], "{}", e.name);
            }
        }
        drop(c);
        drop(ck);
        let held = engine.load_buffer_bytes();
        assert!(held >= (12 << 20) + 4099 + 8 + 6, "allocation kept: {held}");
        // Step 2 into the reused memory (which still holds step 1's bytes): exact.
        let ck2 = engine.load(2).unwrap();
        assert_eq!(engine.load_buffer_bytes(), 0, "reused, not held twice");
        assert_loaded_equal(&ck2, &s2);
        drop(ck2);
        engine.release_load_buffers();
        assert_eq!(engine.load_buffer_bytes(), 0);
        // The library function (no engine pool) gives the same result.
        let opts = shmckpt::restore::ReadOptions::default();
        let ck = shmckpt::restore::load_owned(&dir.path().join("step-2"), 0, &opts).unwrap();
        assert_loaded_equal(&ck, &s2);
    }
}

/// The open's sweep moves stale directories out of the step namespace and removes them
/// behind the open: right after the open, the stale partial and trash names are free (a
/// save of the stale step commits exactly), the committed step is untouched; a hidden
/// directory an interrupted earlier sweep left is removed too; a link or a file under a
/// hidden name is never followed or removed; once the engine is closed nothing hidden of
/// ours is left.
#[test]
fn stale_directories_are_moved_aside_at_open_and_removed_behind_it() {
    let dir = real_dir("clean-behind");
    let root = dir.path();
    let state = |step: u64| step_state(step);
    let engine = Engine::open(small_config(root, shmckpt::BackendKind::Pwrite)).unwrap();
    engine
        .save(2, &state(2).tensors(), &Metadata::new())
        .unwrap()
        .wait()
        .unwrap();
    engine.close();
    let stale = root.join(shmckpt::manifest::partial_dir_name(5));
    std::fs::create_dir(&stale).unwrap();
    std::fs::write(
        stale.join("rank-00000-of-00001.safetensors"),
        vec![7u8; 1 << 20],
    )
    .unwrap();
    let trash = root.join(shmckpt::manifest::trash_dir_name(1));
    std::fs::create_dir_all(trash.join("sub")).unwrap();
    std::fs::write(trash.join("sub").join("x"), b"old").unwrap();
    let earlier = root.join(".shmckpt-removing.step-9.partial.1.2");
    std::fs::create_dir(&earlier).unwrap();
    std::fs::write(earlier.join("f"), b"left by a crashed sweep").unwrap();
    let outside = real_dir("clean-behind-outside");
    std::fs::write(outside.path().join("keep"), b"not ours").unwrap();
    let link = root.join(".shmckpt-removing.link");
    std::os::unix::fs::symlink(outside.path(), &link).unwrap();
    let file = root.join(".shmckpt-removing.file");
    std::fs::write(&file, b"a file, not a directory").unwrap();

    let engine = Engine::open(small_config(root, shmckpt::BackendKind::Pwrite)).unwrap();
    assert!(
        !stale.exists() && !trash.exists(),
        "the stale names are free"
    );
    assert_eq!(committed(root), [2]);
    let rep = engine
        .save(5, &state(5).tensors(), &Metadata::new())
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(rep.dir.as_deref(), Some(&*root.join("step-5")));
    engine.close();
    assert_eq!(committed(root), [2, 5]);
    for step in [2, 5] {
        assert_safetensors_equal(
            &root
                .join(format!("step-{step}"))
                .join("rank-00000-of-00001.safetensors"),
            &state(step),
        );
    }
    let mut hidden: Vec<String> = std::fs::read_dir(root)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".shmckpt-removing."))
        .collect();
    hidden.sort();
    assert_eq!(
        hidden,
        [".shmckpt-removing.file", ".shmckpt-removing.link"],
        "every moved directory removed; the link and the file untouched"
    );
    assert_eq!(
        std::fs::read(outside.path().join("keep")).unwrap(),
        b"not ours"
    );
    assert_eq!(std::fs::read(&file).unwrap(), b"a file, not a directory");
}
