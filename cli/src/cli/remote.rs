//! `inspect`, `verify` and `gc` of a bucket root (`s3://bucket/prefix`), through the
//! library's remote tier (credentials and endpoint from the AWS environment variables).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use shmckpt::remote::{Remote, RemoteOptions, is_remote};
use shmckpt_bench::gbps;

use serde_json::json;

use super::tools::{GcArgs, InspectArgs, Verified, VerifyArgs};
use super::{CliResult, NotFound, human, print_json, secs};

/// The URL when `dir` names a bucket root, and a step when it ends in `/step-N`.
pub fn remote_root(dir: &Path) -> Option<(String, Option<u64>)> {
    let s = dir.to_str()?;
    if !is_remote(s) {
        return None;
    }
    let s = s.trim_end_matches('/');
    if let Some((base, last)) = s.rsplit_once('/')
        && let Some(step) = shmckpt::manifest::parse_step_dir(last)
        && base.len() > "s3://".len()
    {
        return Some((base.to_owned(), Some(step)));
    }
    Some((s.to_owned(), None))
}

fn open(url: &str) -> Result<Remote, shmckpt::Error> {
    Remote::open(url, RemoteOptions::default())
}

pub fn inspect(url: &str, step: Option<u64>, a: &InspectArgs) -> CliResult {
    let r = open(url)?;
    if let Some(step) = step {
        let m = r.manifest(step)?;
        return super::tools::show_manifest(&format!("{url}/step-{step}"), &m, a);
    }
    let steps = r.list()?;
    // Uploads in progress, or left open by a stopped process (`gc` aborts those).
    let uploads = r.open_uploads()?;
    let rows: Vec<_> = steps
        .iter()
        .map(|&s| (s, format!("{url}/step-{s}"), r.manifest(s)))
        .collect();
    if a.json {
        return print_json(&json!({
            "root": url,
            "checkpoints": rows.iter().map(|(s, at, m)| super::tools::step_row_json(*s, at, m)).collect::<Vec<_>>(),
            "open_uploads": uploads.iter().map(|u| json!({
                "step": u.step,
                "rank": u.rank,
                "session": u.session,
                "age_seconds": u.age.as_secs_f64(),
            })).collect::<Vec<_>>(),
        }));
    }
    for u in &uploads {
        println!(
            "open upload: step {} rank {}{}, journaled {} ago",
            u.step,
            u.rank,
            u.session
                .as_deref()
                .map(|s| format!(" (session {s})"))
                .unwrap_or_default(),
            secs(u.age)
        );
    }
    super::tools::print_steps(url, &rows, "prefix");
    Ok(())
}

pub fn verify(url: &str, step: Option<u64>, a: &VerifyArgs) -> CliResult {
    if a.replicas {
        return Err(format!(
            "{url}: --replicas compares local checkpoints only (verify a bucket without it)"
        )
        .into());
    }
    let r = open(url)?;
    let steps: Vec<u64> =
        match (step.or(a.step), a.all) {
            (Some(s), _) => vec![s],
            (None, true) => r.list()?,
            (None, false) => {
                vec![r.latest()?.ok_or_else(|| {
                    NotFound(format!("no committed checkpoint (latest) in {url}"))
                })?]
            }
        };
    let pb = super::progress(steps.len() as u64, "verify");
    pb.enable_steady_tick(Duration::from_millis(200));
    let mut results = Vec::new();
    for s in &steps {
        pb.set_message(format!("step-{s}"));
        let t = Instant::now();
        // The size is the manifest's total (as `inspect` shows it).
        let outcome = r
            .manifest(*s)
            .and_then(|m| r.verify(*s).map(|_| m.total_bytes))
            .map_err(|e| e.to_string());
        let v = Verified {
            at: format!("{url}/step-{s}"),
            outcome,
            took: t.elapsed(),
            replicas: None,
        };
        if !a.json {
            pb.suspend(|| println!("{}", super::tools::verified_line(&v)));
        }
        results.push(v);
        pb.inc(1);
    }
    pb.finish_and_clear();
    super::tools::report_verified(&results, a.json)
}

pub fn gc(url: &str, a: &GcArgs) -> CliResult {
    if a.keep == 0 {
        return Err("--keep must be at least 1".into());
    }
    let r = open(url)?;
    let pb = super::spinner("gc");
    // The one gc (a directory's too): sweep what interrupted uploads left, then retention.
    let res = shmckpt::commit::store::gc(&r, &Duration::from_secs(a.min_age), a.keep);
    pb.finish_and_clear();
    let (rep, removed) = res?;
    if a.json {
        return print_json(&json!({
            "root": url,
            "removed_uncommitted_steps": rep.uncommitted_steps,
            "removed_objects": rep.objects,
            "removed_bytes": rep.bytes,
            "aborted_uploads": rep.aborted_uploads,
            "min_age_seconds": a.min_age,
            "removed_steps": removed,
            "kept": a.keep,
        }));
    }
    for s in &rep.uncommitted_steps {
        println!("removed uncommitted {url}/step-{s}");
    }
    for o in &rep.stray_objects {
        println!("removed {o}: not named by its committed step");
    }
    for (what, why) in &rep.ignored {
        println!("left {what}: {why}");
    }
    println!(
        "removed {} object(s), {} of uncommitted steps (older than {} s)",
        rep.objects,
        human(rep.bytes),
        a.min_age
    );
    println!(
        "removed {} checkpoint(s) {:?}; kept the newest {}",
        removed.len(),
        removed,
        a.keep
    );
    println!(
        "aborted {} multipart upload(s) left open by a stopped process (journal older than {} s)",
        rep.aborted_uploads, a.min_age
    );
    Ok(())
}

/// Arguments of `push`.
#[derive(Debug, clap::Args)]
pub struct PushArgs {
    /// A committed local checkpoint (`ROOT/step-N`): every rank's file is uploaded.
    pub dir: PathBuf,
    /// The bucket root (`s3://bucket/prefix`); the step is committed there as
    /// `prefix/step-N` (refused if it is committed there already).
    pub url: String,
    /// Session recorded in the manifest parts (default none).
    #[arg(long)]
    pub session: Option<String>,
    /// One JSON document on stdout (what was pushed) instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Upload a committed local checkpoint to a bucket and commit it there, with progress
/// (bytes, total, rate) on stderr when it is a terminal.
pub fn push(a: &PushArgs) -> CliResult {
    let url = match remote_root(Path::new(&a.url)) {
        Some((url, None)) => url,
        _ => {
            return Err(format!(
                "{}: not a bucket root (s3://bucket/prefix)",
                shmckpt::remote::redact(&a.url)
            )
            .into());
        }
    };
    super::require_root(&a.dir)?;
    let m = shmckpt::Manifest::read(&a.dir)?;
    let r = open(&url)?;
    let sent = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let pb = super::progress(m.total_bytes, &format!("step-{}", m.step));
    pb.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg:>12} [{bar:40}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    let ticker = {
        let (sent, done, pb) = (Arc::clone(&sent), Arc::clone(&done), pb.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                pb.set_position(sent.load(Ordering::Relaxed));
                std::thread::sleep(Duration::from_millis(200));
            }
        })
    };
    let t = Instant::now();
    let res = (|| -> CliResult {
        for f in &m.files {
            let path = a.dir.join(&f.file);
            // The manifest names plain files of the step; never follow a link.
            let file = {
                use std::os::unix::fs::OpenOptionsExt;
                std::fs::OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_NOFOLLOW)
                    .open(&path)
                    .map_err(|e| format!("{}: {e}", path.display()))?
            };
            r.upload_rank_counted(m.step, &file, f, a.session.as_deref(), &sent)?;
        }
        Ok(())
    })();
    done.store(true, Ordering::Relaxed);
    let _ = ticker.join();
    pb.finish_and_clear();
    res?;
    let took = t.elapsed();
    match r.try_commit(m.step, m.world_size, &m.metadata, a.session.as_deref())? {
        Some(_) if a.json => print_json(&json!({
            "dir": a.dir.display().to_string(),
            "at": format!("{url}/step-{}", m.step),
            "step": m.step,
            "bytes": m.total_bytes,
            "seconds": took.as_secs_f64(),
        }))?,
        Some(_) => println!(
            "pushed {} to {url}/step-{}: {} in {} ({:.2} GB/s)",
            a.dir.display(),
            m.step,
            human(m.total_bytes),
            secs(took),
            gbps(m.total_bytes, took)
        ),
        None => {
            return Err(format!(
                "{url}/step-{}: uploaded, but a rank's object is missing: not committed",
                m.step
            )
            .into());
        }
    }
    Ok(())
}
