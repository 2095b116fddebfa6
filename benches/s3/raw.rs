//! The limit of `benches/s3/s3_bench.py`: the server's raw multipart PUT of `BYTES` bytes
//! (`PART`-byte parts, `CONCURRENCY` in flight) and its parallel ranged GET of them back
//! into memory, with the same library and settings as shmckpt's remote tier
//! (`object_store`, credentials and endpoint from the AWS environment variables), and
//! nothing else: no file, no checksum, no manifest.
//!
//! ```text
//! cargo build --release --features s3 --example s3_raw
//! s3_raw put|get s3://BUCKET/KEY BYTES PART CONCURRENCY [OBJECTS]
//! ```
//! Prints one JSON line: `{"op", "bytes", "seconds", "gbps"}` (GB/s: 1e9 bytes/s); `put`
//! adds `parts_seconds` (until the server acknowledged the last part) and
//! `complete_seconds` (the CompleteMultipartUpload requests: an S3 server that stores
//! an object as one file, like `s3s-fs`, copies every byte again there). `get` reads the
//! object `put` wrote.
//!
//! `OBJECTS` (default 1, `put` only) splits the bytes into that many objects `KEY.0`,
//! `KEY.1`, ... uploaded at once, `CONCURRENCY` parts in flight over all of them: the
//! shape of a DCP writer with `thread_count` = `OBJECTS` (one file per thread), for
//! telling the server's per-object costs from the client's.
//!
//! The tokio runtime has 2 worker threads, as the remote tier's; `S3_RAW_WORKER_THREADS`
//! sets another number (to see whether the client's threads are the limit).

use std::time::Instant;

use bytes::Bytes;
use futures::StreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path;
use object_store::{ObjectStoreExt, WriteMultipart};

fn usage() -> ! {
    eprintln!("usage: s3_raw put|get s3://BUCKET/KEY BYTES PART CONCURRENCY [OBJECTS]");
    std::process::exit(2)
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if !(6..=7).contains(&a.len()) {
        usage();
    }
    let Some(rest) = a[2].strip_prefix("s3://") else {
        usage()
    };
    let Some((bucket, key)) = rest.split_once('/') else {
        usage()
    };
    let parse = |s: &str| s.parse::<usize>().unwrap_or_else(|_| usage());
    let (bytes, part, conc) = (parse(&a[3]), parse(&a[4]), parse(&a[5]));
    let objects = a.get(6).map_or(1, |s| parse(s));
    if part == 0 || conc == 0 || objects == 0 || (objects > 1 && a[1] != "put") {
        usage();
    }
    // The completion of a large object takes the server long (8.6 GB on s3s-fs: 33 s, past
    // object_store's 30 s default): the same 10 min as shmckpt's `complete_timeout`.
    let store = AmazonS3Builder::from_env()
        .with_bucket_name(bucket)
        .with_config(
            object_store::aws::AmazonS3ConfigKey::Client(object_store::ClientConfigKey::Timeout),
            "600s",
        )
        .build()
        .unwrap_or_else(|e| {
            eprintln!("s3_raw: {e}");
            std::process::exit(1)
        });
    let key = Path::from(key);
    let threads = std::env::var("S3_RAW_WORKER_THREADS").map_or(2, |s| parse(&s));
    if threads == 0 {
        usage();
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let res = rt.block_on(async {
        match a[1].as_str() {
            "put" => {
                // One buffer, its parts handed out as zero-copy slices; object `i` gets
                // bytes `[i * bytes / objects, (i + 1) * bytes / objects)`.
                let data = Bytes::from(vec![0x5au8; bytes]);
                let t = Instant::now();
                let per = conc.div_ceil(objects);
                let uploads = (0..objects).map(|i| {
                    let (store, data) = (&store, &data);
                    let key = if objects == 1 {
                        key.clone()
                    } else {
                        Path::from(format!("{key}.{i}"))
                    };
                    let (lo, hi) = (i * bytes / objects, (i + 1) * bytes / objects);
                    async move {
                        let upload = store.put_multipart(&key).await?;
                        let mut w = WriteMultipart::new_with_chunk_size(upload, part);
                        let mut at = lo;
                        while at < hi {
                            w.wait_for_capacity(per).await?;
                            let n = (hi - at).min(part);
                            w.put(data.slice(at..at + n));
                            at += n;
                        }
                        // Every part acknowledged, then the complete request alone.
                        w.wait_for_capacity(0).await?;
                        let parts = t.elapsed().as_secs_f64();
                        w.finish().await?;
                        Ok::<_, object_store::Error>(parts)
                    }
                });
                let parts = futures::future::try_join_all(uploads).await?;
                let secs = t.elapsed().as_secs_f64();
                let parts = parts.into_iter().fold(0f64, f64::max);
                Ok::<_, object_store::Error>((secs, Some((parts, secs - parts))))
            }
            "get" => {
                let mut out = vec![0u8; bytes];
                let t = Instant::now();
                let ranges: Vec<_> = (0..bytes)
                    .step_by(part)
                    .map(|s| s..(s + part).min(bytes))
                    .collect();
                let mut s = futures::stream::iter(ranges.into_iter().map(|r| {
                    let store = &store;
                    let key = &key;
                    async move {
                        let b = store.get_range(key, r.start as u64..r.end as u64).await?;
                        Ok::<_, object_store::Error>((r.start, b))
                    }
                }))
                .buffer_unordered(conc);
                while let Some(r) = s.next().await {
                    let (at, b) = r?;
                    out[at..at + b.len()].copy_from_slice(&b);
                }
                Ok((t.elapsed().as_secs_f64(), None))
            }
            _ => usage(),
        }
    });
    match res {
        Ok((secs, phases)) => println!(
            "{{\"op\": \"{}\", \"bytes\": {bytes}, \"seconds\": {secs:.6}, \"gbps\": {:.4}{}}}",
            a[1],
            bytes as f64 / secs / 1e9,
            phases.map_or(String::new(), |(p, c)| format!(
                ", \"objects\": {objects}, \"parts_seconds\": {p:.6}, \"complete_seconds\": {c:.6}"
            ))
        ),
        Err(e) => {
            eprintln!("s3_raw: {e}");
            std::process::exit(1)
        }
    }
}
