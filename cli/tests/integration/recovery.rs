//! Crash recovery from the staging arena: a child process saves and dies by SIGKILL right
//! after `save` returns; the parent recovers (library, CLI, engine option) and checks the
//! committed bytes against what the child saved. Crafted arenas (`recovery_arenas.rs`) cover every refusal.

use crate::common;

use std::path::Path;
use std::process::Output;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use shmckpt::recover::{self, Owner, SlotOutcome, SlotState};
use shmckpt::{BackendKind, Engine, Error, Metadata};

pub(crate) const CS: u64 = 64 << 10;

/// Poll `cond` every millisecond for at most `limit`; true if it became true.
#[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
pub(crate) fn wait_for(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < limit {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    cond()
}

/// Slot of `step` in arena `name`, as listed.
#[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
pub(crate) fn slot_of(name: &str, step: u64) -> Option<recover::SlotInfo> {
    let info = recover::inspect_arena(name);
    let d = info.details.ok()?;
    d.slots.into_iter().find(|s| s.step == step)
}

/// Child: commit step 1, stage step 2, and die by SIGKILL as soon as `save` returned. With
/// fault injection, writes past the second chunk are held back (and the child waits until
/// the first two chunks are written), so recovery must take two chunks from the partial file
/// and two from staging.
fn child_saver() {
    let root = env_path(ROOT_ENV);
    let shm = std::env::var(SHM_ENV).unwrap();
    let cfg = small_config(&root, BackendKind::Auto)
        .with_staging_capacity(1 << 20)
        .with_queue_depth(1)
        .with_shm_name(shm.clone());
    #[cfg(feature = "fault-injection")]
    let plan = Arc::new(shmckpt::testing::io::fault::FaultPlan::new());
    #[cfg(feature = "fault-injection")]
    let cfg = cfg.with_faults(Arc::clone(&plan));
    let engine = Engine::open(cfg).unwrap();
    let s1 = step_state(1);
    save_committed(&engine, 1, &s1);
    #[cfg(feature = "fault-injection")]
    plan.add(shmckpt::testing::io::fault::Rule {
        kind: shmckpt::testing::io::OpKind::Write,
        offsets: 2 * CS..u64::MAX,
        fault: shmckpt::testing::io::fault::Fault::Delay(Duration::from_secs(60)),
        times: None,
    });
    let s2 = step_state(2);
    let meta: Metadata = [("run".to_owned(), "recovery test".to_owned())].into();
    let handle = engine.save(2, &s2.tensors(), &meta).unwrap();
    #[cfg(feature = "fault-injection")]
    assert!(
        wait_for(Duration::from_secs(20), || slot_of(&shm, 2)
            .is_some_and(|s| s.written >= 2)),
        "the first two chunks of step 2 were never written"
    );
    std::hint::black_box(&handle);
    sigkill_self();
}

/// Child: open an engine on the root and die by SIGKILL without saving (its arena holds
/// nothing to recover).
fn child_idle() {
    let root = env_path(ROOT_ENV);
    let shm = std::env::var(SHM_ENV).unwrap();
    let engine = Engine::open(
        small_config(&root, BackendKind::Auto)
            .with_staging_capacity(1 << 20)
            .with_shm_name(shm),
    )
    .unwrap();
    std::hint::black_box(&engine);
    sigkill_self();
}

/// The child roles of this module's tests.
const ROLES: &[Role] = &[("child_saver", child_saver), ("child_idle", child_idle)];

#[test]
fn sigkilled_child_is_recovered_exactly() {
    if run_role(ROLES) {
        return;
    }
    let dir = real_dir("recover-lib");
    let root = dir.path();
    let shm = test_shm_name("lib");
    let _g = ShmGuard(shm.clone());
    run_child("child_saver", root, &shm);

    // Listing reports the arena and changes none of its bytes.
    let seg = Path::new("/dev/shm").join(&shm);
    let before = std::fs::read(&seg).unwrap();
    let all = recover::list_arenas();
    let info = all.iter().find(|a| a.name == shm).expect("arena listed");
    let d = info.details.as_ref().expect("arena readable");
    assert_eq!(d.owner, Owner::Dead);
    assert!(!d.closed && !d.in_use());
    assert_eq!(d.root, std::fs::canonicalize(root).unwrap());
    assert_eq!((d.rank, d.world_size), (0, 1));
    let already_committed = committed(root).contains(&2);
    if !already_committed {
        assert_eq!(d.slots.len(), 1, "{:?}", d.slots);
        let s = &d.slots[0];
        assert_eq!(
            (s.step, s.state, s.chunks, s.missing),
            (2, SlotState::Staged, 4, 0)
        );
        assert!(s.recoverable());
        #[cfg(feature = "fault-injection")]
        assert_eq!((s.written, s.staged), (2, 2));
    }
    assert!(
        std::fs::read(&seg).unwrap() == before,
        "listing changed the arena"
    );
    assert_eq!(committed(root)[0], 1);

    let report = recover::recover_arena(&shm, None).unwrap();
    assert_eq!(report.owner, Owner::Dead);
    assert!(report.removed && report.kept.is_none(), "{report:?}");
    assert!(!shm_exists(&shm), "the arena is removed after recovery");
    assert_eq!(report.slots.len(), 1);
    match &report.slots[0].outcome {
        SlotOutcome::Committed {
            dir: d,
            bytes,
            from_staging,
            from_file,
        } => {
            assert_eq!(d, &root.join("step-2"));
            assert_eq!(
                *bytes,
                std::fs::metadata(d.join("rank-00000-of-00001.safetensors"))
                    .unwrap()
                    .len()
            );
            assert_eq!(from_staging + from_file, 4);
            #[cfg(feature = "fault-injection")]
            assert_eq!((*from_staging, *from_file), (2, 2));
        }
        SlotOutcome::AlreadyCommitted { .. } => {
            assert!(already_committed);
            eprintln!("note: the child committed step 2 before it was killed");
        }
        other => panic!("step 2 not recovered: {other:?}"),
    }
    #[cfg(feature = "fault-injection")]
    assert!(
        !already_committed,
        "writes were held back: step 2 cannot be committed"
    );
    assert_eq!(committed(root), [1, 2]);
    assert_step_is_exact(root, 1);
    assert_step_is_exact(root, 2);
    assert_safetensors_equal(
        &root.join("step-2/rank-00000-of-00001.safetensors"),
        &step_state(2),
    );
    let m = shmckpt::Manifest::read(&root.join("step-2")).unwrap();
    assert_eq!(
        m.metadata["run"], "recovery test",
        "user metadata survives recovery"
    );
    assert!(partial_dirs(root).is_empty());
    // A second attempt finds nothing.
    assert!(matches!(
        recover::recover_arena(&shm, None),
        Err(Error::Shm { .. })
    ));
}

pub(crate) fn cli(args: &[&str]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_shmckpt"))
        .args(args)
        .output()
        .unwrap()
}

pub(crate) fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn cli_lists_without_touching_then_recovers_the_root() {
    if run_role(ROLES) {
        return;
    }
    let dir = real_dir("recover-cli");
    let root = dir.path();
    let other = real_dir("recover-cli-other");
    let shm = test_shm_name("cli");
    let _g = ShmGuard(shm.clone());
    run_child("child_saver", root, &shm);
    let seg = Path::new("/dev/shm").join(&shm);
    let before = std::fs::read(&seg).unwrap();

    let out = cli(&["recover", "--list"]);
    assert!(out.status.success(), "{}", text(&out));
    let listed = text(&out);
    let line = listed
        .lines()
        .find(|l| l.starts_with(&shm))
        .unwrap_or_else(|| panic!("{shm} not listed:\n{listed}"));
    assert!(line.contains("dead") && line.contains("[stale]"), "{line}");
    if !committed(root).contains(&2) {
        assert!(
            listed.contains("step 2 STAGED") && listed.contains("-> recoverable"),
            "{listed}"
        );
    }
    let out = cli(&["recover", "--list", other.path().to_str().unwrap()]);
    assert!(out.status.success());
    assert!(
        !text(&out).contains(&shm),
        "--list DIR shows only that root"
    );
    assert!(shm_exists(&shm));
    assert!(
        std::fs::read(&seg).unwrap() == before,
        "--list changed the arena"
    );

    let out = cli(&["recover", root.to_str().unwrap()]);
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains("step 2: committed") || said.contains("step 2: already committed"),
        "{said}"
    );
    // Each event once: on stdout from the report, not again from the library's log.
    assert_eq!(String::from_utf8_lossy(&out.stderr), "", "{said}");
    assert_eq!(said.matches("step 2:").count(), 1, "{said}");
    assert!(said.contains(&format!("removed arena {shm}")), "{said}");
    assert!(!shm_exists(&shm));
    assert_eq!(committed(root), [1, 2]);
    assert_step_is_exact(root, 2);
    // Nothing left to do: success, and it says so.
    let out = cli(&["recover", root.to_str().unwrap()]);
    assert!(out.status.success());
    assert!(text(&out).contains("no staging arenas"), "{}", text(&out));
    let out = cli(&["recover"]);
    assert!(!out.status.success(), "recover needs DIR, --shm or --list");
}

/// Issue 36, item 7: a staged save survives a crash by default. An engine opened with
/// recovery off recovers nothing and deletes nothing recoverable (the dead arena and the
/// partial file holding the chunks already written stay, and the engine names the arena);
/// the next default open recovers step 2 exactly, says so, and removes the arena.
#[test]
fn a_default_open_recovers_and_an_opt_out_keeps_everything() {
    if run_role(ROLES) {
        return;
    }
    let dir = real_dir("recover-default");
    let root = dir.path();
    let shm = test_shm_name("default");
    let _g = ShmGuard(shm.clone());
    run_child("child_saver", root, &shm);
    let cfg = || small_config(root, BackendKind::Auto).with_staging_capacity(1 << 20);
    let partial = root.join(shmckpt::manifest::partial_dir_name(2));
    let file = partial.join(shmckpt::manifest::rank_file_name(0, 1));
    let before = std::fs::read(&file).unwrap();

    let off = Engine::open(cfg().with_recover_on_open(false)).unwrap();
    assert!(off.recovered().is_empty() && off.recovered_steps().is_empty());
    assert_eq!(off.unrecovered(), std::slice::from_ref(&shm));
    assert_eq!(off.latest().unwrap(), Some(1));
    assert!(shm_exists(&shm), "the opt-out keeps the arena");
    assert_eq!(
        std::fs::read(&file).unwrap(),
        before,
        "and the partial file"
    );
    drop(off);

    let on = Engine::open(cfg()).unwrap();
    assert_eq!(on.recovered_steps(), [2]);
    assert!(on.unrecovered().is_empty());
    let [report] = on.recovered() else {
        panic!("{:?}", on.recovered())
    };
    assert_eq!(
        (report.arena.as_str(), report.removed),
        (shm.as_str(), true)
    );
    #[cfg(feature = "fault-injection")]
    match &report.slots[0].outcome {
        SlotOutcome::Committed {
            from_staging,
            from_file,
            ..
        } => assert_eq!((*from_staging, *from_file), (2, 2)),
        other => panic!("{other:?}"),
    }
    assert!(!shm_exists(&shm));
    assert_eq!(on.latest().unwrap(), Some(2));
    assert_loaded_equal(&on.load(2).unwrap(), &step_state(2));
    assert!(partial_dirs(root).is_empty());
}

/// `recover --json` prints one JSON document: each arena's report with its slots' outcomes
/// (issue 39, item 6).
#[test]
fn cli_recover_speaks_json() {
    if run_role(ROLES) {
        return;
    }
    let dir = real_dir("recover-json");
    let root = dir.path();
    let shm = test_shm_name("json");
    let _g = ShmGuard(shm.clone());
    run_child("child_saver", root, &shm);
    let out = cli(&["recover", "--json", root.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(String::from_utf8_lossy(&out.stderr), "");
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["not_recovered"], 0, "{j}");
    let arenas = j["arenas"].as_array().unwrap();
    assert_eq!(arenas.len(), 1, "{j}");
    let a = &arenas[0];
    assert_eq!(a["arena"], shm.as_str());
    assert_eq!(
        (&a["rank"], &a["world_size"], &a["removed"], &a["kept"]),
        (
            &serde_json::json!(0),
            &serde_json::json!(1),
            &serde_json::json!(true),
            &serde_json::Value::Null
        ),
        "{j}"
    );
    let canon = std::fs::canonicalize(root).unwrap();
    assert_eq!(a["root"], canon.to_str().unwrap());
    let two: Vec<&serde_json::Value> = a["slots"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["step"] == 2)
        .collect();
    assert_eq!(two.len(), 1, "{j}");
    let step2 = canon.join("step-2");
    match two[0]["outcome"].as_str().unwrap() {
        "committed" => {
            assert_eq!(two[0]["dir"], step2.to_str().unwrap());
            assert!(two[0]["bytes"].as_u64().unwrap() > 0, "{j}");
        }
        "already_committed" => assert_eq!(two[0]["dir"], step2.to_str().unwrap()),
        o => panic!("step 2: {o}: {j}"),
    }
    assert_eq!(committed(root), [1, 2]);
    assert_step_is_exact(root, 2);
}

#[test]
fn engine_recovers_on_open() {
    if run_role(ROLES) {
        return;
    }
    let dir = real_dir("recover-open");
    let root = dir.path();
    let shm = test_shm_name("open");
    let _g = ShmGuard(shm.clone());
    run_child("child_saver", root, &shm);
    assert!(shm_exists(&shm));
    let engine = Engine::open(
        small_config(root, BackendKind::Auto)
            .with_staging_capacity(1 << 20)
            .with_recover_on_open(true),
    )
    .unwrap();
    assert!(!shm_exists(&shm), "recover-on-open removes the dead arena");
    assert_eq!(engine.latest().unwrap(), Some(2));
    assert_loaded_equal(&engine.load(2).unwrap(), &step_state(2));
    assert_loaded_equal(&engine.load(1).unwrap(), &step_state(1));
    assert!(partial_dirs(root).is_empty());
    // The engine keeps working after recovery.
    let s3 = step_state(3);
    save_committed(&engine, 3, &s3);
    assert_loaded_equal(&engine.load(3).unwrap(), &s3);
}

#[test]
fn live_arena_is_listed_and_left_alone() {
    let dir = real_dir("recover-live");
    let root = dir.path();
    let engine =
        Engine::open(small_config(root, BackendKind::Auto).with_staging_capacity(1 << 20)).unwrap();
    let s1 = step_state(1);
    save_committed(&engine, 1, &s1);
    let name = engine.shm_name().to_owned();
    let info = recover::inspect_arena(&name);
    let d = info.details.unwrap();
    assert_eq!(d.owner, Owner::Alive);
    assert!(d.in_use() && d.slots.is_empty());

    let err = recover::recover_arena(&name, None).unwrap_err();
    assert!(
        matches!(&err, Error::Recovery { reason, .. } if reason.contains("alive")),
        "{err}"
    );
    let results = recover::recover_root(root, None);
    assert_eq!(results.len(), 1);
    assert!(matches!(results[0].1, Err(Error::Recovery { .. })));
    let out = cli(&["recover", root.to_str().unwrap()]);
    assert!(
        !out.status.success(),
        "a live arena is a failure to recover"
    );
    assert!(text(&out).contains("alive"), "{}", text(&out));
    let out = cli(&["recover", "--shm", &name]);
    assert!(!out.status.success());
    // Another engine with recover-on-open (other root) does not touch it either.
    let other = real_dir("recover-live-other");
    let e2 = Engine::open(
        small_config(other.path(), BackendKind::Auto)
            .with_staging_capacity(1 << 20)
            .with_recover_on_open(true),
    )
    .unwrap();
    drop(e2);
    assert!(shm_exists(&name));
    let s2 = step_state(2);
    save_committed(&engine, 2, &s2);
    assert_loaded_equal(&engine.load(2).unwrap(), &s2);
    drop(engine);
    assert!(!shm_exists(&name), "a clean shutdown removes the arena");
}

/// Issue 36, item 8: a crash leaks no `/dev/shm`. `shm list` shows a dead trainer's staging
/// arena (owner pid, uid, liveness, root, rank, the steps it could recover) next to a live
/// engine's; `shm rm` refuses the live one and removes the dead one. An open of the root,
/// even with recovery off, removes a dead predecessor's arena that holds nothing to
/// recover (and keeps one that does: `a_default_open_recovers_and_an_opt_out_keeps_everything`).
#[test]
fn shm_list_shows_staging_arenas_and_dead_ones_are_removed() {
    if run_role(ROLES) {
        return;
    }
    let dir = real_dir("recover-shm");
    let root = dir.path().join("dead");
    std::fs::create_dir(&root).unwrap();
    let shm = test_shm_name("dead");
    let idle = test_shm_name("idle");
    let _g = (ShmGuard(shm.clone()), ShmGuard(idle.clone()));
    run_child("child_saver", &root, &shm);
    let live_root = dir.path().join("live");
    std::fs::create_dir(&live_root).unwrap();
    let live =
        Engine::open(small_config(&live_root, BackendKind::Auto).with_staging_capacity(1 << 20))
            .unwrap();
    let live_name = live.shm_name().to_owned();

    let out = cli(&["shm", "list", "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let entry = |name: &str| {
        list.as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == name)
            .unwrap_or_else(|| panic!("{name} not listed: {list}"))
            .clone()
    };
    let dead = entry(&shm);
    let me = rustix::process::geteuid().as_raw();
    assert_eq!(dead["kind"], "staging");
    assert_eq!(dead["owner"], "dead");
    assert_eq!(dead["owner_uid"], me);
    assert_eq!(dead["rank"], 0);
    assert_eq!(dead["recoverable_steps"], serde_json::json!([2]));
    assert_eq!(
        dead["root"],
        std::fs::canonicalize(&root).unwrap().to_str().unwrap()
    );
    let alive = entry(&live_name);
    assert_eq!(
        (&alive["kind"], &alive["owner"], &alive["owner_pid"]),
        (
            &serde_json::json!("staging"),
            &serde_json::json!("alive"),
            &serde_json::json!(std::process::id())
        )
    );
    let plain = text(&cli(&["shm", "list"]));
    assert!(
        plain.lines().any(|l| l.starts_with(&shm)
            && l.contains("  staging  ")
            && l.contains(" dead  recoverable steps [2]")),
        "{plain}"
    );

    // `shm rm` refuses the live arena (even with --force), removes the dead one.
    for args in [
        &["shm", "rm", &live_name][..],
        &["shm", "rm", "--force", &live_name],
    ] {
        let out = cli(args);
        assert!(!out.status.success(), "{}", text(&out));
        assert!(text(&out).contains("in use"), "{}", text(&out));
        assert!(shm_exists(&live_name));
    }
    let out = cli(&["shm", "rm", &shm]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(!shm_exists(&shm));
    drop(live);

    // A dead predecessor's arena with nothing to recover: removed at open, recovery off.
    run_child("child_idle", &root, &idle);
    assert!(shm_exists(&idle));
    let e = Engine::open(
        small_config(&root, BackendKind::Auto)
            .with_staging_capacity(1 << 20)
            .with_recover_on_open(false),
    )
    .unwrap();
    assert!(!shm_exists(&idle), "the open removes the dead arena");
    assert!(e.unrecovered().is_empty() && e.recovered().is_empty());
}
