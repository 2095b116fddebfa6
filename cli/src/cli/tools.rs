//! `inspect`, `verify`, `gc`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use shmckpt::bench::gbps;
use shmckpt::manifest::{self, MANIFEST, Manifest};
use shmckpt::restore::{self, ReadOptions};

use super::{CliResult, human, secs};

/// Arguments of `inspect`.
#[derive(Debug, clap::Args)]
pub struct InspectArgs {
    /// A checkpoint root or one checkpoint directory; or a bucket root
    /// (`s3://bucket/prefix`, or `.../step-N` for one step).
    pub dir: PathBuf,
    /// Tensors to list per file (0 for all).
    #[arg(long, default_value_t = 20)]
    pub tensors: usize,
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
}

/// Whether `dir` is one checkpoint (it has a `manifest.json` entry, of whatever type: a
/// link or FIFO there is then refused by name when the manifest is read, never followed
/// or opened blocking).
fn is_checkpoint(dir: &Path) -> bool {
    std::fs::symlink_metadata(dir.join(MANIFEST)).is_ok()
}

pub fn inspect(a: InspectArgs) -> CliResult {
    if is_checkpoint(&a.dir) {
        return show(&a.dir, a.tensors);
    }
    let all = manifest::list_committed(&a.dir)?;
    if all.is_empty() {
        println!("{}: no committed checkpoints", a.dir.display());
    }
    println!(
        "{:>10} {:>6} {:>9} {:>12}  dir",
        "step", "ranks", "tensors", "bytes"
    );
    for c in &all {
        match Manifest::read(&c.dir) {
            Ok(m) => println!(
                "{:>10} {:>6} {:>9} {:>12}  {}",
                m.step,
                m.world_size,
                m.tensor_count(),
                human(m.total_bytes),
                c.dir.display()
            ),
            Err(e) => println!("{:>10} unreadable manifest: {e}", c.step),
        }
    }
    for e in std::fs::read_dir(&a.dir)?.flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        if n.ends_with(".partial") || n.ends_with(".trash") {
            println!("(not committed: {n})");
        }
    }
    Ok(())
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

fn show(dir: &Path, limit: usize) -> CliResult {
    let m = Manifest::read(dir)?;
    show_manifest(&dir.display().to_string(), &m, limit)
}

/// Print a manifest (`where` names the checkpoint: a directory or a bucket prefix).
pub fn show_manifest(at: &str, m: &Manifest, limit: usize) -> CliResult {
    println!("checkpoint {at} (format {})", m.format_version);
    println!("  step        {}", m.step);
    println!("  world size  {}", m.world_size);
    println!("  total       {}", human(m.total_bytes));
    println!("  created     {}", utc_iso8601(m.created_unix_ms));
    for (k, v) in &m.metadata {
        println!("  meta {k} = {v}");
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

pub fn verify(a: VerifyArgs) -> CliResult {
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
                pick.ok_or_else(|| format!("{}: no committed checkpoint {what}", a.dir.display()))?
                    .dir,
            ]
        }
    };
    let mut failed = 0;
    for d in &dirs {
        let t = Instant::now();
        match restore::verify_dir(d, &ReadOptions::default()) {
            Ok(bytes) => println!(
                "OK   {} ({} in {}, {:.2} GB/s)",
                d.display(),
                human(bytes),
                secs(t.elapsed()),
                gbps(bytes, t.elapsed())
            ),
            Err(e) => {
                failed += 1;
                println!("FAIL {}: {e}", d.display());
            }
        }
    }
    if failed > 0 {
        return Err(format!("{failed} of {} checkpoints failed verification", dirs.len()).into());
    }
    Ok(())
}

pub fn gc(a: GcArgs) -> CliResult {
    if a.keep == 0 {
        return Err("--keep must be at least 1".into());
    }
    let stale = shmckpt::commit::clean_stale_with(&a.dir, u32::MAX, shmckpt::commit::Sweep::Gc)?;
    for s in &stale {
        println!("removed stale {}", s.display());
    }
    let removed = shmckpt::commit::apply_retention(&a.dir, a.keep)?;
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
