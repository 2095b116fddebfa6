"""zygote.spawn/run (the fork server of the multi-process tests) against subprocess: the
same command gives the same stdout, stderr and return code either way."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

import zygote

# Without the fork server (SHMCKPT_TEST_FORK_SERVER=0, or PYTHONPATH set: zygote._enabled)
# both sides would be subprocess.run: nothing would be compared. A skip, shown as one.
pytestmark = pytest.mark.skipif(not zygote._enabled(), reason="the fork server is off (zygote._enabled)")

SCRIPT = textwrap.dedent("""\
    import atexit, os, sys
    print("argv", sys.argv[1:], "cwd", os.getcwd(), "X", os.environ.get("X"), "Y" in os.environ)
    print("path0", sys.path[0], "main", __name__, "pp", sys.path[1] == os.environ["PYTHONPATH"].split(os.pathsep)[0])
    print("to stderr", file=sys.stderr)
    atexit.register(print, "atexit")
    how = sys.argv[1]
    if how == "kill":
        sys.stdout.flush()
        os.kill(os.getpid(), 9)
    if how == "raise":
        raise ValueError("boom")
    if how == "input":
        print("read", sys.stdin.read().upper())
    sys.exit(int(sys.argv[2]))
""")


@pytest.fixture
def script(tmp_path):
    p = tmp_path / "sub" / "w.py"
    p.parent.mkdir()
    p.write_text(SCRIPT)
    return p


def both(args, **kw):
    env = dict(os.environ, X="x", PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("Y", None)
    a = subprocess.run(args, capture_output=True, text=True, env=env, timeout=60, **kw)
    b = zygote.run(args, capture_output=True, text=True, env=env, timeout=60, **kw)
    return a, b


@pytest.mark.parametrize("how", [("exit", "0"), ("exit", "3"), ("kill", "0"), ("raise", "0"), ("input", "0")])
def test_a_script_runs_as_under_subprocess(script, tmp_path, how):
    os.environ["Y"] = "set in the test process only"
    try:
        kw = {"input": "abc"} if how[0] == "input" else {}
        a, b = both([sys.executable, str(script), *how], cwd=tmp_path, **kw)
    finally:
        del os.environ["Y"]
    assert a.returncode == {"exit": int(how[1]), "kill": -signal.SIGKILL, "raise": 1, "input": 0}[how[0]]
    assert (b.returncode, b.stdout) == (a.returncode, a.stdout)
    if how[0] == "raise":  # the traceback's last line (the fork server's frames differ)
        assert b.stderr.splitlines()[-1] == a.stderr.splitlines()[-1] == "ValueError: boom"
    else:
        assert b.stderr == a.stderr == "to stderr\n"


def test_dash_c_runs_as_under_subprocess(tmp_path):
    code = "import sys; print(sys.argv, __name__, repr(sys.path[0])); sys.exit(sys.argv[1])"
    a, b = both([sys.executable, "-c", code, "bye"], cwd=tmp_path)
    assert (a.returncode, a.stdout, a.stderr) == (1, "['-c', 'bye'] __main__ ''\n", "bye\n")
    assert (b.returncode, b.stdout, b.stderr) == (a.returncode, a.stdout, a.stderr)


def test_a_worker_is_killed_and_timed_out_by_pid(script):
    p = zygote.spawn([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                     stdout=subprocess.PIPE)
    assert p.stdout.readline() == b"up\n"
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=0.2)
    assert p.poll() is None
    assert os.path.exists(f"/proc/{p.pid}")
    p.kill()
    assert p.wait(timeout=30) == -signal.SIGKILL
    p.stdout.close()
