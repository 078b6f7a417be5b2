"""Build a manifest into a fresh cache and print one line per kernel: arch, resolved spec, and the
SHA-256 of its machine code.

Used to show that a restructuring leaves every kernel's machine code byte-identical: run it on two
commits and diff the outputs (``diff before.txt after.txt``). The digest covers the ELF's
``.text.*`` sections (every entry of the module, in section-name order), not the whole cubin: the
whole cubin differs whenever the template source does, even where the code does not. This needs
no disassembler; where the digests differ, ``nvdisasm -c`` of the two cubins (the pip wheel
nvidia-cuda-nvdisasm of the NVRTC's version) shows how. It reads the entries' ``meta.json`` and
cubins only, so it works across versions whose cache keys differ.

``--per-entry`` prints one line per entry instead (the entry's suffix after the kernel name, "" for the
main one), so that an entry added to a module does not hide whether the others changed.

    python3 tools/cubin_digests.py --out before.txt [--manifest FILE] [--jobs N] [--per-entry]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path


def text_sections(cubin: bytes) -> list[tuple[str, bytes]]:
    """The ``.text.*`` sections of an ELF64 cubin (name, bytes), in section-name order."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not an ELF64 file")
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    strtab = heads[shstrndx][4]

    def name(off: int) -> str:
        return cubin[strtab + off:cubin.index(b"\0", strtab + off)].decode()

    texts = sorted((name(n), cubin[o:o + size]) for n, _, _, _, o, size in heads if name(n).startswith(".text."))
    if not texts:
        raise ValueError("no .text sections")
    return texts


def text_digest(cubin: bytes) -> str:
    """SHA-256 over the ``.text.*`` sections of an ELF64 cubin, in section-name order."""
    h = hashlib.sha256()
    for _, code in text_sections(cubin):  # names carry the kernel name, which the spec already keys
        h.update(len(code).to_bytes(8, "little") + code)
    return h.hexdigest()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="where to write the digest lines")
    p.add_argument("--manifest", help="manifest to build (default: the shipped one)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--cache", help="cache root to build into (default: a new temporary folder)")
    p.add_argument("--per-entry", action="store_true", help="one digest per entry of each module")
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
        cubin = (meta_path.parent / "kernel.cubin").read_bytes()
        if not args.per_entry:
            lines.append(f"{meta['arch']} {meta['spec_text']} {text_digest(cubin)}")
            continue
        for section, code in text_sections(cubin):
            entry = section.removeprefix(".text." + meta["kernel_name"])
            lines.append(f"{meta['arch']} {meta['spec_text']} entry={entry!r} {hashlib.sha256(code).hexdigest()}")
    lines.sort()
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"{len(lines)} kernels from {root} -> {args.out} (prewarm rc {rc})")
    return rc


if __name__ == "__main__":
    sys.exit(main())
