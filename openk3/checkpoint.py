"""Checkpoints in the official Hugging Face format: ``config.json`` + safetensors.

Tensor names are the released ones (``../shared/k3/model.safetensors.index.json.gz``): the
multimodal ``kimi_k3`` wrapper prefixes the text model with ``language_model.``; a bare
``kimi_linear`` config has no prefix. openk3's module attributes already carry the official
names, so the only translations (one table, :data:`_EXPERT_KEYS`, and :func:`_a_log_from_file`)
are:

* routed experts: openk3 stacks them (``experts.w1`` [E, F, L]); the file stores one tensor per
  expert (``experts.{e}.w1.weight`` [F, L]);
* KDA ``A_log``: openk3 holds one value per head [H]; Kimi Linear files store [1, 1, H, 1] and
  the K3 release pads it with zeros to ``head_dim``; both are read, [H] (K3) / [1,1,H,1] (Kimi
  Linear) is written.

Loading checks every tensor's presence and shape against the config and names the first bad
tensor; nothing is unpickled (safetensors only). Writes are atomic: files go to a temporary
directory first and are moved into place one by one with ``os.replace``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections import OrderedDict

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from openk3.config import K3Config

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 2 * 1024**3

_EXPERT_KEYS = ("w1", "w2", "w3")
_STACKED = re.compile(r"^(?P<pre>.*\.block_sparse_moe\.experts)\.(?P<w>w[123])$")
_PER_EXPERT = re.compile(r"^(?P<pre>.*\.block_sparse_moe\.experts)\.(?P<e>\d+)\.(?P<w>w[123])\.weight$")
# Tensors of the multimodal wrapper that the text model does not own (vision issue).
_FOREIGN_PREFIXES = ("vision_tower.", "mm_projector.")


def _prefix(config: K3Config) -> str:
    return "language_model." if config.wrapper is not None else ""


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], config: K3Config) -> "OrderedDict[str, torch.Tensor]":
    """openk3 ``state_dict`` -> official tensor names and layouts.

    Args:
        state_dict: from ``K3ForCausalLM.state_dict()``.
        config: decides the ``language_model.`` prefix and the ``A_log`` layout.
    Returns:
        Ordered mapping official name -> tensor (expert stacks split into per-expert views).
    """
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    pre = _prefix(config)
    for name, t in state_dict.items():
        m = _STACKED.match(name)
        if m:
            for e in range(t.shape[0]):
                out[f"{pre}{m['pre']}.{e}.{m['w']}.weight"] = t[e]
            continue
        if name.endswith("self_attn.A_log") and not config.is_k3:
            t = t.reshape(1, 1, -1, 1)
        out[pre + name] = t
    return out


def _a_log_from_file(name: str, t: torch.Tensor, heads: int) -> torch.Tensor:
    flat = t.reshape(-1)
    if flat.numel() == heads:
        return flat
    if flat.numel() > heads and bool((flat[heads:] == 0).all()):
        return flat[:heads]  # the K3 release pads A_log to head_dim with zeros
    raise ValueError(f"checkpoint tensor {name}: shape {tuple(t.shape)} does not hold {heads} per-head values")


def from_hf_state_dict(
    tensors: dict[str, torch.Tensor], config: K3Config, expected: dict[str, torch.Size]
) -> dict[str, torch.Tensor]:
    """Official names -> openk3 ``state_dict``, checking presence and shape of every tensor.

    Args:
        tensors: official name -> tensor (as read from the files).
        config: the checkpoint's config.
        expected: openk3 name -> shape, from a model built for ``config``.
    Raises:
        ValueError: a missing, unexpected or mis-shaped tensor (named in the message).
    """
    pre = _prefix(config)
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.startswith(_FOREIGN_PREFIXES):
            continue
        if pre and not name.startswith(pre):
            raise ValueError(f"checkpoint tensor {name}: expected the {pre!r} prefix of a kimi_k3 checkpoint")
        local = name[len(pre):]
        m = _PER_EXPERT.match(local)
        if m:
            stacks.setdefault(f"{m['pre']}.{m['w']}", {})[int(m["e"])] = t
            continue
        if local.endswith("self_attn.A_log"):
            t = _a_log_from_file(name, t, config.linear_num_heads)
        out[local] = t
    for key, parts in stacks.items():
        n = expected[key][0] if key in expected else len(parts)
        missing = [e for e in range(n) if e not in parts]
        if missing:
            m = _STACKED.match(key)
            raise ValueError(f"checkpoint is missing tensor {pre}{m['pre']}.{missing[0]}.{m['w']}.weight")
        extra = sorted(set(parts) - set(range(n)))
        if extra:
            m = _STACKED.match(key)
            raise ValueError(f"checkpoint has unexpected tensor {pre}{m['pre']}.{extra[0]}.{m['w']}.weight")
        shapes = {tuple(p.shape) for p in parts.values()}
        if len(shapes) != 1:
            raise ValueError(f"checkpoint experts under {pre}{key}: per-expert shapes differ: {sorted(shapes)}")
        out[key] = torch.stack([parts[e] for e in range(n)])
    for key, shape in expected.items():
        if key not in out:
            m = _STACKED.match(key)
            hf = f"{pre}{m['pre']}.0.{m['w']}.weight" if m else pre + key
            raise ValueError(f"checkpoint is missing tensor {hf} (expected shape {tuple(shape)})")
        if tuple(out[key].shape) != tuple(shape):
            m = _STACKED.match(key)
            hf = f"{pre}{m['pre']}.N.{m['w']}.weight" if m else pre + key
            got = tuple(out[key].shape[1:]) if m else tuple(out[key].shape)
            want = tuple(shape[1:]) if m else tuple(shape)
            raise ValueError(f"checkpoint tensor {hf}: shape {got} does not match the config ({want})")
    unexpected = sorted(set(out) - set(expected))
    if unexpected:
        raise ValueError(f"checkpoint has unexpected tensor {pre}{unexpected[0]}")
    return out


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (single file or sharded with an index)."""
    index = os.path.join(path, INDEX_NAME)
    files: list[str]
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(path, WEIGHTS_NAME)):
        files = [WEIGHTS_NAME]
    else:
        raise FileNotFoundError(f"no {WEIGHTS_NAME} or {INDEX_NAME} in {path!r}")
    tensors: dict[str, torch.Tensor] = {}
    for fn in files:
        full = os.path.join(path, fn)
        if not os.path.isfile(full):
            raise FileNotFoundError(f"checkpoint shard {full!r} listed in the index is missing")
        with safe_open(full, framework="pt") as f:
            for k in f.keys():
                tensors[k] = f.get_tensor(k)
    return tensors


def write_checkpoint(
    path: str,
    tensors: "OrderedDict[str, torch.Tensor]",
    config: K3Config,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    extra_files: dict[str, str] | None = None,
) -> None:
    """Write ``config.json`` and safetensors shards (with an index above ``max_shard_bytes``).

    Atomic per file: everything is written into a temporary directory next to ``path`` and then
    moved in with ``os.replace``; shards left over from an earlier, differently sharded save are
    removed after the new index is in place.
    """
    os.makedirs(path, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".openk3-save-", dir=path)
    try:
        shards: list[OrderedDict[str, torch.Tensor]] = [OrderedDict()]
        size = 0
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append(OrderedDict())
                size = 0
            shards[-1][name] = t.detach().contiguous().cpu()
            size += nbytes
        meta = {"format": "pt"}
        written: list[str] = []
        if len(shards) == 1:
            save_file(shards[0], os.path.join(tmp, WEIGHTS_NAME), metadata=meta)
            written.append(WEIGHTS_NAME)
        else:
            weight_map = {}
            total = 0
            for i, shard in enumerate(shards):
                fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, os.path.join(tmp, fn), metadata=meta)
                written.append(fn)
                for name, t in shard.items():
                    weight_map[name] = fn
                    total += t.numel() * t.element_size()
            with open(os.path.join(tmp, INDEX_NAME), "w", encoding="utf-8") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
            written.append(INDEX_NAME)
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            f.write(config.to_json_string())
        written.append("config.json")
        for fn, text in (extra_files or {}).items():
            with open(os.path.join(tmp, fn), "w", encoding="utf-8") as f:
                f.write(text)
            written.append(fn)
        for fn in written:
            os.replace(os.path.join(tmp, fn), os.path.join(path, fn))
        stale = [WEIGHTS_NAME, INDEX_NAME] + [
            fn for fn in os.listdir(path) if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", fn)
        ]
        for fn in stale:
            if fn not in written and os.path.isfile(os.path.join(path, fn)):
                os.remove(os.path.join(path, fn))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
