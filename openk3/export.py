"""Turn a training checkpoint into a servable model directory (``openk3 export``).

A trainer checkpoint (``OUT/checkpoints/step-N``) holds ``config.json``, the full-precision
``model.safetensors`` (the QAT master weights) and trainer state; a servable directory also needs
the tokenizer files and ``chat_template.jinja``, and a QAT-trained K3 ships its routed experts the
way it was trained to run: MXFP4 ``weight_packed`` + ``weight_scale`` (k3-release-notes.md §1.9,
the released ``quantization_config``). :func:`export_model` writes exactly that and checks that the
result loads back and computes the same logits as the source with its experts quantized (the
inference-time view of QAT's weight fake-quantization).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch


def _quantized_reference(model, scheme: str):
    """A copy of ``model``'s forward with routed-expert weights replaced by ``dequant(quant(W))``."""
    import copy

    from openk3.quant.qat import resolve_scheme

    ref = copy.deepcopy(model)
    sch = resolve_scheme(scheme)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if ".block_sparse_moe.experts." in name and p.dim() == 3:
                p.copy_(sch.fake_quant_weight(p))
    return ref


def export_model(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | None = None,
    quantization: str | None = "mxfp4",
    model_card: str | os.PathLike | None = None,
    overwrite: bool = False,
    check_tokens: int = 64,
) -> dict:
    """Write ``checkpoint`` as a servable directory ``out`` (atomically: a temporary sibling
    directory is renamed into place only once complete and verified).

    Args:
        checkpoint: a ``save_pretrained``-format directory (e.g. a trainer checkpoint).
        out: destination directory.
        tokenizer: tokenizer directory (default: ``checkpoint`` itself); its files and the chat
            template are written next to the weights.
        quantization: None (float experts) or "mxfp4" (packed routed experts, as K3 ships).
        model_card: a Markdown file copied in as ``MODEL_CARD.md``.
        overwrite: replace an existing ``out``.
        check_tokens: length of the logits check (0 skips it).
    Returns:
        ``{"out", "bytes", "files", "max_abs_logit_diff"}``; the diff is between the reloaded export
        and the source model with its experts quantized the same way (fp32).
    Raises:
        FileExistsError: ``out`` exists and ``overwrite`` is false.
        FileNotFoundError / ValueError: from the checkpoint or tokenizer loaders, an unknown
            ``quantization``, or a reloaded export whose logits differ by more than 1e-4.
    """
    from openk3.pretrained import load_pretrained
    from openk3.tokenizer import load_tokenizer

    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"export: {out} exists (pass overwrite=True / --overwrite)")
    model = load_pretrained(checkpoint, dtype=torch.float32)
    tok = load_tokenizer(tokenizer if tokenizer is not None else checkpoint)
    if tok.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"export: tokenizer has {tok.vocab_size} ids, the model's vocab_size is "
            f"{model.config.vocab_size}"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the export is meant to be shared
    try:
        model.save_pretrained(str(tmp), quantization=quantization)
        tok.save_pretrained(tmp)
        if model_card is not None:
            shutil.copyfile(model_card, tmp / "MODEL_CARD.md")
        diff = None
        if check_tokens:
            ref = _quantized_reference(model, quantization) if quantization else model
            ids = torch.randint(
                0, tok.vocab_size, (1, check_tokens), generator=torch.Generator().manual_seed(0)
            )
            with torch.no_grad():
                want = ref(ids).logits
                got = load_pretrained(tmp, dtype=torch.float32)(ids).logits
            diff = float((got - want).abs().max())
            if not diff <= 1e-4:
                raise ValueError(
                    f"export: reloaded logits differ from the source by {diff:.3g} (> 1e-4)"
                )
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = sorted(p.name for p in out.iterdir())
    return {
        "out": str(out),
        "bytes": sum(p.stat().st_size for p in out.iterdir()),
        "files": files,
        "max_abs_logit_diff": diff,
    }


def cli_export(args) -> int:
    """``openk3 export CHECKPOINT OUT [--tokenizer DIR] [--quantization mxfp4|none] [--model-card F]``."""
    import sys

    q = None if args.quantization == "none" else args.quantization
    try:
        result = export_model(
            args.checkpoint,
            args.out,
            tokenizer=args.tokenizer,
            quantization=q,
            model_card=args.model_card,
            overwrite=args.overwrite,
        )
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"openk3 export: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    return 0


__all__ = ["export_model", "cli_export"]
