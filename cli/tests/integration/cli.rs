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

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn json_of(o: &Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("not one JSON document ({e}): {}", stdout(o)))
}

/// `inspect` and `verify` of one step report the same size (its manifest's total, in the
/// one size convention), `--json` carries exact fields, a long metadata value is shown cut
/// with its length unless `--full`, and nothing is written to stderr when it is not a
/// terminal (no progress) (issue 39, item 6).
#[test]
fn inspect_and_verify_agree_on_size_and_speak_json() {
    let dir = real_dir("cli-json");
    let root = dir.path();
    let skeleton = "s".repeat(5000);
    let e = Engine::open(small_config(root, BackendKind::Pwrite)).unwrap();
    let st = step_state(7);
    let mut meta = shmckpt::Metadata::new();
    meta.insert("skeleton".into(), skeleton.clone());
    meta.insert("note".into(), "short".into());
    e.save(7, &st.tensors(), &meta).unwrap().wait().unwrap();
    e.close();
    let step = root.join("step-7");
    let (r, s) = (root.to_str().unwrap(), step.to_str().unwrap());
    let m = shmckpt::Manifest::read(&step).unwrap();
    let size = shmckpt_cli_human(m.total_bytes);

    let o = shmckpt(&["inspect", s]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stderr(&o), "");
    let text = stdout(&o);
    assert!(text.contains(&format!("  total       {size}\n")), "{text}");
    assert!(text.contains("  meta note = short\n"), "{text}");
    let cut = format!(
        "  meta skeleton = {}... (5000 chars; --full or --json shows all)\n",
        "s".repeat(200)
    );
    assert!(text.contains(&cut), "{text}");
    let o = shmckpt(&["inspect", "--full", s]);
    assert!(
        stdout(&o).contains(&format!("  meta skeleton = {skeleton}\n")),
        "{}",
        stdout(&o)
    );

    let o = shmckpt(&["inspect", "--json", s]);
    assert!(o.status.success());
    let j = json_of(&o);
    assert_eq!(j["at"], s);
    assert_eq!(
        j["manifest"],
        serde_json::to_value(&m).unwrap(),
        "--json is the whole manifest"
    );
    assert_eq!(j["manifest"]["metadata"]["skeleton"], skeleton.as_str());

    let o = shmckpt(&["inspect", "--json", r]);
    assert!(o.status.success());
    assert_eq!(
        json_of(&o),
        serde_json::json!({
            "root": r,
            "checkpoints": [{
                "step": 7, "at": s, "world_size": 1,
                "tensors": m.tensor_count(), "bytes": m.total_bytes,
            }],
            "uncommitted": [],
        })
    );

    let o = shmckpt(&["verify", r]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stderr(&o), "", "no progress when stderr is not a terminal");
    let line = stdout(&o);
    assert!(
        line.starts_with(&format!("OK   {s} ({size} in ")),
        "verify shows the size inspect shows ({size}): {line}"
    );
    assert_eq!(line.lines().count(), 1, "{line}");

    let o = shmckpt(&["verify", "--json", "--all", r]);
    assert!(o.status.success());
    let j = json_of(&o);
    assert_eq!(j["failed"], 0);
    let c = &j["checkpoints"].as_array().unwrap()[..];
    assert_eq!(c.len(), 1);
    assert_eq!(
        (&c[0]["at"], &c[0]["ok"], &c[0]["bytes"]),
        (
            &serde_json::json!(s),
            &serde_json::json!(true),
            &serde_json::json!(m.total_bytes)
        )
    );
    assert!(c[0]["seconds"].as_f64().unwrap() >= 0.0);

    // A damaged tensor: one failed entry, the JSON still printed, exit status 1.
    let file = step.join(&m.files[0].file);
    let mut bytes = std::fs::read(&file).unwrap();
    let at = m.files[0].data_start as usize;
    bytes[at] ^= 0xff;
    std::fs::write(&file, &bytes).unwrap();
    let o = shmckpt(&["verify", "--json", s]);
    assert_eq!(o.status.code(), Some(1));
    let j = json_of(&o);
    assert_eq!(
        (&j["failed"], &j["checkpoints"][0]["ok"]),
        (&serde_json::json!(1), &serde_json::json!(false))
    );
    assert!(
        j["checkpoints"][0]["error"]
            .as_str()
            .unwrap()
            .contains("crc"),
        "{j}"
    );
    assert_eq!(
        stderr(&o),
        "shmckpt: 1 of 1 checkpoints failed verification\n"
    );
}

/// The CLI's size formatting, as the binary prints it (the same function's rules).
fn shmckpt_cli_human(bytes: u64) -> String {
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let units = ["KiB", "MiB", "GiB"];
    let mut v = bytes as f64 / 1024.0;
    let mut u = 0;
    while (v * 10.0).round() / 10.0 >= 1024.0 {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", units[u])
}

/// A missing root, checkpoint or step is one sentence on stderr and exit status 3, for
/// every command that takes a root (issue 39, item 6).
#[test]
fn missing_roots_and_steps_are_one_sentence_and_status_3() {
    let dir = real_dir("cli-missing");
    let nope = dir.path().join("nope");
    let n = nope.to_str().unwrap();
    let want = format!("shmckpt: no checkpoint root at {n} (No such file or directory)\n");
    for args in [
        &["inspect", n][..],
        &["inspect", "--json", n][..],
        &["verify", n][..],
        &["verify", "--all", n][..],
        &["gc", n, "--keep", "1"][..],
    ] {
        let o = shmckpt(args);
        assert_eq!(o.status.code(), Some(3), "{args:?}");
        assert_eq!(stderr(&o), want, "{args:?}");
        assert_eq!(stdout(&o), "", "{args:?}");
    }
    let root = dir.path().join("root");
    std::fs::create_dir(&root).unwrap();
    checkpoints(&root, &[1]);
    let r = root.to_str().unwrap();
    let o = shmckpt(&["verify", "--step", "9", r]);
    assert_eq!(o.status.code(), Some(3));
    assert_eq!(
        stderr(&o),
        format!("shmckpt: no committed checkpoint step 9 in {r}\n")
    );
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let o = shmckpt(&["verify", empty.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(3));
    assert_eq!(
        stderr(&o),
        format!(
            "shmckpt: no committed checkpoint (latest) in {}\n",
            empty.display()
        )
    );
    let help = stdout(&shmckpt(&["--help"]));
    assert!(help.contains("Exit status: 0 success; 1 failure"), "{help}");
}

/// `gc` prints each removal once (the library's log of the same events stays quiet at the
/// default level), and `--json` lists exactly what it removed (issue 39, item 6).
#[test]
fn gc_prints_each_event_once_and_speaks_json() {
    let dir = real_dir("cli-gc");
    let root = dir.path();
    checkpoints(root, &[1, 2, 3]);
    let stale = root.join("step-4.partial");
    std::fs::create_dir(&stale).unwrap();
    let r = root.to_str().unwrap();
    let o = shmckpt(&["gc", r, "--keep", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stderr(&o), "", "the event is printed once, on stdout");
    assert_eq!(
        stdout(&o),
        format!(
            "removed stale {}\nremoved 1 checkpoint(s) [1]; kept the newest 2\n",
            stale.display()
        )
    );
    std::fs::create_dir(&stale).unwrap();
    let o = shmckpt(&["gc", "--json", r, "--keep", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stderr(&o), "");
    assert_eq!(
        json_of(&o),
        serde_json::json!({
            "root": r,
            "removed_stale": [stale.display().to_string()],
            "removed_steps": [2],
            "kept": 1,
        })
    );
    let left: Vec<String> = names(root)
        .into_iter()
        .filter(|n| n.starts_with("step-"))
        .collect();
    assert_eq!(left, ["step-3"]);
}
