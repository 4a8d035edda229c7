"""``python -m spec_serve.tools.bench``: the ``spec-serve bench`` command, or a helper process."""

from __future__ import annotations

import sys

from spec_serve.tools.bench.compile_time import _compile_probe_main
from spec_serve.tools.bench.helpers import _direct_server, _null_worker, _push_sender


def main(argv: list[str] | None = None) -> None:
    """``python -m spec_serve.tools.bench``: the ``spec-serve bench`` command (one parser), or a helper process."""
    argv = sys.argv[1:] if argv is None else argv
    helpers = {"_null_worker": _null_worker, "_direct_server": _direct_server, "_push_sender": _push_sender,
               "_compile_probe": _compile_probe_main}
    if argv and argv[0] in helpers:
        helpers[argv[0]](argv[1:])
        return
    from spec_serve.tools.cli import bench

    bench.main(args=argv, prog_name="python -m spec_serve.tools.bench")
