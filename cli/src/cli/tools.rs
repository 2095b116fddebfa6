//! `inspect`, `verify`, `gc`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::{Value, json};
use shmckpt::divergence::{self, ReplicaReport};
use shmckpt::manifest::{self, MANIFEST, Manifest};
use shmckpt::restore::{self, ReadOptions};
use shmckpt_bench::gbps;

use super::{CliResult, NotFound, human, print_json, require_root, secs};

/// Metadata values longer than this are shown truncated by `inspect` (with their length)
/// unless `--full` is given; `--json` always carries them whole.
pub const META_SHOWN_CHARS: usize = 200;

/// Arguments of `inspect`.
#[derive(Debug, clap::Args)]
pub struct InspectArgs {
    /// A checkpoint root or one checkpoint directory; or a bucket root
    /// (`s3://bucket/prefix`, or `.../step-N` for one step).
    pub dir: PathBuf,
    /// Tensors to list per file (0 for all).
    #[arg(long, default_value_t = 20)]
    pub tensors: usize,
    /// Show metadata values whole (by default a value longer than 200 characters, such as
    /// the Python package's state skeleton, is cut to 200 with its length).
    #[arg(long)]
    pub full: bool,
    /// One JSON document on stdout (the whole manifest of a checkpoint; the steps of a
    /// root) instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `verify`.
#[derive(Debug, clap::Args)]
pub struct VerifyArgs {
    /// A checkpoint root or one checkpoint directory; or a bucket root
    /// (`s3://bucket/prefix`, or `.../step-N` for one step).
    pub dir: PathBuf,
    /// Step to verify when DIR is a root (default: the latest).
    #[arg(long)]
    pub step: Option<u64>,
    /// Verify every committed checkpoint of the root.
    #[arg(long, conflicts_with = "step")]
    pub all: bool,
    /// Also compare data-parallel replicas: every tensor that several rank files hold
    /// under the same name, dtype and shape (and DCP offsets) must have the same CRC-32C
    /// in each; a divergence (which ranks hold which CRC) fails the checkpoint (exit 1).
    /// Local checkpoints only.
    #[arg(long)]
    pub replicas: bool,
    /// One JSON document on stdout (each checkpoint's outcome) instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `gc`.
#[derive(Debug, clap::Args)]
pub struct GcArgs {
    /// A checkpoint root, or a bucket root (`s3://bucket/prefix`).
    pub dir: PathBuf,
    /// Committed checkpoints to keep (newest first).
    #[arg(long)]
    pub keep: usize,
    /// Bucket roots only: remove uncommitted steps (no manifest) whose newest object is at
    /// least this many seconds old (younger ones may be uploads in progress).
    #[arg(long, default_value_t = 3600)]
    pub min_age: u64,
    /// One JSON document on stdout (what was removed) instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Whether `dir` is one checkpoint (it has a `manifest.json` entry, of whatever type: a
/// link or FIFO there is then refused by name when the manifest is read, never followed
/// or opened blocking).
fn is_checkpoint(dir: &Path) -> bool {
    std::fs::symlink_metadata(dir.join(MANIFEST)).is_ok()
}

pub fn inspect(a: InspectArgs) -> CliResult {
    require_root(&a.dir)?;
    if is_checkpoint(&a.dir) {
        let m = Manifest::read(&a.dir)?;
        return show_manifest(&a.dir.display().to_string(), &m, &a);
    }
    let all = manifest::list_committed(&a.dir)?;
    let rows: Vec<(u64, String, Result<Manifest, shmckpt::Error>)> = all
        .iter()
        .map(|c| (c.step, c.dir.display().to_string(), Manifest::read(&c.dir)))
        .collect();
    let mut uncommitted = Vec::new();
    for e in std::fs::read_dir(&a.dir)?.flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        if n.ends_with(".partial") || n.ends_with(".trash") {
            uncommitted.push(n);
        }
    }
    uncommitted.sort();
    if a.json {
        return print_json(&json!({
            "root": a.dir.display().to_string(),
            "checkpoints": rows.iter().map(|(s, at, m)| step_row_json(*s, at, m)).collect::<Vec<_>>(),
            "uncommitted": uncommitted,
        }));
    }
    print_steps(&a.dir.display().to_string(), &rows, "dir");
    for n in &uncommitted {
        println!("(not committed: {n})");
    }
    Ok(())
}

/// One row of a root's listing as JSON.
pub fn step_row_json(step: u64, at: &str, m: &Result<Manifest, shmckpt::Error>) -> Value {
    match m {
        Ok(m) => json!({
            "step": m.step,
            "at": at,
            "world_size": m.world_size,
            "tensors": m.tensor_count(),
            "bytes": m.total_bytes,
        }),
        Err(e) => json!({ "step": step, "at": at, "error": e.to_string() }),
    }
}

/// A root's listing as text (`rows`: step, where, its manifest).
pub fn print_steps(
    root: &str,
    rows: &[(u64, String, Result<Manifest, shmckpt::Error>)],
    col: &str,
) {
    if rows.is_empty() {
        println!("{root}: no committed checkpoints");
        return;
    }
    println!(
        "{:>10} {:>6} {:>9} {:>12}  {col}",
        "step", "ranks", "tensors", "bytes"
    );
    for (step, at, m) in rows {
        match m {
            Ok(m) => println!(
                "{:>10} {:>6} {:>9} {:>12}  {at}",
                m.step,
                m.world_size,
                m.tensor_count(),
                human(m.total_bytes),
            ),
            Err(e) => println!("{step:>10} unreadable manifest: {e}"),
        }
    }
}

/// `v` as shown by `inspect` without `--full`: at most [`META_SHOWN_CHARS`] characters, and
/// when cut, its length.
pub fn shown_value(v: &str, full: bool) -> String {
    let n = v.chars().count();
    if full || n <= META_SHOWN_CHARS {
        return v.to_owned();
    }
    let head: String = v.chars().take(META_SHOWN_CHARS).collect();
    format!("{head}... ({n} chars; --full or --json shows all)")
}

/// `ms` milliseconds since the Unix epoch as a UTC ISO-8601 date and time with
/// milliseconds (`2026-12-01T15:41:58.307Z`), for every `u64`.
fn utc_iso8601(ms: u64) -> String {
    let (secs, milli) = (ms / 1000, ms % 1000);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, mo, d) = civil_from_days(days);
    format!(
        "{y:04}-{mo:02}-{d:02}T{:02}:{:02}:{:02}.{milli:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// The proleptic Gregorian (year, month, day) of `days` after 1970-01-01 (H. Hinnant's
/// `civil_from_days`, for non-negative days; in u64, so no overflow for any input).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + u64::from(m <= 2);
    (y, m, d)
}

/// Print a manifest (`at` names the checkpoint: a directory or a bucket prefix), or with
/// `--json` the whole manifest.
pub fn show_manifest(at: &str, m: &Manifest, a: &InspectArgs) -> CliResult {
    if a.json {
        return print_json(&json!({ "at": at, "manifest": m }));
    }
    let limit = a.tensors;
    println!("checkpoint {at} (format {})", m.format_version);
    println!("  step        {}", m.step);
    println!("  world size  {}", m.world_size);
    println!("  total       {}", human(m.total_bytes));
    println!("  created     {}", utc_iso8601(m.created_unix_ms));
    for (k, v) in &m.metadata {
        println!("  meta {k} = {}", shown_value(v, a.full));
    }
    for f in &m.files {
        println!(
            "  rank {} file {} ({}, {} tensors, data at {})",
            f.rank,
            f.file,
            human(f.bytes),
            f.tensors.len(),
            f.data_start
        );
        let n = if limit == 0 {
            f.tensors.len()
        } else {
            limit.min(f.tensors.len())
        };
        for t in &f.tensors[..n] {
            println!(
                "    {:<40} {:>11} {:<18} {:>12} crc32c {:08x}",
                t.name,
                t.dtype.as_str(),
                format!("{:?}", t.shape),
                human(t.len()),
                t.crc32c
            );
        }
        if n < f.tensors.len() {
            println!("    ... {} more", f.tensors.len() - n);
        }
    }
    Ok(())
}

/// The outcome of verifying one checkpoint, as `verify` prints it (text or JSON). `bytes`
/// is the checkpoint's size as `inspect` shows it (every rank's file: the manifest's
/// total), so both commands report the same size of one step.
pub struct Verified {
    /// The checkpoint (directory or bucket prefix).
    pub at: String,
    /// Its size, or why it failed.
    pub outcome: Result<u64, String>,
    /// Time taken.
    pub took: std::time::Duration,
    /// With `--replicas`: the replica comparison (or why it could not be made).
    pub replicas: Option<Result<ReplicaReport, String>>,
}

/// Print the outcomes (text, or one JSON document) and fail when any failed.
pub fn report_verified(results: &[Verified], json_out: bool) -> CliResult {
    let failed = results.iter().filter(|v| v.outcome.is_err()).count();
    if json_out {
        print_json(&json!({
            "checkpoints": results.iter().map(|v| {
                let mut o = match &v.outcome {
                    Ok(b) => json!({"at": v.at, "ok": true, "bytes": b, "seconds": v.took.as_secs_f64()}),
                    Err(e) => json!({"at": v.at, "ok": false, "error": e, "seconds": v.took.as_secs_f64()}),
                };
                if let Some(r) = &v.replicas {
                    o["replicas"] = replicas_json(r);
                }
                o
            }).collect::<Vec<_>>(),
            "failed": failed,
        }))?;
    }
    if failed > 0 {
        return Err(format!(
            "{failed} of {} checkpoints failed verification",
            results.len()
        )
        .into());
    }
    Ok(())
}

/// The `replicas` object of one checkpoint in `verify --replicas --json`: `step`,
/// `compared` (tensors held alike by several rank files), and `divergent`, one object per
/// diverging tensor (`tensor`, `dtype`, `shape`, `crcs`: rank -> CRC-32C of its copy,
/// `odd`: the ranks whose copy differs from the majority's, every holder without one,
/// `majority`: that CRC or null); or `error` when the comparison could not be made.
pub fn replicas_json(r: &Result<ReplicaReport, String>) -> Value {
    match r {
        Err(e) => json!({"error": e}),
        Ok(r) => json!({
            "step": r.step,
            "compared": r.compared,
            "divergent": r.divergences.iter().map(|d| json!({
                "tensor": d.tensor,
                "dtype": d.dtype.as_str(),
                "shape": d.shape,
                "crcs": d.ranks.iter().zip(&d.crcs)
                    .map(|(r, c)| (r.to_string(), json!(c)))
                    .collect::<serde_json::Map<String, Value>>(),
                "odd": d.odd,
                "majority": d.majority,
            })).collect::<Vec<_>>(),
        }),
    }
}

/// One line per diverging tensor: which ranks hold which CRC-32C.
pub fn divergence_lines(r: &ReplicaReport) -> Vec<String> {
    r.divergences
        .iter()
        .map(|d| {
            let mut by_crc: Vec<(u32, Vec<u32>)> = Vec::new();
            for (&rank, &crc) in d.ranks.iter().zip(&d.crcs) {
                match by_crc.iter_mut().find(|(c, _)| *c == crc) {
                    Some((_, rs)) => rs.push(rank),
                    None => by_crc.push((crc, vec![rank])),
                }
            }
            let held = by_crc
                .iter()
                .map(|(c, rs)| format!("rank(s) {rs:?} hold {c:#010x}"))
                .collect::<Vec<_>>()
                .join(", ");
            format!(
                "     step {} tensor {:?} ({} {:?}): {held}; differs on rank(s) {:?}",
                r.step,
                d.tensor,
                d.dtype.as_str(),
                d.shape,
                d.odd
            )
        })
        .collect()
}

/// The text line of one outcome.
pub fn verified_line(v: &Verified) -> String {
    let mut line = match &v.outcome {
        Ok(bytes) => format!(
            "OK   {} ({} in {}, {:.2} GB/s)",
            v.at,
            human(*bytes),
            secs(v.took),
            gbps(*bytes, v.took)
        ),
        Err(e) => format!("FAIL {}: {e}", v.at),
    };
    if let Some(Ok(r)) = &v.replicas {
        if r.divergences.is_empty() {
            line.push_str(&format!(
                "; replicas agree ({} tensors compared)",
                r.compared
            ));
        }
        for l in divergence_lines(r) {
            line.push('\n');
            line.push_str(&l);
        }
    }
    line
}

pub fn verify(a: VerifyArgs) -> CliResult {
    require_root(&a.dir)?;
    let dirs: Vec<PathBuf> = if is_checkpoint(&a.dir) {
        vec![a.dir.clone()]
    } else {
        let all = manifest::list_committed(&a.dir)?;
        if a.all {
            all.into_iter().map(|c| c.dir).collect()
        } else {
            let pick = match a.step {
                Some(s) => all.into_iter().find(|c| c.step == s),
                None => all.into_iter().last(),
            };
            let what = a
                .step
                .map_or("(latest)".to_owned(), |s| format!("step {s}"));
            vec![
                pick.ok_or_else(|| {
                    NotFound(format!(
                        "no committed checkpoint {what} in {}",
                        a.dir.display()
                    ))
                })?
                .dir,
            ]
        }
    };
    let pb = super::progress(dirs.len() as u64, "verify");
    pb.enable_steady_tick(std::time::Duration::from_millis(200));
    let mut results = Vec::new();
    for d in &dirs {
        pb.set_message(
            d.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
        );
        let t = Instant::now();
        // The size reported is the checkpoint's (its manifest's total, as `inspect` shows);
        // verify_dir reads the manifest again and checks every file against it.
        let mut outcome = Manifest::read(d)
            .and_then(|m| restore::verify_dir(d, &ReadOptions::default()).map(|_| m.total_bytes))
            .map_err(|e| e.to_string());
        let mut replicas = None;
        if a.replicas {
            let r = divergence::check_checkpoint(d).map_err(|e| e.to_string());
            match &r {
                Ok(rep) if !rep.divergences.is_empty() && outcome.is_ok() => {
                    let names: Vec<&str> =
                        rep.divergences.iter().map(|d| d.tensor.as_str()).collect();
                    outcome = Err(format!(
                        "replicas diverge in step {}: {} of {} replicated tensors differ ({})",
                        rep.step,
                        names.len(),
                        rep.compared,
                        names
                            .iter()
                            .take(8)
                            .map(|n| format!("{n:?}"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ));
                }
                Err(e) if outcome.is_ok() => {
                    outcome = Err(format!("replica comparison failed: {e}"));
                }
                _ => {}
            }
            replicas = Some(r);
        }
        let v = Verified {
            at: d.display().to_string(),
            outcome,
            took: t.elapsed(),
            replicas,
        };
        if !a.json {
            pb.suspend(|| println!("{}", verified_line(&v)));
        }
        results.push(v);
        pb.inc(1);
    }
    pb.finish_and_clear();
    report_verified(&results, a.json)
}

pub fn gc(a: GcArgs) -> CliResult {
    if a.keep == 0 {
        return Err("--keep must be at least 1".into());
    }
    require_root(&a.dir)?;
    let pb = super::spinner("gc");
    // The one gc (the bucket's too): sweep what interrupted saves left, then retention.
    let res = shmckpt::commit::store::gc(
        &shmckpt::commit::LocalDir::new(&a.dir),
        &(u32::MAX, shmckpt::commit::Sweep::Gc),
        a.keep,
    );
    pb.finish_and_clear();
    let (stale, removed) = res?;
    if a.json {
        return print_json(&json!({
            "root": a.dir.display().to_string(),
            "removed_stale": stale.iter().map(|s| s.display().to_string()).collect::<Vec<_>>(),
            "removed_steps": removed,
            "kept": a.keep,
        }));
    }
    for s in &stale {
        println!("removed stale {}", s.display());
    }
    println!(
        "removed {} checkpoint(s) {:?}; kept the newest {}",
        removed.len(),
        removed,
        a.keep
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::utc_iso8601;

    #[test]
    fn creation_time_prints_as_a_utc_date() {
        assert_eq!(utc_iso8601(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(utc_iso8601(1_796_139_718_307), "2026-12-01T15:41:58.307Z");
        // Leap days, the end of a century year that is not a leap year, and 2000's.
        assert_eq!(utc_iso8601(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(utc_iso8601(4_107_542_399_999), "2100-02-28T23:59:59.999Z");
        assert_eq!(utc_iso8601(4_107_542_400_000), "2100-03-01T00:00:00.000Z");
        // Any u64 from a manifest formats without overflow.
        assert_eq!(utc_iso8601(u64::MAX), "584556019-04-03T14:25:51.615Z");
    }
}
