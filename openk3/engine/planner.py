"""Memory planner (``openk3 plan``) and the one set of cache-size formulas the engine also uses.

Every byte count the engine allocates for decode state comes from the functions here, so the
planner's numbers and the engine's accounting cannot drift apart:

* :func:`kv_bytes_per_token` — MLA: ``kv_lora_rank + qk_rope_head_dim`` values (normalised latent
  ĉ + shared key slice k^R) per token per MLA layer, in the cache dtype (architecture.md §4, §14:
  576 values × 24 layers × 2 B = 27,648 B/token in BF16 for Kimi K3).
* :func:`kda_state_bytes` — KDA, constant per sequence: the fp32 recurrent state H·K·V per layer
  (96·128·128·4 B × 69 = 414 MiB for Kimi K3) plus three conv tails of P·(W-1) values per layer in
  the activation dtype (14.6 MiB in BF16) (architecture.md §3.5, §14).
* :func:`snapshot_bytes` — one prefix-cache KDA snapshot: a KDA state, the MLA latents of up to
  ``block_size - 1`` tail tokens, and one fp32 logits row (see :mod:`openk3.engine.prefix_cache`).
* :func:`weight_bytes` — weights by storage format as released: routed experts MXFP4 (4 bits +
  one E8M0 byte per 32 values = 4.25 bits/value, k3-release-notes.md §1.9), everything else BF16
  (the few small fp32 vectors are counted as BF16), plus the vision tower and projector in BF16
  when the config has a ``vision_config``. For Kimi K3: 1,559.9 GB of text backbone + 0.89 GB of
  vision (401.2M tower + 46.1M projector parameters) = 1,560.8 GB, against the checkpoint's 1,560.9 GB.

GPU memory sizes are the vendors' nominal decimal capacities; ``--gpu-util`` (default 0.9, as
vLLM's ``gpu_memory_utilization``) leaves room for activations and the runtime.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from openk3.config import KDA, MLA, K3Config

MIB = 1 << 20
GIB = 1 << 30

# Nominal HBM per device (decimal bytes, vendor datasheets).
GPU_MEMORY = {
    "A100": 80e9,
    "H100": 80e9,
    "H20": 96e9,
    "H200": 141e9,
    "B200": 180e9,
    "B300": 288e9,
    "GB200": 186e9,
    "GB300": 288e9,
    "MI300X": 192e9,
    "MI325X": 256e9,
    "MI350X": 288e9,
    "MI355X": 288e9,
}
MXFP4_BITS = 4.25  # E2M1 nibble + one E8M0 scale byte per 32 values


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kv_bytes_per_token(config: K3Config, dtype: torch.dtype = torch.bfloat16) -> int:
    """MLA cache bytes per token over all MLA layers: ``n_mla * (C + R) * itemsize(dtype)``.

    Source: architecture.md §4 (cache ĉ_kv and k^R), §14 (27,648 B/token for Kimi K3 in BF16).
    """
    n_mla = config.layer_types.count(MLA)
    return n_mla * sum(config.mla_cache_dims) * _itemsize(dtype)


def kda_state_bytes(config: K3Config, conv_dtype: torch.dtype = torch.bfloat16) -> dict:
    """KDA decode state per sequence over all KDA layers.

    Returns:
        ``{"recurrent": n_kda*H*K*K*4 (fp32 always), "conv": n_kda*3*P*(W-1)*itemsize(conv_dtype),
        "total": their sum}`` in bytes.
    Source: architecture.md §3.5, §14 (414 MiB fp32 + 14.6 MiB BF16 conv for Kimi K3).
    """
    n_kda = config.layer_types.count(KDA)
    H, K, W = config.kda_state_dims
    recurrent = n_kda * H * K * K * 4
    conv = n_kda * 3 * config.linear_proj_dim * (W - 1) * _itemsize(conv_dtype)
    return {"recurrent": recurrent, "conv": conv, "total": recurrent + conv}


def snapshot_bytes(config: K3Config, block_size: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """One prefix-cache snapshot entry: KDA state + (block_size - 1) tail tokens of MLA latent +
    an fp32 logits row [vocab_size]."""
    return (
        kda_state_bytes(config, dtype)["total"]
        + (block_size - 1) * kv_bytes_per_token(config, dtype)
        + config.vocab_size * 4
    )


def sequence_bytes(config: K3Config, tokens: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Decode state of one sequence of ``tokens`` tokens: KDA state + ``tokens`` MLA latents."""
    return kda_state_bytes(config, dtype)["total"] + tokens * kv_bytes_per_token(config, dtype)


def weight_bytes(config: K3Config) -> dict:
    """Checkpoint weight bytes by storage format (text backbone built on the meta device; the vision
    tower and projector counted from ``vision_config`` when the config has one).

    Returns:
        ``{"mxfp4": bytes, "bf16": bytes, "vision": bytes, "total": bytes, "params": {fmt: count}}``;
        routed experts count 4.25 bits per value, every other tensor (vision included) 2 bytes.
        ``params["mxfp4"] + params["bf16"]`` is the text model (what the K3 report counts).
    """
    from openk3.model import K3ForCausalLM

    key = repr(config) + repr((config.wrapper or {}).get("vision_config"))
    if key not in _WEIGHT_CACHE:  # building the full config on meta takes seconds
        with torch.device("meta"):
            model = K3ForCausalLM(config)
        params = {"mxfp4": 0, "bf16": 0, "vision": 0}
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            params["mxfp4" if ".block_sparse_moe.experts." in name else "bf16"] += t.numel()
        vision = (config.wrapper or {}).get("vision_config")
        if isinstance(vision, dict):
            from openk3.vision import count_vision_parameters

            params["vision"] = count_vision_parameters(vision)["total"]
        _WEIGHT_CACHE[key] = params
    params = dict(_WEIGHT_CACHE[key])
    out = {
        "mxfp4": int(params["mxfp4"] * MXFP4_BITS / 8),
        "bf16": params["bf16"] * 2,
        "vision": params["vision"] * 2,
    }
    out["total"] = sum(out.values())
    out["params"] = params
    return out


_WEIGHT_CACHE: dict[str, dict] = {}


def parse_gpus(spec: str) -> tuple[int, str, float]:
    """``"8xH200"`` / ``"H200"`` / ``"4x80GB"`` / ``"2x96GiB"`` -> (count, name, bytes per GPU).

    Raises:
        ValueError: malformed spec or unknown GPU name (the message lists the known ones).
    """
    m = re.fullmatch(r"\s*(?:(\d+)\s*[xX*]\s*)?([A-Za-z0-9.]+)\s*", spec or "")
    if not m:
        raise ValueError(f"gpus={spec!r}: expected COUNTxTYPE, e.g. 8xH200 or 4x80GB")
    count = int(m.group(1) or 1)
    if count < 1:
        raise ValueError(f"gpus={spec!r}: count must be >= 1")
    name = m.group(2)
    size = re.fullmatch(r"(\d+(?:\.\d+)?)(GB|GiB|TB)", name, flags=re.IGNORECASE)
    if size:
        unit = {"gb": 1e9, "gib": float(GIB), "tb": 1e12}[size.group(2).lower()]
        return count, name, float(size.group(1)) * unit
    key = name.upper()
    if key not in GPU_MEMORY:
        raise ValueError(
            f"gpus={spec!r}: unknown GPU {name!r}; known: {', '.join(sorted(GPU_MEMORY))} "
            "(or give the size, e.g. 8x141GB)"
        )
    return count, key, GPU_MEMORY[key]


@dataclass
class Plan:
    """Result of :func:`plan` (all sizes in bytes)."""

    gpus: int
    gpu_name: str
    gpu_bytes: float
    gpu_util: float
    context: int
    weights: dict
    kv_per_token: int
    kda_state: dict
    per_sequence: int
    usable: float
    free_for_cache: float
    max_sequences: int
    notes: list = field(default_factory=list)


def plan(
    config: K3Config,
    gpus: str,
    context: int,
    *,
    gpu_util: float = 0.9,
    cache_dtype: torch.dtype = torch.bfloat16,
) -> Plan:
    """How many sequences of ``context`` tokens fit next to the weights on ``gpus``.

    Weights and caches are assumed evenly sharded over the GPUs (TP/EP), so the aggregate memory
    is what counts. ``max_sequences = floor((gpus * bytes * gpu_util - weights) / per_sequence)``,
    with ``per_sequence = kda_state + context * kv_per_token`` (:func:`sequence_bytes`).

    Raises:
        ValueError: bad ``gpus``, ``context`` < 1 or ``gpu_util`` outside (0, 1].
    """
    if not isinstance(context, int) or context < 1:
        raise ValueError(f"context={context!r}: must be a positive number of tokens")
    if not 0 < gpu_util <= 1:
        raise ValueError(f"gpu_util={gpu_util!r}: must lie in (0, 1]")
    count, name, per_gpu = parse_gpus(gpus)
    weights = weight_bytes(config)
    kv = kv_bytes_per_token(config, cache_dtype)
    kda = kda_state_bytes(config, cache_dtype)
    per_seq = sequence_bytes(config, context, cache_dtype)
    usable = count * per_gpu * gpu_util
    free = usable - weights["total"]
    notes = []
    if free <= 0:
        notes.append(
            f"the weights ({weights['total'] / 1e9:,.1f} GB) do not fit in {gpu_util:.0%} of "
            f"{count}x{name} ({usable / 1e9:,.1f} GB): more or larger GPUs are needed"
        )
    if context > config.max_position_embeddings:
        notes.append(
            f"context {context:,} exceeds max_position_embeddings {config.max_position_embeddings:,}"
        )
    n = max(0, int(free // per_seq)) if free > 0 else 0
    return Plan(
        count, name, per_gpu, gpu_util, context, weights, kv, kda, per_seq, usable, free, n, notes
    )


def format_plan(p: Plan, source: str = "") -> str:
    """Human-readable report of a :class:`Plan`."""
    w = p.weights
    gb = lambda b: f"{b / 1e9:,.2f} GB"  # noqa: E731
    lines = [
        f"memory plan{' for ' + source if source else ''}: {p.gpus}x{p.gpu_name} "
        f"({p.gpu_bytes / 1e9:,.0f} GB each, {p.gpu_util:.0%} usable = {gb(p.usable)})",
        "weights:",
        f"  MXFP4 routed experts ({MXFP4_BITS} bits) {w['params']['mxfp4']:>20,} params  {gb(w['mxfp4']):>14}",
        f"  BF16                              {w['params']['bf16']:>20,} params  {gb(w['bf16']):>14}",
        *(
            [
                f"  vision tower + projector (BF16)   {w['params']['vision']:>20,} params  {gb(w['vision']):>14}"
            ]
            if w["params"].get("vision")
            else []
        ),
        f"  total                                                          {gb(w['total']):>14}"
        f"  ({gb(w['total'] / p.gpus)} per GPU)",
        "decode state:",
        f"  MLA latent cache (BF16)   {p.kv_per_token:,} B/token",
        f"  KDA state per sequence    {p.kda_state['recurrent'] / MIB:,.1f} MiB fp32 recurrent + "
        f"{p.kda_state['conv'] / MIB:,.1f} MiB conv tails = {p.kda_state['total'] / MIB:,.1f} MiB",
        f"  one sequence of {p.context:,} tokens: {p.per_sequence / GIB:,.2f} GiB",
        f"free for caches: {gb(max(p.free_for_cache, 0))}",
        f"concurrent sequences of {p.context:,} tokens that fit: {p.max_sequences:,}",
    ]
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)
