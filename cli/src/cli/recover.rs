//! `recover`: list the staging arenas in `/dev/shm`, or commit what dead trainers had
//! fully staged.

use std::path::PathBuf;

use shmckpt::Error;
use shmckpt::recover::{self, ArenaInfo, RecoverOptions, RecoveryReport, SlotOutcome};

use serde_json::{Value, json};

use super::{CliResult, human, print_json};

/// Arguments of `recover`.
#[derive(Debug, clap::Args)]
pub struct RecoverArgs {
    /// Checkpoint root. Without --shm: recover every dead arena recorded for this root.
    /// With --shm: commit into this root instead of the one recorded in the arena. With
    /// --list: show only the arenas of this root.
    pub dir: Option<PathBuf>,
    /// Recover only this arena (its name in /dev/shm, e.g. shmckpt.1234.r0.0).
    #[arg(long, value_name = "NAME")]
    pub shm: Option<String>,
    /// Show the arenas in /dev/shm and what they hold, changing nothing.
    #[arg(long, conflicts_with = "shm")]
    pub list: bool,
    /// Also recover arenas owned by another user. Off by default: any local user can
    /// create a segment in /dev/shm, and committing it would inject a checkpoint into a
    /// root you own. Only use it for arenas you know a trusted job of that user left.
    #[arg(long)]
    pub allow_foreign: bool,
    /// One JSON document on stdout (each arena's report) instead of text (not with --list).
    #[arg(long, conflicts_with = "list")]
    pub json: bool,
}

/// Exit status: success when every arena asked for was processed (saves that cannot be
/// restored are reported, not failures); failure when an arena was refused as a whole
/// (owner alive, not an arena, root locked) or kept after an I/O error.
pub fn run(a: RecoverArgs) -> CliResult {
    if a.list {
        return list(a.dir);
    }
    let opts = RecoverOptions {
        allow_foreign: a.allow_foreign,
    };
    let results: Vec<(String, Result<RecoveryReport, Error>)> = match (&a.shm, &a.dir) {
        (Some(name), dir) => vec![(
            name.clone(),
            recover::recover_arena_with(name, dir.as_deref(), opts),
        )],
        (None, Some(dir)) => recover::recover_root_with(dir, None, opts),
        (None, None) => {
            return Err("give a checkpoint root DIR, --shm NAME, or --list".into());
        }
    };
    if results.is_empty() && !a.json {
        println!("no staging arenas recorded for this root");
        return Ok(());
    }
    let mut bad = 0;
    for (name, r) in &results {
        match r {
            Ok(rep) => {
                if !a.json {
                    print_report(rep);
                }
                if rep.kept.is_some() {
                    bad += 1;
                }
            }
            Err(e) => {
                bad += 1;
                if !a.json {
                    println!("arena {name}: not recovered: {e}");
                }
            }
        }
    }
    if a.json {
        print_json(&json!({
            "arenas": results.iter().map(|(name, r)| match r {
                Ok(rep) => report_json(rep),
                Err(e) => json!({"arena": name, "error": e.to_string()}),
            }).collect::<Vec<_>>(),
            "not_recovered": bad,
        }))?;
    }
    if bad > 0 {
        return Err(format!("{bad} of {} arena(s) not fully recovered", results.len()).into());
    }
    Ok(())
}

/// One arena's report as JSON (the fields of [`RecoveryReport`]; each slot's `outcome` is
/// `committed`, `awaiting_ranks`, `already_committed`, `adopted`, `behind`, `refused`
/// or `failed`).
fn report_json(r: &RecoveryReport) -> Value {
    let slots: Vec<Value> = r
        .slots
        .iter()
        .map(|s| {
            let mut v = json!({"slot": s.slot, "step": s.step, "state": s.state.to_string()});
            let o = match &s.outcome {
                SlotOutcome::Committed {
                    dir,
                    bytes,
                    from_staging,
                    from_file,
                } => {
                    json!({"outcome": "committed", "dir": dir.display().to_string(), "bytes": bytes,
                    "chunks_from_staging": from_staging, "chunks_from_file": from_file})
                }
                SlotOutcome::AwaitingRanks { partial } => {
                    json!({"outcome": "awaiting_ranks", "partial": partial.display().to_string()})
                }
                SlotOutcome::AlreadyCommitted { dir } => {
                    json!({"outcome": "already_committed", "dir": dir.display().to_string()})
                }
                SlotOutcome::Adopted => json!({"outcome": "adopted"}),
                SlotOutcome::Behind => json!({"outcome": "behind"}),
                SlotOutcome::Refused { reason } => json!({"outcome": "refused", "reason": reason}),
                SlotOutcome::Failed { error } => {
                    json!({"outcome": "failed", "error": error.to_string()})
                }
            };
            if let (Some(v), Value::Object(o)) = (v.as_object_mut(), o) {
                v.extend(o);
            }
            v
        })
        .collect();
    json!({
        "arena": r.arena,
        "owner_pid": r.owner_pid,
        "owner": r.owner.to_string(),
        "closed": r.closed,
        "rank": r.rank,
        "world_size": r.world_size,
        "root": r.root.display().to_string(),
        "slots": slots,
        "removed": r.removed,
        "kept": r.kept,
    })
}

fn print_report(r: &RecoveryReport) {
    println!(
        "arena {} (pid {}, {}{}; rank {} of {}; root {})",
        r.arena,
        r.owner_pid,
        r.owner,
        if r.closed { ", closed cleanly" } else { "" },
        r.rank,
        r.world_size,
        r.root.display()
    );
    if r.slots.is_empty() {
        println!("  no saves staged");
    }
    for s in &r.slots {
        match &s.outcome {
            SlotOutcome::Committed {
                dir,
                bytes,
                from_staging,
                from_file,
            } => println!(
                "  step {}: committed {} ({}, {from_staging} chunk(s) from staging, {from_file} already on disk)",
                s.step,
                dir.display(),
                human(*bytes)
            ),
            SlotOutcome::AwaitingRanks { partial } => println!(
                "  step {}: this rank's file is durable in {}; waiting for the other ranks",
                s.step,
                partial.display()
            ),
            SlotOutcome::AlreadyCommitted { dir } => {
                println!("  step {}: already committed ({})", s.step, dir.display())
            }
            SlotOutcome::Adopted => {
                println!("  step {}: held in memory by the opening engine", s.step)
            }
            SlotOutcome::Behind => {
                println!(
                    "  step {}: recovered by the opening engine after its open",
                    s.step
                )
            }
            SlotOutcome::Refused { reason } => {
                println!("  step {}: NOT recovered ({}): {reason}", s.step, s.state)
            }
            SlotOutcome::Failed { error } => {
                println!("  step {}: FAILED: {error}", s.step)
            }
        }
    }
    if r.removed {
        println!("  removed arena {}", r.arena);
    }
    if let Some(k) = &r.kept {
        println!("  kept arena {}: {k}", r.arena);
    }
}

fn list(dir: Option<PathBuf>) -> CliResult {
    let want = dir.map(|d| std::fs::canonicalize(&d).unwrap_or(d));
    let all: Vec<ArenaInfo> = recover::list_arenas()
        .into_iter()
        .filter(|a| match (&want, &a.details) {
            (None, _) => true,
            (Some(w), Ok(d)) => &d.root == w,
            (Some(_), Err(_)) => false,
        })
        .collect();
    if all.is_empty() {
        println!("no shmckpt staging arenas in /dev/shm");
        return Ok(());
    }
    for a in &all {
        let uid = a.uid.map(|u| format!(", uid {u}")).unwrap_or_default();
        match &a.details {
            Err(why) if a.foreign => {
                println!("{}  {}{uid}  FOREIGN: {why}", a.name, human(a.bytes))
            }
            Err(why) => println!("{}  {}{uid}  unreadable: {why}", a.name, human(a.bytes)),
            Ok(d) => {
                let verdict = if d.in_use() {
                    "in use"
                } else if d.slots.is_empty() {
                    "stale, nothing staged"
                } else {
                    "stale"
                };
                println!(
                    "{}  {}{uid}  pid {} {}{}  rank {} of {}  root {}  [{verdict}]",
                    a.name,
                    human(a.bytes),
                    d.owner_pid,
                    d.owner,
                    if d.closed { ", closed" } else { "" },
                    d.rank,
                    d.world_size,
                    d.root.display()
                );
                for s in &d.slots {
                    println!(
                        "  slot {}: step {} {}: {} chunk(s): {} on disk, {} in staging, {} missing -> {}",
                        s.slot,
                        s.step,
                        s.state,
                        s.chunks,
                        s.written,
                        s.staged,
                        s.missing,
                        if s.recoverable() {
                            "recoverable"
                        } else {
                            "not recoverable"
                        }
                    );
                }
            }
        }
    }
    Ok(())
}
