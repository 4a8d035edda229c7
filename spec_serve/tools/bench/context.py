"""A run's context: its config, the colocated engines and references, and the cluster its remote scenarios need."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from spec_serve.tools.bench.batches import padded_batch, row_lengths, worker_threads
from spec_serve.tools.bench.checks import _flip_bounds, _row_noise, verify_packed
from spec_serve.tools.bench.config import LLAMA_8B_AUX_LAYERS, LLAMA_8B_CONFIG, BenchConfig, bytes_per_token
from spec_serve.tools.bench.helpers import _spawn_helper

if TYPE_CHECKING:
    from spec_serve.tools.launch import Cluster


# Services of one worker on the first device, and the flags that worker takes besides the common ones.
ONE_WORKER_SERVICES = {"w1": (), "nccl": (), "packed": ("--packing",), "compiled": ("--compile",),
                       "compiled_packed": ("--packing", "--compile")}


class Context:
    """What scenarios share: config, target, batches, mapping, the cluster (started lazily)."""

    def __init__(self, cfg: BenchConfig, tmp: str):
        from spec_serve.supervision.vocab import build_vocab_mapping
        from spec_serve.tools.random_target import write_random_init_target
        from spec_serve.tools.tiny import make_tiny_target

        self.cfg, self.tmp = cfg, tmp
        self.device = torch.device(cfg.devices[0])
        if cfg.target:
            self.target = cfg.target
        elif cfg.gpu_8b:
            self.target = str(write_random_init_target(Path(tmp) / "llama-8b-shape", LLAMA_8B_CONFIG))
        else:
            self.target = str(make_tiny_target(Path(tmp) / "tiny"))
        self.config = json.loads((Path(self.target) / "config.json").read_text())
        vocab = int(self.config["vocab_size"])
        self.info = {"vocab_size": vocab, "hidden_size": int(self.config["hidden_size"])}
        lengths = row_lengths(cfg.lengths, max(cfg.warmup, 1) + cfg.steps, cfg.batch, cfg.seq)
        self.batches = [padded_batch(rows, vocab, seed=s) for s, rows in enumerate(lengths)]
        ids = torch.cat([b[0].reshape(-1) for b in self.batches[:4]])
        loss = torch.cat([b[2].reshape(-1) for b in self.batches[:4]])
        self.mapping = build_vocab_mapping(ids, loss, vocab, min(cfg.draft_vocab, vocab))
        dtype_bytes = 2 if (cfg.dtype or self.config.get("torch_dtype", "float32")) in ("bfloat16", "float16") else 4
        self.dtype_bytes = dtype_bytes
        self.reply_bytes_per_token = bytes_per_token(self.info["hidden_size"], min(cfg.draft_vocab, vocab),
                                                     dtype_bytes)
        self._engine = None
        self._compiled = None
        self._noise: dict[int, dict[str, float]] = {}  # batch -> the eager forward's batch-composition noise
        self._flip_bounds: dict[int, dict[str, float]] = {}  # batch -> its derived flip bound
        self._references: dict[tuple, dict] = {}  # (batch, how it was received) -> its colocated fingerprint
        self.recycle = True
        self.cluster: Cluster | None = None  # started by start_cluster
        self.extra_figures: dict[str, dict] = {}  # figures a scenario measured besides its own (compile_*)
        self._stack = contextlib.ExitStack()

    def engine(self):
        if self._engine is None:
            from spec_serve.engines.hf import HFTarget

            self._engine = HFTarget(self.target, device=self.device, dtype=self.cfg.dtype,
                                    aux_layer_ids=self._aux_ids())
            self._engine.set_vocab_mapping(*self.mapping)
        return self._engine

    def compiled_engine(self):
        """A second colocated engine, ``HFTarget(compile=True)`` (started after the workers: it loads the
        kernels a compiling worker already put in the Inductor cache)."""
        if self._compiled is None:
            from spec_serve.engines.hf import HFTarget

            with worker_threads(self.device):
                self._compiled = HFTarget(self.target, device=self.device, dtype=self.cfg.dtype,
                                          aux_layer_ids=self._aux_ids(), compile=True)
            self._compiled.set_vocab_mapping(*self.mapping)
        return self._compiled

    def verify_compiled(self, batches, outputs, remote: bool = False) -> dict[str, Any]:
        """Compiled answers: within ``compiled.TOLERANCE`` of the colocated eager forward (``verify_packed``),
        next to the eager forward's own batch-composition noise on the same rows (``noise``); a ``remote``
        worker's padded answers also counted bit-equal to the colocated compiled forward
        (``bit_equal_compiled``; a packing worker's are not, as queued requests may share a forward)."""
        from spec_serve.tools.verify import mismatch

        with worker_threads(self.device):
            checked = verify_packed(self.engine(), batches, outputs, flip_bounds=self.flip_bounds)
            checked["noise"] = self.batch_noise(batches)
            if remote:
                engine = self.compiled_engine()
                equal = sum(mismatch(out, engine.generate_batch(*b, kind="eagle3")) is None
                            for b, out in zip(batches, outputs))
                checked["bit_equal_compiled"] = f"{equal}/{len(outputs)}"
        return checked

    def flip_bounds(self, batch, reference: dict | None = None) -> dict[str, float]:
        """``batch``'s flip bound (``verify_packed``), derived once per batch and kept over rounds."""
        if id(batch[0]) not in self._flip_bounds:
            with worker_threads(self.device):
                self._flip_bounds[id(batch[0])] = _flip_bounds(self.engine(), batch, reference)
        return self._flip_bounds[id(batch[0])]

    def batch_noise(self, batches) -> dict[str, float]:
        """The eager forward's batch-composition noise on these rows (the yardstick compiled and packed
        answers are held against, docs/compile.md): each row alone, as a batch of one of its real tokens,
        against the same row inside its batch (``packing.compare``), worst per measure over all rows."""
        worst: dict[str, float] = {}
        for b in batches:
            if id(b[0]) not in self._noise:
                self._noise[id(b[0])] = _row_noise(self.engine(), b)
            for key, value in self._noise[id(b[0])].items():
                worst[key] = max(worst.get(key, 0.0), value)
        return {k: float(f"{v:.3g}") for k, v in sorted(worst.items())}

    def verify(self, batch: tuple, got: dict, *, shards: int = 1, compact: bool = False,
               device: torch.device | None = None, kind: str = "eagle3", quiet: bool = False) -> bool:
        """Whether ``got`` equals, bit for bit, the colocated forward of ``batch`` as a client with
        ``shards`` shards (and ``compact``, expanded on ``device``) receives it; a mismatch is printed."""
        from spec_serve.tools.verify import colocated_reference, mismatch

        with worker_threads(self.device):
            want = colocated_reference(self.engine(), batch, kind, shards=shards, compact=compact,
                                       device=device, selected=self.mapping)
        wrong = mismatch(got, want)
        if wrong is not None and not quiet:
            print(f"[bench] a batch differs from the colocated forward: {wrong}", file=sys.stderr, flush=True)
        return wrong is None

    def keep_reference(self, i: int, out: dict[str, torch.Tensor], *, kind: str, compact: bool) -> None:
        """The colocated forward's answer to batch ``i`` (unsharded, compact ones expanded on this device),
        fingerprinted (``verify.fingerprint``) as the reference remote answers to it are checked against."""
        from spec_serve.tools.verify import fingerprint

        self._references.setdefault(self._reference_key(i, kind, 1, compact, self.device), fingerprint(out))

    def check(self, i: int, got, *, shards: int = 1, compact: bool = False, device: torch.device | None = None,
              kind: str = "eagle3", quiet: bool = False) -> bool:
        """Whether the fingerprint ``got`` of a remote answer to batch ``i`` equals that of the colocated
        forward as a client with ``shards`` shards (and ``compact``, expanded on ``device``) receives it: the
        colocated scenario's own answer where it ran, else computed once and kept for every round."""
        from spec_serve.tools.verify import colocated_reference, fingerprint, fingerprint_mismatch

        key = self._reference_key(i, kind, shards, compact, device or self.device)
        if key not in self._references:
            with worker_threads(self.device):
                want = colocated_reference(self.engine(), self.batches[i], kind, shards=shards, compact=compact,
                                           device=device, selected=self.mapping)
            self._references[key] = fingerprint(want)
        wrong = fingerprint_mismatch(got, self._references[key])
        if wrong is not None and not quiet:
            print(f"[bench] batch {i} differs from the colocated forward: {wrong}", file=sys.stderr, flush=True)
        return wrong is None

    @staticmethod
    def _reference_key(i: int, kind: str, shards: int, compact: bool, device: torch.device) -> tuple:
        return i, kind, shards, compact, str(device) if compact else None  # only an expansion depends on the device

    def _aux_ids(self):
        return [int(i) for i in LLAMA_8B_AUX_LAYERS.split(",")] if self.cfg.gpu_8b else None

    @property
    def frontend(self) -> str:
        """The cluster's client endpoint; scenarios that use it run after ``start_cluster``."""
        assert self.cluster is not None, "start_cluster first"
        return self.cluster.frontend

    def start_cluster(self, services: set[str]) -> None:
        """One broker; each service its own workers (all start in parallel, then we wait)."""
        from spec_serve.tools.launch import Cluster

        cfg = self.cfg
        log_dir = Path(cfg.log_dir) if cfg.log_dir else None
        cluster = Cluster.on_free_ports(env={"SPEC_SERVE_UNKNOWN_SERVICE_GRACE": "600"}, log_dir=log_dir)
        self._stack.callback(cluster.stop)
        cluster.start_broker()
        common = ["--capacity", "2"]
        if cfg.dtype:
            common += ["--dtype", cfg.dtype]
        if cfg.gpu_8b:
            common += ["--aux-layer-ids", LLAMA_8B_AUX_LAYERS]
        second = cfg.devices[1] if len(cfg.devices) > 1 else cfg.devices[0]
        expected = 0
        for service in sorted(services & ONE_WORKER_SERVICES.keys()):
            cluster.start_worker(self.target, "--device", cfg.devices[0], *ONE_WORKER_SERVICES[service], *common,
                                 service=service)
            expected += 1
        if "w2" in services:
            for device in (cfg.devices[0], second):
                cluster.start_worker(self.target, "--device", device, *common, service="w2")
            expected += 2
        if "batch" in services:
            cluster.start_worker(self.target, "--device", cfg.devices[0], "--packing", "--max-batch-tokens",
                                 str(cfg.max_batch_tokens),
                                 *[a for a in common if a not in ("--capacity", "2")], "--capacity", "8",
                                 service="batch")
            expected += 1
        if "null" in services:  # tools/null_engine.py: the 8B reply shape, whatever the target
            proc = _spawn_helper("_null_worker", cluster.backend, "null")
            cluster.workers.append(proc)
            expected += 1
        cluster.wait_workers(expected, timeout=900)
        self.cluster = cluster

    def close(self) -> None:
        self._stack.close()
