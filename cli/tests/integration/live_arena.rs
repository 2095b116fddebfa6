//! Issue 21, item 4: a live engine's kept arena is never removed without `--force`
//! (listing says whether each arena's owner is alive; the library and `shm rm` refuse a
//! live or unknown one). Runs in a private mount namespace, with the harness of
//! `hostile.rs`.

use std::path::Path;

use crate::common::*;
use crate::hostile::{assert_no_signal, cli, in_private_shm, output_text, plant, shm_names};
use shmckpt::{BackendKind, Engine, Error};

fn kept_arena_of(root: &Path) -> String {
    let canon = std::fs::canonicalize(root).unwrap();
    shmckpt::testing::staging::kept_name(&canon, 0)
}

fn listed_owner(name: &str) -> String {
    let out = cli(&["shm", "list", "--json"]);
    assert!(out.status.success(), "{}", output_text(&out));
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let entry = list
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["name"] == name)
        .unwrap_or_else(|| panic!("{name} not listed: {list}"));
    entry["owner"].as_str().unwrap().to_owned()
}

fn live_arena_body() {
    let dir = real_dir("hostile21-4");
    let live_root = dir.path().join("live");
    let dead_root = dir.path().join("dead");
    std::fs::create_dir(&live_root).unwrap();
    std::fs::create_dir(&dead_root).unwrap();
    let keep = |root: &Path| small_config(root, BackendKind::Auto).with_keep_in_memory(true);
    // A dead engine's kept arena: its engine closed, its lock is free.
    let dead = Engine::open(keep(&dead_root)).unwrap();
    save_committed(&dead, 1, &step_state(1));
    dead.close();
    let dead_name = kept_arena_of(&dead_root);
    // A live engine (this process) keeping its arena.
    let live = Engine::open(keep(&live_root)).unwrap();
    save_committed(&live, 1, &step_state(1));
    let live_name = kept_arena_of(&live_root);
    assert_eq!(live.shm_name(), live_name);
    assert_eq!(shm_names(), {
        let mut v = vec![dead_name.clone(), live_name.clone()];
        v.sort();
        v
    });

    // Listing says whose owner runs, in the library and in the CLI.
    let owners: Vec<(String, shmckpt::flash::ArenaOwner)> = shmckpt::flash::list_kept()
        .into_iter()
        .map(|k| (k.name, k.owner))
        .collect();
    assert!(owners.contains(&(live_name.clone(), shmckpt::flash::ArenaOwner::Alive)));
    assert!(owners.contains(&(dead_name.clone(), shmckpt::flash::ArenaOwner::Gone)));
    assert_eq!(listed_owner(&live_name), "alive");
    assert_eq!(listed_owner(&dead_name), "gone");
    let text = output_text(&cli(&["shm", "list"]));
    assert!(
        text.lines()
            .any(|l| l.starts_with(&live_name) && l.ends_with("owner alive")),
        "{text}"
    );

    // The library refuses the live one with a typed error naming the lock.
    match shmckpt::flash::remove_kept(&live_name) {
        Err(Error::ArenaInUse { name, reason }) => {
            assert_eq!(name, live_name);
            assert!(reason.contains(".shmckpt-rank-0.lock"), "{reason}");
        }
        other => panic!("expected ArenaInUse, got {other:?}"),
    }
    assert!(shm_exists(&live_name));

    // `shm rm --all` removes the dead one, refuses the live one (which stays), and fails.
    let out = cli(&["shm", "rm", "--all"]);
    let text = output_text(&out);
    assert_no_signal(&out, "shm rm --all");
    assert!(!out.status.success(), "{text}");
    assert!(text.contains(&format!("removed {dead_name}")), "{text}");
    assert!(
        text.contains(&format!("arena {live_name} not removed"))
            && text.contains("is running")
            && text.contains("--force"),
        "{text}"
    );
    assert_eq!(shm_names(), vec![live_name.clone()]);
    // Named explicitly: refused the same way.
    let out = cli(&["shm", "rm", &live_name]);
    assert!(!out.status.success(), "{}", output_text(&out));
    assert_eq!(shm_names(), vec![live_name.clone()]);

    // --force removes it; the live engine saves and loads on, exactly.
    let out = cli(&["shm", "rm", "--all", "--force"]);
    let text = output_text(&out);
    assert!(out.status.success(), "{text}");
    assert!(text.contains(&format!("removed {live_name}")), "{text}");
    assert!(shm_names().is_empty());
    let s2 = step_state(2);
    save_committed(&live, 2, &s2);
    assert_loaded_equal(&live.load(2).unwrap(), &s2);
    live.close();

    // A kept-named file whose header cannot be read: its owner cannot be told, so it is
    // refused too; the forced removal takes it.
    plant(&dead_name, b"not an arena");
    assert!(matches!(
        shmckpt::flash::remove_kept(&dead_name),
        Err(Error::ArenaInUse { .. })
    ));
    assert_eq!(
        shmckpt::flash::list_kept()
            .iter()
            .find(|k| k.name == dead_name)
            .map(|k| k.owner),
        Some(shmckpt::flash::ArenaOwner::Unknown)
    );
    shmckpt::flash::remove_kept_forced(&dead_name).unwrap();
    assert!(shm_names().is_empty());
    println!("ISSUE21-ITEM4: live kept arena refused, dead one removed, --force removes");
}

#[test]
fn issue21_item4_a_live_engines_kept_arena_is_not_removed_without_force() {
    in_private_shm(
        "issue21_item4_a_live_engines_kept_arena_is_not_removed_without_force",
        live_arena_body,
    );
}
