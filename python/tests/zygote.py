"""Worker processes forked from one interpreter that imported torch and shmckpt once.

Each Python process a test starts pays ~2 CPU-s to import torch and shmckpt (the test
suite starts hundreds, on a 2-core CI machine). ``spawn(argv, ...)`` starts the same
command, ``[sys.executable, SCRIPT | -c CODE | -m MODULE, *args]``, as a child forked from
a server process (this file run as a script) that imported ``PRELOAD`` at its start and
is single-threaded in Python when it forks. The child then becomes the command as
``python`` would run it: its own argv, environment, working directory, stdin/stdout/
stderr (the caller's, passed over a Unix socket), ``sys.path`` (the script's directory or
the working directory, ``PYTHONPATH``, then the site directories), the code run as
``__main__``; it exits as an interpreter does (SystemExit's code, 1 and a traceback on an
uncaught exception, atexit handlers and finalisation). ``pid`` is the worker's own pid
(kill it, look for its arenas); the server reaps it and sends its wait status, so
``returncode`` is what ``subprocess.Popen`` would report (``-9`` after SIGKILL).

What is not the same as a fresh interpreter, so tests that depend on it keep
``subprocess`` (test_startup.py, import-time checks, interpreter options such as ``-u``
or ``-I``): the preloaded modules are in ``sys.modules`` before the command runs (a
``PYTHONPATH`` that would find another copy of one of them is refused, exit 70);
environment variables read at import time by a preloaded module (OMP_NUM_THREADS, read
by torch's OpenMP at load) take the server's values: the server runs with
``OMP_NUM_THREADS=1``, as every worker of these tests does; the worker's parent is the
server, not the test (it is reaped at once: no zombie waits for the test).

``SHMCKPT_TEST_FORK_SERVER=0`` makes ``spawn`` start a plain ``subprocess.Popen``.
"""

import atexit
import json
import os
import select
import socket
import struct
import subprocess
import sys
import tempfile
import threading

#: Imported once by a server: what nearly every worker of the suite imports. ``spawn``'s
#: ``preload=`` names more (one server per distinct set, started at its first use).
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "numpy", "shmckpt", "shmckpt.dcp")

_HERE = os.path.dirname(os.path.abspath(__file__))
_LEN = struct.Struct("!I")
_STATUS = struct.Struct("!i")


# ---------------------------------------------------------------- the server's side


def _recv_exact(sock, n):
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise EOFError("connection closed")
        buf += part
    return buf


def _serve(path):
    """Accept requests until stdin (a pipe from the test process) closes.
    Returns only in a forked child: ``(request, [stdin, stdout, stderr] fds)``."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print(json.dumps(sys.path), flush=True)
    waiting = {}  # pidfd -> (pid, connection)
    while True:
        readable, _, _ = select.select([listener, sys.stdin.fileno(), *waiting], [], [])
        for fd in readable:
            if fd == sys.stdin.fileno():
                if not os.read(fd, 4096):  # the test process is gone or done
                    for pidfd, (_, conn) in waiting.items():
                        conn.close()
                        os.close(pidfd)
                    listener.close()
                    sys.exit(0)
            elif fd is listener:
                conn, _ = listener.accept()
                head, fds, _, _ = socket.recv_fds(conn, _LEN.size, 3)
                head += _recv_exact(conn, _LEN.size - len(head))
                request = json.loads(_recv_exact(conn, _LEN.unpack(head)[0]))
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for pidfd, (_, other) in waiting.items():
                        other.close()
                        os.close(pidfd)
                    conn.close()
                    return request, fds
                for f in fds:
                    os.close(f)
                conn.sendall(_STATUS.pack(pid))
                waiting[os.pidfd_open(pid)] = (pid, conn)
            else:
                pid, conn = waiting.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                try:
                    conn.sendall(_STATUS.pack(status))
                except OSError:
                    pass  # the test stopped waiting
                conn.close()


def _become(request, fds):
    """In the forked child: set up the process as ``python`` would for the command, and
    return what to run."""
    for target, fd in enumerate(fds):
        if fd != target:
            os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"][1:]
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if argv[0] == "-c":
        first = ""
    elif argv[0] == "-m":
        first = os.getcwd()
    else:
        first = os.path.dirname(os.path.abspath(argv[0]))
    sys.path[:] = [first, *pythonpath, *request["site"]]
    # A preloaded module that this sys.path would find elsewhere would run stale code.
    import importlib.util

    for name, module in _PRE.items():
        sys.modules.pop(name)
        try:
            found = importlib.util.find_spec(name)
        finally:
            sys.modules[name] = module
        if _where(found) != _where(module.__spec__):
            print(f"zygote: {name} would be imported from {_where(found)}, not {_where(module.__spec__)}", file=sys.stderr)
            os._exit(70)
    return argv


_PRE = {}


def _where(spec):
    """A module's file, or a namespace package's first directory."""
    if spec is None:
        return None
    return os.path.realpath(spec.origin if spec.has_location else list(spec.submodule_search_locations)[0])


def _run(argv):
    """Run the command as ``__main__`` (raises what the command raises)."""
    import runpy
    import types

    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    elif argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy._run_module_as_main(argv[1], alter_argv=True)
    else:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


# ---------------------------------------------------------------- the test's side

_servers = {}
_lock = threading.Lock()


def _enabled():
    """On unless ``SHMCKPT_TEST_FORK_SERVER=0``, or ``PYTHONPATH`` is set: the server
    imports its modules from the site directories only (a worker whose ``PYTHONPATH``
    would find another copy is refused), so a run that finds ``shmckpt`` through
    ``PYTHONPATH`` (a source tree with its compiled module, as on the GPU machine) gets
    fresh interpreters instead of a server that cannot start."""
    if os.environ.get("PYTHONPATH"):
        return False
    return os.environ.get("SHMCKPT_TEST_FORK_SERVER", "1") != "0"


def _start(preload):
    with _lock:
        if preload in _servers:
            return _servers[preload]
        d = tempfile.mkdtemp(prefix="shmckpt-zygote-")
        path = os.path.join(d, "sock")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["OMP_NUM_THREADS"] = "1"
        with open(os.path.join(d, "server.log"), "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-P", os.path.abspath(__file__), path, ",".join(preload)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                cwd=d,
            )
        line = proc.stdout.readline()
        assert line.startswith(b"["), f"the fork server did not start: {line!r}, {open(log.name).read()}"
        site = json.loads(line)

        def stop():
            proc.stdin.close()
            proc.wait(timeout=60)
            for name in os.listdir(d):
                os.unlink(os.path.join(d, name))
            os.rmdir(d)

        atexit.register(stop)
        _servers[preload] = (path, site)
        return _servers[preload]


def _child_fd(spec, default):
    """(fd for the child, fd to close after sending, our end or None)."""
    if spec is None:
        return default, None, None
    if spec == subprocess.PIPE:
        r, w = os.pipe()
        return (w, w, r) if default != 0 else (r, r, w)
    if spec == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        return fd, fd, None
    if spec == subprocess.STDOUT:
        raise AssertionError("STDOUT is resolved by the caller")
    fd = spec if isinstance(spec, int) else spec.fileno()
    return fd, None, None


class Worker:
    """The parts of ``subprocess.Popen`` the tests use, for a forked worker."""

    def __init__(self, args, *, env=None, cwd=None, stdin=None, stdout=None, stderr=None, text=False, preload=()):
        path, site = _start(PRELOAD + tuple(preload))
        self.args = list(args)
        self.returncode = None
        self._text = text
        to_close, ours = [], {}
        fds = []
        for i, spec in enumerate((stdin, stdout)):
            fd, close, mine = _child_fd(spec, i)
            fds.append(fd)
            to_close += [close] if close is not None else []
            ours[i] = mine
        if stderr == subprocess.STDOUT:
            fds.append(fds[1])
            ours[2] = None
        else:
            fd, close, mine = _child_fd(stderr, 2)
            fds.append(fd)
            to_close += [close] if close is not None else []
            ours[2] = mine
        body = json.dumps({
            "argv": self.args,
            "env": dict(os.environ if env is None else env),
            "cwd": os.path.abspath(cwd or os.getcwd()),
            "site": site,
        }).encode()
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(path)
        try:
            socket.send_fds(self._conn, [_LEN.pack(len(body))], fds)
            self._conn.sendall(body)
            self.pid = _STATUS.unpack(_recv_exact(self._conn, _STATUS.size))[0]
        finally:
            for fd in to_close:
                os.close(fd)
        mode = "w" if text else "wb"
        self.stdin = os.fdopen(ours[0], mode) if ours[0] is not None else None
        mode = "r" if text else "rb"
        self.stdout = os.fdopen(ours[1], mode) if ours[1] is not None else None
        self.stderr = os.fdopen(ours[2], mode) if ours[2] is not None else None
        self._readers = None

    def _status(self, timeout):
        if self.returncode is not None:
            return self.returncode
        self._conn.settimeout(timeout)
        try:
            raw = _recv_exact(self._conn, _STATUS.size)
        except (socket.timeout, BlockingIOError):
            return None
        finally:
            self._conn.settimeout(None)
        self._conn.close()
        self.returncode = os.waitstatus_to_exitcode(_STATUS.unpack(raw)[0])
        return self.returncode

    def poll(self):
        return self._status(0)

    def wait(self, timeout=None):
        if self._status(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig):
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self):
        self.send_signal(9)

    def terminate(self):
        self.send_signal(15)

    def communicate(self, input=None, timeout=None):
        import time

        if self._readers is None:
            if self.stdin is not None:
                if input:
                    self.stdin.write(input)
                self.stdin.close()
            self._readers = []
            for stream in (self.stdout, self.stderr):
                if stream is None:
                    self._readers.append(None)
                    continue
                chunks = []
                t = threading.Thread(target=lambda s=stream, c=chunks: c.append(s.read()), daemon=True)
                t.start()
                self._readers.append((t, chunks, stream))
        deadline = None if timeout is None else time.monotonic() + timeout
        for r in self._readers:
            if r is not None:
                r[0].join(None if deadline is None else max(0, deadline - time.monotonic()))
                if r[0].is_alive():
                    raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0, deadline - time.monotonic()))
        outs = []
        for r in self._readers:
            if r is None:
                outs.append(None)
            else:
                r[2].close()
                outs.append(r[1][0] if r[1] else ("" if self._text else b""))
        return tuple(outs)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for s in (self.stdout, self.stderr, self.stdin):
            if s is not None and not s.closed:
                s.close()
        self.wait()


def _forkable(args):
    return (
        _enabled()
        and len(args) >= 2
        and args[0] == sys.executable
        and (args[1] in ("-c", "-m") or not args[1].startswith("-"))
    )


def spawn(args, *, preload=(), **kw):
    """``subprocess.Popen(args, **kw)`` for ``[sys.executable, SCRIPT | -c CODE | -m MOD, ...]``,
    forked from the server that preloaded ``PRELOAD`` and ``preload`` (stdin, stdout,
    stderr, env, cwd, text are supported)."""
    if not _forkable(args):
        return subprocess.Popen(args, **kw)
    return Worker(args, preload=preload, **kw)


def run(args, *, capture_output=False, timeout=None, check=False, input=None, **kw):
    """``subprocess.run`` over ``spawn``."""
    if capture_output:
        kw["stdout"] = kw["stderr"] = subprocess.PIPE
    if input is not None:
        kw["stdin"] = subprocess.PIPE
    with spawn(args, **kw) as p:
        try:
            out, err = p.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            raise
    cp = subprocess.CompletedProcess(args, p.returncode, out, err)
    if check:
        cp.check_returncode()
    return cp


if __name__ == "__main__":
    _preload = sys.argv[2].split(",")
    for _name in _preload:
        __import__(_name)
    _PRE.update({n: sys.modules[n] for n in {m.split(".")[0] for m in _preload}})
    # The preloaded objects go to the permanent generation: the children's collections
    # do not walk them (nor copy their pages).
    import gc

    gc.collect()
    gc.freeze()
    _request, _fds = _serve(sys.argv[1])
    _run(_become(_request, _fds))
