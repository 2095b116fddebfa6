//! Committed images held in their staging chunks for replication
//! (`EngineConfig::with_replica_hold`, `docs/replicas.md`): held at commit when whole in the
//! arena, with exactly the committed file's bytes, with and without flash restore; given
//! back to a later save that needs the arena (it never waits for them); none with the
//! option off.

use crate::common;

use std::time::Duration;

use common::*;
use shmckpt::replica::{HeldImage, HeldPiece};
use shmckpt::{BackendKind, Engine, Metadata};

const CS: u64 = 64 << 10;

/// Every piece of `image` (two chunks each): its bytes, and how each piece came.
fn take_all(image: &HeldImage) -> (Vec<u8>, Vec<&'static str>) {
    let (mut out, mut kinds) = (Vec::new(), Vec::new());
    let mut a = 0;
    while a < image.len() {
        let b = (a + 2 * CS).min(image.len());
        match image.take(a, b).unwrap() {
            HeldPiece::Staged(v) => {
                out.extend_from_slice(v.as_slice());
                kinds.push("staging");
            }
            HeldPiece::Copied(c) => {
                out.extend_from_slice(c.as_bytes());
                kinds.push("copied");
            }
            HeldPiece::File => kinds.push("file"),
        }
        a = b;
    }
    (out, kinds)
}

#[test]
fn a_committed_image_is_held_with_exactly_the_files_bytes() {
    for keep in [false, true] {
        let dir = real_dir("held");
        let root = dir.path();
        let cfg = small_config(root, BackendKind::Auto)
            .with_replica_hold(true)
            .with_keep_in_memory(keep);
        let engine = Engine::open(cfg).unwrap();
        for step in 1..=3 {
            let st = step_state(step);
            let h = engine.save(step, &st.tensors(), &Metadata::new()).unwrap();
            let cell = h.held_image();
            let rep = h.wait().unwrap();
            let image = cell.take().expect("a whole committed image is held");
            assert!(cell.take().is_none(), "taken once");
            let file = std::fs::read(&rep.file).unwrap();
            assert!(file.len() as u64 > 3 * CS);
            assert_eq!((image.step(), image.len()), (step, file.len() as u64));
            // A fresh arena hands out consecutive chunks, given back in order: every
            // piece is a zero-copy view, and the pieces are the file.
            let (bytes, kinds) = take_all(&image);
            assert_eq!(kinds, ["staging", "staging"], "keep {keep}, step {step}");
            assert!(
                bytes == file,
                "keep {keep}, step {step}: not the file's bytes"
            );
        }
        engine.close();
        if keep {
            std::fs::remove_file(
                std::path::Path::new("/dev/shm").join(crate::common::kept_arena_name(root)),
            )
            .unwrap();
        }
    }
}

#[test]
fn a_save_that_needs_the_arena_takes_the_held_chunks_back() {
    // 6 chunks; images of 4: step 2 takes the 2 free chunks, then the reclaim hook gives
    // back step 1's 4 held ones (none taken), and the save completes.
    let dir = real_dir("held-pressure");
    let cfg = small_config(dir.path(), BackendKind::Auto)
        .with_staging_capacity(6 * CS)
        .with_replica_hold(true);
    let engine = Engine::open(cfg).unwrap();
    let h1 = engine
        .save(1, &step_state(1).tensors(), &Metadata::new())
        .unwrap();
    let cell1 = h1.held_image();
    h1.wait().unwrap();
    let image1 = cell1.take().unwrap();
    let st2 = step_state(2);
    let h2 = engine.save(2, &st2.tensors(), &Metadata::new()).unwrap();
    let cell2 = h2.held_image();
    let rep2 = match h2.wait_timeout(Duration::from_secs(60)) {
        Ok(r) => r.unwrap(),
        Err(_) => panic!("the save waited for the held image"),
    };
    assert_eq!(image1.spilled_chunks(), 4);
    assert_eq!(take_all(&image1).1, ["file", "file"]);
    let image2 = cell2.take().unwrap();
    let (bytes, kinds) = take_all(&image2);
    assert!(!kinds.contains(&"file"), "{kinds:?}");
    assert!(bytes == std::fs::read(&rep2.file).unwrap());
}

#[test]
fn nothing_is_held_with_the_option_off() {
    let dir = real_dir("held-off");
    let engine = Engine::open(small_config(dir.path(), BackendKind::Auto)).unwrap();
    let h = engine
        .save(1, &step_state(1).tensors(), &Metadata::new())
        .unwrap();
    let cell = h.held_image();
    h.wait().unwrap();
    assert!(cell.take().is_none());
}
