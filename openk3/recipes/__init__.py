"""Training recipes: Python functions that return a :class:`~openk3.train.run_config.RunConfig`,
and their registry.

``openk3 train --recipe NAME`` looks NAME up in :data:`RECIPES` (this module registers the
built-in ones below; add one with :func:`register_recipe`), or imports ``package.module:function``
for a recipe kept elsewhere.

Built in:

* ``smoke`` (:mod:`openk3.recipes.smoke`): ``k3-test-tiny`` on a synthetic byte-level corpus.
* ``default-model`` (:mod:`openk3.recipes.default_model`): the shipped ``openk3-tiny`` end to end.
* ``default-model-vision`` (:mod:`openk3.recipes.default_model_vision`): the vision stage from a
  text SFT checkpoint.
* ``default-model-long`` (same module): the long-prompt stage, the vision stage's recipe continued
  from its checkpoint with long harness-prompt rows among the text rows.
* ``tiny-chat`` (:mod:`openk3.recipes.tiny_chat`): the default-model pipeline in ~10 minutes.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from openk3.recipes import default_model, default_model_vision, smoke, tiny_chat
from openk3.recipes.smoke import (
    synthetic_data,
    synthetic_document,
    synthetic_entropy_per_sentence,
    synthetic_store,
)
from openk3.train.run_config import RunConfig

RECIPES: dict[str, Callable[[], RunConfig]] = {}


def register_recipe(name: str):
    """Decorator: ``@register_recipe("name")`` on a function returning a :class:`RunConfig`.

    Raises:
        ValueError: the name is already registered.
    """

    def deco(fn: Callable[[], RunConfig]) -> Callable[[], RunConfig]:
        if name in RECIPES and RECIPES[name] is not fn:
            raise ValueError(f"recipe {name!r} is already registered")
        RECIPES[name] = fn
        return fn

    return deco


def get_recipe(name: str, **overrides) -> RunConfig:
    """The run config of recipe ``name`` (registered, or ``module:function``), with overrides.

    Raises:
        ValueError: an unknown recipe (the message lists the known ones), a function that does
            not return a RunConfig, or an unknown override field.
    """
    if ":" in name:
        mod, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"recipe {name!r}: cannot import ({e})") from None
    elif name in RECIPES:
        fn = RECIPES[name]
    else:
        raise ValueError(
            f"unknown recipe {name!r}; known: {', '.join(sorted(RECIPES))} (or module:function)"
        )
    run = fn()
    if not isinstance(run, RunConfig):
        raise ValueError(f"recipe {name!r}: returned {type(run).__name__}, expected RunConfig")
    return run.replace(**overrides) if overrides else run


register_recipe("smoke")(smoke.smoke)
register_recipe("default-model")(default_model.default_model)
register_recipe("default-model-vision")(default_model_vision.default_model_vision)
register_recipe("default-model-long")(default_model_vision.default_model_long)
register_recipe("tiny-chat")(tiny_chat.tiny_chat)

__all__ = [
    "RunConfig",
    "RECIPES",
    "register_recipe",
    "get_recipe",
    "synthetic_store",
    "synthetic_data",
    "synthetic_document",
    "synthetic_entropy_per_sentence",
]
