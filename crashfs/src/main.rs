//! `crashfs MOUNTPOINT IMAGE_DIR [--cut-at N]`: serve the tree at IMAGE_DIR (all of it
//! durable) at MOUNTPOINT, for tests in other processes (python/tests/test_crashfs.py).
//!
//! Prints `mounted` once the mount is up. With `--cut-at N` the power goes off at the
//! N-th mutating request (0: the first). Reads commands on stdin, one a line:
//! `cut` cuts the power now; `stop` (or the end of stdin) unmounts and replaces the
//! contents of IMAGE_DIR with what survives: after a cut, only what was durable; without
//! one, everything (a clean unmount). Then prints `mutations M cut true|false` and exits.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mountpoint, image_dir, cut_at) = match args.as_slice() {
        [m, i] => (PathBuf::from(m), PathBuf::from(i), None),
        [m, i, flag, n] if flag == "--cut-at" => match n.parse::<u64>() {
            Ok(n) => (PathBuf::from(m), PathBuf::from(i), Some(n)),
            Err(e) => return usage(&format!("--cut-at {n}: {e}")),
        },
        _ => return usage("wrong arguments"),
    };
    match run(&mountpoint, &image_dir, cut_at) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("crashfs: {e}");
            ExitCode::FAILURE
        }
    }
}

fn usage(why: &str) -> ExitCode {
    eprintln!("crashfs: {why}\nusage: crashfs MOUNTPOINT IMAGE_DIR [--cut-at N]");
    ExitCode::from(2)
}

fn run(
    mountpoint: &std::path::Path,
    image_dir: &std::path::Path,
    cut_at: Option<u64>,
) -> std::io::Result<()> {
    let image = crashfs::Image::from_dir(image_dir)?;
    let mounted = crashfs::Mounted::mount(image, mountpoint)?;
    if let Some(n) = cut_at {
        mounted.power().cut_at_mutation(n);
    }
    println!("mounted");
    std::io::stdout().flush()?;
    for line in std::io::stdin().lock().lines() {
        match line?.trim() {
            "cut" => mounted.power().cut(),
            "stop" => break,
            other => eprintln!("crashfs: unknown command {other:?}"),
        }
    }
    let power = mounted.power().clone();
    let cut = power.is_cut();
    let image = if cut {
        mounted.crash()
    } else {
        mounted.unmount()
    };
    for e in std::fs::read_dir(image_dir)? {
        let p = e?.path();
        if p.is_dir() {
            std::fs::remove_dir_all(&p)?;
        } else {
            std::fs::remove_file(&p)?;
        }
    }
    image.write_to(image_dir)?;
    println!("mutations {} cut {cut}", power.mutations());
    std::io::stdout().flush()
}
