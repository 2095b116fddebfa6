//! SIGKILL at random points of a save (staging, writing, fsync, commit), 60 times on one
//! checkpoint root. After every kill: the latest committed checkpoint loads and verifies
//! with exactly the bytes of its step, no partial checkpoint is listed, recovery (three
//! ways) commits only exact saves, and opening the root cleans the partial directories that
//! hold nothing durable or recoverable (without recovery, it keeps those the arena holds).

use crate::common;

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use shmckpt::manifest::{MANIFEST, partial_dir_name, step_dir_name};
use shmckpt::recover;
use shmckpt::testing::io::OpKind;
use shmckpt::testing::io::fault::{Fault, FaultPlan, Rule};
use shmckpt::testing::staging::AttachedArena;
use shmckpt::testing::staging::descriptor::{chunk_state, slot_state};
use shmckpt::{BackendKind, Engine, Metadata};

const CS: u64 = 64 << 10;
const TRIALS: usize = 60;
const SAVES: u64 = 3;

fn var(k: &str) -> String {
    std::env::var(k).unwrap()
}

/// Busy-wait `us` microseconds (finer than sleep).
fn spin(us: u64) {
    let t = Instant::now();
    while t.elapsed() < Duration::from_micros(us) {
        std::hint::spin_loop();
    }
}

fn has_manifest_or_tmp(partial: &Path) -> bool {
    std::fs::read_dir(partial).is_ok_and(|rd| {
        rd.flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with(MANIFEST))
    })
}

/// Runs in the child: kill the process by SIGKILL as soon as save `target` reaches
/// `phase` (with `param` chunks staged or written for staging and writing), after `spin_us`
/// more microseconds. Once the target is committed, it kills at once.
fn watcher(shm: String, root: PathBuf, phase: String, target: u64, param: u64, spin_us: u64) {
    let att = AttachedArena::open(&shm).unwrap();
    let done = root.join(step_dir_name(target));
    let partial = root.join(partial_dir_name(target));
    loop {
        let slot = (0..att.slot_count())
            .map(|s| att.slot(s))
            .find(|v| v.state != slot_state::FREE && v.step == target);
        let count = |st: u32| {
            slot.as_ref()
                .map_or(0, |v| v.chunks.iter().filter(|c| c.0 == st).count() as u64)
        };
        let state = slot.as_ref().map(|v| v.state);
        let n = slot.as_ref().map_or(u64::MAX, |v| v.chunks.len() as u64);
        let written = count(chunk_state::WRITTEN);
        let fire = match phase.as_str() {
            "staging" => {
                state == Some(slot_state::STAGING) && count(chunk_state::STAGED) + written >= param
            }
            "writing" => state == Some(slot_state::STAGED) && written >= param,
            "fsync" => state == Some(slot_state::STAGED) && written == n,
            "commit" => has_manifest_or_tmp(&partial) || done.exists(),
            other => panic!("unknown phase {other}"),
        };
        if fire || done.exists() {
            spin(spin_us);
            sigkill_self();
        }
        std::hint::spin_loop();
    }
}

/// Child: a trainer saving three steps back to back through slow writes (3 ms each) and a
/// staging arena of one file (so every save but the first waits for the previous one's
/// writes while staging), killed by its watcher thread or by the parent.
fn child_trainer() {
    let root = PathBuf::from(var("KILL_ROOT"));
    let shm = var("KILL_SHM");
    let base: u64 = var("KILL_BASE").parse().unwrap();
    let phase = var("KILL_PHASE");
    let plan = Arc::new(FaultPlan::new());
    plan.add(Rule {
        kind: OpKind::Write,
        offsets: 0..u64::MAX,
        fault: Fault::Delay(Duration::from_millis(3)),
        times: None,
    });
    let engine = Engine::open(
        small_config(&root, BackendKind::Auto)
            .with_staging_capacity(4 * CS)
            .with_max_inflight_saves(2)
            .with_queue_depth(2)
            .with_shm_name(shm.clone())
            .with_faults(plan),
    )
    .unwrap();
    let states: Vec<State> = (1..=SAVES).map(|i| step_state(base + i)).collect();
    if phase != "external" {
        let target: u64 = var("KILL_TARGET").parse().unwrap();
        let param: u64 = var("KILL_PARAM").parse().unwrap();
        let spin_us: u64 = var("KILL_SPIN").parse().unwrap();
        let root = root.clone();
        std::thread::spawn(move || watcher(shm, root, phase, target, param, spin_us));
    }
    let handles: Vec<_> = states
        .iter()
        .zip(1..)
        .map(|(s, i)| {
            engine
                .save(base + i, &s.tensors(), &Metadata::new())
                .unwrap()
        })
        .collect();
    for h in handles {
        h.wait().unwrap();
    }
    // Only SIGKILL ends this process.
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// splitmix64 step.
fn next(rng: &mut u64) -> u64 {
    *rng = rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
    shmckpt_bench::synthetic::splitmix64(*rng)
}

/// Where the dead child was, judged from what it left.
fn classify(shm: &str, root: &Path) -> &'static str {
    let Ok(d) = recover::inspect_arena(shm).details else {
        return "no arena";
    };
    let mut worst = "between saves";
    for s in &d.slots {
        let phase = match s.state {
            recover::SlotState::Staging => "staging",
            _ if s.written < s.chunks => "writing",
            _ if root.join(step_dir_name(s.step)).exists() => "after commit",
            _ if has_manifest_or_tmp(&root.join(partial_dir_name(s.step))) => "commit",
            _ => "fsync",
        };
        let rank = |p: &str| {
            [
                "between saves",
                "after commit",
                "commit",
                "fsync",
                "writing",
                "staging",
            ]
            .iter()
            .position(|x| *x == p)
        };
        if rank(phase) > rank(worst) {
            worst = phase;
        }
    }
    worst
}

fn engine_cfg(root: &Path) -> shmckpt::EngineConfig {
    small_config(root, BackendKind::Auto).with_staging_capacity(8 * CS)
}

/// The latest committed checkpoint is a real `step-N` directory and holds exactly step N.
fn check_latest(root: &Path) {
    let all = shmckpt::manifest::list_committed(root).unwrap();
    if let Some(c) = all.last() {
        assert_eq!(
            c.dir.file_name().unwrap().to_str().unwrap(),
            step_dir_name(c.step)
        );
        assert_step_is_exact(root, c.step);
    }
    for p in partial_dirs(root) {
        let step: u64 = p
            .trim_start_matches("step-")
            .trim_end_matches(".partial")
            .parse()
            .unwrap();
        assert!(
            !all.iter().any(|c| c.step == step),
            "partial step {step} is listed as committed"
        );
    }
}

/// The child roles of this module's tests.
const ROLES: &[Role] = &[("child_trainer", child_trainer)];

#[test]
fn sigkill_at_random_points_never_breaks_the_root() {
    if run_role(ROLES) {
        return;
    }
    let dir = real_dir("kill");
    let root = dir.path();
    let seed: u64 = std::env::var("SHMCKPT_KILL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x6b69_6c6c);
    eprintln!("kill test seed {seed} (set SHMCKPT_KILL_SEED to replay)");
    let mut rng = seed;
    let phases = ["staging", "writing", "fsync", "commit", "external"];
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    let mut recovered = 0;
    let mut refused = 0;
    let started = Instant::now();
    for trial in 0..TRIALS {
        let base = 10 * (trial as u64 + 1);
        let shm = test_shm_name("kill");
        let _g = ShmGuard(shm.clone());
        let phase = phases[trial % phases.len()];
        // Staging only waits (and so can be caught) from the second save on.
        let target = base + 1 + next(&mut rng) % SAVES;
        let target = if phase == "staging" {
            target.max(base + 2)
        } else {
            target
        };
        let mut cmd = child_command("child_trainer");
        cmd.env("KILL_ROOT", root)
            .env("KILL_SHM", &shm)
            .env("KILL_BASE", base.to_string())
            .env("KILL_PHASE", phase)
            .env("KILL_TARGET", target.to_string())
            .env("KILL_PARAM", (next(&mut rng) % 4).to_string())
            .env("KILL_SPIN", (next(&mut rng) % 300).to_string())
            .stdout(std::process::Stdio::null());
        let mut child = cmd.spawn().unwrap();
        let t = Instant::now();
        if phase == "external" {
            let first = root.join(partial_dir_name(base + 1));
            while !first.exists() && t.elapsed() < Duration::from_secs(30) {
                if child.try_wait().unwrap().is_some() {
                    break;
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            std::thread::sleep(Duration::from_micros(next(&mut rng) % 40_000));
            let _ = child.kill();
        }
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if t.elapsed() > Duration::from_secs(60) {
                let _ = child.kill();
                panic!("trial {trial}: the child was not killed within 60 s");
            }
            std::thread::sleep(Duration::from_micros(500));
        };
        assert_eq!(
            status.signal(),
            Some(libc::SIGKILL),
            "trial {trial}: the child must die by SIGKILL, not {status:?}"
        );
        let at = classify(&shm, root);
        *seen.entry(at).or_default() += 1;

        // Right after the crash.
        let before = committed(root);
        check_latest(root);
        for &s in before.iter().filter(|&&s| s > base) {
            assert_step_is_exact(root, s);
        }

        // Recover, three ways.
        match trial % 3 {
            0 => drop(Engine::open(engine_cfg(root).with_recover_on_open(true)).unwrap()),
            1 => {
                let r = recover::recover_arena(&shm, None).unwrap();
                assert!(!r.has_failures(), "trial {trial}: {r:?}");
                assert!(r.removed);
                refused += r
                    .slots
                    .iter()
                    .filter(|s| matches!(s.outcome, recover::SlotOutcome::Refused { .. }))
                    .count();
                drop(Engine::open(engine_cfg(root)).unwrap());
            }
            _ => {
                // Opening the root without recovery first removes a dead arena that
                // holds nothing to recover, then only the partial directories that
                // nothing holds (the partial-part rule): those of the saves a kept dead
                // arena holds stay for the recovery that follows.
                let slots = recover::inspect_arena(&shm).details.unwrap().slots;
                let recoverable = slots.iter().any(|s| s.recoverable());
                let held: Vec<String> = if recoverable {
                    slots.iter().map(|s| partial_dir_name(s.step)).collect()
                } else {
                    Vec::new()
                };
                // What the rule keeps: a partial directory the arena holds, or one with a
                // durable part (its manifest), unless a step as new is committed.
                let newest = committed(root).last().copied();
                let mut want: Vec<String> = partial_dirs(root)
                    .into_iter()
                    .filter(|p| {
                        let step =
                            shmckpt::manifest::parse_step_with_suffix(p, ".partial").unwrap();
                        let durable =
                            std::fs::symlink_metadata(root.join(p).join(MANIFEST)).is_ok();
                        (held.contains(p) || durable) && newest.is_none_or(|c| c < step)
                    })
                    .collect();
                want.sort();
                drop(Engine::open(engine_cfg(root).with_recover_on_open(false)).unwrap());
                let mut left = partial_dirs(root);
                left.sort();
                assert_eq!(left, want, "trial {trial}: the arena holds {held:?}");
                if recoverable {
                    let r = recover::recover_arena(&shm, None).unwrap();
                    assert!(!r.has_failures(), "trial {trial}: {r:?}");
                    refused += r
                        .slots
                        .iter()
                        .filter(|s| matches!(s.outcome, recover::SlotOutcome::Refused { .. }))
                        .count();
                } else {
                    assert!(
                        !shm_exists(&shm),
                        "trial {trial}: the open removes a dead arena holding nothing to recover"
                    );
                }
                drop(Engine::open(engine_cfg(root)).unwrap());
            }
        }
        assert!(
            !shm_exists(&shm),
            "trial {trial}: the dead arena was not removed"
        );
        assert!(
            partial_dirs(root).is_empty(),
            "trial {trial}: partial directories left: {:?}",
            partial_dirs(root)
        );
        let after = committed(root);
        assert!(
            before.iter().all(|s| after.contains(s)),
            "trial {trial}: recovery lost a committed checkpoint"
        );
        for &s in after.iter().filter(|s| !before.contains(s)) {
            assert!(s > base && s <= base + SAVES, "trial {trial}: step {s}");
            assert_step_is_exact(root, s);
            recovered += 1;
        }
        check_latest(root);
    }
    eprintln!(
        "{TRIALS} kills in {:.1} s; state at death: {seen:?}; {recovered} save(s) recovered, \
         {refused} refused",
        started.elapsed().as_secs_f64()
    );
}
