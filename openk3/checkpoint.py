"""Checkpoints in the official Hugging Face format: ``config.json`` + safetensors.

Tensor names are the released ones (``../shared/k3/model.safetensors.index.json.gz``): the
multimodal ``kimi_k3`` wrapper prefixes the text model with ``language_model.``; a bare
``kimi_linear`` config has no prefix. openk3's module attributes already carry the official
names, so the only translations (one table, :data:`_EXPERT_KEYS`, and :func:`_a_log_from_file`)
are:

* routed experts: openk3 stacks them (``experts.w1`` [E, F, L]); the file stores one tensor per
  expert (``experts.{e}.w1.weight`` [F, L]);
* KDA ``A_log``: openk3 holds one value per head [H]. Files differ by the code that loads them:
  the K3 reference (``modeling_kimi_linear.py`` of the K3 release, which also runs Kimi-Linear
  configs) declares [H] and the K3 release pads it with zeros to ``head_dim``; the original Kimi
  Linear (``modeling_kimi.py`` of Kimi-Linear-48B-A3B, whose files hold [1, 1, 32, 1]), vLLM's
  ``kimi_linear`` and transformers' ``KimiLinear`` declare [1, 1, H, 1]. All are read. Written:
  [H] for a ``kimi_k3`` checkpoint or a K3 gate (``gate_lower_bound`` set), the shapes the K3
  reference loads; [1, 1, H, 1] for a bare ``kimi_linear`` checkpoint with the Kimi Linear gate,
  the shape Kimi Linear's own code loads (:func:`a_log_file_shape`).
* ``num_nextn_predict_layers > 0``: MTP layers (``model.layers.{L}`` .. ``{L+n-1}``) are not
  implemented; their tensors are skipped on load with a logged warning.
* Zero-size tensors (the zero-width shared MLP of ``num_shared_experts=0``) are written, as the
  reference does, and may be absent from a file (they hold no values).
* MXFP4 experts (k3-release-notes.md §1.9): a quantized file stores each routed expert weight as
  ``experts.{e}.w1.weight_packed`` uint8 [O, K/2] + ``.weight_scale`` uint8 [O, K/32] and carries
  the compressed-tensors ``quantization_config`` in its text config. The format is recognised by
  the tensor suffixes (as the release notes advise; its ignore regexes do not describe the file
  exactly). Each expert is converted to what the model holds: dense ``experts.w1`` (exact
  dequantization) or packed ``experts.w1.weight_packed`` / ``.weight_scale`` stacks
  (:class:`openk3.quant.packed.PackedExperts`; dense file tensors are then quantized on load).
  Any other ``X.weight_packed`` + ``X.weight_scale`` pair is dequantized into ``X.weight``.

Loading checks every tensor's presence and shape against the config and names the first bad
tensor; nothing is unpickled (safetensors only). Writes are atomic: files go to a temporary
directory first and are moved into place one by one with ``os.replace``.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import re
import shutil
import tempfile
from collections import OrderedDict

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from openk3.config import K3Config
from openk3.quant.mx import mxfp4_weight_from_packed, mxfp4_weight_to_packed
from openk3.quant.packed import compressed_tensors_config
from openk3.quant.qat import QuantScheme, resolve_scheme

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 2 * 1024**3

_EXPERT_KEYS = ("w1", "w2", "w3")
_STACKED = re.compile(r"^(?P<pre>.*\.block_sparse_moe\.experts)\.(?P<w>w[123])$")
_STACKED_PACKED = re.compile(
    r"^(?P<pre>.*\.block_sparse_moe\.experts)\.(?P<w>w[123])\.(?P<s>weight_packed|weight_scale)$"
)
_PER_EXPERT = re.compile(
    r"^(?P<pre>.*\.block_sparse_moe\.experts)\.(?P<e>\d+)\.(?P<w>w[123])\.(?P<s>weight|weight_packed|weight_scale)$"
)
_PACKED_PAIR = ("weight_packed", "weight_scale")
_MXFP4_FORMAT = "mxfp4-pack-quantized"
# Tensors of the multimodal wrapper that the text model does not own: skipped by
# from_hf_state_dict (openk3.pretrained loads them into K3ForConditionalGeneration), written under
# their own names by to_hf_state_dict.
_FOREIGN_PREFIXES = ("vision_tower.", "mm_projector.")


_log = logging.getLogger("openk3.checkpoint")


def _prefix(config: K3Config) -> str:
    return "language_model." if config.wrapper is not None else ""


_A_LOG_LAYOUT = "__a_log_layout__"  # K3Config.source key: how the loaded file stored A_log


def a_log_file_shape(config: K3Config, heads: int) -> tuple[int, ...]:
    """The shape ``A_log`` is written with, by the code the checkpoint is for.

    * [H]: a ``kimi_k3`` wrapper or a K3 lower-bounded gate (only the K3 reference code runs
      those; it declares ``A_log`` [num_heads]).
    * A bare ``kimi_linear`` config with the Kimi Linear softplus gate is read by two official
      codes that disagree: the K3 reference (``modeling_kimi_linear.py``, [H]) and Kimi Linear's
      own ``modeling_kimi.py`` ([1, 1, H, 1], as are vLLM ``kimi_linear`` and transformers
      ``KimiLinear``). The layout of the checkpoint the config was loaded from wins (a round trip
      keeps its reader), then the ``auto_map`` of the config (``modeling_kimi_linear`` /
      ``configuration_kimi_k3``: [H]), else [1, 1, H, 1].
    """
    if config.wrapper is not None or config.is_k3:
        return (heads,)
    layout = (config.source or {}).get(_A_LOG_LAYOUT)
    if layout is not None:
        return (heads,) if layout == "per_head" else (1, 1, heads, 1)
    auto_map = config.extra_text_config.get("auto_map")
    if isinstance(auto_map, dict) and any(
        isinstance(v, str) and ("modeling_kimi_linear." in v or "configuration_kimi_k3." in v)
        for v in auto_map.values()
    ):
        return (heads,)
    return (1, 1, heads, 1)


def record_file_layout(config: K3Config, tensors: dict[str, torch.Tensor]) -> None:
    """Remember in ``config.source`` how the checkpoint stored ``A_log`` (``per_head`` [H] or
    ``unsqueezed`` [1, 1, H, 1]), so that saving the loaded model writes it the same way."""
    if config.source is None:
        return
    for name, t in tensors.items():
        if name.endswith("self_attn.A_log"):
            config.source[_A_LOG_LAYOUT] = "unsqueezed" if t.dim() == 4 else "per_head"
            return


def quantized_config(config: K3Config, quantization: str | QuantScheme | None) -> K3Config:
    """A copy of ``config`` whose text config carries the ``quantization_config`` of the scheme
    (:func:`openk3.quant.packed.compressed_tensors_config`), or none for ``quantization=None``."""
    scheme = resolve_scheme(quantization)
    cfg = copy.deepcopy(config)
    if cfg.wrapper is not None:
        cfg.wrapper.pop("quantization_config", None)  # the release keeps it in text_config only
    if scheme is None:
        cfg.extra_text_config.pop("quantization_config", None)
    else:
        cfg.extra_text_config["quantization_config"] = compressed_tensors_config(scheme)
    return cfg


def to_hf_state_dict(
    state_dict: dict[str, torch.Tensor],
    config: K3Config,
    quantization: str | QuantScheme | None = None,
) -> "OrderedDict[str, torch.Tensor]":
    """openk3 ``state_dict`` -> official tensor names and layouts.

    Args:
        state_dict: from ``K3ForCausalLM.state_dict()`` (dense ``experts.w1`` stacks and/or packed
            ``experts.w1.weight_packed`` / ``.weight_scale`` stacks); ``vision_tower.*`` /
            ``mm_projector.*`` entries (``K3ForConditionalGeneration``) are written unchanged.
        config: decides the ``language_model.`` prefix and the ``A_log`` layout.
        quantization: None writes routed experts as float ``experts.{e}.wN.weight`` (packed stacks
            are dequantized exactly); "mxfp4" writes ``weight_packed`` uint8 [O, K/2] +
            ``weight_scale`` uint8 [O, K/32] per expert (dense stacks quantized from their values).
    Returns:
        Ordered mapping official name -> tensor (expert stacks split into per-expert views).
    Raises:
        ValueError: unknown quantization, or expert widths that are not multiples of 32.
    """
    scheme = resolve_scheme(quantization)
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    pre = _prefix(config)
    if scheme is not None and any(_STACKED.match(n) for n in state_dict):
        scheme.check_expert_widths(config.moe_latent_size, config.moe_intermediate_size)

    def put_experts(m: re.Match, dense: torch.Tensor | None, packed: tuple | None) -> None:
        base = f"{pre}{m['pre']}"
        if scheme is None:
            dense = dense if dense is not None else mxfp4_weight_from_packed(*packed)
            for e in range(dense.shape[0]):
                out[f"{base}.{e}.{m['w']}.weight"] = dense[e]
            return
        packed = (
            packed
            if packed is not None
            else mxfp4_weight_to_packed(dense.detach(), scheme.scale_mode)
        )
        for e in range(packed[0].shape[0]):
            for suffix, t in zip(_PACKED_PAIR, packed):
                out[f"{base}.{e}.{m['w']}.{suffix}"] = t[e]

    for name, t in state_dict.items():
        m = _STACKED.match(name)
        if m:
            put_experts(m, t, None)
            continue
        m = _STACKED_PACKED.match(name)
        if m:
            if m["s"] == "weight_packed":  # its weight_scale is written with it
                put_experts(m, None, (t, state_dict[f"{m['pre']}.{m['w']}.weight_scale"]))
            continue
        if name.startswith(_FOREIGN_PREFIXES):
            out[name] = t  # the vision tower and projector sit beside language_model.*, unprefixed
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied to embed_tokens: stored once, as transformers does
        if name.endswith("self_attn.A_log"):
            t = t.reshape(a_log_file_shape(config, t.numel()))
        out[pre + name] = t
    return out


def _a_log_from_file(name: str, t: torch.Tensor, heads: int) -> torch.Tensor:
    flat = t.reshape(-1)
    if flat.numel() == heads:
        return flat
    if flat.numel() > heads and bool((flat[heads:] == 0).all()):
        return flat[:heads]  # the K3 release pads A_log to head_dim with zeros
    raise ValueError(
        f"checkpoint tensor {name}: shape {tuple(t.shape)} does not hold {heads} per-head values"
    )


def _check_quantization_config(config: K3Config) -> None:
    for where, d in (("text_config", config.extra_text_config), ("config", config.wrapper or {})):
        qc = d.get("quantization_config")
        if qc is None:
            continue
        method = qc.get("quant_method") if isinstance(qc, dict) else None
        fmt = qc.get("format") if isinstance(qc, dict) else None
        if method != "compressed-tensors" or fmt != _MXFP4_FORMAT:
            raise ValueError(
                f"{where}.quantization_config: quant_method={method!r}, format={fmt!r}; only compressed-tensors "
                f"{_MXFP4_FORMAT!r} (the K3 release) is supported"
            )


def _file_name(pre: str, key: str, expert: int | str = "N", suffix: str | None = None) -> str:
    """Official name of openk3 tensor ``key`` (for an expert stack: of one expert's tensor)."""
    m = _STACKED.match(key)
    if m:
        return f"{pre}{m['pre']}.{expert}.{m['w']}.{suffix or 'weight'}"
    m = _STACKED_PACKED.match(key)
    if m:
        return f"{pre}{m['pre']}.{expert}.{m['w']}.{m['s']}"
    return pre + key


def _expert_stack(
    pre: str,
    key: str,
    parts: dict[int, dict[str, torch.Tensor]],
    expected: dict,
    float_dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """One layer's per-expert tensors -> the stack(s) the model holds (dense or packed)."""
    packed_target = f"{key}.weight_packed" in expected
    shape = expected.get(f"{key}.weight_packed" if packed_target else key)
    n = shape[0] if shape is not None else len(parts)
    file_suffix = "weight_packed" if any("weight_packed" in p for p in parts.values()) else "weight"
    missing = [e for e in range(n) if e not in parts]
    if missing:
        raise ValueError(
            f"checkpoint is missing tensor {_file_name(pre, key, missing[0], file_suffix)}"
        )
    extra = sorted(set(parts) - set(range(n)))
    if extra:
        raise ValueError(
            f"checkpoint has unexpected tensor {_file_name(pre, key, extra[0], file_suffix)}"
        )
    dense = []
    packed = []
    scale = []
    for e in range(n):
        part = parts[e]
        if "weight" in part and len(part) > 1:
            raise ValueError(f"checkpoint has both {_file_name(pre, key, e)} and its packed form")
        if "weight" not in part:
            lost = [s for s in _PACKED_PAIR if s not in part]
            if lost:
                raise ValueError(f"checkpoint is missing tensor {_file_name(pre, key, e, lost[0])}")
        for suffix in _PACKED_PAIR:
            if suffix in part and part[suffix].dtype != torch.uint8:
                raise ValueError(
                    f"checkpoint tensor {_file_name(pre, key, e, suffix)}: dtype {part[suffix].dtype}, "
                    "expected torch.uint8 (MXFP4 codes / E8M0 scales)"
                )
        if packed_target:
            p, s = (
                (part["weight_packed"], part["weight_scale"])
                if "weight" not in part
                else mxfp4_weight_to_packed(part["weight"])
            )
            packed.append(p)
            scale.append(s)
        else:
            w = part.get("weight")
            dense.append(
                w
                if w is not None
                else mxfp4_weight_from_packed(
                    part["weight_packed"], part["weight_scale"], float_dtype
                )
            )
    groups = {"weight_packed": packed, "weight_scale": scale} if packed_target else {None: dense}
    out = {}
    for suffix, ts in groups.items():
        shapes = {tuple(t.shape) for t in ts}
        if len(shapes) > 1:
            raise ValueError(
                f"checkpoint experts under {pre}{key}: per-expert shapes differ: {sorted(shapes)}"
            )
        out[key if suffix is None else f"{key}.{suffix}"] = torch.stack(ts)
    return out


def from_hf_state_dict(
    tensors: dict[str, torch.Tensor], config: K3Config, expected: dict[str, torch.Size]
) -> dict[str, torch.Tensor]:
    """Official names -> openk3 ``state_dict``, checking presence and shape of every tensor.

    Routed experts are converted to the representation ``expected`` asks for: a dense stack
    ``experts.wN`` (packed files are dequantized exactly, into the dtype of ``embed_tokens``) or
    packed stacks ``experts.wN.weight_packed`` / ``.weight_scale`` (dense files are quantized, FLOOR).

    Args:
        tensors: official name -> tensor (as read from the files).
        config: the checkpoint's config (its ``quantization_config``, if any, must be MXFP4).
        expected: openk3 name -> shape, from a model built for ``config``.
    Raises:
        ValueError: a missing, unexpected or mis-shaped tensor (named in the message), or an
            unsupported ``quantization_config``.
    """
    _check_quantization_config(config)
    pre = _prefix(config)
    tensors = _skip_mtp(tensors, config, pre)
    embed = tensors.get(f"{pre}model.embed_tokens.weight")
    float_dtype = embed.dtype if embed is not None and embed.is_floating_point() else torch.float32
    stacks: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.startswith(_FOREIGN_PREFIXES):
            continue
        if pre and not name.startswith(pre):
            raise ValueError(
                f"checkpoint tensor {name}: expected the {pre!r} prefix of a kimi_k3 checkpoint"
            )
        local = name[len(pre) :]
        m = _PER_EXPERT.match(local)
        if m:
            stacks.setdefault(f"{m['pre']}.{m['w']}", {}).setdefault(int(m["e"]), {})[m["s"]] = t
            continue
        base, _, suffix = local.rpartition(".")
        if suffix in _PACKED_PAIR:
            pairs.setdefault(base, {})[suffix] = t
            continue
        if local.endswith("self_attn.A_log"):
            t = _a_log_from_file(name, t, config.linear_num_heads)
        out[local] = t
    for base, pair in pairs.items():  # a packed tensor outside the routed experts: dequantize it
        lost = [s for s in _PACKED_PAIR if s not in pair]
        if lost:
            raise ValueError(f"checkpoint is missing tensor {pre}{base}.{lost[0]}")
        if f"{base}.weight" in out:
            raise ValueError(f"checkpoint has both {pre}{base}.weight and its packed form")
        out[f"{base}.weight"] = mxfp4_weight_from_packed(
            pair["weight_packed"], pair["weight_scale"], float_dtype
        )
    for key, parts in stacks.items():
        out.update(_expert_stack(pre, key, parts, expected, float_dtype))
    for key, shape in expected.items():
        if key not in out and math.prod(shape) == 0:
            out[key] = torch.empty(tuple(shape), dtype=float_dtype)  # zero-size: nothing to read
        if key not in out:
            raise ValueError(
                f"checkpoint is missing tensor {_file_name(pre, key, 0)} (expected shape {tuple(shape)})"
            )
        if tuple(out[key].shape) != tuple(shape):
            stacked = bool(_STACKED.match(key) or _STACKED_PACKED.match(key))
            got = tuple(out[key].shape[1:]) if stacked else tuple(out[key].shape)
            want = tuple(shape[1:]) if stacked else tuple(shape)
            raise ValueError(
                f"checkpoint tensor {_file_name(pre, key)}: shape {got} does not match the config ({want})"
            )
    unexpected = sorted(set(out) - set(expected))
    if unexpected:
        raise ValueError(f"checkpoint has unexpected tensor {_file_name(pre, unexpected[0])}")
    return out


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _skip_mtp(
    tensors: dict[str, torch.Tensor], config: K3Config, pre: str
) -> dict[str, torch.Tensor]:
    """Drop the MTP layers' tensors (``model.layers.{L}`` .. ``{L+n-1}``, DeepSeek-V3 layout) of a
    config with ``num_nextn_predict_layers = n > 0``, logging how many were skipped."""
    n = config.num_nextn_predict_layers
    L = config.num_hidden_layers
    if n <= 0:
        return tensors
    kept = {}
    skipped = 0
    for name, t in tensors.items():
        m = _LAYER.match(name[len(pre) :]) if name.startswith(pre) else None
        if m and L <= int(m[1]) < L + n:
            skipped += 1
            continue
        kept[name] = t
    _log.warning(
        "num_nextn_predict_layers=%d: MTP is not implemented; %d MTP tensor(s) skipped", n, skipped
    )
    return kept


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (single file, or sharded with an index).

    Raises:
        FileNotFoundError: no weights, or a shard named by the index is missing.
        ValueError: a malformed index (not an object, a shard outside the directory, a tensor
            listed for a shard that does not hold it) or an unreadable safetensors file (named).
    """
    index = os.path.join(path, INDEX_NAME)
    plan: dict[str, list[str] | None]  # shard file -> tensors to read (None: all of them)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"{index}: not a readable JSON index ({e})") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(
                f"{index}: 'weight_map' must be a non-empty object of tensor name -> shard file"
            )
        plan = {}
        for name, fn in weight_map.items():
            if not isinstance(fn, str) or os.path.basename(fn) != fn or fn in ("", ".", ".."):
                raise ValueError(
                    f"{index}: tensor {name!r} maps to {fn!r}, not a file name in the checkpoint directory"
                )
            plan.setdefault(fn, []).append(name)
    elif os.path.isfile(os.path.join(path, WEIGHTS_NAME)):
        plan = {WEIGHTS_NAME: None}
    else:
        raise FileNotFoundError(f"no {WEIGHTS_NAME} or {INDEX_NAME} in {path!r}")
    tensors: dict[str, torch.Tensor] = {}
    for fn in sorted(plan):
        full = os.path.join(path, fn)
        if not os.path.isfile(full):
            raise FileNotFoundError(f"checkpoint shard {full!r} listed in the index is missing")
        try:
            with safe_open(full, framework="pt") as f:
                keys = set(f.keys())
                wanted = plan[fn] if plan[fn] is not None else sorted(keys)
                for k in wanted:
                    if k not in keys:
                        raise ValueError(
                            f"{full}: the index lists tensor {k!r} in this shard, but it is not there"
                        )
                    tensors[k] = f.get_tensor(k)
        except ValueError:
            raise
        except Exception as e:  # safetensors raises its own error type for damaged files
            raise ValueError(
                f"{full}: not a readable safetensors file ({type(e).__name__}: {e})"
            ) from None
    return tensors


def _file_mode() -> int:
    """0o666 minus the process umask (the mode ``open(..., "w")`` creates files with)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


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
                json.dump(
                    {"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2
                )
            written.append(INDEX_NAME)
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            f.write(config.to_json_string())
        written.append("config.json")
        for fn, text in (extra_files or {}).items():
            with open(os.path.join(tmp, fn), "w", encoding="utf-8") as f:
                f.write(text)
            written.append(fn)
        mode = _file_mode()
        for fn in written:
            # safetensors creates its files owner-only (0600); a checkpoint is meant to be shared and
            # served by other users, so every file gets the mode a plain open() would give.
            os.chmod(os.path.join(tmp, fn), mode)
            os.replace(os.path.join(tmp, fn), os.path.join(path, fn))
        stale = [WEIGHTS_NAME, INDEX_NAME] + [
            fn for fn in os.listdir(path) if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", fn)
        ]
        for fn in stale:
            if fn not in written and os.path.isfile(os.path.join(path, fn)):
                os.remove(os.path.join(path, fn))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
