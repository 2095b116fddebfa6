//! Hostile and careless input, item 9 (issue 9): odd step names (`u64::MAX`, `step-05`
//! beside `step-5`, names that are not steps) are never deleted, listed twice or loaded in
//! place of the real step.

use std::io::Read;
use std::path::Path;

use crate::common::*;
use crate::hostile::{RANK_FILE, cli, output_text};
use shmckpt::{BackendKind, Engine, Error};

fn save_steps(root: &Path, steps: &[u64]) {
    let engine = Engine::open(small_config(root, BackendKind::Auto)).unwrap();
    for &step in steps {
        let s = step_state(step % 7);
        save_committed(&engine, step, &s);
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

fn names(root: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(root)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    v.sort();
    v
}

#[test]
fn item9_odd_step_names_are_never_deleted_or_loaded() {
    // (a) u64::MAX: there is no next step, and it says so.
    let d = real_dir("hostile9a");
    save_steps(d.path(), &[u64::MAX]);
    let engine = Engine::open(small_config(d.path(), BackendKind::Auto)).unwrap();
    assert_eq!(engine.latest().unwrap(), Some(u64::MAX));
    let err = shmckpt::manifest::next_step(d.path(), engine.latest().unwrap()).unwrap_err();
    assert!(
        matches!(err, Error::StepOverflow { step: u64::MAX, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains(&d.path().display().to_string()));
    drop(engine);

    // (b) step-5 beside step-05: gc keeps going, never touches the odd name.
    let d = real_dir("hostile9b");
    let root = d.path();
    save_steps(root, &[1, 2, 5]);
    copy_dir(&root.join("step-5"), &root.join("step-05"));
    let before = std::fs::read(root.join("step-05").join(RANK_FILE)).unwrap();
    let out = cli(&["gc", root.to_str().unwrap(), "--keep", "1"]);
    assert!(out.status.success(), "{}", output_text(&out));
    assert_eq!(names(root), ["step-05", "step-5"]);
    assert_eq!(
        std::fs::read(root.join("step-05").join(RANK_FILE)).unwrap(),
        before
    );
    assert_step_is_exact(root, 5);

    // (c) step-9 -> step-4: the link is never counted, step-4 never deleted.
    let d = real_dir("hostile9c");
    let root = d.path();
    save_steps(root, &[4]);
    std::os::unix::fs::symlink("step-4", root.join("step-9")).unwrap();
    let out = cli(&["gc", root.to_str().unwrap(), "--keep", "1"]);
    assert!(out.status.success(), "{}", output_text(&out));
    assert_eq!(names(root), ["step-4", "step-9"]);
    assert_step_is_exact(root, 4);
    let engine = Engine::open(small_config(root, BackendKind::Auto)).unwrap();
    assert_eq!(engine.latest().unwrap(), Some(4));
    drop(engine);

    // (d) step-1 holding the manifest of step 2: not listed, not verified, not loaded.
    let d = real_dir("hostile9d");
    let root = d.path();
    save_steps(root, &[2]);
    std::fs::rename(root.join("step-2"), root.join("step-1")).unwrap();
    let out = cli(&["verify", root.join("step-1").to_str().unwrap()]);
    let text = output_text(&out);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("of step 2") && text.contains("step-1"),
        "{text}"
    );
    assert!(!cli(&["verify", root.to_str().unwrap()]).status.success());
    let engine = Engine::open(small_config(root, BackendKind::Auto)).unwrap();
    assert_eq!(engine.latest().unwrap(), None);
    assert!(engine.load(1).is_err());
    drop(engine);
    assert_eq!(names(root), ["step-1"], "nothing deleted");
    let mut m = String::new();
    std::fs::File::open(root.join("step-1").join("manifest.json"))
        .unwrap()
        .read_to_string(&mut m)
        .unwrap();
    assert!(m.contains("\"step\": 2"));
}
