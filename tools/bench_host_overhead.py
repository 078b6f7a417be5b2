"""Host time of one ``attngen.prefill`` call without a GPU: the Python path, timed on a stand-in driver.

``python3 tools/bench_host_overhead.py [--calls 2000] [--batches 15] [--json]``

Loads the stub libcuda of ``tests/fake_cuda.py`` (needs gcc) and CPU torch tensors dressed as
CUDA tensors, then times ``attngen.prefill`` on B=1, S=128, H=8, D=64 bf16 as ``attngen bench jit``
does on a GPU. The numbers leave out what only a GPU costs (a CUDA allocation, torch's stream
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
    fake_cuda.prebuild()
    fake_cuda.install()
    wrap = fake_cuda.patch_torch_cuda()
    import torch

    import attngen

    q, k, v = (wrap(torch.randn(1, 128, 8, 64).to(torch.bfloat16)) for _ in range(3))
    out = torch.empty(1, 128, 8, 64, dtype=torch.bfloat16, device="cuda")
    cases = {
        "prefill(q, k, v)": lambda: attngen.prefill(q, k, v),
        "prefill(q, k, v, out=out)": lambda: attngen.prefill(q, k, v, out=out),
        "prefill(q, k, v, causal=True)": lambda: attngen.prefill(q, k, v, causal=True),
        "prefill(q, k, v, return_lse=True)": lambda: attngen.prefill(q, k, v, return_lse=True),
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
