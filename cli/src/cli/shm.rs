//! `shmckpt shm list|replicas|rm`: the arenas in `/dev/shm` (engines' staging arenas, and
//! those flash restore keeps: `EngineConfig::with_keep_in_memory`) and the peer replicas
//! (`shmckpt::replica`).

use super::{CliResult, human};

/// What to do with kept arenas.
#[derive(Debug, clap::Subcommand)]
pub enum ShmCmd {
    /// List every shmckpt arena. Kept arenas: name, size, owner uid, root, rank, kept
    /// step, and whether the engine that owns it is running (`owner alive`: an engine of
    /// its root and rank holds the root's rank lock). Staging arenas
    /// (`shmckpt.<pid>.r<rank>.<n>`, and any other `shmckpt.` segment): name, size, owner
    /// uid, owner pid and whether it runs (`alive`, `dead`, `closed`), root, rank, and the
    /// steps of the saves it holds that recovery could commit (JSON: `"kind": "staging"`;
    /// kept arenas are `"kind": "kept"`).
    List {
        /// Print a JSON array.
        #[arg(long)]
        json: bool,
    },
    /// List peer replicas (`docs/replicas.md`): name, size, owner uid, tag of the root
    /// (FNV-1a 64 of its canonical path), source rank and step; then replicas' temporary
    /// files (`<replica name>.tmp<pid>`: being written, or left by a writer that died),
    /// with their writer's pid and whether it runs (JSON: `"unfinished": true`).
    Replicas {
        /// Print a JSON array.
        #[arg(long)]
        json: bool,
    },
    /// Remove arenas (only this user's, never following a link). A kept arena whose
    /// engine is running (or may be: its header cannot be read) is refused, and left in
    /// place, unless --force. A staging arena is removed when its owner process is dead
    /// (or closed its engine), whatever saves it held (`shmckpt recover` commits them
    /// first), and refused while its owner runs, even with --force. A peer replica's
    /// name (`shmckpt-replica.*`, as `replicas` shows it) removes that replica, or that
    /// temporary file if its writer is dead (refused while it runs). The command fails
    /// after removing the others when one was refused.
    Rm {
        /// Names to remove (as `list` shows them).
        names: Vec<String>,
        /// Remove every kept arena of this user, and every staging arena of this user whose
        /// owner is dead.
        #[arg(long, conflicts_with = "names")]
        all: bool,
        /// Remove arenas whose engine is running too (that engine saves on, but nothing is
        /// kept under the name for the next engine's flash restore).
        #[arg(long)]
        force: bool,
    },
}

/// Arguments of `shm`.
#[derive(Debug, clap::Args)]
pub struct ShmArgs {
    #[command(subcommand)]
    pub cmd: ShmCmd,
}

pub fn run(a: ShmArgs) -> CliResult {
    match a.cmd {
        ShmCmd::List { json } => {
            let kept = shmckpt::flash::list_kept();
            let staging = staging_arenas();
            if json {
                let mut v: Vec<serde_json::Value> = kept
                    .iter()
                    .map(|k| {
                        serde_json::json!({
                            "kind": "kept",
                            "name": k.name,
                            "bytes": k.bytes,
                            "owner_uid": k.owner_uid,
                            "root": k.root.as_ref().map(|r| r.display().to_string()),
                            "rank": k.rank,
                            "step": k.step,
                            "owner": k.owner.as_str(),
                            "problem": k.problem,
                        })
                    })
                    .collect();
                v.extend(staging.iter().map(|a| {
                    let d = a.details.as_ref().ok();
                    serde_json::json!({
                        "kind": "staging",
                        "name": a.name,
                        "bytes": a.bytes,
                        "owner_uid": a.uid,
                        "owner_pid": d.map(|d| d.owner_pid),
                        "owner": d.map(staging_owner),
                        "root": d.map(|d| d.root.display().to_string()),
                        "rank": d.map(|d| d.rank),
                        "recoverable_steps": d.map(recoverable_steps),
                        "problem": a.details.as_ref().err(),
                    })
                }));
                println!("{}", serde_json::Value::Array(v));
                return Ok(());
            }
            if kept.is_empty() && staging.is_empty() {
                println!("no arenas");
            }
            for k in &kept {
                let step = k.step.map_or("none".into(), |s| s.to_string());
                let root = k
                    .root
                    .as_ref()
                    .map_or_else(|| "?".into(), |r| r.display().to_string());
                let rank = k.rank.map_or("?".into(), |r| r.to_string());
                print!(
                    "{}  {}  uid {}  root {}  rank {}  step {}  owner {}",
                    k.name,
                    human(k.bytes),
                    k.owner_uid,
                    root,
                    rank,
                    step,
                    k.owner.as_str()
                );
                match &k.problem {
                    Some(p) => println!("  ({p})"),
                    None => println!(),
                }
            }
            for a in &staging {
                let uid = a.uid.map_or("?".into(), |u| u.to_string());
                match &a.details {
                    Ok(d) => println!(
                        "{}  {}  uid {}  staging  root {}  rank {}  owner pid {} {}  recoverable steps {:?}",
                        a.name,
                        human(a.bytes),
                        uid,
                        d.root.display(),
                        d.rank,
                        d.owner_pid,
                        staging_owner(d),
                        recoverable_steps(d)
                    ),
                    Err(p) => println!(
                        "{}  {}  uid {}  staging  ({p})",
                        a.name,
                        human(a.bytes),
                        uid
                    ),
                }
            }
            Ok(())
        }
        ShmCmd::Replicas { json } => {
            let reps = shmckpt::replica::list();
            let unfinished = shmckpt::replica::list_unfinished();
            if json {
                let mut v: Vec<serde_json::Value> = reps
                    .iter()
                    .map(|r| {
                        serde_json::json!({
                            "name": r.name,
                            "bytes": r.bytes,
                            "owner_uid": r.owner_uid,
                            "root_tag": r.root_tag,
                            "source_rank": r.source_rank,
                            "step": r.step,
                        })
                    })
                    .collect();
                v.extend(unfinished.iter().map(|u| {
                    serde_json::json!({
                        "name": u.name,
                        "bytes": u.bytes,
                        "owner_uid": u.owner_uid,
                        "unfinished": true,
                        "replica": u.replica,
                        "writer_pid": u.writer_pid,
                        "writer_alive": u.writer_alive,
                    })
                }));
                println!("{}", serde_json::Value::Array(v));
                return Ok(());
            }
            if reps.is_empty() {
                println!("no replicas");
            }
            for u in &unfinished {
                println!(
                    "{}  {}  uid {}  unfinished: writer pid {} {}",
                    u.name,
                    human(u.bytes),
                    u.owner_uid,
                    u.writer_pid,
                    if u.writer_alive { "running" } else { "dead" }
                );
            }
            for r in &reps {
                println!(
                    "{}  {}  uid {}  root tag {}  source rank {}  step {}",
                    r.name,
                    human(r.bytes),
                    r.owner_uid,
                    r.root_tag,
                    r.source_rank,
                    r.step
                );
            }
            Ok(())
        }
        ShmCmd::Rm { names, all, force } => {
            let names: Vec<String> = if all {
                let uid = rustix::process::geteuid().as_raw();
                let mut names: Vec<String> = shmckpt::flash::list_kept()
                    .into_iter()
                    .filter(|k| k.owner_uid == uid)
                    .map(|k| k.name)
                    .collect();
                names.extend(
                    staging_arenas()
                        .into_iter()
                        .filter(|a| a.details.as_ref().is_ok_and(|d| !d.in_use()))
                        .map(|a| a.name),
                );
                names
            } else {
                names
            };
            if names.is_empty() {
                return Err("nothing to remove: give names or --all".into());
            }
            let mut refused = 0usize;
            for n in &names {
                let r = if shmckpt::replica::parse_replica_name(n).is_some()
                    || shmckpt::replica::parse_unfinished_name(n).is_some()
                {
                    shmckpt::replica::remove(n)
                } else if !shmckpt::flash::is_kept_name(n) {
                    shmckpt::recover::remove_dead_arena(n)
                } else if force {
                    shmckpt::flash::remove_kept_forced(n)
                } else {
                    shmckpt::flash::remove_kept(n)
                };
                match r {
                    Ok(()) => println!("removed {n}"),
                    Err(e @ shmckpt::Error::ArenaInUse { .. }) => {
                        eprintln!("{e}");
                        refused += 1;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            if refused > 0 {
                return Err(format!(
                    "{refused} name(s) in use left in place (--force removes kept arenas in use, \
                     never a running engine's staging arena)"
                )
                .into());
            }
            Ok(())
        }
    }
}

/// Every `shmckpt.` segment of `/dev/shm` but flash restore's kept arenas, as
/// `shmckpt recover --list` reads them (links and other users' segments are listed with
/// the reason, never opened).
fn staging_arenas() -> Vec<shmckpt::recover::ArenaInfo> {
    shmckpt::recover::list_arenas()
        .into_iter()
        .filter(|a| !shmckpt::flash::is_kept_name(&a.name))
        .collect()
}

/// `alive`, `dead` or `closed` (its owner shut its engine down), as `shm list` says it.
fn staging_owner(d: &shmckpt::recover::ArenaDetails) -> &'static str {
    if d.in_use() {
        "alive"
    } else if d.closed {
        "closed"
    } else {
        "dead"
    }
}

/// Steps of the saves `d` holds that recovery could commit.
fn recoverable_steps(d: &shmckpt::recover::ArenaDetails) -> Vec<u64> {
    d.slots
        .iter()
        .filter(|s| s.recoverable())
        .map(|s| s.step)
        .collect()
}
