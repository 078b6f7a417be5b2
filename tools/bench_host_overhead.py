"""Host time of one ``attngen.prefill`` and ``attngen.decode`` call without a GPU: the Python path, timed on a stand-in driver.

``python3 tools/bench_host_overhead.py [--calls 2000] [--batches 15] [--json]``

Loads the stub libcuda of ``tests/fake_cuda.py`` (needs gcc) and CPU torch tensors dressed as
CUDA tensors, then times ``attngen.prefill`` on B=1, S=128, H=8, D=64 bf16 and ``attngen.decode`` on B=1,
H=32/8, D=128 against a 256-cell cache, as ``attngen bench host`` does on a GPU. The numbers leave out what only a GPU costs (a CUDA allocation, torch's stream
query, the driver's own launch work), so they are a floor of the GPU harness's, for comparing
versions of the Python path on one machine. The first call compiles through NVRTC into a
temporary cache root.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import fake_cuda  # noqa: E402


def measure(calls: int, batches: int) -> dict:
    fake_cuda.prebuild(extra=[("DecodeSpec", dict(head_dim=128, dtype="bf16", q_rows=16))])
    fake_cuda.install()
    wrap = fake_cuda.patch_torch_cuda()
    import torch

    import attngen

    q, k, v = (wrap(torch.randn(1, 128, 8, 64).to(torch.bfloat16)) for _ in range(3))
    out = torch.empty(1, 128, 8, 64, dtype=torch.bfloat16, device="cuda")
    dq = wrap(torch.randn(1, 1, 32, 128).to(torch.bfloat16))
    kc, vc = (wrap(torch.randn(1, 256, 8, 128).to(torch.bfloat16)) for _ in range(2))
    lens = wrap(torch.tensor([200], dtype=torch.int32))
    cases = {
        "prefill(q, k, v)": lambda: attngen.prefill(q, k, v),
        "prefill(q, k, v, out=out)": lambda: attngen.prefill(q, k, v, out=out),
        "prefill(q, k, v, causal=True)": lambda: attngen.prefill(q, k, v, causal=True),
        "prefill(q, k, v, return_lse=True)": lambda: attngen.prefill(q, k, v, return_lse=True),
        "decode(q, k_cache, v_cache, cache_seqlens=lens)": lambda: attngen.decode(dq, kc, vc, cache_seqlens=lens),
        "decode(..., cache_seqlens=200)": lambda: attngen.decode(dq, kc, vc, cache_seqlens=200),
        "torch.empty_like(q) (for scale)": lambda: torch.empty(1, 128, 8, 64, dtype=torch.bfloat16, device="cuda"),
    }
    res = {}
    for label, fn in cases.items():
        for _ in range(50):
            fn()
        per = []
        for _ in range(batches):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            per.append((time.perf_counter() - t0) / calls * 1e6)
        res[label] = round(statistics.median(per), 3)
    res["launches recorded by the stub"] = fake_cuda.counts()["launches"]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--batches", type=int, default=15)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if not fake_cuda.available():
        print("error: needs gcc to build the stub driver", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="attngen-host-") as tmp:
        os.environ["ATTNGEN_CACHE_DIR"] = tmp
        res = measure(a.calls, a.batches)
    if a.json:
        print(json.dumps(res))
    else:
        for label, us in res.items():
            print(f"{label:40s} {us}" + (" us" if isinstance(us, float) else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
