"""The command line and the broker never import torch (issue 22, item 4): `spec-serve --help` and
`--version` cost an interpreter, click and a few of our own modules, and a broker process holds no torch
even after it registered draft-vocab mappings and routed requests (it reads mappings as numpy arrays).

Speed itself is measured, not asserted (BENCHMARKS.md); these tests hold the mechanism: what is imported.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cluster_util import CLIENT_KW, FAST_ENV
from spec_serve.client.api import RemoteTargetModel
from spec_serve.tools.cli import main
from spec_serve.tools.launch import free_port, local_cluster
from spec_serve.tools.tiny import sample_batch


def torch_import_chain(importtime: str) -> list[str]:
    """From ``python -X importtime`` output: the first torch module imported and the modules that imported
    it, innermost first ([] if torch was never imported)."""
    rows = []
    for line in importtime.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            name = line.rsplit("|", 1)[1]
            rows.append((len(name) - len(name.lstrip()), name.strip()))
    for i, (depth, name) in enumerate(rows):
        if name == "torch" or name.startswith("torch."):
            chain = [name]
            for parent_depth, parent in rows[i + 1:]:  # a parent finishes after its children
                if parent_depth < depth:
                    chain.append(parent)
                    depth = parent_depth
            return chain
    return []


def test_the_chain_finder_names_who_imports_torch():
    """The helper the next test trusts: fed a real interpreter's import log, it names the chain."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "import spec_serve.engines.hf"],
                         capture_output=True, text=True, timeout=120)
    chain = torch_import_chain(out.stderr)
    assert chain and chain[0].startswith("torch") and "spec_serve.engines.hf" in chain, chain


@pytest.mark.parametrize("args", [("--help",), ("--version",), *((name, "--help") for name in sorted(main.commands))],
                         ids=lambda args: " ".join(args))
def test_cli_help_and_version_import_no_torch(args):
    script = Path(sys.executable).with_name("spec-serve")  # the entry point a user runs, when installed
    entry = [str(script)] if script.is_file() else ["-m", "spec_serve.tools.cli"]
    out = subprocess.run([sys.executable, "-X", "importtime", *entry, *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert ", version " in out.stdout or "Usage:" in out.stdout, out.stdout
    chain = torch_import_chain(out.stderr)
    assert not chain, "spec-serve " + " ".join(args) + " imports torch: " + " <- ".join(chain)


def test_a_worker_with_a_bad_broker_fails_before_importing_torch(tiny_target_dir):
    """A worker (on the CPU, no layer-id flags: nothing asks for torch) fails its broker check with its one line
    before it imports torch: seconds of CPU less for a user's typo, and for every such test here."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "spec_serve.tools.cli", "worker", "--target",
                          str(tiny_target_dir), "--device", "cpu", "--broker", f"tcp://127.0.0.1:{free_port()}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "nothing accepts connections" in out.stderr, out.stderr[-2000:]
    chain = torch_import_chain(out.stderr)
    assert not chain, "a worker imported torch before its broker check: " + " <- ".join(chain)


def _maps_torch(pid: int) -> bool:
    """Whether process ``pid`` has torch's native library mapped (it imported torch)."""
    return any("libtorch" in Path(line.rsplit(" ", 1)[-1]).name
               for line in Path(f"/proc/{pid}/maps").read_text().splitlines())


def test_a_serving_broker_holds_no_torch(tiny_target_dir, tiny_vocab_mapping):
    """A broker that registered a mapping (SET_VOCAB: it checks and digests the tensors) and routed
    EAGLE-3 and DSpark requests has no torch in its process; its worker, for contrast, has."""
    with local_cluster(tiny_target_dir, workers=1, env=FAST_ENV) as cluster, \
            RemoteTargetModel(cluster.frontend, timeout=60, **CLIENT_KW) as client:
        client.set_vocab_mapping(*tiny_vocab_mapping)
        batch = sample_batch(tiny_target_dir, 2, 16, seed=0)
        assert client.generate_batch(*batch, kind="eagle3")["target_probs"].shape[-1] == len(tiny_vocab_mapping[0])
        assert client.generate_batch(*batch, kind="dspark")["target_hidden_states"].shape[0] == 2
        assert cluster.get("/metrics")[0] == 200 and cluster.get("/model_info")[0] == 200
        assert _maps_torch(cluster.workers[0].pid), "the check finds torch where it is"
        assert not _maps_torch(cluster.broker.pid), "the broker process imported torch"


def test_the_version_is_one_number():
    """`--version` prints spec_serve.__version__ (it must work without installed metadata); pyproject.toml
    must say the same."""
    import spec_serve

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["version"] == spec_serve.__version__


def test_importing_the_client_loads_no_reply_path():
    """``PATHS`` names modules imported when a client's or worker's paths are built: importing the client
    loads neither NCCL's pair group (nor any torch.distributed module that ``import torch`` itself does not
    load) nor the same-host plane."""
    code = ("import sys; import torch; base = set(sys.modules); import spec_serve.client; "
            "print(*sorted(set(sys.modules) - base))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = out.stdout.split()
    assert "spec_serve.client.api" in loaded  # the probe saw the client's own modules
    unwanted = [m for m in loaded
                if m.startswith(("torch.distributed", "spec_serve.paths.nccl", "spec_serve.paths.plane"))]
    assert unwanted == []
