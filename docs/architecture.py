"""Draw docs/architecture.svg, the README's picture of openk3: a request's path through the server,
the chat format, the engine and the model with its caches, and the training path that ends in a
checkpoint the server loads.

    .venv/bin/python docs/architecture.py        # rewrites docs/architecture.svg (deterministic)
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = Path(__file__).resolve().parent / "architecture.svg"
SERVE, TRAIN, STATE, CLIENT = "#dbeafe", "#dcfce7", "#fef3c7", "#f3f4f6"


def box(ax, x, y, w, h, title, lines, color):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", fc=color, ec="#374151",
                                lw=1.2))
    ax.text(x + w / 2, y + h - 0.17, title, ha="center", va="top", fontsize=10.5, weight="bold", family="DejaVu Sans")
    ax.text(x + w / 2, y + h - 0.47, "\n".join(lines), ha="center", va="top", fontsize=8, family="DejaVu Sans",
            linespacing=1.35, color="#1f2937")
    return (x, y, w, h)


def arrow(ax, a, b, label="", rad=0.0, style="-|>", color="#111827", lw=1.4, offset=(0.0, 0.12)):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=13, lw=lw, color=color,
                                 connectionstyle=f"arc3,rad={rad}", shrinkA=2, shrinkB=2))
    if label:
        ax.text((a[0] + b[0]) / 2 + offset[0], (a[1] + b[1]) / 2 + offset[1], label, ha="center", va="bottom",
                fontsize=7.5, style="italic", color="#374151", family="DejaVu Sans")


def right(b, f=0.5):
    return (b[0] + b[2], b[1] + b[3] * f)


def left(b, f=0.5):
    return (b[0], b[1] + b[3] * f)


def top(b, f=0.5):
    return (b[0] + b[2] * f, b[1] + b[3])


def bottom(b, f=0.5):
    return (b[0] + b[2] * f, b[1])


def main() -> None:
    plt.rcParams["svg.hashsalt"] = "openk3"  # stable element ids: the file only changes with the drawing
    plt.rcParams["svg.fonttype"] = "none"  # text stays text (smaller, searchable)
    fig, ax = plt.subplots(figsize=(15.9, 7.0))
    ax.set_xlim(0, 15.9)
    ax.set_ylim(0, 7.0)
    ax.axis("off")
    W, GAP, Y, H = 2.35, 0.95, 4.5, 1.9

    ax.text(0.1, 6.85, "serving: a request", fontsize=11, weight="bold", va="top", family="DejaVu Sans")
    xs = [0.1 + i * (W + GAP) for i in range(5)]
    client = box(ax, xs[0], Y, W, H, "client", ["OpenAI / Anthropic SDKs,", "Claude Code, Codex,",
                                                 "Kimi CLI, kosong", "examples/*.py"], CLIENT)
    server = box(ax, xs[1], Y, W, H, "server", ["openk3/server", "FastAPI: /v1, /anthropic", "validation (400s)",
                                                 "SSE, usage, /metrics"], SERVE)
    fmt = box(ax, xs[2], Y, W, H, "chat format", ["openk3/chat_format", "messages, tools -> ids",
                                                   "output parser: reasoning,", "content, tool calls"], SERVE)
    engine = box(ax, xs[3], Y, W, H, "engine", ["openk3/engine", "continuous batching", "constrained decoding",
                                                 "sampling (token ids only)"], SERVE)
    model = box(ax, xs[4], Y, W, H, "model", ["openk3/model.py", "KDA + gated MLA", "Block AttnRes",
                                               "LatentMoE, vision tower"], SERVE)
    caches = box(ax, xs[3], 2.85, xs[4] + W * 0.62 - xs[3], 1.2, "caches (caller-owned)",
                 ["paged MLA latent pool,  KDA state slots,", "prefix-cache snapshots (KDA state + latents)"], STATE)

    arrow(ax, right(client, 0.62), left(server, 0.62), "HTTP")
    arrow(ax, left(server, 0.3), right(client, 0.3), "JSON / SSE", offset=(0, -0.32))
    arrow(ax, right(server, 0.62), left(fmt, 0.62), "request")
    arrow(ax, left(fmt, 0.3), right(server, 0.3), "events", offset=(0, -0.32))
    arrow(ax, right(fmt, 0.62), left(engine, 0.62), "prompt ids")
    arrow(ax, left(engine, 0.3), right(fmt, 0.3), "new ids", offset=(0, -0.32))
    arrow(ax, right(engine, 0.62), left(model, 0.62), "forward")
    arrow(ax, left(model, 0.3), right(engine, 0.3), "logits", offset=(0, -0.32))
    arrow(ax, bottom(engine, 0.5), (engine[0] + W * 0.5, 4.05), style="<|-|>")
    arrow(ax, bottom(model, 0.3), (model[0] + W * 0.3, 4.05), style="<|-|>")

    ax.text(0.1, 2.6, "training: a checkpoint", fontsize=11, weight="bold", va="top", family="DejaVu Sans")
    TY, TH = 0.2, 1.85
    corpus = box(ax, xs[0], TY, W, TH, "corpus", ["openk3 build-corpus", "permissive offline text", "(DATA.md)"], TRAIN)
    tok = box(ax, xs[1], TY, W, TH, "tokenizer", ["openk3 train-tokenizer", "byte-level BPE +", "K3 special tokens"],
              TRAIN)
    train = box(ax, xs[2], TY, W, TH, "trainer", ["openk3 train --recipe", "Per-Head Muon, QB,", "QK-Clip, MXFP4 QAT",
                                                   "FSDP2 + EP (torchrun)"], TRAIN)
    ckpt = box(ax, xs[3], TY, W, TH, "checkpoint", ["official HF layout:", "config.json (kimi_k3),",
                                                     "safetensors, tokenizer,", "chat template"], TRAIN)
    export = box(ax, xs[4], TY, W, TH, "export", ["openk3 export", "(MXFP4 experts)", "-> openk3 serve,",
                                                   "vLLM, SGLang"], TRAIN)

    arrow(ax, right(corpus), left(tok), "text")
    arrow(ax, right(tok), left(train), "ids")
    arrow(ax, right(train), left(ckpt), "save_pretrained")
    arrow(ax, right(ckpt), left(export), "")
    arrow(ax, top(export, 0.82), bottom(model, 0.82), "")
    ax.text(model[0] + W * 0.86, 3.3, "load_pretrained", fontsize=7.5, style="italic", color="#374151",
            family="DejaVu Sans", rotation=90, va="center")

    fig.savefig(OUT, format="svg", bbox_inches="tight", metadata={"Date": None, "Creator": "docs/architecture.py"})
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
