//! The `shmckpt` binary's `bench` and `demo` against directories they did not create, and
//! against sizes and files they must refuse (issue 9, items 6 and 10).

use crate::common;

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::*;
use shmckpt::{BackendKind, Engine};

fn shmckpt(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_shmckpt"))
        .args(args)
        .output()
        .expect("run shmckpt")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Commit steps `steps` of [`step_state`] into `root` with a real engine.
fn checkpoints(root: &Path, steps: &[u64]) {
    let e = Engine::open(small_config(root, BackendKind::Pwrite)).unwrap();
    for &s in steps {
        let st = step_state(s);
        save_committed(&e, s, &st);
    }
    e.close();
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn bench_never_deletes_checkpoints_it_did_not_write() {
    let dir = real_dir("cli-bench");
    let root = dir.path();
    checkpoints(root, &[1, 2]);
    let before = names(root);
    for keep in [false, true] {
        let mut args = vec![
            "bench",
            "--size",
            "1MiB",
            "--tensors",
            "4",
            "--repeat",
            "2",
            "--no-reference",
            "--json",
            "--chunk-size",
            "1MiB",
            "--backend",
            "pwrite",
            "--dir",
        ];
        args.push(root.to_str().unwrap());
        if keep {
            args.push("--keep");
        }
        let o = shmckpt(&args);
        assert!(o.status.success(), "bench failed: {}", stderr(&o));
        let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(report["repeat"], 2);
        assert_eq!(committed(root), [1, 2]);
        assert_step_is_exact(root, 1);
        assert_step_is_exact(root, 2);
        if keep {
            // The kept checkpoint lives in the run's own subdirectory.
            let kept = Path::new(report["kept_dir"].as_str().unwrap()).to_owned();
            let run_dir = kept.parent().unwrap();
            assert_eq!(run_dir.parent().unwrap(), root);
            assert!(
                run_dir
                    .file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with("shmckpt-bench-")
            );
            assert!(kept.join("manifest.json").is_file());
        } else {
            assert_eq!(report["kept_dir"], serde_json::Value::Null);
            assert_eq!(names(root), before, "the bench left something behind");
        }
    }
}

#[test]
fn demo_runs_twice_in_the_same_dir_and_refuses_foreign_ones() {
    let dir = real_dir("cli-demo");
    let d = dir.path().join("demo");
    let demo = |d: &Path| {
        shmckpt(&[
            "demo",
            "--steps",
            "2",
            "--model-bytes",
            "2MiB",
            "--dir",
            d.to_str().unwrap(),
        ])
    };
    for run in 0..2 {
        let o = demo(&d);
        assert!(o.status.success(), "demo run {run} failed: {}", stderr(&o));
        assert_eq!(committed(&d), [1, 2], "run {run}");
        assert!(d.join(".shmckpt-demo").is_file());
    }

    // A root of someone else's checkpoints: refused, every step kept.
    let foreign = dir.path().join("foreign");
    std::fs::create_dir(&foreign).unwrap();
    checkpoints(&foreign, &[1, 2, 3, 4, 5]);
    let o = demo(&foreign);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("not created by shmckpt demo"),
        "{}",
        stderr(&o)
    );
    assert_eq!(committed(&foreign), [1, 2, 3, 4, 5]);
    for s in 1..=5 {
        assert_step_is_exact(&foreign, s);
    }

    // A marked directory holding something else: refused, nothing removed.
    std::fs::write(d.join("notes.txt"), b"mine").unwrap();
    let o = demo(&d);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("notes.txt"), "{}", stderr(&o));
    assert_eq!(committed(&d), [1, 2]);
    assert_eq!(std::fs::read(d.join("notes.txt")).unwrap(), b"mine");
}

#[test]
fn bench_refuses_sizes_beyond_memory_before_allocating() {
    let dir = real_dir("cli-size");
    let root = dir.path().join("never-created");
    let t = Instant::now();
    let o = shmckpt(&["bench", "--size", "1PiB", "--dir", root.to_str().unwrap()]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains("not enough memory"), "{err}");
    // The numbers are in the message: 1 PiB of tensors.
    assert!(err.contains(&(1u64 << 50).to_string()), "{err}");
    assert!(
        !err.contains("panicked") && !err.contains("memory allocation"),
        "{err}"
    );
    assert!(t.elapsed() < Duration::from_secs(30));
    assert!(!root.exists(), "nothing may be created for a refused run");
}

#[test]
fn bench_layout_must_be_a_small_regular_file() {
    let dir = real_dir("cli-layout");
    let run = |layout: &Path| {
        shmckpt(&[
            "bench",
            "--layout",
            layout.to_str().unwrap(),
            "--dir",
            dir.path().join("b").to_str().unwrap(),
        ])
    };
    // A character device that never ends.
    let o = run(Path::new("/dev/zero"));
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("/dev/zero: not a regular file"),
        "{}",
        stderr(&o)
    );

    // A FIFO with no writer: refused, not blocked on.
    let fifo = dir.path().join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let t = Instant::now();
    let o = run(&fifo);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("not a regular file"), "{}", stderr(&o));
    assert!(t.elapsed() < Duration::from_secs(30));

    // Larger than the cap (sparse, so the test stays cheap).
    let big = dir.path().join("big.json");
    std::fs::File::create(&big)
        .unwrap()
        .set_len((64 << 20) + 1)
        .unwrap();
    let o = run(&big);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("larger than"), "{}", stderr(&o));
    assert!(!dir.path().join("b").exists());
}

#[test]
fn io_errors_name_their_path() {
    let dir = real_dir("cli-path");
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let under = file.join("sub");
    let at = under.to_str().unwrap();
    for args in [
        &["bench", "--size", "1MiB", "--no-reference", "--dir", at][..],
        &["demo", "--model-bytes", "1MiB", "--dir", at][..],
    ] {
        let o = shmckpt(args);
        assert!(!o.status.success(), "{args:?}");
        assert!(stderr(&o).contains(at), "{args:?}: {}", stderr(&o));
    }
}

/// `bench --load` times loads of the checkpoint it saved against raw O_DIRECT reads of its
/// file, and the raw write reference is the better of one stream and 16 requests in flight.
#[test]
fn bench_load_reports_load_and_raw_read_references() {
    let dir = real_dir("cli-bench-load");
    let root = dir.path();
    let o = shmckpt(&[
        "bench",
        "--size",
        "8MiB",
        "--tensors",
        "5",
        "--repeat",
        "2",
        "--load",
        "--flash",
        "--json",
        "--chunk-size",
        "1MiB",
        "--dir",
        root.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "bench failed: {}", stderr(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    // --flash: a new engine served every load from the kept arena (the bench fails
    // otherwise), and removed the arena afterwards.
    assert!(r["flash_load_s"].as_f64().unwrap() > 0.0, "{r}");
    assert_eq!(r["flash_load_runs_s"].as_array().unwrap().len(), 2);
    assert!(shmckpt::flash::list_kept().iter().all(|k| {
        k.root
            .as_ref()
            .is_none_or(|p| !p.starts_with(std::fs::canonicalize(root).unwrap()))
    }));
    let f = |k: &str| {
        r[k].as_f64()
            .unwrap_or_else(|| panic!("{k} missing or not a number in {r}"))
    };
    let (load, read, ratio) = (f("load_s"), f("reference_read_s"), f("load_ratio"));
    assert!(load > 0.0 && read > 0.0, "{r}");
    assert!((ratio - read / load).abs() < 1e-9 * ratio.max(1.0), "{r}");
    // The raw read is the better of its two measurements, and so is the raw write.
    let runs = r["load_runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    for run in runs {
        assert!(run["load_s"].as_f64().unwrap() > 0.0);
        assert!(run["reference_read_single_s"].as_f64().unwrap() > 0.0);
    }
    // The raw read reference is the better pattern, each pattern taken as the median of
    // its runs; the per-run best (the faster of each run's two reads) is reported beside.
    let single = f("reference_read_single_s");
    let expected = r["reference_read_uring_s"]
        .as_f64()
        .map_or(single, |u| u.min(single));
    assert_eq!(read, expected, "{r}");
    let per_run = f("reference_read_per_run_best_s");
    assert!(per_run <= single + 1e-12, "{r}");
    let pr = f("load_ratio_per_run_best");
    assert!((pr - per_run / load).abs() < 1e-9 * pr.max(1.0), "{r}");
    let w = f("reference_write_s");
    assert!(w <= f("reference_write_single_s"), "{r}");
    if let Some(u) = r["reference_write_uring_s"].as_f64() {
        assert!(w <= u, "{r}");
    }
    for run in r["runs"].as_array().unwrap() {
        let best = run["reference_s"].as_f64().unwrap();
        let s = run["reference_single_s"].as_f64().unwrap();
        assert!(best <= s);
        if let Some(u) = run["reference_uring_s"].as_f64() {
            assert_eq!(best, s.min(u));
        }
    }
    // Nothing of the run is left behind.
    assert!(names(root).is_empty(), "{:?}", names(root));
}
