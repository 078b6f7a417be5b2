"""A prewarm dies with its parent (issue 57): SIGKILL, SIGTERM or SIGINT to the prewarm process alone
leaves no worker or resource tracker behind, and SIGINT/SIGTERM cancel the pending work."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cache_support import ROOT, child_env

MANIFEST = """format = 1
archs = ["sm_80", "sm_86", "sm_89"]

[[kernel]]
family = "prefill"
head_dim = [64]
dtype = ["fp16", "bf16"]
mask = ["none", "causal", "sliding_window"]
"""


def _descendants(pid: int) -> set[int]:
    parents: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for c in parents.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _default_sigint() -> None:
    """In the child before exec: SIGINT to its default. A job a non-interactive shell starts in the background
    (``cmd &``) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler, which is right for
    the prewarm (an ignored Ctrl-C stays ignored) but would leave nothing for this test to see."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_prewarm_dies_with_its_parent(tmp_path, sig):
    manifest = tmp_path / "m.toml"
    manifest.write_text(MANIFEST)
    p = subprocess.Popen([sys.executable, "-m", "attngen", "prewarm", "--manifest", str(manifest), "--jobs", "2"],
                         cwd=str(ROOT), env=child_env(tmp_path / "cache"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=_default_sigint)
    kids: set[int] = set()
    try:
        first = p.stderr.readline()
        assert first.startswith("[1/18]"), first
        kids = _descendants(p.pid)
        assert len(kids) >= 2, kids  # the workers (and the resource tracker)
        os.kill(p.pid, sig)
        t0 = time.monotonic()
        rc = p.wait(timeout=20)
        deadline = time.monotonic() + 10
        while any(_alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [k for k in kids if _alive(k)], "workers outlived the prewarm"
        assert time.monotonic() - t0 < 15
        rest = p.stderr.read()  # EOF only now that no process holds the pipe
        if sig != signal.SIGKILL:
            assert rc == 128 + sig, (rc, rest)
            assert "[18/18]" not in rest and "interrupted" in rest, rest
            assert "Traceback" not in rest
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for k in kids | _descendants(p.pid):
            try:
                os.kill(k, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()
