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

/// The command line's one size convention: bytes below 1 KiB as `N B`, larger sizes in
/// binary units with one decimal (`55.9 KiB`, `1.0 GiB`). Every size it prints goes
/// through here.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64 / 1024.0;
    let mut unit = 0;
    // Round first, so 1023.96 KiB prints as 1.0 MiB rather than 1024.0 KiB.
    while (v * 10.0).round() / 10.0 >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
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

/// A spinner on stderr with `msg` and the elapsed time, ticking by itself, when stderr is
/// a terminal; hidden otherwise (nothing written when piped or redirected).
pub fn spinner(msg: &str) -> ProgressBar {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new_spinner();
    pb.set_style(
        ProgressStyle::with_template("{spinner} {msg} {elapsed}").expect("valid template"),
    );
    pb.set_message(msg.to_owned());
    pb.enable_steady_tick(Duration::from_millis(120));
    pb
}

/// Print `v` as the command's one JSON document on stdout (`--json`).
pub fn print_json(v: &serde_json::Value) -> CliResult {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

/// Error type of the CLI: a message.
pub type CliResult = Result<(), Box<dyn std::error::Error>>;

/// Exit status of success.
pub const EXIT_OK: u8 = 0;
/// Exit status of a failure: an error, a checkpoint that failed verification, an arena not
/// fully recovered.
pub const EXIT_FAILURE: u8 = 1;
/// Exit status when the root, checkpoint or step named does not exist.
pub const EXIT_NOT_FOUND: u8 = 3;

/// The exit statuses, for `--help`.
pub const EXIT_CODES_HELP: &str = "Exit status: 0 success; 1 failure (an error, a checkpoint \
that failed verification, an arena not fully recovered); 2 invalid command line; 3 the \
root, checkpoint or step named does not exist.";

/// A root, checkpoint or step that does not exist: one sentence, exit status
/// [`EXIT_NOT_FOUND`].
#[derive(Debug)]
pub struct NotFound(pub String);

impl std::fmt::Display for NotFound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NotFound {}

/// An I/O error's reason without Rust's ` (os error N)` suffix.
pub fn io_reason(e: &std::io::Error) -> String {
    let s = e.to_string();
    match s.rfind(" (os error ") {
        Some(i) if s.ends_with(')') => s[..i].to_owned(),
        _ => s,
    }
}

/// `Ok` when `dir` exists (as anything: what it is is checked by the command), else the
/// one-sentence [`NotFound`] error naming it.
pub fn require_root(dir: &std::path::Path) -> CliResult {
    match std::fs::symlink_metadata(dir) {
        Ok(_) => Ok(()),
        Err(e) => Err(Box::new(NotFound(format!(
            "no checkpoint root at {} ({})",
            dir.display(),
            io_reason(&e)
        )))),
    }
}

#[cfg(test)]
mod tests {
    use super::human;

    #[test]
    fn sizes_print_in_binary_units_with_one_decimal() {
        assert_eq!(human(0), "0 B");
        assert_eq!(human(1023), "1023 B");
        assert_eq!(human(1024), "1.0 KiB");
        assert_eq!(human(57_242), "55.9 KiB");
        assert_eq!(human(1024 * 1024 - 1), "1.0 MiB");
        assert_eq!(human(3 << 30), "3.0 GiB");
        assert_eq!(human(u64::MAX), "16.0 EiB");
    }
}
