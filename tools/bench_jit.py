"""JIT latency of attngen: cold compile, warm load in a fresh process, repeated request, host overhead.

Runs from a checkout with no install: ``python tools/bench_jit.py --out results --markdown results/jit.md``
(on a machine with no GPU add ``--arch sm_90``). Same as ``attngen bench jit ...``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from attngen.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["jit", *sys.argv[1:]]))
