"""End-to-end benchmark: remote supervision against the colocated forward, measured in one run.

The ``spec-serve bench`` command, runnable from a checkout without installing (PYTHONPATH set):

    python benchmarks/bench_e2e.py --json cpu.json                                   # tiny target, CPU
    python benchmarks/bench_e2e.py --gpu-8b --devices cuda:0 --json h200.json        # 1 x H200
    python benchmarks/bench_e2e.py --gpu-8b --devices cuda:0,cuda:1 --json h200x2.json  # 2 x H200

Scenarios and options: ``python benchmarks/bench_e2e.py --help`` (spec_serve/tools/bench/).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spec_serve.tools.bench.command import main  # noqa: E402

if __name__ == "__main__":
    main()
