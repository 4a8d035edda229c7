"""NeMo AutoModel's EAGLE-3 recipe with spec-serve as its remote target (docs/migrating-from-nemo.md).

- :class:`SpecServeEagle3Target`: NeMo's ``RemoteEagle3TargetModel`` surface over a spec-serve broker
  (target.py), packed sequences included (packed.py);
- ``SpecServeEagle3Recipe``: NeMo's ``TrainEagle3Recipe`` that builds it from the whole YAML and
  serves packed recipes (recipe.py; made on first access, since it needs nemo_automodel);
- ``python -m spec_serve.integrations.nemo CONFIG.yaml``: the recipe's launcher;
- :func:`patch_recipe`: NeMo's own recipe, its remote target replaced.
"""

from __future__ import annotations

from typing import Any

from spec_serve.integrations.nemo.recipe import SpecServeRecipeMixin, main, patch_recipe, recipe_class
from spec_serve.integrations.nemo.target import Eagle3Batch, SpecServeEagle3Target, batch_class

__all__ = ["Eagle3Batch", "SpecServeEagle3Recipe", "SpecServeEagle3Target", "SpecServeRecipeMixin", "batch_class",
           "main", "patch_recipe", "recipe_class"]


def __getattr__(name: str) -> Any:
    # NeMo's CLI resolves `recipe: spec_serve.integrations.nemo.SpecServeEagle3Recipe` with getattr here.
    if name == "SpecServeEagle3Recipe":
        return recipe_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
