"""attngen.prefill vs PyTorch SDPA (flash / cudnn / efficient) on FlashAttention's standard sweep.

Runs from a checkout with no install: ``python tools/bench_prefill.py --out results --markdown results/prefill.md``.
Same as ``attngen bench prefill ...``; ``--help`` lists the options.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from attngen.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["prefill", *sys.argv[1:]]))
