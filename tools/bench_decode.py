"""attngen.decode vs PyTorch SDPA (flash / cudnn) on KV-cache decode shapes: GB/s, % of copy, ratios.

Runs from a checkout with no install: ``python tools/bench_decode.py --json results/bench_decode.json
--markdown results/decode.md``. Same as ``attngen bench decode ...``; ``--help`` lists the options.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from attngen.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["decode", *sys.argv[1:]]))
