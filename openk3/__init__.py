"""openk3: the reference open implementation of Kimi K3 in Python/PyTorch.

Public surface: :class:`K3Config` and :func:`preset` (architecture), :class:`K3ForCausalLM`
(the model; :class:`K3ForConditionalGeneration` with the vision tower), :func:`load_pretrained` / :func:`build_model` (official checkpoint format / fresh
init). The engine, server and trainer live in ``openk3.engine``, ``openk3.server`` and
``openk3.train``.
"""

from openk3.config import K3Config, preset
from openk3.model import K3ForCausalLM
from openk3.multimodal import K3ForConditionalGeneration
from openk3.pretrained import build_model, load_pretrained

__all__ = ["K3Config", "K3ForCausalLM", "K3ForConditionalGeneration", "build_model", "load_pretrained", "preset"]
__version__ = "0.1.0"
