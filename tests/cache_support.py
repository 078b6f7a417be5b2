"""What the cache tests share: the cheapest kernel (head_dim 64 on sm_80), its key, a populated root to copy,
and a child process that builds it with a cache root of its own. The fixtures (``compiles``, ``golden``) are
conftest's."""

import hashlib
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from attngen.arch import get_arch
from attngen.builder import BuildResult
from attngen.cache import key_material, key_of
from attngen.compiler import compile_options
from attngen.spec import resolve
from attngen import PrefillSpec

ROOT = Path(__file__).resolve().parent.parent
SPEC = PrefillSpec(head_dim=64)
SPEC_TEXT = "prefill:head_dim=64"
ARCH = "sm_80"


def key_for(spec=SPEC, arch=ARCH) -> str:
    a = get_arch(arch)
    r = resolve(spec, a)
    return key_of(key_material(r, a, compile_options(a)))


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def populate(golden, dest: Path) -> BuildResult:
    root, results = golden
    shutil.copytree(root, dest)
    return results[ARCH]


def child_env(cache_dir: Path, **extra) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), ATTNGEN_CACHE_DIR=str(cache_dir))
    env.update(extra)
    return env


def run_child(code: str, cache_dir: Path, *args: str, timeout: float = 180, **extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=str(ROOT), env=child_env(cache_dir, **extra),
                          capture_output=True, text=True, timeout=timeout)


BUILD_AND_REPORT = f"""
import hashlib, json
from attngen.builder import build
from attngen.spec import parse_spec
r = build(parse_spec({SPEC_TEXT!r}), {ARCH!r})
print(json.dumps({{"origin": r.origin, "stored": r.stored, "key": r.key,
                  "sha": hashlib.sha256(r.binary.cubin).hexdigest()}}))
"""


def flip_cubin(entry: Path):
    """Corrupts a cache entry's cubin in place (16 bytes flipped in its middle)."""
    p = entry / "kernel.cubin"
    b = bytearray(p.read_bytes())
    mid = len(b) // 2
    b[mid:mid + 16] = bytes(x ^ 0xFF for x in b[mid:mid + 16])
    p.write_bytes(bytes(b))


@pytest.fixture
def other_user():
    """A second user (uid, gid) for tests that need two; created with useradd when run as root (as CI is)."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root to create a second user")
    name = f"ag57{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/false", name], check=True, capture_output=True)
    try:
        import pwd

        pw = pwd.getpwnam(name)
        yield pw.pw_uid, pw.pw_gid
    finally:
        subprocess.run(["userdel", name], capture_output=True)
