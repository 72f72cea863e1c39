"""Synthetic image-question SFT data for the vision stage of the default model.

Shape legend: T tokens per packed row, L patches of the row's images, P patch size, G images.

Images are drawn offline with Pillow, deterministic per ``(seed, index)``: a plain background
with coloured shapes (circle / square / triangle) or a rendered digit / word (Pillow's default
FreeType font). Question types (:data:`QUESTION_TYPES`) and their exact short answers:

* ``color``: "What colour is the shape?" -> ``red`` (one shape);
* ``shape``: "What shape is in the image?" -> ``circle``;
* ``count``: "How many shapes are in the image?" -> ``1``..``4`` (one per quadrant);
* ``position``: "Is the shape on the left or the right?" / "... at the top or the bottom?" -> ``left``;
* ``digit``: "What digit is shown in the image?" -> ``7``;
* ``word``: "What word is written in the image?" -> ``cat`` (from :data:`WORDS`).

Every item is a chat-completions request whose user message holds an ``image_url`` part (a base64
PNG data URL, exactly what a client sends) and the question; the reference assistant message is
the answer with a short ``reasoning_content`` whose length follows the thinking effort
(:func:`openk3.datasets.sft_tasks.reasoning`), as in the text SFT set. Images are
:data:`IMAGE_SIZE` px square: 8 x 8 patches of 14, merged 2 x 2 -> 16 ``<|media_pad|>`` tokens.

Train / held-out split (as :mod:`openk3.datasets.sft_data`): an item's key is the hash of its PNG
bytes and question; held-out items are those with ``hash % 10 == 0`` and come from seed
``seed + EVAL_SEED_OFFSET``, training items are the rest, so no held-out (image, question) is
ever trained on. Accuracy is exact match of :func:`normalise_answer`.
"""

from __future__ import annotations

import base64
import hashlib
import io
import random

from PIL import Image, ImageDraw, ImageFont

from openk3.datasets.sft_data import EFFORTS, EVAL_SEED_OFFSET
from openk3.datasets.sft_tasks import Item, reasoning, set_effort

IMAGE_SIZE = 112
QUESTION_TYPES = ("color", "shape", "count", "position", "digit", "word")
COLORS = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "yellow": (235, 200, 20),
    "purple": (140, 40, 170),
    "orange": (245, 130, 20),
}
SHAPES = ("circle", "square", "triangle")
WORDS = ("cat", "dog", "sun", "car", "box", "hat", "pen", "map", "cup", "bed")
BACKGROUNDS = ((255, 255, 255), (235, 235, 235), (250, 240, 220), (220, 235, 250))
SUITE = "images"


# ------------------------------------------------------------------------------------ drawing
def _draw_shape(
    d: ImageDraw.ImageDraw, kind: str, cx: float, cy: float, r: float, fill: tuple
) -> None:
    if kind == "circle":
        d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif kind == "square":
        d.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif kind == "triangle":
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    else:
        raise ValueError(f"kind={kind!r}: must be one of {SHAPES}")


def _text_colour(rng: random.Random) -> tuple[str, tuple]:
    name = rng.choice(("red", "blue", "green", "purple"))
    return name, COLORS[name]


def draw_scene(rng: random.Random, qtype: str) -> tuple[Image.Image, str, str, list[str]]:
    """One image and its question for ``qtype``: ``(RGB image IMAGE_SIZE^2, question, answer,
    reasoning lines most-essential first)``.

    Raises:
        ValueError: unknown ``qtype``.
    """
    s = IMAGE_SIZE
    img = Image.new("RGB", (s, s), rng.choice(BACKGROUNDS))
    d = ImageDraw.Draw(img)
    if qtype in ("color", "shape"):
        kind = rng.choice(SHAPES)
        colour = rng.choice(sorted(COLORS))
        r = rng.uniform(16, 30)
        _draw_shape(
            d, kind, rng.uniform(r + 4, s - r - 4), rng.uniform(r + 4, s - r - 4), r, COLORS[colour]
        )
        answer = colour if qtype == "color" else kind
        q = "What colour is the shape?" if qtype == "color" else "What shape is in the image?"
        return img, q, answer, [f"I see one {colour} {kind}.", f"The answer is {answer}."]
    if qtype == "count":
        n = rng.randint(1, 4)
        cells = rng.sample(range(4), n)  # one shape per quadrant: never overlapping
        kinds = []
        for c in cells:
            r = rng.uniform(9, 18)
            x0 = (c % 2) * s / 2
            y0 = (c // 2) * s / 2
            kind = rng.choice(SHAPES)
            kinds.append(kind)
            _draw_shape(
                d,
                kind,
                x0 + rng.uniform(r + 3, s / 2 - r - 3),
                y0 + rng.uniform(r + 3, s / 2 - r - 3),
                r,
                COLORS[rng.choice(sorted(COLORS))],
            )
        return (
            img,
            "How many shapes are in the image?",
            str(n),
            [
                "Counting: " + ", ".join(str(i + 1) for i in range(n)) + ".",
                f"There are {n} shapes.",
            ],
        )
    if qtype == "position":
        kind = rng.choice(SHAPES)
        colour = rng.choice(sorted(COLORS))
        r = rng.uniform(12, 20)
        near = rng.uniform(r + 4, s / 2 - r - 6)
        far = rng.uniform(r + 4, s - r - 4)
        first = rng.random() < 0.5  # left / top
        main = near if first else s - near
        if rng.random() < 0.5:
            _draw_shape(d, kind, main, far, r, COLORS[colour])
            q = "Is the shape on the left or the right?"
            answer = "left" if first else "right"
        else:
            _draw_shape(d, kind, far, main, r, COLORS[colour])
            q = "Is the shape at the top or the bottom?"
            answer = "top" if first else "bottom"
        return (
            img,
            q,
            answer,
            [f"The {colour} {kind} is in the {answer} half.", f"The answer is {answer}."],
        )
    if qtype in ("digit", "word"):
        answer = str(rng.randint(0, 9)) if qtype == "digit" else rng.choice(WORDS)
        size = rng.randint(48, 64) if qtype == "digit" else rng.randint(28, 36)
        font = ImageFont.load_default(size=size)
        cname, colour = _text_colour(rng)
        x0, y0, x1, y1 = d.textbbox((0, 0), answer, font=font)
        w = x1 - x0
        h = y1 - y0
        x = rng.uniform(2, max(2.0, s - w - 2)) - x0
        y = rng.uniform(2, max(2.0, s - h - 2)) - y0
        d.text((x, y), answer, fill=colour, font=font)
        q = (
            "What digit is shown in the image?"
            if qtype == "digit"
            else "What word is written in the image?"
        )
        return img, q, answer, [f"The {cname} text reads {answer}.", f"The answer is {answer}."]
    raise ValueError(f"qtype={qtype!r}: must be one of {QUESTION_TYPES}")


def png_bytes(img: Image.Image) -> bytes:
    """Deterministic PNG encoding of ``img`` (no metadata)."""
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def data_url(png: bytes) -> str:
    """``data:image/png;base64,...`` of PNG bytes (what a chat client sends)."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def normalise_answer(text: str | None) -> str:
    """Lower-case, strip whitespace and trailing punctuation: the exact-match key of the eval."""
    return (text or "").strip().strip(".!?\"'").strip().lower()


# ------------------------------------------------------------------------------------- items
def gen_image_item(rng: random.Random, effort: str | None, qtype: str | None = None) -> Item:
    """One image question (``qtype`` drawn uniformly if None) as an :class:`Item` of suite
    ``"images"``; ``expected`` = ``{"answer", "type", "key"}`` (key: split hash input)."""
    qtype = qtype or rng.choice(QUESTION_TYPES)
    img, question, answer, lines = draw_scene(rng, qtype)
    png = png_bytes(img)
    request = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url(png)}},
                    {"type": "text", "text": question},
                ],
            }
        ]
    }
    set_effort(request, effort)
    ref = {"role": "assistant", "content": answer}
    r = reasoning(lines, effort)
    if r is not None:
        ref["reasoning_content"] = r
    key = hashlib.sha256(png + question.encode()).hexdigest()
    return Item(SUITE, request, ref, {"answer": answer, "type": qtype, "key": key})


def is_held_out_image(item: Item) -> bool:
    """True for the held-out tenth (by the hash of image bytes + question)."""
    return int(item.expected["key"][:8], 16) % 10 == 0


def image_items(seed: int, n: int, *, thinking_off: float = 0.1) -> list[Item]:
    """``n`` training items (held-out keys excluded), efforts drawn as in the text SFT set.

    Raises:
        ValueError: ``n`` < 0.
    """
    if n < 0:
        raise ValueError(f"n={n}: must be >= 0")
    rng = random.Random(seed)
    out: list[Item] = []
    while len(out) < n:
        effort = None if rng.random() < thinking_off else rng.choice(EFFORTS)
        it = gen_image_item(rng, effort)
        if not is_held_out_image(it):
            out.append(it)
    return out


def eval_image_items(seed: int, n: int) -> list[Item]:
    """``n`` held-out items from seed ``seed + EVAL_SEED_OFFSET``: question types cycle through
    :data:`QUESTION_TYPES` (balanced per type), thinking effort ``low`` (short, cheap to decode).

    Raises:
        ValueError: ``n`` < 1.
    """
    if n < 1:
        raise ValueError(f"n={n}: must be >= 1")
    rng = random.Random(seed + EVAL_SEED_OFFSET + 17)
    out: list[Item] = []
    while len(out) < n:
        it = gen_image_item(rng, "low", QUESTION_TYPES[len(out) % len(QUESTION_TYPES)])
        if is_held_out_image(it):
            out.append(it)
    return out


def score_image(item: Item, msg: dict) -> dict:
    """``correct``: the normalised content equals the expected answer."""
    return {"correct": normalise_answer(msg.get("content")) == item.expected["answer"]}


def summarize_images(items: list[Item], scores: list[dict]) -> dict:
    """``{"n", "accuracy", "accuracy_by_type": {type: fraction}}`` (types in :data:`QUESTION_TYPES` order)."""
    by: dict[str, list[bool]] = {}
    for it, s in zip(items, scores):
        by.setdefault(it.expected["type"], []).append(bool(s["correct"]))
    n = len(scores)
    return {
        "n": n,
        "accuracy": sum(bool(s["correct"]) for s in scores) / n if n else float("nan"),
        "accuracy_by_type": {t: sum(by[t]) / len(by[t]) for t in QUESTION_TYPES if t in by},
    }


__all__ = [
    "IMAGE_SIZE",
    "QUESTION_TYPES",
    "COLORS",
    "SHAPES",
    "WORDS",
    "SUITE",
    "draw_scene",
    "png_bytes",
    "data_url",
    "normalise_answer",
    "gen_image_item",
    "is_held_out_image",
    "image_items",
    "eval_image_items",
    "score_image",
    "summarize_images",
]
