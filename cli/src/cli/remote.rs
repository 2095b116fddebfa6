//! `inspect`, `verify` and `gc` of a bucket root (`s3://bucket/prefix`), through the
//! library's remote tier (credentials and endpoint from the AWS environment variables).

use std::path::Path;
use std::time::{Duration, Instant};

use shmckpt::bench::gbps;
use shmckpt::remote::{Remote, RemoteOptions, is_remote};

use super::tools::{GcArgs, InspectArgs, VerifyArgs};
use super::{CliResult, human, secs};

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
        return super::tools::show_manifest(&format!("{url}/step-{step}"), &m, a.tensors);
    }
    let steps = r.list()?;
    if steps.is_empty() {
        println!("{url}: no committed checkpoints");
    }
    println!(
        "{:>10} {:>6} {:>9} {:>12}  prefix",
        "step", "ranks", "tensors", "bytes"
    );
    for s in steps {
        match r.manifest(s) {
            Ok(m) => println!(
                "{:>10} {:>6} {:>9} {:>12}  {url}/step-{s}",
                m.step,
                m.world_size,
                m.tensor_count(),
                human(m.total_bytes),
            ),
            Err(e) => println!("{s:>10} unreadable manifest: {e}"),
        }
    }
    Ok(())
}

pub fn verify(url: &str, step: Option<u64>, a: &VerifyArgs) -> CliResult {
    let r = open(url)?;
    let steps: Vec<u64> = match (step.or(a.step), a.all) {
        (Some(s), _) => vec![s],
        (None, true) => r.list()?,
        (None, false) => {
            vec![
                r.latest()?
                    .ok_or_else(|| format!("{url}: no committed checkpoint (latest)"))?,
            ]
        }
    };
    let mut failed = 0;
    for s in &steps {
        let t = Instant::now();
        match r.verify(*s) {
            Ok(bytes) => println!(
                "OK   {url}/step-{s} ({} in {}, {:.2} GB/s)",
                human(bytes),
                secs(t.elapsed()),
                gbps(bytes, t.elapsed())
            ),
            Err(e) => {
                failed += 1;
                println!("FAIL {url}/step-{s}: {e}");
            }
        }
    }
    if failed > 0 {
        return Err(format!(
            "{failed} of {} checkpoints failed verification",
            steps.len()
        )
        .into());
    }
    Ok(())
}

pub fn gc(url: &str, a: &GcArgs) -> CliResult {
    if a.keep == 0 {
        return Err("--keep must be at least 1".into());
    }
    let r = open(url)?;
    let rep = r.gc(Duration::from_secs(a.min_age))?;
    for s in &rep.uncommitted_steps {
        println!("removed uncommitted {url}/step-{s}");
    }
    println!(
        "removed {} object(s), {} of uncommitted steps (older than {} s)",
        rep.objects,
        human(rep.bytes),
        a.min_age
    );
    let removed = r.apply_retention(a.keep)?;
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
