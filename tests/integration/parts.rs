//! Part-only saves (`SaveOptions::part_only`): each rank's engine, in a root of its own,
//! writes its file and manifest part and commits nothing; one caller finds every part
//! (`commit::find_parts`) and commits them (`commit::assemble_ranks`), as the DCP writer
//! does.

use shmckpt::commit::{assemble_ranks, find_parts};
use shmckpt::manifest::{Manifest, partial_dir_name, rank_file_name, step_dir_name};
use shmckpt::{BackendKind, Metadata, SaveOptions};

use crate::common::{
    State, assert_safetensors_equal, committed, real_dir, small_config, step_state,
};

/// Two ranks (one with one engine root, one with a stale root beside it) save step 7
/// part-only: no step is committed anywhere, each part is found, and the assembled
/// checkpoint holds exactly each rank's bytes. A one-rank world does the same (no
/// commit of its own either).
#[test]
fn part_only_saves_commit_nothing_and_assemble_exactly() {
    let dir = real_dir("parts");
    let spool = dir.path();
    for world in [1u32, 2] {
        let states: Vec<State> = (0..world)
            .map(|r| step_state(100 * u64::from(world) + u64::from(r)))
            .collect();
        let mut reports = Vec::new();
        for rank in 0..world {
            let root = spool.join(format!("w{world}-rank-{rank}")).join("1234-0");
            std::fs::create_dir_all(&root).unwrap();
            let engine = small_config(&root, BackendKind::Pwrite)
                .with_rank(rank, world)
                .build()
                .unwrap();
            let rep = engine
                .save_with(
                    7,
                    &states[rank as usize].tensors(),
                    &Metadata::new(),
                    &SaveOptions::new().part_only(),
                )
                .unwrap()
                .wait()
                .unwrap();
            assert_eq!(rep.dir, None);
            assert_eq!(
                rep.file,
                root.join(partial_dir_name(7))
                    .join(rank_file_name(rank, world))
            );
            assert!(committed(&root).is_empty());
            assert!(!root.join(step_dir_name(7)).exists());
            engine.close();
            reports.push(rep);
        }
        let mut sources = Vec::new();
        for rank in 0..world {
            let rank_dir = spool.join(format!("w{world}-rank-{rank}"));
            // A root of another process without this step is not a part of it.
            std::fs::create_dir_all(rank_dir.join("999-0")).unwrap();
            let found = find_parts(&rank_dir, 7).unwrap();
            assert_eq!(
                found,
                vec![rank_dir.join("1234-0").join(partial_dir_name(7))]
            );
            assert!(find_parts(&rank_dir, 8).unwrap().is_empty());
            sources.extend(found);
        }
        let out = spool.join(format!("assembled-{world}"));
        let m = assemble_ranks(&sources, &out, 7, None, &Metadata::new()).unwrap();
        assert_eq!((m.step, m.world_size), (7, world));
        assert_eq!(m, Manifest::read_any_name(&out).unwrap());
        for rank in 0..world {
            let file = out.join(rank_file_name(rank, world));
            assert_eq!(
                std::fs::metadata(&file).unwrap().len(),
                reports[rank as usize].bytes
            );
            assert_safetensors_equal(&file, &states[rank as usize]);
        }
    }
    assert!(find_parts(&spool.join("missing"), 7).unwrap().is_empty());
}

/// A link where an engine root or a partial directory would be is not followed.
#[test]
fn find_parts_follows_no_link() {
    let dir = real_dir("parts-links");
    let rank_dir = dir.path().join("rank");
    let elsewhere = dir.path().join("elsewhere");
    std::fs::create_dir_all(elsewhere.join(partial_dir_name(3))).unwrap();
    std::fs::create_dir_all(rank_dir.join("1-0")).unwrap();
    std::os::unix::fs::symlink(&elsewhere, rank_dir.join("2-0")).unwrap();
    std::os::unix::fs::symlink(
        elsewhere.join(partial_dir_name(3)),
        rank_dir.join("1-0").join(partial_dir_name(3)),
    )
    .unwrap();
    assert!(find_parts(&rank_dir, 3).unwrap().is_empty());
}

/// Issue 36, item 4: an engine opening a root never removes another rank's durable part.
/// Rank 0 of 2 saves step 1 and closes (its report commits nothing: no `dir`, no commit
/// time); rank 1's engine then opens the root: rank 0's file and part are still there,
/// byte for byte, and rank 1's save of step 1 commits both. A durable part is removed once
/// provably stale (a newer step committed), and a partial directory without one (nothing
/// durable, no arena holding it) at once.
#[test]
fn opening_a_root_keeps_another_ranks_durable_part_until_it_is_stale() {
    let dir = real_dir("parts-keep");
    let root = dir.path();
    let open = |rank: u32| {
        small_config(root, BackendKind::Pwrite)
            .with_rank(rank, 2)
            .build()
            .unwrap()
    };
    let state = |step: u64, rank: u32| step_state(10 * step + u64::from(rank));
    let save = |e: &shmckpt::Engine, step: u64, rank: u32| {
        e.save(step, &state(step, rank).tensors(), &Metadata::new())
            .unwrap()
            .wait()
            .unwrap()
    };
    let r0 = open(0);
    let rep = save(&r0, 1, 0);
    assert_eq!((rep.dir.as_deref(), rep.timings.committed), (None, None));
    r0.close();
    let partial = root.join(partial_dir_name(1));
    let part = partial.join(shmckpt::manifest::rank_manifest_name(0));
    let part_bytes = std::fs::read(&part).unwrap();

    let r1 = open(1);
    assert_eq!(
        std::fs::read(&part).unwrap(),
        part_bytes,
        "rank 0's part kept"
    );
    assert_safetensors_equal(&partial.join(rank_file_name(0, 2)), &state(1, 0));
    let rep = save(&r1, 1, 1);
    assert_eq!(rep.dir.as_deref(), Some(&*root.join(step_dir_name(1))));
    assert!(rep.timings.committed.is_some());
    r1.close();
    assert_eq!(committed(root), [1]);
    for rank in 0..2 {
        assert_safetensors_equal(
            &root.join(step_dir_name(1)).join(rank_file_name(rank, 2)),
            &state(1, rank),
        );
    }

    // Rank 0 saves step 2 alone and closes: kept across opens until step 3 is committed.
    let r0 = open(0);
    save(&r0, 2, 0);
    r0.close();
    // A partial directory with nothing durable in it (a file, no part) is removed.
    let bare = root.join(partial_dir_name(5));
    std::fs::create_dir(&bare).unwrap();
    std::fs::write(bare.join(rank_file_name(1, 2)), b"torn").unwrap();
    let (r0, r1) = (open(0), open(1));
    assert!(!bare.exists(), "a partial without a durable part is stale");
    assert!(
        root.join(partial_dir_name(2))
            .join(rank_file_name(0, 2))
            .is_file()
    );
    std::thread::scope(|s| {
        s.spawn(|| save(&r0, 3, 0));
        s.spawn(|| save(&r1, 3, 1));
    });
    r0.close();
    r1.close();
    assert_eq!(committed(root), [1, 3]);
    drop(open(1));
    assert!(
        !root.join(partial_dir_name(2)).exists(),
        "step 3 is committed: step 2's part is provably stale"
    );
}
