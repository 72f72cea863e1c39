"""openk3: the reference open implementation of Kimi K3 in Python/PyTorch.

Public surface: :class:`K3Config` and :func:`preset` (architecture), :class:`K3ForCausalLM`
(the model; :class:`K3ForConditionalGeneration` with the vision tower), :func:`load_pretrained` / :func:`build_model` (official checkpoint format / fresh
init). The engine, server and trainer live in ``openk3.engine``, ``openk3.server`` and
``openk3.train``.

The names are imported on first use (PEP 562), so ``import openk3.cli`` and ``openk3 --help`` do
not pay for importing torch.
"""

from importlib import import_module

__version__ = "0.1.0"

_LAZY = {
    "K3Config": "openk3.config",
    "preset": "openk3.config",
    "K3ForCausalLM": "openk3.model",
    "K3ForConditionalGeneration": "openk3.multimodal",
    "build_model": "openk3.pretrained",
    "load_pretrained": "openk3.pretrained",
}

__all__ = [
    "K3Config",
    "K3ForCausalLM",
    "K3ForConditionalGeneration",
    "build_model",
    "load_pretrained",
    "preset",
]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'openk3' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
