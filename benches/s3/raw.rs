//! The limit of `benches/s3/s3_bench.py`: the server's raw multipart PUT of `BYTES` bytes
//! (`PART`-byte parts, `CONCURRENCY` in flight) and its parallel ranged GET of them back
//! into memory, with the same library and settings as shmckpt's remote tier
//! (`object_store`, credentials and endpoint from the AWS environment variables), and
//! nothing else: no file, no checksum, no manifest.
//!
//! ```text
//! cargo build --release --features s3 --example s3_raw
//! s3_raw put|get s3://BUCKET/KEY BYTES PART CONCURRENCY
//! ```
//! Prints one JSON line: `{"op", "bytes", "seconds", "gbps"}` (GB/s: 1e9 bytes/s). `get`
//! reads the object `put` wrote.

use std::time::Instant;

use bytes::Bytes;
use futures::StreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path;
use object_store::{ObjectStoreExt, WriteMultipart};

fn usage() -> ! {
    eprintln!("usage: s3_raw put|get s3://BUCKET/KEY BYTES PART CONCURRENCY");
    std::process::exit(2)
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() != 6 {
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
    let store = AmazonS3Builder::from_env()
        .with_bucket_name(bucket)
        .build()
        .unwrap_or_else(|e| {
            eprintln!("s3_raw: {e}");
            std::process::exit(1)
        });
    let key = Path::from(key);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let res = rt.block_on(async {
        match a[1].as_str() {
            "put" => {
                // One buffer, its parts handed out as zero-copy slices.
                let data = Bytes::from(vec![0x5au8; bytes]);
                let t = Instant::now();
                let upload = store.put_multipart(&key).await?;
                let mut w = WriteMultipart::new_with_chunk_size(upload, part);
                let mut at = 0;
                while at < bytes {
                    w.wait_for_capacity(conc).await?;
                    let n = (bytes - at).min(part);
                    w.put(data.slice(at..at + n));
                    at += n;
                }
                w.finish().await?;
                Ok::<_, object_store::Error>(t.elapsed().as_secs_f64())
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
                Ok(t.elapsed().as_secs_f64())
            }
            _ => usage(),
        }
    });
    match res {
        Ok(secs) => println!(
            "{{\"op\": \"{}\", \"bytes\": {bytes}, \"seconds\": {secs:.6}, \"gbps\": {:.4}}}",
            a[1],
            bytes as f64 / secs / 1e9
        ),
        Err(e) => {
            eprintln!("s3_raw: {e}");
            std::process::exit(1)
        }
    }
}
