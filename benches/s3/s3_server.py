"""The S3-protocol server of ``s3_bench.py``: an ``s3s-fs`` binary serving a directory on a
free port (started and stopped here), or an endpoint already running."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Optional

BUCKET = "bench"
ACCESS, SECRET, REGION = "shmckptbench", "shmckptbenchsecret", "us-east-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



class Server:
    """``s3s-fs`` serving ``root`` on a free port (or an endpoint already running)."""

    def __init__(self, binary: Optional[str], root: str, endpoint: Optional[str]):
        self.proc: Optional[subprocess.Popen] = None
        self.root = root
        if endpoint:
            self.url = endpoint.rstrip("/")
            import boto3  # an external server: the bucket is made and emptied with boto3

            c = boto3.client("s3", endpoint_url=self.url, region_name=REGION)
            if BUCKET not in [b["Name"] for b in c.list_buckets().get("Buckets", [])]:
                c.create_bucket(Bucket=BUCKET)
            return
        assert binary is not None
        if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
            sys.exit(f"s3_bench: --server {binary!r} is not an executable file (an s3s-fs binary)")
        os.makedirs(root, exist_ok=True)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(os.path.join(os.path.dirname(root.rstrip("/")), "s3s-fs.log"), "ab")
        self.proc = subprocess.Popen(
            [binary, "--host", "127.0.0.1", "--port", str(port), "--access-key", ACCESS, "--secret-key", SECRET, root],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "RUST_LOG": "error"},
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"s3_bench: the server {binary} did not start (see s3s-fs.log)")
                time.sleep(0.05)
        os.makedirs(os.path.join(root, BUCKET), exist_ok=True)  # s3s-fs: a bucket is a directory

    def clear(self, prefix: str) -> None:
        """Remove every object under ``prefix`` (not timed)."""
        if self.proc is not None:
            shutil.rmtree(os.path.join(self.root, BUCKET, prefix), ignore_errors=True)
            return
        import boto3

        c = boto3.client("s3", endpoint_url=self.url, region_name=REGION)
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
            objs = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if objs:
                c.delete_objects(Bucket=BUCKET, Delete={"Objects": objs})

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
