//! The `shmckpt` command line: demo, bench, inspect, verify, gc, export, recover.
#![deny(unsafe_code)]

mod cli;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// shmckpt: checkpoints without stalling the trainer.
#[derive(Debug, Parser)]
#[command(name = "shmckpt", version, about, long_about = None, after_help = cli::EXIT_CODES_HELP)]
struct Cli {
    /// More logging (-v info, -vv debug). RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Save a built-in ~1 GiB model state three times, load the latest back, verify it,
    /// and print the timings.
    Demo(cli::demo::DemoArgs),
    /// Benchmark saves of a synthetic state against a raw O_DIRECT write of the same bytes.
    Bench(cli::bench::BenchArgs),
    /// Show the checkpoints of a root, or one checkpoint's manifest.
    Inspect(cli::tools::InspectArgs),
    /// Verify a checkpoint: header against manifest, sizes and every CRC-32C; with
    /// --replicas, also that the rank files' copies of each replicated tensor agree.
    Verify(cli::tools::VerifyArgs),
    /// Delete all but the newest N committed checkpoints and stale partial directories.
    Gc(cli::tools::GcArgs),
    /// Write a checkpoint's model as Hugging Face safetensors shards plus
    /// model.safetensors.index.json (docs/export.md).
    Export(cli::export::ExportArgs),
    /// Upload a committed local checkpoint to a bucket (s3://bucket/prefix) and commit it
    /// there; progress on stderr when it is a terminal.
    Push(cli::remote::PushArgs),
    /// Commit what a crashed trainer had fully staged in shared memory, or list the
    /// staging arenas in /dev/shm (--list, changes nothing).
    Recover(cli::recover::RecoverArgs),
    /// List or remove the arenas flash restore keeps in /dev/shm.
    Shm(cli::shm::ShmArgs),
    /// The writer process of the CUDA IPC baseline (spawned by the trainer; not for
    /// direct use).
    #[command(name = "ipc-writer", hide = true)]
    IpcWriter(cli::ipc_writer::IpcWriterArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // `recover` and `gc` print every event of their run from the report the library
    // returns; the library also logs those events (a trainer's recovery on open has no
    // other voice), so at the default level the CLI keeps only its errors: each event is
    // printed once. `-v` shows the library's log again.
    let reports_events = matches!(cli.cmd, Cmd::Recover(_) | Cmd::Gc(_));
    let default = match cli.verbose {
        0 if reports_events => "error",
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let res = match cli.cmd {
        Cmd::Demo(a) => cli::demo::run(a),
        Cmd::Bench(a) => cli::bench::run(a),
        // A root `s3://bucket/prefix[/step-N]` is a bucket (cli/remote.rs).
        Cmd::Inspect(a) => match cli::remote::remote_root(&a.dir) {
            Some((url, step)) => cli::remote::inspect(&url, step, &a),
            None => cli::tools::inspect(a),
        },
        Cmd::Verify(a) => match cli::remote::remote_root(&a.dir) {
            Some((url, step)) => cli::remote::verify(&url, step, &a),
            None => cli::tools::verify(a),
        },
        Cmd::Gc(a) => match cli::remote::remote_root(&a.dir) {
            Some((url, _)) => cli::remote::gc(&url, &a),
            None => cli::tools::gc(a),
        },
        Cmd::Export(a) => cli::export::run(a),
        Cmd::Push(a) => cli::remote::push(&a),
        Cmd::Recover(a) => cli::recover::run(a),
        Cmd::Shm(a) => cli::shm::run(a),
        Cmd::IpcWriter(a) => cli::ipc_writer::run(a),
    };
    match res {
        Ok(()) => ExitCode::from(cli::EXIT_OK),
        Err(e) => {
            eprintln!("shmckpt: {e}");
            if e.downcast_ref::<cli::NotFound>().is_some() {
                ExitCode::from(cli::EXIT_NOT_FOUND)
            } else {
                ExitCode::from(cli::EXIT_FAILURE)
            }
        }
    }
}
