"""Where a served decode step's GPU time goes, from a PyTorch profiler trace of SGLang: the command
line of ``oasis_sglang.bench.profile_trace``.

    python scripts/profile_trace.py TRACE.trace.json.gz --steps 8 [--out profile.md]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # this checkout's package, not an installed copy

from oasis_sglang.bench.profile_trace import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
