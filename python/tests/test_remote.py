"""The object-storage tier against a real S3-protocol server: moto's server, started by
these tests (``python -m moto.server``), reached through the standard AWS environment
variables. Without moto the tests are skipped; ``SHMCKPT_REQUIRE_S3=1`` (CI) makes that a
failure."""

from __future__ import annotations

import http.client
import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from typing import Optional

import numpy as np
import pytest

import shmckpt
from shmckpt.errors import ConfigError, RemoteError, RemoteFailed

from conftest import SMALL, free_port as _free_port
import zygote

torch = pytest.importorskip("torch")


def _require_moto():
    try:
        import boto3  # noqa: F401
        import moto.server  # noqa: F401
    except ImportError as e:
        if os.environ.get("SHMCKPT_REQUIRE_S3") == "1":
            pytest.fail(f"SHMCKPT_REQUIRE_S3=1 but moto[server] is not installed: {e}")
        pytest.skip(f"moto[server] is not installed ({e}); set SHMCKPT_REQUIRE_S3=1 to fail instead")


class Moto:
    """A moto S3 server process on a free port."""

    def __init__(self, extra_env=None):
        self.port = _free_port()
        env = dict(os.environ)
        env.update(extra_env or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto server did not start")
                time.sleep(0.1)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def moto():
    _require_moto()
    m = Moto()
    yield m
    m.stop()


@pytest.fixture
def s3(moto, monkeypatch):
    """Environment for `moto`, a fresh bucket; yields (boto3 client, bucket name)."""
    import boto3

    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": moto.url,
        "AWS_ALLOW_HTTP": "true",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    client = boto3.client("s3", endpoint_url=moto.url, region_name="us-east-1")
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    return client, bucket


def keys(client, bucket, prefix=""):
    out = client.list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in out.get("Contents", []))


def rank_key(client, bucket, step_prefix: str, rank: int = 0) -> str:
    """The key of ``rank``'s object of the committed step ``step_prefix`` (``run1/step-3``):
    each upload names its object apart, and the step's manifest records the name."""
    m = json.loads(client.get_object(Bucket=bucket, Key=f"{step_prefix}/manifest.json")["Body"].read())
    f = m["files"][rank]
    return f"{step_prefix}/{f.get('object', f['file'])}"


def state(seed: int, n: int = 1 << 16):
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(n, generator=g), "b": torch.arange(7, dtype=torch.int64) + seed},
        "step": seed,
        "note": "hi",
    }


def same(a, b):
    assert a["step"] == b["step"] and a["note"] == b["note"]
    for k in ("w", "b"):
        assert a["model"][k].dtype == b["model"][k].dtype
        assert torch.equal(a["model"][k], b["model"][k]), k


def open_ck(root, remote, **kw):
    tuning = shmckpt.Tuning(staging_capacity=SMALL, chunk_size=1 << 20)
    return shmckpt.Checkpointer(root, tuning=tuning, remote=remote, **kw)


def test_save_wait_remote_list_and_load_after_local_dir_is_deleted(s3, root):
    client, bucket = s3
    url = f"s3://{bucket}/run1"
    with open_ck(root, url) as ck:
        st = state(3)
        h = ck.save(3, st)
        local = h.wait()
        rep = h.wait_remote()
        assert rep["step"] == 3 and rep["bytes"] == local["bytes"]
        assert rep["committed_here"] is True
        assert rep["remote_durable"] >= rep["upload"] > 0
        assert h.wait_remote() == rep  # may be called again
        assert ck.list(remote=True) == [3]
        obj_key = rank_key(client, bucket, "run1/step-3")
        assert re.fullmatch(r"run1/step-3/rank-00000-of-00001\.[0-9a-f]{32}\.safetensors", obj_key), obj_key
        assert keys(client, bucket) == [
            "run1/step-3/manifest.json",
            obj_key,
            "run1/step-3/rank-00000.manifest.json",
        ]
        # The object is the local safetensors file, byte for byte (`aws s3 cp` gives it).
        obj = client.get_object(Bucket=bucket, Key=obj_key)["Body"].read()
        assert obj == (root / "step-3" / "rank-00000-of-00001.safetensors").read_bytes()
        # Served locally while the disk has it.
        same(ck.load("latest"), st)
        assert ck.last_load_source[0] == "disk"
        # From the bucket on request.
        same(ck.load(3, source="remote"), st)
        assert ck.last_load_source == ("remote", None)

    shutil.rmtree(root)
    root.mkdir()
    with open_ck(root, url) as ck:
        assert ck.list(source="local") == [] and ck.list() == ck.list(remote=True) == [3]
        got = ck.load("latest")
        same(got, st)
        assert ck.last_load_source == ("remote", None)
        with pytest.raises(shmckpt.NotFound):
            ck.load("latest", source="local")
        # The loaded tensors own their memory.
        assert got["model"]["w"].sum().item() == pytest.approx(st["model"]["w"].sum().item())


def test_remote_retention_keeps_the_newest(s3, root):
    client, bucket = s3
    url = f"s3://{bucket}/ret"
    with open_ck(root, shmckpt.RemoteTier(url, keep_last=2), keep_last=1) as ck:
        retired = []
        for step in range(1, 5):
            h = ck.save(step, state(step, 1024))
            h.wait()
            retired += h.wait_remote()["retired"]
        assert retired == [1, 2]
        assert ck.list(remote=True) == [3, 4]
        assert ck.list(source="local") == [4] and ck.list() == [3, 4]
        assert {k.split("/")[1] for k in keys(client, bucket)} == {"step-3", "step-4"}
        same(ck.load(3), state(3, 1024))
        assert ck.last_load_source == ("remote", None)


def test_remote_every_uploads_every_kth_disk_save_and_no_memory_only_one(s3, root):
    """Issue 38: with ``disk_every=2`` saves 1, 3, 5 go to disk; with ``remote_every=2``
    the bucket takes every second of those (1, 5); memory-only saves are never uploaded."""
    client, bucket = s3
    url = f"s3://{bucket}/every"
    with open_ck(root, shmckpt.RemoteTier(url, every=2), cadence=shmckpt.Cadence(disk_every=2)) as ck:
        for step in range(1, 7):
            h = ck.save(step, state(step, 1024))
            rep = h.wait()
            assert rep["memory_only"] == (step % 2 == 0), (step, rep)
            if step in (1, 5):
                assert h.wait_remote()["step"] == step
            else:
                with pytest.raises(shmckpt.ConfigError, match="no remote copy"):
                    h.wait_remote()
        assert ck.list(tiers=True) == [(1, ["disk", "bucket"]), (3, ["disk"]), (5, ["disk", "bucket"]), (6, ["memory"])]
        assert ck.list(remote=True) == [1, 5]
        assert {k.split("/")[1] for k in keys(client, bucket)} == {"step-1", "step-5"}
        same(ck.load("latest"), state(6, 1024))
        assert ck.last_load_source == ("memory", None)
        same(ck.load(5, source="remote"), state(5, 1024))


def test_foreign_manifests_in_the_bucket_never_count_as_steps(s3, root):
    """Only ``prefix/step-N/manifest.json`` of step N commits step N in the bucket (the
    disk's rule): a ``manifest.json`` deeper down, of another step or not valid changes
    neither the listing, nor ``load("latest")``, nor retention."""
    client, bucket = s3
    url = f"s3://{bucket}/for"
    for key, body in [
        ("for/step-99/notes/manifest.json", b'{"step": 99}'),
        ("for/step-98/manifest.json", b'{"step": 2}'),
        ("for/step-97/manifest.json", b"not json"),
    ]:
        client.put_object(Bucket=bucket, Key=key, Body=body)
    with open_ck(root, shmckpt.RemoteTier(url, keep_last=2)) as ck:
        retired = []
        for step in (1, 2, 3):
            h = ck.save(step, state(step, 1024))
            h.wait()
            retired += h.wait_remote()["retired"]
        assert retired == [1]
        assert ck.list(remote=True) == [2, 3]
    shutil.rmtree(root)
    root.mkdir()
    with open_ck(root, url) as ck:
        same(ck.load("latest"), state(3, 1024))
        assert ck.last_load_source == ("remote", None)
    assert [k for k in keys(client, bucket) if k.endswith("/manifest.json")] == [
        "for/step-2/manifest.json",
        "for/step-3/manifest.json",
        "for/step-97/manifest.json",
        "for/step-98/manifest.json",
        "for/step-99/notes/manifest.json",
    ]


def test_a_writer_whose_object_is_not_committed_gets_remote_conflict(s3, tmp_path):
    """Two ranks given explicitly (no session): writer A's rank 0 uploads step 1 and waits
    for rank 1; writer B's rank 0 uploads step 1 too (its manifest part replaces A's); A's
    rank 1 commits the step, over B's rank-0 object. A's rank 0 is told
    ``RemoteConflict`` (a ``RemoteFailed``, with ``step``), B's rank 0 "committed"."""
    client, bucket = s3
    url = f"s3://{bucket}/two"

    def ck(name, rank):
        return shmckpt.Checkpointer(
            tmp_path / name,
            tuning=shmckpt.Tuning(staging_capacity=SMALL, chunk_size=1 << 20),
            remote=url,
            rank=rank,
            world_size=2,
        )

    def saved(c, st):
        h = c.save(1, st)
        h.wait()
        deadline = time.monotonic() + 60
        while not h._get_rust().is_remote_done():
            assert time.monotonic() < deadline, "the upload never ended"
            time.sleep(0.01)
        return h

    a0, b0, a1 = ck("a0", 0), ck("b0", 0), ck("a1", 1)
    try:
        ha0 = saved(a0, state(1, 1024))
        hb0 = saved(b0, state(2, 1024))
        ha1 = saved(a1, state(3, 1024))
        assert ha1.wait_remote()["committed_here"] is True
        with pytest.raises(shmckpt.RemoteConflict) as e:
            ha0.wait_remote()
        assert isinstance(e.value, RemoteFailed) and e.value.step == 1
        assert f"remote copy of step 1 to {url} lost to another writer" in str(e.value), str(e.value)
        assert hb0.wait_remote()["committed_here"] is False
        same(b0.load(1, source="remote"), state(2, 1024))
    finally:
        for c in (a0, b0, a1):
            c.close()


def test_missing_bucket_is_a_clear_error(s3, root):
    _, bucket = s3
    with pytest.raises(RemoteError) as e:
        open_ck(root, f"s3://{bucket}-missing/x")
    msg = str(e.value)
    assert f"s3://{bucket}-missing/x" in msg and "the bucket does not exist" in msg, msg


def test_bad_credentials_are_a_clear_error(root, monkeypatch):
    """A server that checks credentials (moto with INITIAL_NO_AUTH_ACTION_COUNT=0 refuses
    keys it does not know)."""
    _require_moto()
    m = Moto({"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    try:
        for k, v in {
            "AWS_ACCESS_KEY_ID": "AKIAWRONGWRONGWRONG0",
            "AWS_SECRET_ACCESS_KEY": "wrong",
            "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": m.url,
            "AWS_ALLOW_HTTP": "true",
        }.items():
            monkeypatch.setenv(k, v)
        with pytest.raises(RemoteError) as e:
            open_ck(root, "s3://some-bucket/x")
        msg = str(e.value)
        assert "s3://some-bucket/x" in msg and "AWS_ACCESS_KEY_ID" in msg, msg
    finally:
        m.stop()


def test_an_endpoints_password_never_appears_in_errors(root, monkeypatch):
    """``AWS_ENDPOINT_URL`` with a password in its userinfo, unreachable: the Python
    exception and the CLI's error name the endpoint without the password or the secret
    key."""
    port = _free_port()  # nothing listens there
    for k, v in {
        "AWS_ACCESS_KEY_ID": "AKIDEXAMPLE",
        "AWS_SECRET_ACCESS_KEY": "SECRETKEYVALUE",
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://someone:S3cretPASS@127.0.0.1:{port}",
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ALLOW_HTTP", raising=False)
    with pytest.raises(RemoteError) as e:
        open_ck(root, "s3://some-bucket/x")
    msg = str(e.value)
    assert f"http://***@127.0.0.1:{port}/some-bucket" in msg, msg
    assert "S3cretPASS" not in msg and "SECRETKEYVALUE" not in msg, msg
    assert "builder error" not in msg, msg  # an http:// endpoint needs no AWS_ALLOW_HTTP
    r = _cli("inspect", "s3://some-bucket/x")
    assert r.returncode != 0
    assert f"http://***@127.0.0.1:{port}/some-bucket" in r.stderr, r.stderr
    assert "S3cretPASS" not in r.stdout + r.stderr and "SECRETKEYVALUE" not in r.stdout + r.stderr


def test_an_http_endpoint_needs_no_allow_http(s3, root, monkeypatch):
    """As boto3 and the AWS CLI do, an ``http://`` ``AWS_ENDPOINT_URL`` is taken as it is
    (object_store alone refused it with "builder error")."""
    _, bucket = s3
    monkeypatch.delenv("AWS_ALLOW_HTTP")
    url = f"s3://{bucket}/plain"
    with open_ck(root, url) as ck:
        h = ck.save(1, state(1, 1024))
        h.wait()
        assert h.wait_remote()["committed_here"] is True
        assert ck.list(remote=True) == [1]
    r = _cli("inspect", url)
    assert r.returncode == 0, r.stderr
    # Said false explicitly: refused, and the message names the setting.
    monkeypatch.setenv("AWS_ALLOW_HTTP", "false")
    with pytest.raises(RemoteError) as e:
        open_ck(root, url)
    assert "AWS_ALLOW_HTTP=true" in str(e.value), str(e.value)


class ProxyHandler(http.server.BaseHTTPRequestHandler):
    """What the test proxies in front of moto share: the request's body read, the request
    forwarded and its answer relayed, a 503 ``SlowDown``, a dropped connection."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def read_body(self) -> Optional[bytes]:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else None

    def forward(self, upstream_port: int, body: Optional[bytes]):
        """Send the request upstream: ``(status, headers, data)`` of its answer."""
        c = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=60)
        headers = {k: v for k, v in self.headers.items()}
        c.request(self.command, self.path, body=body, headers=headers)
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, r.getheaders(), data

    def answer(self, status: int, headers, data: bytes) -> None:
        """Relay an upstream answer (``data`` replaces its body)."""
        self.send_response(status)
        head = self.command == "HEAD"
        for k, v in headers:
            # A HEAD answer keeps the object's length; other answers carry `data`.
            if k.lower() not in ("transfer-encoding", "connection") and (head or k.lower() != "content-length"):
                self.send_header(k, v)
        if not head:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if not head:
            self.wfile.write(data)

    def slow_down(self) -> None:
        msg = b"<Error><Code>SlowDown</Code><Message>injected</Message></Error>"
        self.send_response(503)
        self.send_header("Content-Length", str(len(msg)))
        self.end_headers()
        self.wfile.write(msg)

    def drop(self) -> None:
        """Close the connection without an answer."""
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def serve(handler: type):
    """A threading HTTP server of ``handler`` on a free port, serving in the background:
    ``(server, port)``."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


class FaultProxy:
    """An HTTP proxy in front of moto that fails every upload of a multipart part
    numbered `fail_part` or more, while armed: with a 503 (`mode="503"`) or by closing the
    connection without an answer (`mode="reset"`); and answers every
    CompleteMultipartUpload late, or never (see `complete_delay`)."""

    def __init__(
        self,
        upstream_port: int,
        fail_part: int,
        mode: str = "503",
        budget: Optional[int] = None,
        complete_delay: float = 0.0,
        complete_drop: bool = False,
    ):
        self.fail_part = fail_part
        # CompleteMultipartUpload: answered `complete_delay` seconds late (forwarded after
        # the delay), or never (`complete_drop`: the connection closed after the delay).
        self.complete_delay = complete_delay
        self.complete_drop = complete_drop
        self.completes = 0
        self.mode = mode
        self.budget = budget  # fail at most this many requests (None: every one)
        self.armed = True
        self.failed = 0
        proxy = self

        class H(ProxyHandler):
            def _any(self):
                body = self.read_body()
                q = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
                part = int(q.get("partNumber", ["0"])[0])
                if self.command == "POST" and "uploadId" in q:
                    proxy.completes += 1
                    time.sleep(proxy.complete_delay)
                    if proxy.complete_drop:
                        self.drop()
                        return
                if (
                    self.command == "PUT"
                    and proxy.armed
                    and part >= proxy.fail_part
                    and (proxy.budget is None or proxy.failed < proxy.budget)
                ):
                    proxy.failed += 1
                    if proxy.mode == "reset":
                        self.drop()
                        return
                    self.slow_down()
                    return
                self.answer(*self.forward(upstream_port, body))

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.server, self.port = serve(H)

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("mode", ["503", "reset"])
def test_server_errors_leave_no_visible_step_and_the_next_save_works(s3, moto, root, monkeypatch, mode):
    client, bucket = s3
    proxy = FaultProxy(moto.port, fail_part=2, mode=mode)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
    try:
        url = f"s3://{bucket}/f"
        # 20 MiB of float32: two 16 MiB parts, the second refused.
        big = {"w": torch.arange(5 << 20, dtype=torch.float32)}
        with shmckpt.Checkpointer(
            root, tuning=shmckpt.Tuning(staging_capacity=64 << 20, chunk_size=1 << 20), remote=url
        ) as ck:
            h = ck.save(1, big)
            h.wait()  # the local tier is not held back
            with pytest.raises(RemoteFailed) as e:
                h.wait_remote()
            assert "remote copy of step 1 failed" in str(e.value), str(e.value)
            assert proxy.failed >= 1
            assert ck.list() == [1]
            assert ck.list(remote=True) == []
            assert keys(client, bucket) == []
            # The multipart upload was aborted.
            assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
            proxy.armed = False
            h = ck.save(2, big)
            h.wait()
            rep = h.wait_remote()
            assert rep["step"] == 2 and rep["read_from_file"] == 0
            # Step 1, still the newest on the local disk and not in the bucket, was
            # uploaded again (from the local file) by this save, before step 2.
            assert rep["retried"] == (1, None)
            assert ck.list(remote=True) == [1, 2]
            for step in (1, 2):
                got = ck.load(step, source="remote")
                assert torch.equal(got["w"], big["w"])
            assert [k for k in keys(client, bucket) if ".shmckpt" in k] == []
    finally:
        proxy.stop()


def test_a_slow_completion_is_waited_for_with_its_own_timeout(s3, moto, root, monkeypatch, tmp_path):
    """The server assembles the object before it answers CompleteMultipartUpload, which for
    a large object takes far longer than any other request (8.6 GB on the s3s-fs bench
    server: 33 s, past object_store's 30 s request timeout, so 8 GiB saves failed). The
    completion has its own timeout (`remote_complete_timeout`, default 10 min): a server
    answering it 3 s late, with requests limited to 1 s, still commits the step, exact
    bytes; with the completion's timeout at 1 s too, the copy fails clearly, nothing is
    visible and the upload is aborted."""
    client, bucket = s3
    big = {"w": torch.arange(5 << 20, dtype=torch.float32)}  # two 16 MiB parts
    proxy = FaultProxy(moto.port, fail_part=10**9, complete_delay=3.0)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
    try:
        url = f"s3://{bucket}/slow"
        with shmckpt.Checkpointer(
            root,
            tuning=shmckpt.Tuning(staging_capacity=64 << 20, chunk_size=1 << 20),
            remote=shmckpt.RemoteTier(url, request_timeout=1.0),
        ) as ck:
            h = ck.save(1, big)
            h.wait()
            rep = h.wait_remote()
            assert rep["step"] == 1
            assert proxy.completes == 1  # answered once, 3 s late, not retried
            assert ck.list(remote=True) == [1]
            assert torch.equal(ck.load(1, source="remote")["w"], big["w"])
        proxy.complete_drop = True
        proxy.complete_delay = 1.5
        url = f"s3://{bucket}/never"
        with shmckpt.Checkpointer(
            tmp_path / "r2",
            tuning=shmckpt.Tuning(staging_capacity=64 << 20, chunk_size=1 << 20),
            remote=shmckpt.RemoteTier(url, request_timeout=1.0, complete_timeout=1.0),
        ) as ck:
            h = ck.save(1, big)
            h.wait()
            with pytest.raises(RemoteFailed) as e:
                h.wait_remote()
            assert "complete multipart upload failed" in str(e.value), str(e.value)
            assert ck.list(remote=True) == []
        assert [k for k in keys(client, bucket) if k.startswith("never/")] == []
        assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    finally:
        proxy.stop()
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ConfigError):
            shmckpt.Checkpointer(tmp_path / "r3", remote=shmckpt.RemoteTier(f"s3://{bucket}/x", complete_timeout=bad))


@pytest.mark.parametrize("remote_only", [False, True])
def test_two_gloo_ranks_commit_each_step_once(s3, root, tmp_path, remote_only):
    """Each rank uploads its own file; the step is committed in the bucket once, after
    both objects are complete (exactly one rank writes the manifest). Remote only, each
    rank has its own scratch directory: no shared disk at all."""
    import json

    client, bucket = s3
    url = f"s3://{bucket}/dist"
    world = 2
    port = _free_port()
    outs = [tmp_path / f"out{r}.json" for r in range(world)]
    worker = str(os.path.join(os.path.dirname(__file__), "remote_worker.py"))
    procs = [
        zygote.spawn(
            [sys.executable, worker, "-" if remote_only else str(root), url, str(r), str(world), str(port), str(outs[r])]
        )
        for r in range(world)
    ]
    try:
        codes = [p.wait(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0] * world
    res = [json.loads(o.read_text()) for o in outs]
    for r in res:
        assert r["remote"] == [5, 6] and r["ok"] == [True, True] and r["source"] == "remote", r
    # Per step, exactly one rank created the manifest.
    for i in range(2):
        assert sorted(r["committed_here"][i] for r in res) == [False, True], res
    assert keys(client, bucket, "dist/step-6/") == [
        "dist/step-6/manifest.json",
        rank_key(client, bucket, "dist/step-6", 0),
        "dist/step-6/rank-00000.manifest.json",
        rank_key(client, bucket, "dist/step-6", 1),
        "dist/step-6/rank-00001.manifest.json",
    ]
    import json as _json

    m = _json.loads(client.get_object(Bucket=bucket, Key="dist/step-6/manifest.json")["Body"].read())
    assert m["world_size"] == 2 and [f["rank"] for f in m["files"]] == [0, 1]
    # Both ranks' parts carry the session rank 0 broadcast.
    sessions = {
        _json.loads(client.get_object(Bucket=bucket, Key=f"dist/step-6/rank-0000{r}.manifest.json")["Body"].read())[
            "session"
        ]
        for r in range(2)
    }
    assert len(sessions) == 1 and len(sessions.pop()) == 32


def _cli(*args):
    from conftest import shmckpt_bin

    exe = shmckpt_bin()
    if exe is None:
        pytest.fail("no shmckpt binary: cargo build --bin shmckpt, or set SHMCKPT_BIN")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)


def test_cli_inspect_verify_gc_on_a_bucket(s3, root):
    client, bucket = s3
    url = f"s3://{bucket}/cli"
    with open_ck(root, url) as ck:
        for step in (1, 2, 3):
            h = ck.save(step, state(step, 4096))
            h.wait()
            h.wait_remote()
    r = _cli("inspect", url)
    assert r.returncode == 0, r.stderr
    lines = [l.split() for l in r.stdout.splitlines()[1:]]
    assert [l[0] for l in lines] == ["1", "2", "3"] and all(l[-1] == f"{url}/step-{l[0]}" for l in lines), r.stdout
    r = _cli("inspect", f"{url}/step-2", "--tensors", "0")
    assert r.returncode == 0, r.stderr
    assert f"checkpoint {url}/step-2" in r.stdout and "model.w" in r.stdout, r.stdout
    r = _cli("verify", url, "--all")
    assert r.returncode == 0, r.stdout + r.stderr
    assert [l.split()[0:2] for l in r.stdout.splitlines()] == [["OK", f"{url}/step-{s}"] for s in (1, 2, 3)]
    # A flipped byte in step 2's object: verify names it and fails.
    key = rank_key(client, bucket, "cli/step-2")
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[-3] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    r = _cli("verify", url, "--step", "2")
    assert r.returncode != 0
    assert r.stdout.startswith(f"FAIL {url}/step-2:") and "fails its checksum" in r.stdout, r.stdout
    # Leftovers of an interrupted upload (no manifest): gc removes them, and retention.
    client.put_object(Bucket=bucket, Key="cli/step-9/rank-00000-of-00001.safetensors", Body=b"x" * 100)
    client.put_object(Bucket=bucket, Key="cli/step-9/rank-00000.manifest.json", Body=b"{}")
    r = _cli("gc", url, "--keep", "2")
    assert r.returncode == 0, r.stderr
    assert "removed 0 object(s)" in r.stdout  # younger than --min-age (1 h)
    assert "removed 1 checkpoint(s) [1]; kept the newest 2" in r.stdout, r.stdout
    assert "cli/step-9/rank-00000.manifest.json" in keys(client, bucket)
    r = _cli("gc", url, "--keep", "2", "--min-age", "0")
    assert r.returncode == 0, r.stderr
    assert f"removed uncommitted {url}/step-9" in r.stdout, r.stdout
    assert "removed 2 object(s), 102 B" in r.stdout and "removed 0 checkpoint(s)" in r.stdout, r.stdout
    assert {k.split("/")[1] for k in keys(client, bucket)} == {"step-2", "step-3"}


def test_cli_gc_never_deletes_a_valid_step_for_a_planted_manifest(s3, root):
    """A ``manifest.json`` planted deeper under a step name (``step-99/notes/``): ``shmckpt
    gc`` keeps the real newest steps, removes no object it cannot prove is an upload's
    leftover, and says what it left."""
    client, bucket = s3
    url = f"s3://{bucket}/gcf"
    with open_ck(root, url) as ck:
        for step in (1, 2):
            h = ck.save(step, state(step, 1024))
            h.wait()
            h.wait_remote()
    client.put_object(Bucket=bucket, Key="gcf/step-99/notes/manifest.json", Body=b'{"step": 99}')
    before = keys(client, bucket)
    r = _cli("gc", url, "--keep", "2", "--min-age", "0")
    assert r.returncode == 0, r.stderr
    assert "removed 0 checkpoint(s) []; kept the newest 2" in r.stdout, r.stdout
    assert f"left {url}/step-99/notes/manifest.json: not an object of shmckpt's uploads" in r.stdout, r.stdout
    assert keys(client, bucket) == before
    r = _cli("gc", url, "--keep", "1", "--min-age", "0")
    assert r.returncode == 0, r.stderr
    assert "removed 1 checkpoint(s) [1]; kept the newest 1" in r.stdout, r.stdout
    assert [k for k in keys(client, bucket) if k.endswith("manifest.json")] == [
        "gcf/step-2/manifest.json",
        "gcf/step-2/rank-00000.manifest.json",
        "gcf/step-99/notes/manifest.json",
    ]


def test_cli_push_uploads_a_local_checkpoint_and_commits_it(s3, root):
    """`shmckpt push ROOT/step-N s3://...`: every rank file uploaded byte for byte, the step
    committed in the bucket (verify passes), no journal left; a second push is refused."""
    client, bucket = s3
    url = f"s3://{bucket}/pushed"
    with shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=SMALL, chunk_size=1 << 20)) as ck:
        ck.save(4, state(4, 3 << 20)).wait()
    step_dir = os.path.join(root, "step-4")
    r = _cli("push", step_dir, url)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"pushed {step_dir} to {url}/step-4: "), r.stdout
    name = "rank-00000-of-00001.safetensors"
    with open(os.path.join(step_dir, name), "rb") as f:
        local = f.read()
    obj_key = rank_key(client, bucket, "pushed/step-4")
    assert client.get_object(Bucket=bucket, Key=obj_key)["Body"].read() == local
    assert keys(client, bucket, "pushed/") == [
        "pushed/step-4/manifest.json",
        obj_key,
        "pushed/step-4/rank-00000.manifest.json",
    ]
    r = _cli("verify", url, "--step", "4")
    assert r.returncode == 0 and r.stdout.startswith(f"OK   {url}/step-4"), r.stdout + r.stderr
    r = _cli("inspect", url)
    assert r.returncode == 0 and "open upload" not in r.stdout, r.stdout
    r = _cli("push", step_dir, url)
    assert r.returncode != 0 and "exists" in r.stderr, r.stderr
    r = _cli("push", step_dir, f"{url}/step-4")
    assert r.returncode != 0 and "not a bucket root" in r.stderr, r.stderr


KILL_CHILD = r"""
import sys, torch, shmckpt
root, url = sys.argv[1], sys.argv[2]
ck = shmckpt.Checkpointer(root, tuning=shmckpt.Tuning(staging_capacity=64 << 20, chunk_size=1 << 20), remote=url)
h = ck.save(1, {"w": torch.arange(5 << 20, dtype=torch.float32)})
h.wait()
print("committed", flush=True)
h.wait_remote()
print("uploaded?!", flush=True)
"""


def test_trainer_killed_mid_upload_leaves_nothing_visible(s3, moto, root, monkeypatch):
    """SIGKILL while the second part of the upload is held by the server: nothing of the
    step is visible in the bucket; the upload the killed process opened is journaled in the
    bucket, and `shmckpt gc` aborts it (the server lists no upload after) and removes the
    journal; the next trainer's save commits."""
    client, bucket = s3
    hold = threading.Event()
    release = threading.Event()
    # A proxy that fails nothing, and holds part 2 until released (the child is killed
    # meanwhile).
    proxy = FaultProxy(moto.port, fail_part=10**9)
    orig = proxy.server.RequestHandlerClass._any

    def held(self):
        q = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
        if self.command == "PUT" and q.get("partNumber") == ["2"] and not release.is_set():
            hold.set()
            release.wait(60)
        return orig(self)

    proxy.server.RequestHandlerClass.do_PUT = held
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
    url = f"s3://{bucket}/kill"
    child = zygote.spawn(
        [sys.executable, "-c", KILL_CHILD, str(root), url],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert child.stdout.readline().strip() == "committed"
        assert hold.wait(60), "the upload never reached part 2"
        child.kill()
        child.wait(30)
    finally:
        release.set()
        if child.poll() is None:
            child.kill()
    try:
        left = keys(client, bucket, "kill/")
        assert len(left) == 1 and left[0].startswith("kill/.shmckpt/uploads/nosession-0-1-"), left
        journal = json.loads(client.get_object(Bucket=bucket, Key=left[0])["Body"].read())
        uploads = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
        assert [(u["Key"], u["UploadId"]) for u in uploads] == [(journal["object"], journal["upload_id"])]
        assert re.fullmatch(r"kill/step-1/rank-00000-of-00001\.[0-9a-f]{32}\.safetensors", journal["object"]), journal
        # gc: younger than --min-age, kept (may be in progress); with --min-age 0, aborted.
        r = _cli("gc", url, "--keep", "1")
        assert r.returncode == 0, r.stderr
        assert "aborted 0 multipart upload(s)" in r.stdout, r.stdout
        assert len(client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])) == 1
        r = _cli("gc", url, "--keep", "1", "--min-age", "0")
        assert r.returncode == 0, r.stderr
        assert "aborted 1 multipart upload(s)" in r.stdout, r.stdout
        assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
        assert keys(client, bucket, "kill/") == []
        # The next trainer: the local step 1 exists, so it saves step 2, which commits.
        with shmckpt.Checkpointer(
            root, tuning=shmckpt.Tuning(staging_capacity=64 << 20, chunk_size=1 << 20), remote=url
        ) as ck:
            assert ck.list() == [1] and ck.list(remote=True) == []
            h = ck.save(2, {"w": torch.ones(1 << 20)})
            h.wait()
            assert h.wait_remote()["step"] == 2
            assert ck.list(remote=True) == [2]
    finally:
        proxy.stop()


def test_remote_only_checkpointer_keeps_nothing_on_disk(s3, monkeypatch, tmp_path):
    """`Checkpointer("s3://...")`: every save goes to the bucket; the scratch directory
    holds no checkpoint after the upload started and is removed by close."""
    client, bucket = s3
    scratch_parent = tmp_path / "tmp"
    scratch_parent.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch_parent))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # TMPDIR is read again
    url = f"s3://{bucket}/only"
    with shmckpt.Checkpointer(
        url,
        tuning=shmckpt.Tuning(staging_capacity=SMALL, chunk_size=1 << 20),
        remote=shmckpt.RemoteTier(url, keep_last=2),
    ) as ck:
        assert ck.remote == url
        for step in (1, 2, 3):
            h = ck.save(step, state(step, 2048))
            h.wait()
            assert h.wait_remote()["step"] == step
        scratch = ck._scratch
        assert [p.name for p in scratch_parent.iterdir()] == [os.path.basename(scratch)]
        left = sorted(os.listdir(scratch))
        assert all(n.startswith(".shmckpt-rank-") for n in left), left
        assert ck.list(source="local") == [] and ck.list() == ck.list(remote=True) == [2, 3]
        same(ck.load("latest"), state(3, 2048))
        assert ck.last_load_source == ("remote", None)
    assert list(scratch_parent.iterdir()) == []
    with shmckpt.Checkpointer(url, tuning=shmckpt.Tuning(staging_capacity=SMALL, chunk_size=1 << 20)) as ck:
        same(ck.load(2), state(2, 2048))
    with pytest.raises(shmckpt.ConfigError):
        shmckpt.Checkpointer(url, remote=url)


def test_load_into_falls_back_to_the_bucket(s3, root):
    _, bucket = s3
    url = f"s3://{bucket}/li"
    st = state(5)
    with open_ck(root, url) as ck:
        h = ck.save(5, st)
        h.wait()
        h.wait_remote()
    shutil.rmtree(root / "step-5")
    with open_ck(root, url) as ck:
        dest = {"model": {"w": torch.zeros_like(st["model"]["w"]), "b": torch.zeros(7, dtype=torch.int64)}}
        res = ck.load_into(dest, strict=False)
        assert res.step == 5 and res.missing_keys == [] and res.unexpected_keys == []
        assert torch.equal(dest["model"]["w"], st["model"]["w"]) and torch.equal(dest["model"]["b"], st["model"]["b"])
        with pytest.raises(shmckpt.DestinationError):
            ck.load_into({"model": {"w": torch.zeros(3)}})


@pytest.mark.parametrize("mode", ["503", "reset"])
def test_transient_server_errors_are_retried(s3, moto, root, monkeypatch, mode):
    """Two failed part uploads (the server briefly down or overloaded) are retried by
    object_store: the step commits, byte for byte."""
    client, bucket = s3
    proxy = FaultProxy(moto.port, fail_part=1, mode=mode, budget=2)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
    try:
        url = f"s3://{bucket}/t"
        big = {"w": torch.arange(5 << 20, dtype=torch.float32)}
        with shmckpt.Checkpointer(
            root, tuning=shmckpt.Tuning(staging_capacity=64 << 20, chunk_size=1 << 20), remote=url
        ) as ck:
            h = ck.save(1, big)
            h.wait()
            assert h.wait_remote()["step"] == 1
            assert proxy.failed == 2
            assert ck.list(remote=True) == [1]
            assert torch.equal(ck.load(1, source="remote")["w"], big["w"])
    finally:
        proxy.stop()


def test_part_size_and_concurrency_settings(s3, root):
    """``remote_part_size``/``remote_concurrency`` reach the uploader: 5 MiB parts, 2 in
    flight, give a multipart object of exactly ceil(size / 5 MiB) parts with the file's
    bytes; settings out of range are a ConfigError before anything is opened."""
    client, bucket = s3
    url = f"s3://{bucket}/parts"
    big = {"w": torch.arange(3 * (5 << 20) // 4 + 1000, dtype=torch.float32)}  # ~15 MiB + 4 kB
    with open_ck(root, shmckpt.RemoteTier(url, part_size=5 << 20, concurrency=2)) as ck:
        h = ck.save(1, big)
        h.wait()
        assert h.wait_remote()["step"] == 1
        key = rank_key(client, bucket, "parts/step-1")
        local = (root / "step-1" / "rank-00000-of-00001.safetensors").read_bytes()
        assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == local
        etag = client.head_object(Bucket=bucket, Key=key)["ETag"].strip('"')
        assert etag.endswith(f"-{-(-len(local) // (5 << 20))}"), etag  # parts in the ETag
        assert torch.equal(ck.load(1, source="remote")["w"], big["w"])
    for bad in (dict(part_size=1 << 20), dict(concurrency=0), dict(concurrency=257)):
        with pytest.raises(shmckpt.ConfigError):
            open_ck(root, shmckpt.RemoteTier(url, **bad))
