//! `export`: a checkpoint as Hugging Face safetensors shards plus their index.

use std::path::PathBuf;

use shmckpt::export::{self, ExportOptions, Rename};

use super::{CliResult, human};

/// Arguments of `export`.
#[derive(Debug, clap::Args)]
pub struct ExportArgs {
    /// A checkpoint root (its latest step), a step-N directory, a DCP checkpoint
    /// written by ShmckptWriter, s3://bucket/prefix (its latest committed step) or
    /// s3://bucket/prefix/step-N, or memory:ROOT (the images flash restore keeps in
    /// /dev/shm for ROOT's latest committed step, readable while training runs).
    pub src: PathBuf,
    /// Output directory (created; written whole or not at all).
    pub out: PathBuf,
    /// Largest shard: bytes, or 5GB / 500MB (powers of 10), 5GiB (powers of 2).
    #[arg(long, default_value = "5GB", value_name = "SIZE")]
    pub max_shard_size: String,
    /// Remove this prefix from every name that has it (after the default selection).
    /// Repeatable; rules apply in the order given, --strip-prefix before --map.
    #[arg(long, value_name = "P")]
    pub strip_prefix: Vec<String>,
    /// Replace the prefix OLD of a name by NEW. Repeatable.
    #[arg(long = "map", value_name = "OLD=NEW")]
    pub map: Vec<String>,
    /// Cast floating tensors: bf16, fp16 (from fp32) or fp32 (from bf16).
    #[arg(long, value_name = "DTYPE")]
    pub dtype: Option<String>,
    /// Export the optimizer state too, every tensor under its full name.
    #[arg(long)]
    pub include_optimizer: bool,
    /// Replace OUT when it exists and is not empty.
    #[arg(long)]
    pub overwrite: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Run `export`.
pub fn run(a: ExportArgs) -> CliResult {
    let mut rename: Vec<Rename> = a
        .strip_prefix
        .iter()
        .map(|p| Rename::StripPrefix(p.clone()))
        .collect();
    for m in &a.map {
        let (from, to) = m
            .split_once('=')
            .ok_or_else(|| format!("--map {m:?}: expected OLD=NEW"))?;
        rename.push(Rename::Prefix {
            from: from.to_owned(),
            to: to.to_owned(),
        });
    }
    let opts = ExportOptions {
        max_shard_size: export::parse_size(&a.max_shard_size)?,
        rename,
        dtype: a.dtype.as_deref().map(export::parse_dtype).transpose()?,
        include_optimizer: a.include_optimizer,
        overwrite: a.overwrite,
        ..ExportOptions::default()
    };
    let r = export::export(&a.src, &a.out, &opts)?;
    if a.json {
        let v = serde_json::json!({
            "source": r.source,
            "step": r.step,
            "out": a.out,
            "files": r.files,
            "tensors": r.tensors,
            "bytes": r.bytes,
            "bytes_read": r.bytes_read,
            "seconds": r.seconds,
        });
        println!("{v}");
    } else {
        println!(
            "exported step {} of {}: {} tensors, {} in {} file(s) to {} in {:.3} s",
            r.step,
            r.source.display(),
            r.tensors,
            human(r.bytes),
            r.files.len() - 1,
            a.out.display(),
            r.seconds
        );
    }
    Ok(())
}
