"""``load_pretrained``: build a :class:`~openk3.model.K3ForCausalLM` from a checkpoint directory.

The model is constructed on the meta device (no memory, no init) and the checkpoint tensors are
assigned directly, so loading costs one copy of the weights. A ``kimi_k3`` config with a
``vision_config`` builds :class:`~openk3.multimodal.K3ForConditionalGeneration` (the text model
plus ``vision_tower`` / ``mm_projector``) when the file holds the vision tensors.
"""

from __future__ import annotations

import os
import re

import torch

from openk3.checkpoint import from_hf_state_dict, read_safetensors, record_file_layout
from openk3.config import K3Config
from openk3.model import K3ForCausalLM


def build_model(
    config: K3Config,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int | None = 0,
) -> K3ForCausalLM:
    """A freshly initialised model (``K3ForCausalLM.init_weights``, :mod:`openk3.weight_init`) on
    ``device`` in ``dtype``, drawn from a generator seeded with ``seed`` (None: the default generator):
    :class:`~openk3.multimodal.K3ForConditionalGeneration` when the config has a ``vision_config``
    (its tower and projector get the same init rules), else the text-only ``K3ForCausalLM``.

    Raises:
        ValueError: the config's weights cannot fit the device's memory (:func:`check_fits_memory`),
            before anything is built.
    """
    from openk3.multimodal import model_class_for

    check_fits_memory(config, device, dtype)
    with torch.device("meta"):
        model = model_class_for(config)(config)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    model.init_weights(generator=gen)
    model.tie_weights()  # to_empty() unties shared params
    return cast_model_(model, dtype)


def available_memory(device: str | torch.device) -> int | None:
    """Bytes the weights could take on `device`: ``MemAvailable`` (/proc/meminfo) for the CPU,
    the free memory of a CUDA device (``torch.cuda.mem_get_info``); None where it cannot be read."""
    device = torch.device(device)
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except (RuntimeError, AssertionError):
            return None
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits_memory(
    config: K3Config,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    available: int | None = None,
) -> None:
    """Refuse a config whose weights alone exceed the memory of `device`, before building: the
    parameter count (:func:`openk3.params.estimate_parameters`, which does not build the layers)
    times the bytes of `dtype` against `available` (default :func:`available_memory`; no check
    where it is unknown). A config of 10^6 layers or a 10^9-token vocabulary otherwise allocates
    (or builds a meta skeleton) for minutes and then dies of memory.

    Raises:
        ValueError: naming the parameter count, the bytes it needs and the memory available.
    """
    from openk3.params import estimate_parameters

    if available is None:
        available = available_memory(device)
    if available is None:
        return
    n = estimate_parameters(config)
    itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
    need = n * itemsize
    if need > available:
        raise ValueError(
            f"config: {n:,} parameters x {itemsize} bytes ({dtype}) = {need / 2**30:,.1f} GiB, more "
            f"than the {available / 2**30:,.1f} GiB of memory available on {torch.device(device)}; "
            "not built (check num_hidden_layers, hidden_size, vocab_size, n_routed_experts)"
        )


def cast_model_(model: K3ForCausalLM, dtype: torch.dtype) -> K3ForCausalLM:
    """Cast floating parameters and buffers to ``dtype`` in place, keeping the tensors the release
    keeps in fp32 (``A_log``, ``dt_bias``, the router weight and ``e_score_correction_bias``)."""
    from openk3.model import keeps_fp32

    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.is_floating_point():
                t.data = t.data.to(torch.float32 if keeps_fp32(name) else dtype)
    return model


_LAYER_KEY = re.compile(r"(?:^|\.)model\.layers\.(\d+)\.")


def _check_layers_in_file(config: K3Config, tensors: dict, path: str) -> None:
    """Fail fast on a config whose depth the weights cannot back (``num_hidden_layers: 1000000``
    would otherwise build a million-layer skeleton for minutes before the missing tensors show).

    Raises:
        ValueError: naming ``config.json``'s ``num_hidden_layers`` and the layers in the file.
    """
    present = {int(m.group(1)) for k in tensors for m in [_LAYER_KEY.search(k)] if m}
    if present and config.num_hidden_layers > max(present) + 1:
        raise ValueError(
            f"{os.path.join(os.fspath(path), 'config.json')}: num_hidden_layers="
            f"{config.num_hidden_layers} but the weights hold layers 0..{max(present)} only"
        )


def load_pretrained(
    path: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    keep_packed: bool = False,
) -> K3ForCausalLM:
    """Load an official-format checkpoint (``config.json`` + safetensors) into openk3.

    MXFP4 routed experts (``weight_packed`` + ``weight_scale``, recognised by suffix) are either
    dequantized exactly into dense ``Experts`` (default) or, with ``keep_packed=True``, kept packed
    in :class:`openk3.quant.packed.PackedExperts` (4.25 bits per weight; expert GEMMs read the packed
    weights). ``keep_packed=True`` on a float checkpoint quantizes its experts to MXFP4 (FLOOR).

    Args:
        path: checkpoint directory, or the name of a model shipped in the package
            (``"openk3-tiny"``, :mod:`openk3.shipped`).
        device: where the weights go.
        dtype: cast floating tensors to this dtype (None keeps the file's dtype; dequantized experts
            take the dtype of ``embed_tokens``).
        keep_packed: hold routed experts packed (see above).
    Returns:
        ``K3ForCausalLM`` in eval mode; a ``K3ForConditionalGeneration`` when the config has a
        ``vision_config`` and the file has ``vision_tower.*`` / ``mm_projector.*`` tensors (a
        wrapper config whose file has none of them loads as the text model).
    Raises:
        FileNotFoundError: no config or weights.
        ValueError: a missing / mis-shaped / unexpected tensor, named in the message.
    """
    from openk3.multimodal import VISION_PREFIXES, K3ForConditionalGeneration, vision_config_of
    from openk3.vision.weights import load_vision_weights

    from openk3.shipped import resolve_model_path

    path = resolve_model_path(path)
    config = K3Config.from_pretrained(path)
    tensors = read_safetensors(path)
    _check_layers_in_file(config, tensors, path)
    record_file_layout(config, tensors)
    # Vision tensors without a vision_config are ignored, as the text model always did.
    with_vision = vision_config_of(config) is not None and any(
        k.startswith(VISION_PREFIXES) for k in tensors
    )
    with torch.device("meta"):
        model = K3ForConditionalGeneration(config) if with_vision else K3ForCausalLM(config)
    if keep_packed:
        from openk3.quant.packed import pack_experts

        pack_experts(model)  # meta skeleton: packed buffers to be assigned from the file
    meta_state = model.state_dict()
    tied = config.tie_word_embeddings
    expected = {
        k: v.shape
        for k, v in meta_state.items()
        if not (tied and k == "lm_head.weight") and not k.startswith(VISION_PREFIXES)
    }
    state = from_hf_state_dict(tensors, config, expected)
    for k, v in state.items():
        if meta_state[k].is_floating_point() and not v.is_floating_point():
            raise ValueError(
                f"checkpoint tensor {k}: dtype {v.dtype} where a floating tensor is expected"
            )
    # One compute dtype for the whole model (the file's embedding dtype unless `dtype` is given);
    # the release's fp32 tensors stay fp32 whatever it is.
    from openk3.model import keeps_fp32

    target = dtype or state["model.embed_tokens.weight"].dtype
    state = {
        k: (v.to(torch.float32 if keeps_fp32(k) else target) if v.is_floating_point() else v).to(
            device
        )
        for k, v in state.items()
    }
    if tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    if with_vision:
        vision = {
            k: (v.to(target) if v.is_floating_point() else v).to(device)
            for k, v in tensors.items()
            if k.startswith(VISION_PREFIXES)
        }
        for module in (model.vision_tower, model.mm_projector):
            load_vision_weights(module, vision, assign=True)  # strict per prefix: names and shapes
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        missing = [k for k in missing if not k.startswith(VISION_PREFIXES)]
        if missing or unexpected:  # from_hf_state_dict already checked both; kept as a guard
            raise ValueError(f"checkpoint: missing {missing[:3]}, unexpected {unexpected[:3]}")
    else:
        model.load_state_dict(state, strict=True, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()
