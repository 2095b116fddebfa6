//! Subcommands.

pub mod bench;
pub mod demo;
pub mod engine_args;
pub mod export;
pub mod guard;
pub mod ipc_writer;
pub mod recover;
pub mod remote;
pub mod shm;
pub mod tools;

use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

/// Parse a human size: `4GiB`, `512 MiB`, `1.5GB`, `4096`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    s.trim()
        .parse::<bytesize::ByteSize>()
        .map(|b| b.as_u64())
        .map_err(|e| format!("invalid size {s:?}: {e}"))
}

/// `1.00 GiB` style.
pub fn human(bytes: u64) -> String {
    bytesize::ByteSize(bytes).display().iec().to_string()
}

/// Seconds with 3 decimals.
pub fn secs(d: Duration) -> String {
    format!("{:.3} s", d.as_secs_f64())
}

/// A progress bar on stderr when it is a terminal, hidden otherwise.
pub fn progress(len: u64, msg: &str) -> ProgressBar {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template("{msg:>12} [{bar:40}] {pos}/{len} {elapsed}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    pb.set_message(msg.to_owned());
    pb
}

/// Error type of the CLI: a message.
pub type CliResult = Result<(), Box<dyn std::error::Error>>;
