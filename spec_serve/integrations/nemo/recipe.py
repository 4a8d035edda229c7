"""NeMo's EAGLE-3 recipe with spec-serve as its remote target: the recipe class and its launcher.

The switch is one line, whichever of NeMo's seams a run goes through:

- the launcher: ``python -m spec_serve.integrations.nemo CONFIG.yaml`` in place of ``automodel CONFIG.yaml``
  (``torchrun --nproc-per-node N -m spec_serve.integrations.nemo CONFIG.yaml`` for several ranks);
- NeMo's own CLI: ``recipe: spec_serve.integrations.nemo.SpecServeEagle3Recipe`` in the YAML (its
  ``recipe:`` key takes any dotted class name).

Either way the YAML's ``target_model_backend: remote`` and ``remote_urls`` (or ``SPEC_SERVE_CLIENT_BROKER``)
point the recipe at a broker, and every client option comes from the environment or the YAML
(``recipe_args.spec_serve``, docs/client-options.md). :class:`SpecServeRecipeMixin` holds what changes in
NeMo's ``TrainEagle3Recipe``:

- ``_setup_remote_target`` builds :class:`SpecServeEagle3Target` from the whole ``recipe_args`` (NeMo's own
  passes only ``timeout`` and ``max_retries``);
- packed sequences (``packed_sequence_size > 0``): NeMo refuses them for every backend but ``colocated``,
  because its server cannot mask per document; spec-serve can (packed.py), so for that one gate the
  backend reads as ``colocated`` while setup runs, and the target is built remotely where NeMo would load
  it; ``_prefetched_batches`` hands each packed batch's boundaries to the target, since NeMo's loop does
  not pass them;
- ``_resolve_prefetch_depth`` keeps NeMo's checks but not its cap at one request a worker.

:func:`patch_recipe` is the older switch (NeMo builds :class:`SpecServeEagle3Target` through its own
``_setup_remote_target``): it reaches the environment, but not the YAML's ``spec_serve`` keys nor packing.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from spec_serve.integrations.nemo.target import SpecServeEagle3Target

logger = logging.getLogger("spec_serve.nemo")

RECIPE_MODULE = "nemo_automodel.recipes.llm.train_eagle3"
RECIPE_CLASS = "TrainEagle3Recipe"
# What a YAML's `recipe:` key may name for this launcher: NeMo's EAGLE-3 recipe, or ours.
_EAGLE3_RECIPES = ("TrainEagle3Recipe", "SpecServeEagle3Recipe")


class SpecServeRecipeMixin:
    """Overrides of NeMo's ``TrainEagle3Recipe`` methods, placed before it in a subclass's bases.

    Uses what the recipe sets: ``cfg`` (NeMo's config), ``device``, ``target_model``, ``target_wrapper``.
    """

    cfg: Any
    device: Any
    target_model: Any
    target_wrapper: Any
    _spec_serve_packed_remote = False

    def _setup_remote_target(self, recipe_cfg: Any) -> None:
        """Connect to the spec-serve broker (no target loaded here)."""
        self.target_model = None
        self.target_wrapper = SpecServeEagle3Target.from_recipe(recipe_cfg, device=self.device)

    def _setup_online_target(self, recipe_cfg: Any, target_path: Any, draft_base_config: Any) -> Any:
        parent: Any = super()
        if not _packed_remote(recipe_cfg):
            return parent._setup_online_target(recipe_cfg, target_path, draft_base_config)
        self._refuse_parallel_target()
        # NeMo's setup refuses packing unless the backend is colocated: let it read so until setup is done;
        # _setup_colocated_target then builds the remote target.
        recipe_cfg.target_model_backend = "colocated"
        self._spec_serve_packed_remote = True
        try:
            return parent._setup_online_target(recipe_cfg, target_path, draft_base_config)
        finally:
            recipe_cfg.target_model_backend = "remote"
            self._spec_serve_packed_remote = False

    def _setup_colocated_target(self, recipe_cfg: Any, target_path: Any, draft_base_config: Any) -> Any:
        if self._spec_serve_packed_remote:
            return self._setup_remote_target(recipe_cfg)
        parent: Any = super()
        return parent._setup_colocated_target(recipe_cfg, target_path, draft_base_config)

    def _refuse_parallel_target(self) -> None:
        """What NeMo refuses for a remote target (its gates would read ``colocated`` during packed setup)."""
        for key in ("distributed.cp_size", "distributed.tp_size"):
            if int(self.cfg.get(key, 1) or 1) > 1:
                raise NotImplementedError(f"{key} > 1 needs target_model_backend: colocated; with remote the target "
                                          f"runs in spec-serve workers: set {key}: 1")

    def _resolve_prefetch_depth(self, recipe_cfg: Any) -> int:
        """``target_prefetch_depth`` as NeMo checks it, but not capped at ``num_remote_servers``.

        NeMo caps it at one request a server so that its NCCL receives stay in order. spec-serve matches every
        reply to its request on every path, NCCL included, and a worker takes its next request while its last
        reply travels: across hosts each worker needs 3-4 batches in flight to keep computing."""
        parent: Any = super()
        depth = int(recipe_cfg.get("target_prefetch_depth", 0) or 0)
        if depth <= 0 or not isinstance(self.target_wrapper, SpecServeEagle3Target):
            return parent._resolve_prefetch_depth(recipe_cfg)
        bound = self.target_wrapper.client.prefetch_depth
        if depth > bound:
            logger.warning("target_prefetch_depth %d: the client keeps at most %d in flight (set "
                           "recipe_args.spec_serve.prefetch_depth: %d)", depth, bound, depth)
        return depth

    def _prefetched_batches(self, dataloader: Iterable[Any]) -> Any:
        parent: Any = super()
        wrapper = self.target_wrapper
        if isinstance(wrapper, SpecServeEagle3Target):
            dataloader = wrapper.packed_source(dataloader)
        return parent._prefetched_batches(dataloader)


def _packed_remote(recipe_cfg: Any) -> bool:
    return (recipe_cfg.get("target_model_backend", "colocated") == "remote"
            and int(recipe_cfg.get("packed_sequence_size", 0) or 0) > 0)


_recipe_class: type | None = None


def recipe_class() -> type:
    """``SpecServeEagle3Recipe``: NeMo's ``TrainEagle3Recipe`` with :class:`SpecServeRecipeMixin` (needs
    nemo_automodel)."""
    global _recipe_class
    if _recipe_class is None:
        base = getattr(importlib.import_module(RECIPE_MODULE), RECIPE_CLASS)
        _recipe_class = type("SpecServeEagle3Recipe", (SpecServeRecipeMixin, base), {
            "__module__": "spec_serve.integrations.nemo",
            "__doc__": "NeMo's EAGLE-3 recipe with spec-serve as its remote target (spec_serve.integrations.nemo)."})
    return _recipe_class


def patch_recipe() -> type:
    """Make NeMo's own EAGLE-3 recipe build :class:`SpecServeEagle3Target` for ``target_model_backend:
    remote``; returns the class it replaced. Call it before the recipe's ``setup()``."""
    recipe: Any = importlib.import_module(RECIPE_MODULE)
    previous = recipe.RemoteEagle3TargetModel
    recipe.RemoteEagle3TargetModel = SpecServeEagle3Target
    return previous


USAGE = """usage: python -m spec_serve.integrations.nemo CONFIG.yaml [--dotted.key=value ...]

Runs NeMo AutoModel's EAGLE-3 recipe (TrainEagle3Recipe) with spec-serve as its remote target:
CONFIG.yaml is the recipe's YAML with target_model_backend: remote. Overrides as NeMo's CLI takes them.

  python -m spec_serve.integrations.nemo llama_eagle3_remote.yaml \\
      --recipe_args.remote_urls='["tcp://BROKER:5555"]' --recipe_args.spec_serve.compact=true
  SPEC_SERVE_CLIENT_BROKER=tcp://BROKER:5555 SPEC_SERVE_NUM_SHARDS=2 \\
      torchrun --nproc-per-node 8 -m spec_serve.integrations.nemo llama_eagle3_remote.yaml

Options from the environment and recipe_args.spec_serve: docs/client-options.md."""


def _recipe_named(cfg: Any) -> str:
    """The class name a config's ``recipe:`` key gives (a name, a dotted path, or ``_target_``)."""
    named = cfg.get("recipe", None)
    if named is None:
        return RECIPE_CLASS
    if not isinstance(named, str):
        target = getattr(named, "get", lambda key, default: default)("_target_", named)
        named = target if isinstance(target, str) else getattr(target, "__name__", repr(target))
    return named.rsplit(".", 1)[-1]


def main(argv: Sequence[str] | None = None) -> Any:
    """``python -m spec_serve.integrations.nemo``: load the config as NeMo's CLI does, then set up and train."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    try:
        from nemo_automodel.components.config._arg_parser import parse_args_and_load_config
    except ImportError as e:
        raise SystemExit(f"error: this runs NeMo AutoModel's EAGLE-3 recipe, and nemo_automodel does not import "
                         f"({e}): pip install nemo-automodel") from None
    path = None if args[0].startswith("-") else args.pop(0)
    cfg = parse_args_and_load_config(path, argv=args)
    named = _recipe_named(cfg)
    if named not in _EAGLE3_RECIPES:
        raise SystemExit(f"error: spec-serve serves NeMo's EAGLE-3 recipe ({RECIPE_CLASS}); this config names "
                         f"recipe {named!r}")
    recipe = recipe_class()(cfg)
    recipe.setup()
    return recipe.run_train_validation_loop()
