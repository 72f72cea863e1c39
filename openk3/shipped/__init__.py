"""Models shipped inside the package: names that resolve to a checkpoint directory.

``openk3-tiny`` is the default model: a tiny K3 trained by openk3's own ``default-model`` recipe
(``openk3/shipped/openk3-tiny/MODEL_CARD.md``). Its directory is a normal checkpoint
(``config.json``, ``model.safetensors`` with MXFP4-packed routed experts, ``tokenizer.json``,
``tokenizer_config.json``, ``chat_template.jinja``), so ``load_pretrained``, ``load_tokenizer``,
``openk3 serve``, transformers-style tooling and a plain file copy all see the same thing.

Resolution rule (:func:`resolve_model_path`): an existing path always wins; otherwise a shipped
model's name maps to its directory. So a local folder that happens to be called ``openk3-tiny``
is never shadowed.
"""

from __future__ import annotations

import os
from pathlib import Path

SHIPPED_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL = "openk3-tiny"
SHIPPED_MODELS = (DEFAULT_MODEL,)


def shipped_model_path(name: str = DEFAULT_MODEL) -> Path:
    """The directory of shipped model ``name``.

    Raises:
        ValueError: ``name`` is not a shipped model (the message lists them).
        FileNotFoundError: the package was installed without the model's weights.
    """
    if name not in SHIPPED_MODELS:
        raise ValueError(f"unknown shipped model {name!r}; shipped: {', '.join(SHIPPED_MODELS)}")
    path = SHIPPED_DIR / name
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"shipped model {name!r}: {path / 'model.safetensors'} is missing "
            "(was the package installed without its data files?)"
        )
    return path


def resolve_model_path(path: str | os.PathLike) -> str:
    """``path`` itself when it exists, else the directory of the shipped model of that name, else
    ``path`` unchanged (the caller's loader then reports what is missing)."""
    p = os.fspath(path)
    if not os.path.exists(p) and p in SHIPPED_MODELS:
        return str(SHIPPED_DIR / p)
    return p


__all__ = [
    "SHIPPED_DIR",
    "DEFAULT_MODEL",
    "SHIPPED_MODELS",
    "shipped_model_path",
    "resolve_model_path",
]
