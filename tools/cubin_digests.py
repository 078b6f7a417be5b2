"""Build a manifest into a fresh cache and print one line per kernel: arch, resolved spec, cubin SHA-256.

Used to show that a restructuring leaves every binary byte-identical: run it on two commits and
diff the outputs (``diff before.txt after.txt``). It reads the entries' ``meta.json`` only, so it
works across versions whose cache keys differ.

    python3 tools/cubin_digests.py --out before.txt [--manifest FILE] [--jobs N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="where to write the digest lines")
    p.add_argument("--manifest", help="manifest to build (default: the shipped one)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--cache", help="cache root to build into (default: a new temporary folder)")
    args = p.parse_args(argv)
    root = Path(args.cache or tempfile.mkdtemp(prefix="attngen-digests-"))
    env = dict(os.environ, ATTNGEN_CACHE_DIR=str(root))
    cmd = [sys.executable, "-m", "attngen", "prewarm", "--quiet", "--jobs", str(args.jobs)]
    if args.manifest:
        cmd += ["--manifest", args.manifest]
    rc = subprocess.call(cmd, env=env)
    lines = []
    for meta_path in root.rglob("meta.json"):
        meta = json.loads(meta_path.read_text())
        lines.append(f"{meta['arch']} {meta['spec_text']} {meta['cubin_sha256']}")
    lines.sort()
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"{len(lines)} kernels from {root} -> {args.out} (prewarm rc {rc})")
    return rc


if __name__ == "__main__":
    sys.exit(main())
