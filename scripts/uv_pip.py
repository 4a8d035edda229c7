"""`uv pip ARGS` for the venv whose python runs this, with the package sources pip is configured with here.

The test command installs with uv (scripts/test.sh, .ci/setup_vllm_venv.sh): the same resolution as pip, in a
fraction of its CPU. But uv reads none of pip's configuration, and a host's pip configuration can be what makes
an install right: a find-links directory serving the CPU build of torch, where PyPI's torch of the same version
is the CUDA build with gigabytes of CUDA libraries. So this reads pip's own view of its configuration (`pip
config list`: its files and PIP_* variables, env first, then the install command's section, then global) and
passes uv the same index, extra indexes, find-links, constraints and certificate bundle. Like pip, uv then picks
the best version across all of them (--index-strategy unsafe-best-match), not the first index that has a name.

    .venv/bin/python scripts/uv_pip.py install -c .ci/constraints.txt -e '.[dev]'

uv is the venv's own (`pip install uv` into it first). Other commands (uninstall) pass through as they are.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

# pip option -> the uv pip option that means the same; every value pip lists (whitespace-separated) is passed
OPTIONS = {"index-url": "--default-index", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
           "constraint": "--constraint"}
SECTIONS = (":env:", "install", "global")  # pip's precedence for `pip install`


def pip_config(python: str) -> dict[str, str]:
    """``{section.key: value}`` as ``python -m pip config list`` prints them (``key='value'``)."""
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True).stdout
    config = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            config[key] = ast.literal_eval(value)
    return config


def uv_options(config: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The uv pip arguments and environment that carry ``config``'s package sources."""
    args = ["--index-strategy", "unsafe-best-match"]
    env = {}
    for key, option in OPTIONS.items():
        for value in _setting(config, key).split():
            args += [option, value]
    if _setting(config, "no-index").lower() in ("1", "true", "yes", "on"):
        args.append("--no-index")
    cert = _setting(config, "cert")
    if cert:
        env["SSL_CERT_FILE"] = cert
    return args, env


def _setting(config: dict[str, str], key: str) -> str:
    return next((config[f"{section}.{key}"] for section in SECTIONS if f"{section}.{key}" in config), "")


def main(argv: list[str]) -> None:
    uv = Path(sys.executable).parent / "uv"
    if not uv.exists():
        sys.exit(f"error: {uv} is missing: install it into this venv first ({sys.executable} -m pip install uv)")
    command, *rest = argv
    args, env = uv_options(pip_config(sys.executable)) if command == "install" else ([], {})
    # --python: the venv this python belongs to, not an activated one or the first on PATH
    os.execve(uv, [str(uv), "pip", command, "--python", sys.executable, *args, *rest], {**os.environ, **env})


if __name__ == "__main__":
    main(sys.argv[1:])
