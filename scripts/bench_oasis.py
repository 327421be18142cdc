"""OasisKV vs dense SGLang on one GPU host through SGLang's ``bench_serving``: the command line
of ``oasis_sglang.bench.serving`` (``--help`` there and in docs/benchmarks.md).

    python scripts/bench_oasis.py [--suite all] [--resume] [--out out/bench_oasis]
    python scripts/bench_oasis.py --suite all --list          # the planned runs
    bash scripts/gpu_smoke.sh 4 --suite all --resume          # on the lent H200, call after call
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # this checkout's package, not an installed copy

from oasis_sglang.bench.serving import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
