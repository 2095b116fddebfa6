//! `shmckpt shm list|rm`: the arenas flash restore keeps in `/dev/shm`
//! (`EngineConfig::with_keep_in_memory`).

use super::{CliResult, human};

/// What to do with kept arenas.
#[derive(Debug, clap::Subcommand)]
pub enum ShmCmd {
    /// List kept arenas: name, size, owner uid, root, rank and kept step.
    List {
        /// Print a JSON array.
        #[arg(long)]
        json: bool,
    },
    /// Remove kept arenas (only this user's, never following a link).
    Rm {
        /// Names to remove (as `list` shows them).
        names: Vec<String>,
        /// Remove every kept arena of this user.
        #[arg(long, conflicts_with = "names")]
        all: bool,
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
                    "{}  {}  uid {}  root {}  rank {}  step {}",
                    k.name,
                    human(k.bytes),
                    k.owner_uid,
                    root,
                    rank,
                    step
                );
                match &k.problem {
                    Some(p) => println!("  ({p})"),
                    None => println!(),
                }
            }
            Ok(())
        }
        ShmCmd::Rm { names, all } => {
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
            for n in &names {
                shmckpt::flash::remove_kept(n)?;
                println!("removed {n}");
            }
            Ok(())
        }
    }
}
