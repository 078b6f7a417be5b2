"""Checks run against the installed wheel, from a folder outside the checkout (see wheel_check.sh).

argv[1] is the checkout, only to make sure the attngen in use is not the one in it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import attngen
from attngen.cache_entry import unpack_source
from attngen.family import families
from attngen.manifest import load_manifest

repo = Path(sys.argv[1]).resolve()
pkg = Path(attngen.__file__).resolve().parent
assert repo not in pkg.parents, f"attngen was imported from the checkout ({pkg}), not from the wheel"
print(f"wheel: attngen {attngen.__version__} from {pkg}")

missing = [n for n in attngen.__all__ if not hasattr(attngen, n)]
assert not missing, f"public names missing from the installed package: {missing}"
print(f"wheel: {len(attngen.__all__)} public names import")

templates = pkg / "templates"
pieces = sorted(str(p.relative_to(templates)) for p in templates.rglob("*") if p.is_file())

# Every registered family's default spec, for sm_80 and sm_90a.
archs = ("sm_80", "sm_90a")
for fam in families():
    text = fam.spec().to_text()
    for arch in archs:
        out = subprocess.run(["attngen", "inspect", text, "--arch", arch, "--resources", "--json"],
                             capture_output=True, text=True)
        assert out.returncode == 0, f"attngen inspect {text} --arch {arch}: {out.stderr}"
        json.loads(out.stdout)
    print(f"wheel: attngen inspect {text} on {', '.join(archs)}")

lines = ["format = 1", f"archs = {json.dumps(list(archs))}"]
for group in load_manifest().groups:
    # every group of the default manifest, each list narrowed to its first value, on its own archs if it names them
    own = None if group.archs is None else [a.name for a in group.archs if a.name in archs]
    if own == []:
        continue
    lines.append("[[kernel]]")
    if own is not None:
        lines.append(f"archs = {json.dumps(own)}")
    for k, v in group.fields.items():
        v = v[0] if isinstance(v, list) else v
        lines.append(f"{k} = {json.dumps(v)}")
# Pieces only a variant outside the default manifest includes: the unfused decode kernels (decode/unfused.cuh) and
# the fp8-cache ones (decode/fp8.cuh).
lines += ["[[kernel]]", 'family = "decode"', 'variant = "unfused"']
lines += ["[[kernel]]", 'family = "decode"', 'kv_dtype = "fp8_e4m3"']
# and pieces the manifest reaches only through what its lines' ops choose by size (a first value of each list
# does not): MLA decode's alternate tiles (mla_decode/alternate.cuh), at 64 rows on sm_90a; its fp8 cache's wgmma
# kernel (mla_decode/fp8_wgmma.cuh), at 64 rows on sm_90a (the manifest's fp8 line starts at 16 rows: mma.sync).
lines += ["[[kernel]]", 'archs = ["sm_90a"]', 'family = "mla_decode"', "q_rows = 64", 'qk_shard = "alternate"']
lines += ["[[kernel]]", 'archs = ["sm_90a"]', 'family = "mla_decode"', "q_rows = 64", 'kv_dtype = "fp8_e4m3"']
with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
    f.write("\n".join(lines) + "\n")
rc = subprocess.call(["attngen", "prewarm", "--manifest", f.name, "--quiet"])
assert rc == 0, f"attngen prewarm of the slice exited {rc}"

# A mask_mod's block plan (prefill/mod_plan.cuh) is in snippet kernels only, which no manifest carries: one built
# through the command, into the same cache.
with tempfile.NamedTemporaryFile("w", suffix=".cu", delete=False) as m:
    m.write("return kv_idx <= q_idx;\n")
out = subprocess.run(["attngen", "inspect", "prefill:head_dim=128,custom_mask=true", "--mask-mod-file", m.name,
                      "--arch", "sm_90a", "--resources"], capture_output=True, text=True)
assert out.returncode == 0, f"attngen inspect of a mask_mod kernel: {out.stderr}"

root = Path(os.environ["ATTNGEN_CACHE_DIR"])
sources = "\n".join(unpack_source(p.read_bytes()) or "" for p in root.rglob("kernel.cu"))  # stored gzip-compressed
used = {line.split("// attngen:begin ", 1)[1].strip() for line in sources.splitlines() if "// attngen:begin " in line}
tops = {p for p in pieces if p.endswith(".cu.jinja")}  # the families' top-level templates are not bracketed
untouched = sorted(set(pieces) - used - tops)
assert not untouched, f"the prewarm slice touched no kernel that includes {untouched}"
print(f"wheel: prewarm of {len(lines)} manifest lines built kernels that include all {len(pieces) - len(tops)} "
      f"template pieces")
