//! The remote tier's settings: part size, parallelism and retries, where the bucket is
//! (`s3://bucket/prefix`, or any `object_store` store), and the URL's parsing.

use std::sync::Arc;
use std::time::Duration;

use object_store::ObjectStore;

use super::Remote;

use crate::error::{Error, Result};

/// Default size of each multipart part and ranged read: 16 MiB.
pub const DEFAULT_PART_SIZE: usize = 16 << 20;
/// Default parts (uploads) or ranged reads (loads) in flight: 8.
pub const DEFAULT_CONCURRENCY: usize = 8;
/// Default retries of one request (object_store's retry with backoff): 3.
pub const DEFAULT_RETRIES: usize = 3;

/// Default [`RemoteOptions::request_timeout`]: 30 s.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Default [`RemoteOptions::complete_timeout`]: 10 minutes.
pub const DEFAULT_COMPLETE_TIMEOUT: Duration = Duration::from_secs(600);

/// How the remote tier talks to the bucket.
#[derive(Clone, PartialEq, Eq)]
pub struct RemoteOptions {
    /// Bytes per multipart part and per ranged GET: 5 MiB (S3's smallest part) to 1 GiB.
    /// Default 16 MiB.
    pub part_size: usize,
    /// Parts uploaded, or ranges read, at once: 1..=256. Default 8.
    pub concurrency: usize,
    /// Retries of a failed request (server errors, timeouts, connection resets), with
    /// exponential backoff, within `retry_timeout`. Default 3.
    pub retries: usize,
    /// Time after which a request is no longer retried. Default 30 s.
    pub retry_timeout: Duration,
    /// Longest time one request (a part, a ranged read, a listing) may take before it
    /// fails, and is retried: a hung connection is detected after this. Default 30 s
    /// (object_store's own). A `timeout` in [`RemoteOptions::config`] overrides it.
    pub request_timeout: Duration,
    /// Longest time a `CompleteMultipartUpload` may take. The server assembles the whole
    /// object before it answers, which for a large object takes far longer than a part:
    /// S3 documents "several minutes", and a test server that copies the parts at
    /// 0.26 GB/s needs 33 s for 8.6 GB, beyond the request timeout. Default 10 min.
    pub complete_timeout: Duration,
    /// Settings applied over the environment's, as object_store's `AmazonS3ConfigKey`
    /// names (`aws_endpoint`, `aws_access_key_id`, `aws_secret_access_key`, `aws_region`,
    /// `aws_allow_http`, ...). Default none.
    pub config: Vec<(String, String)>,
}

impl std::fmt::Debug for RemoteOptions {
    /// The `config` keys only: their values may be secrets.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteOptions")
            .field("part_size", &self.part_size)
            .field("concurrency", &self.concurrency)
            .field("retries", &self.retries)
            .field("retry_timeout", &self.retry_timeout)
            .field("request_timeout", &self.request_timeout)
            .field("complete_timeout", &self.complete_timeout)
            .field(
                "config",
                &self
                    .config
                    .iter()
                    .map(|(k, _)| k.as_str())
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Default for RemoteOptions {
    fn default() -> Self {
        RemoteOptions {
            part_size: DEFAULT_PART_SIZE,
            concurrency: DEFAULT_CONCURRENCY,
            retries: DEFAULT_RETRIES,
            retry_timeout: Duration::from_secs(30),
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            complete_timeout: DEFAULT_COMPLETE_TIMEOUT,
            config: Vec::new(),
        }
    }
}

impl RemoteOptions {
    pub(crate) fn validate(&self) -> Result<()> {
        if !(5 << 20..=1 << 30).contains(&self.part_size) {
            return Err(Error::Config(format!(
                "remote part size {} must be between 5 MiB and 1 GiB",
                self.part_size
            )));
        }
        if !(1..=256).contains(&self.concurrency) {
            return Err(Error::Config("remote concurrency must be 1..=256".into()));
        }
        for (what, d) in [
            ("request", self.request_timeout),
            ("complete", self.complete_timeout),
        ] {
            if d.is_zero() {
                return Err(Error::Config(format!(
                    "remote {what} timeout must be longer than zero"
                )));
            }
        }
        Ok(())
    }
}

/// Where an engine's remote tier goes ([`crate::EngineConfig::with_remote`],
/// [`crate::EngineConfig::with_remote_store`]).
#[derive(Clone)]
pub(crate) enum RemoteTarget {
    /// `s3://bucket/prefix`, configured from the environment.
    Url(String),
    /// A store given by the caller, and a key prefix.
    Store {
        store: Arc<dyn ObjectStore>,
        /// The same store's multipart API, when given (uploads are then journaled).
        mp: Option<Arc<dyn object_store::multipart::MultipartStore>>,
        prefix: String,
    },
}

impl std::fmt::Debug for RemoteTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RemoteTarget::Url(u) => f.debug_tuple("Url").field(u).finish(),
            RemoteTarget::Store { store, mp, prefix } => f
                .debug_struct("Store")
                .field("store", store)
                .field("multipart", &mp.is_some())
                .field("prefix", prefix)
                .finish(),
        }
    }
}

impl RemoteTarget {
    pub(crate) fn open(&self, opts: RemoteOptions) -> Result<Remote> {
        match self {
            RemoteTarget::Url(u) => Remote::open(u, opts),
            RemoteTarget::Store { store, mp, prefix } => {
                let url = format!("{store}/{prefix}");
                Remote::build(Arc::clone(store), mp.clone(), prefix, url, opts)
            }
        }
    }
}

/// A parsed `s3://bucket/prefix` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteUrl {
    /// Bucket name.
    pub bucket: String,
    /// Key prefix without leading or trailing `/` (may be empty).
    pub prefix: String,
}

impl RemoteUrl {
    /// Parse `s3://bucket[/prefix]`. The prefix's segments must be plain names (no `.`,
    /// `..` or empty segment).
    pub fn parse(url: &str) -> Result<RemoteUrl> {
        let bad = |why: &str| Error::Config(format!("remote URL {:?}: {why}", redact(url)));
        let rest = url
            .strip_prefix("s3://")
            .ok_or_else(|| bad("must start with s3://"))?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if !(3..=63).contains(&bucket.len())
            || !bucket
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        {
            return Err(bad(
                "the bucket name must be 3..=63 lowercase letters, digits, '-' or '.'",
            ));
        }
        let prefix = prefix.trim_end_matches('/');
        if !prefix.is_empty()
            && prefix
                .split('/')
                .any(|s| s.is_empty() || s == "." || s == ".." || s.starts_with("step-"))
        {
            return Err(bad(
                "the prefix's segments must be non-empty names other than '.', '..' and step-*",
            ));
        }
        Ok(RemoteUrl {
            bucket: bucket.to_owned(),
            prefix: prefix.to_owned(),
        })
    }
}

impl std::fmt::Display for RemoteUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.prefix.is_empty() {
            write!(f, "s3://{}", self.bucket)
        } else {
            write!(f, "s3://{}/{}", self.bucket, self.prefix)
        }
    }
}

/// `text` with the credentials of every URL in it taken out: the userinfo of
/// `scheme://user:password@host` becomes `***@`, and the value of each query parameter
/// that looks like a credential (`X-Amz-Signature`, `X-Amz-Credential`,
/// `X-Amz-Security-Token`, `AWSAccessKeyId`, `Signature`, and any name containing
/// `token`, `secret`, `key`, `password` or `credential`, in any case) becomes `***`.
/// Every URL, endpoint and object-store error text that enters an error or a log message
/// of the remote tier passes through it.
pub fn redact(text: &str) -> String {
    let stop = |c: char| c.is_whitespace() || matches!(c, '"' | '\'' | '<' | '>' | '`');
    // Userinfo: between `://` and the last `@` of the authority.
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("://") {
        let (head, tail) = rest.split_at(i + 3);
        out.push_str(head);
        let end = tail
            .find(|c: char| stop(c) || matches!(c, '/' | '?' | '#'))
            .unwrap_or(tail.len());
        let authority = &tail[..end];
        match authority.rfind('@') {
            Some(at) => {
                out.push_str("***");
                out.push_str(&authority[at..]);
            }
            None => out.push_str(authority),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    // Query parameters: `?name=value` or `&name=value` (also `&amp;`-free forms only).
    let secret = |name: &str| {
        let n = name.to_ascii_lowercase();
        [
            "token",
            "secret",
            "key",
            "password",
            "credential",
            "signature",
        ]
        .iter()
        .any(|w| n.contains(w))
    };
    let mut red = String::with_capacity(out.len());
    let mut rest = out.as_str();
    while let Some(i) = rest.find(['?', '&']) {
        let (head, tail) = rest.split_at(i + 1);
        red.push_str(head);
        let name_end = tail
            .find(|c: char| stop(c) || matches!(c, '=' | '&' | '?' | '#'))
            .unwrap_or(tail.len());
        let name = &tail[..name_end];
        if tail[name_end..].starts_with('=') && secret(name) {
            red.push_str(name);
            red.push_str("=***");
            let value = &tail[name_end + 1..];
            let v_end = value
                .find(|c: char| stop(c) || matches!(c, '&' | '#' | ')' | ','))
                .unwrap_or(value.len());
            rest = &value[v_end..];
        } else {
            rest = tail;
        }
    }
    red.push_str(rest);
    red
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn credentials_are_taken_out_of_urls() {
        assert_eq!(
            redact("error sending request for url (http://user:PASS@host:9000/b/k?list-type=2)"),
            "error sending request for url (http://***@host:9000/b/k?list-type=2)"
        );
        assert_eq!(
            redact(
                "GET https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIA%2F1&X-Amz-Signature=abc&x=1 \
                 and s3://u:p@b/x?sessionToken=t#f"
            ),
            "GET https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***&x=1 \
             and s3://***@b/x?sessionToken=***#f"
        );
        assert_eq!(
            redact("http://h/p?AWSAccessKeyId=A&Signature=S&max-keys=5&a=b"),
            "http://h/p?AWSAccessKeyId=***&Signature=***&max-keys=***&a=b"
        );
        // Nothing to take out; odd input never panics.
        for t in [
            "plain text",
            "x://",
            "://@",
            "?=&=",
            "a@b",
            "é://é@é?é=é",
            "",
        ] {
            let _ = redact(t);
        }
        assert_eq!(redact("plain text, a@b"), "plain text, a@b");
    }
}
