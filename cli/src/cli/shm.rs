//! `shmckpt shm list|replicas|rm`: the arenas flash restore keeps in `/dev/shm`
//! (`EngineConfig::with_keep_in_memory`) and the peer replicas (`shmckpt::replica`).

use super::{CliResult, human};

/// What to do with kept arenas.
#[derive(Debug, clap::Subcommand)]
pub enum ShmCmd {
    /// List kept arenas: name, size, owner uid, root, rank, kept step, and whether the
    /// engine that owns it is running (`owner alive`: an engine of its root and rank holds
    /// the root's rank lock).
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
    /// Remove kept arenas (only this user's, never following a link); a peer replica's
    /// name (`shmckpt-replica.*`, as `replicas` shows it) removes that replica, or that
    /// temporary file if its writer is dead (refused while it runs). An arena whose
    /// engine is running (or may be: its header cannot be read) is refused, and left in
    /// place, unless --force; the command then fails after removing the others.
    Rm {
        /// Names to remove (as `list` shows them).
        names: Vec<String>,
        /// Remove every kept arena of this user.
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
            if json {
                let v: Vec<serde_json::Value> = kept
                    .iter()
                    .map(|k| {
                        serde_json::json!({
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
                println!("{}", serde_json::Value::Array(v));
                return Ok(());
            }
            if kept.is_empty() {
                println!("no kept arenas");
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
                shmckpt::flash::list_kept()
                    .into_iter()
                    .filter(|k| k.owner_uid == uid)
                    .map(|k| k.name)
                    .collect()
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
                    "{refused} name(s) in use left in place (--force removes kept arenas in use)"
                )
                .into());
            }
            Ok(())
        }
    }
}
