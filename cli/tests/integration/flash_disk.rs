//! Flash restore and the disk copy (issue 21, item 7): a load served from a good kept
//! image still checks the disk copy's size and header, and reports a damaged one
//! (`LoadReport::disk_problem`); `Engine::verify_disk_copy` checks every byte. Uses the
//! kept-arena harness of `flash.rs`.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::common::*;
use crate::flash::{ROLES, keep_config, killed_keeper, load_exact};
use shmckpt::{Engine, LoadSource};

fn rank_file_of(root: &Path, step: u64) -> PathBuf {
    let dir = root.join(shmckpt::manifest::step_dir_name(step));
    let m = shmckpt::Manifest::read(&dir).unwrap();
    dir.join(&m.file_of_rank(0).unwrap().file)
}

/// Issue 21, item 7: a disk copy damaged under a good kept image. The load is served from
/// memory (its bytes are the manifest's), and the cheap check of the disk copy (size,
/// header) reports what is wrong; damage in the data section only the full check finds.
#[test]
fn a_damaged_disk_copy_under_a_good_kept_image_is_reported() {
    if run_role(ROLES) {
        return;
    }
    #[derive(Debug, Clone, Copy)]
    enum Damage {
        Truncated,
        Header,
        Data,
    }
    for damage in [Damage::Truncated, Damage::Header, Damage::Data] {
        let dir = real_dir("flash-diskcopy");
        let root = dir.path();
        let _guard = killed_keeper(root);
        let file = rank_file_of(root, 2);
        let len = std::fs::metadata(&file).unwrap().len();
        let f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
        match damage {
            Damage::Truncated => f.set_len(len - 1).unwrap(),
            // Inside the JSON header.
            Damage::Header => f.write_all_at(b"#", 10).unwrap(),
            // The last byte of the last tensor.
            Damage::Data => {
                let mut b = [0u8; 1];
                std::fs::File::open(&file)
                    .unwrap()
                    .read_exact_at(&mut b, len - 1)
                    .unwrap();
                f.write_all_at(&[b[0] ^ 0xFF], len - 1).unwrap();
            }
        }
        drop(f);
        // The disk copy really is damaged: a load from disk fails.
        let from_disk = shmckpt::restore::load_owned(
            file.parent().unwrap(),
            0,
            &shmckpt::restore::ReadOptions::default(),
        );
        assert!(from_disk.is_err(), "{damage:?}: the disk copy still loads");
        let engine = Engine::open(keep_config(root)).unwrap();
        let report = load_exact(&engine, 2, &step_state(2), LoadSource::Memory);
        let problem = report.disk_problem.clone();
        match damage {
            Damage::Truncated => {
                let p = problem
                    .as_deref()
                    .expect("a truncated disk copy is reported");
                assert!(
                    p.contains(&format!("is {} bytes, the manifest says {len}", len - 1)),
                    "{p}"
                );
            }
            Damage::Header => {
                let p = problem
                    .as_deref()
                    .expect("a damaged header on disk is reported");
                assert!(
                    p.contains("differs from the kept image's at byte 10"),
                    "{p}"
                );
            }
            Damage::Data => assert_eq!(problem, None, "the cheap check reads the header only"),
        }
        // load_into is served from memory too.
        let s2 = step_state(2);
        let mut bufs: Vec<Vec<u8>> = s2.data.iter().map(|d| vec![0u8; d.len()]).collect();
        let mut dest: Vec<(&str, &mut [u8])> = s2
            .layout
            .iter()
            .zip(bufs.iter_mut())
            .map(|(e, b)| (e.name.as_str(), &mut b[..]))
            .collect();
        assert_eq!(load_into(&engine, 2, &mut dest).unwrap(), 2);
        assert_eq!(bufs, s2.data);
        // The full check finds every kind of damage, the data section's included.
        let err = engine.verify_disk_copy().unwrap_err();
        match damage {
            Damage::Truncated => {
                assert!(matches!(err, shmckpt::Error::Truncated { .. }), "{err:?}")
            }
            Damage::Header => assert!(matches!(err, shmckpt::Error::Corrupt { .. }), "{err:?}"),
            Damage::Data => assert!(matches!(err, shmckpt::Error::Checksum { .. }), "{err:?}"),
        }
        eprintln!("{damage:?}: {problem:?}; full check: {err}");
    }
    // An intact disk copy: nothing reported, and the full check passes.
    let dir = real_dir("flash-diskcopy-ok");
    let root = dir.path();
    let _guard = killed_keeper(root);
    let engine = Engine::open(keep_config(root)).unwrap();
    let report = load_exact(&engine, 2, &step_state(2), LoadSource::Memory);
    assert_eq!(report.disk_problem, None);
    assert_eq!(engine.verify_disk_copy().unwrap(), Some(2));
    // A save drops the image: nothing to check then.
    save_committed(&engine, 3, &step_state(3));
    assert_eq!(engine.verify_disk_copy().unwrap(), None);
}
