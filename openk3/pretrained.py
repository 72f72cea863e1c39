"""``load_pretrained``: build a :class:`~openk3.model.K3ForCausalLM` from a checkpoint directory.

The model is constructed on the meta device (no memory, no init) and the checkpoint tensors are
assigned directly, so loading costs one copy of the weights.
"""

from __future__ import annotations

import os

import torch

from openk3.checkpoint import from_hf_state_dict, read_safetensors
from openk3.config import K3Config
from openk3.model import K3ForCausalLM


def build_model(config: K3Config, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                seed: int | None = 0) -> K3ForCausalLM:
    """A freshly initialised model (``K3ForCausalLM.init_weights``) on ``device`` in ``dtype``."""
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    model.init_weights(generator=gen)
    return model.to(dtype=dtype) if dtype != torch.float32 else model


def load_pretrained(path: str | os.PathLike, *, device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = None, keep_packed: bool = False) -> K3ForCausalLM:
    """Load an official-format checkpoint (``config.json`` + safetensors) into openk3.

    MXFP4 routed experts (``weight_packed`` + ``weight_scale``, recognised by suffix) are either
    dequantized exactly into dense ``Experts`` (default) or, with ``keep_packed=True``, kept packed
    in :class:`openk3.quant.packed.PackedExperts` (4.25 bits per weight; expert GEMMs read the packed
    weights). ``keep_packed=True`` on a float checkpoint quantizes its experts to MXFP4 (FLOOR).

    Args:
        path: checkpoint directory.
        device: where the weights go.
        dtype: cast floating tensors to this dtype (None keeps the file's dtype; dequantized experts
            take the dtype of ``embed_tokens``).
        keep_packed: hold routed experts packed (see above).
    Returns:
        ``K3ForCausalLM`` in eval mode.
    Raises:
        FileNotFoundError: no config or weights.
        ValueError: a missing / mis-shaped / unexpected tensor, named in the message.
    """
    path = os.fspath(path)
    config = K3Config.from_pretrained(path)
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    if keep_packed:
        from openk3.quant.packed import pack_experts

        pack_experts(model)  # meta skeleton: packed buffers to be assigned from the file
    expected = {k: v.shape for k, v in model.state_dict().items()}
    tensors = read_safetensors(path)
    state = from_hf_state_dict(tensors, config, expected)
    if dtype is not None:
        state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    state = {k: v.to(device) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()
