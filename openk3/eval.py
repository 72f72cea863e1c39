"""``openk3 eval``: the held-out suites of the default model against a checkpoint or a server.

Runs the eval sets of :mod:`openk3.train.sft_data` (generated from their own seeds, disjoint from
the training prompts) through a model and writes the eval table of issue 8 item 4:

* ``validation``: token-mean loss and perplexity on the corpus ``val`` split (``--corpus``) and
  on the held-out SFT conversations (assistant tokens only); in-process models only;
* ``problems``: accuracy per thinking effort and mean reasoning length (characters of
  ``reasoning_content``) per effort;
* ``tools``: tool-name accuracy (the set of called names equals the expected one), argument
  accuracy (every expected call made with equal arguments) and schema validity (every call's
  arguments valid under its tool's parameter schema);
* ``json``: validity (a JSON object, valid under the schema for ``json_schema``) and key accuracy
  (share of expected fields present with the expected value);
* ``effort``: self-report accuracy (the answer names the request's effort and no other);
* ``images``: exact-match accuracy per question type on held-out synthetic image questions
  (:mod:`openk3.train.vision_data`), images sent as base64 PNG parts and expanded exactly as the
  server does; skipped with a note for a text-only model.

Models: :class:`InProcessModel` (a checkpoint directory: engine + chat format + output parser,
greedy, with the same output constraints the server applies for JSON formats and tool calls) or
:class:`ServerModel` (``POST /v1/chat/completions`` of a running server, temperature 0 and a
per-item seed; a K3 server samples at its fixed temperature, so the numbers are sampled). Every
score is a function of ``(item, message)`` so the reference answers score 100 %
(:class:`OracleModel`). Accuracies are fractions in [0, 1].
"""

from __future__ import annotations

import json
import math
import re
import sys
import urllib.request
from collections import defaultdict
from typing import Any, Protocol

from openk3.train.sft_data import EFFORTS, EVAL_SUITES, Item, eval_items

IMAGE_SUITE = "images"
ALL_SUITES = EVAL_SUITES + (IMAGE_SUITE,)

_INT = re.compile(r"-?\d+")


class ChatModel(Protocol):
    """Anything that answers a chat-completions request body with an OpenAI assistant message."""

    def chat(self, requests: list[dict]) -> list[dict]:
        """May also take ``progress``: a callable called with 1 per answered request."""
        ...


# ------------------------------------------------------------------------------------ scoring
def score_problem(item: Item, msg: dict) -> dict:
    """``correct``: the last integer of the content equals the answer; ``reasoning_chars``."""
    nums = _INT.findall(msg.get("content") or "")
    return {"correct": bool(nums) and int(nums[-1]) == item.expected["answer"],
            "reasoning_chars": len(msg.get("reasoning_content") or "")}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, str) and isinstance(b, str):
        return a.strip().lower() == b.strip().lower()
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
            and not isinstance(b, bool):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    return a == b


def _calls(msg: dict) -> list[tuple[str, Any]]:
    out = []
    for c in msg.get("tool_calls") or []:
        fn = c.get("function") or {}
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except json.JSONDecodeError:
            args = None
        out.append((fn.get("name"), args))
    return out


def score_tool(item: Item, msg: dict) -> dict:
    """``name_correct``, ``args_correct``, ``schema_valid`` of the message's tool calls."""
    import jsonschema

    got = _calls(msg)
    want = item.expected["calls"]
    name_ok = sorted(str(n) for n, _ in got) == sorted(c["name"] for c in want)
    remaining = list(got)
    args_ok = name_ok
    for c in want:
        hit = next((g for g in remaining if g[0] == c["name"] and isinstance(g[1], dict)
                    and set(g[1]) == set(c["arguments"]) and all(_same(g[1][k], v) for k, v in c["arguments"].items())),
                   None)
        if hit is None:
            args_ok = False
        else:
            remaining.remove(hit)
    schema_ok = bool(got)
    for name, args in got:
        schema = item.expected["schemas"].get(name)
        if schema is None or not isinstance(args, dict) or not jsonschema.Draft202012Validator(schema).is_valid(args):
            schema_ok = False
    return {"name_correct": name_ok, "args_correct": args_ok, "schema_valid": schema_ok}


def score_json(item: Item, msg: dict) -> dict:
    """``valid`` (an object; schema-valid for json_schema) and ``key_accuracy``."""
    import jsonschema

    try:
        value = json.loads(msg.get("content") or "")
    except json.JSONDecodeError:
        return {"valid": False, "key_accuracy": 0.0}
    if not isinstance(value, dict):
        return {"valid": False, "key_accuracy": 0.0}
    valid = True
    if item.request["response_format"]["type"] == "json_schema":
        valid = jsonschema.Draft202012Validator(item.expected["schema"]).is_valid(value)
    fields = item.expected["fields"]
    acc = sum(k in value and _same(value[k], v) for k, v in fields.items()) / len(fields)
    return {"valid": valid, "key_accuracy": acc}


def score_effort(item: Item, msg: dict) -> dict:
    """``correct``: the content names the request's effort and no other effort."""
    words = set(re.findall(r"[a-z]+", (msg.get("content") or "").lower()))
    named = words & set(EFFORTS)
    return {"correct": named == {item.expected["effort"]}}


SCORERS = {"problems": score_problem, "tools": score_tool, "json": score_json, "effort": score_effort}


def summarize(suite: str, items: list[Item], scores: list[dict]) -> dict:
    """Aggregate one suite's per-item scores into its row of the eval table."""
    n = len(scores)
    mean = (lambda key: sum(float(s[key]) for s in scores) / n if n else math.nan)
    if suite == "problems":
        by: dict[str, list[dict]] = defaultdict(list)
        for it, s in zip(items, scores):
            by[it.request.get("reasoning_effort", "none")].append(s)
        return {"n": n,
                "accuracy_by_effort": {e: sum(s["correct"] for s in v) / len(v) for e, v in by.items()},
                "mean_reasoning_chars_by_effort": {e: sum(s["reasoning_chars"] for s in v) / len(v)
                                                   for e, v in by.items()},
                "accuracy": mean("correct")}
    if suite == "tools":
        return {"n": n, "name_accuracy": mean("name_correct"), "argument_accuracy": mean("args_correct"),
                "schema_validity": mean("schema_valid")}
    if suite == "json":
        return {"n": n, "validity": mean("valid"), "key_accuracy": mean("key_accuracy")}
    return {"n": n, "accuracy": mean("correct")}


# ------------------------------------------------------------------------------------- models
class OracleModel:
    """Answers every eval request with its item's reference message (checks the scorers)."""

    def __init__(self, items: list[Item]):
        self._ref = {json.dumps(it.request, sort_keys=True): it.reference for it in items}

    def chat(self, requests: list[dict]) -> list[dict]:
        return [self._ref[json.dumps(r, sort_keys=True)] for r in requests]


class InProcessModel:
    """A checkpoint directory served in-process: :func:`~openk3.chat_format.encode_request` ->
    :class:`~openk3.engine.Engine` (greedy, batched) -> :class:`~openk3.chat_format.OutputParser`.
    JSON response formats and tool calls (unless ``tool_choice: none``) are constrained as the
    server does (:func:`~openk3.engine.constraints.make_constraint`).

    Raises:
        FileNotFoundError / ValueError: from loading the checkpoint or tokenizer.
    """

    def __init__(self, path: str, tokenizer: str | None = None, *, device: Any = "cpu", dtype: Any = None,
                 max_tokens: int = 256, max_num_seqs: int = 8):
        from openk3.pretrained import load_pretrained
        from openk3.tokenizer import load_tokenizer

        from openk3.server.images import image_config_for

        self.tokenizer = load_tokenizer(tokenizer or path)
        self.model = load_pretrained(path, device=device, dtype=dtype)
        self.model.eval()
        self.image_config = image_config_for(self.model, path)  # None: text-only model
        self.supports_images = self.image_config is not None
        self.max_tokens, self.max_num_seqs = max_tokens, max_num_seqs

    def _constraint(self, request: dict, prompt: Any):
        from openk3.engine.constraints import make_constraint

        rf = request.get("response_format") or {}
        kind = rf.get("type") if rf.get("type") in ("json_object", "json_schema") else None
        schema = rf["json_schema"]["schema"] if kind == "json_schema" else None
        tools = list(request.get("tools") or [])
        tools += [t for m in request["messages"] if m.get("role") == "system" for t in (m.get("tools") or [])]
        use_tools = tools if tools and prompt.tool_choice != "none" else None
        if kind is None and use_tools is None:
            return None
        return make_constraint(self.tokenizer, kind or "text", schema=schema, tools=use_tools,
                               tool_choice=prompt.tool_choice, thinking=prompt.channel == "think",
                               vocab_size=self.model.config.vocab_size)

    def chat(self, requests: list[dict], progress: Any = None) -> list[dict]:
        from openk3.chat_format import OutputParser, encode_request
        from openk3.engine import Engine, EngineConfig, SamplingParams

        engine = Engine(self.model, EngineConfig(max_num_seqs=self.max_num_seqs, enable_prefix_cache=False))
        parsers = {}
        for i, req in enumerate(requests):
            prompt = encode_request(req, self.tokenizer)
            params = SamplingParams(max_tokens=self.max_tokens, temperature=0.0,
                                    stop_token_ids=list(self.tokenizer.stop_token_ids))
            ids, mm = prompt.token_ids, None
            if prompt.image_slots:  # the server's path: decode, preprocess, expand the slots
                from openk3.server.images import expand_images

                if not self.supports_images:
                    raise ValueError("model: a text-only model cannot take image input")
                expanded = expand_images(prompt, self.tokenizer, self.image_config, pixels=True)
                ids, mm = expanded.token_ids, expanded.mm_inputs
            engine.add_request(ids, params, self._constraint(req, prompt), request_id=str(i), mm_inputs=mm)
            parsers[str(i)] = OutputParser(self.tokenizer, start_channel=prompt.channel or "think",
                                           tool_index_start=prompt.history_tool_calls,
                                           tools_enabled=prompt.tool_choice != "none")
        while engine.has_unfinished():
            for out in engine.step():
                parsers[out.request_id].feed(out.new_token_ids)
                if out.finished and progress is not None:
                    progress(1)
        messages = []
        for i in range(len(requests)):
            p = parsers[str(i)]
            p.finish()
            messages.append(p.message().to_openai())
        return messages

    def validation(self, corpus: str | None, n_items: int, seed: int, *, seq_len: int = 512,
                   max_batches: int = 16) -> dict:
        """Loss / perplexity on the corpus ``val`` split (if given) and the held-out SFT answers."""
        from openk3.train.data import DocumentStore, PackedLoader
        from openk3.train.trainer import evaluate

        def run(store) -> dict:
            loader = PackedLoader(store, seq_len, 1, shuffle=False, loop=False, split_documents=True,
                                  pad_id=self.model.config.pad_token_id or 0)
            batches = []
            for b in loader:
                batches.append(b.packed())
                if len(batches) >= max_batches:
                    break
            ev = evaluate(self.model, batches)
            return {"loss": ev["eval_loss"], "perplexity": math.exp(min(ev["eval_loss"], 50.0)),
                    "tokens": ev["eval_tokens"]}

        out: dict = {}
        if corpus:
            out["corpus"] = run(DocumentStore.from_corpus(corpus, self.tokenizer, "val"))
        convs = [it.conversation() for s in EVAL_SUITES for it in eval_items(s, seed, n_items)]
        out["sft"] = run(DocumentStore.from_conversations(convs, self.tokenizer))
        return out


class ServerModel:
    """A running openk3 (or any OpenAI-compatible) server: one ``POST {url}/v1/chat/completions``
    per request, temperature 0 and ``seed`` = the item's index; the model id is the first of
    ``GET /v1/models`` unless given. A K3 server samples at its fixed temperature (1.0 with
    thinking) whatever is asked, so these numbers are sampled — reproducible through the seeds, but
    not comparable with the greedy in-process table."""

    def __init__(self, url: str, *, model: str | None = None, api_key: str | None = None, max_tokens: int = 256,
                 timeout: float = 600.0):
        self.url, self.api_key, self.max_tokens, self.timeout = url.rstrip("/"), api_key, max_tokens, timeout
        models = self._get("/v1/models")["data"]
        self.model = model or models[0]["id"]
        self.supports_images = any(m.get("id") == self.model and m.get("supports_image_in") for m in models)

    def _headers(self) -> dict:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def _get(self, path: str) -> dict:
        req = urllib.request.Request(self.url + path, headers=self._headers())
        with urllib.request.urlopen(req, timeout=self.timeout) as r:
            return json.loads(r.read())

    def chat(self, requests: list[dict], progress: Any = None) -> list[dict]:
        out = []
        for i, body in enumerate(requests):
            data = json.dumps(dict(body, model=self.model, temperature=0, seed=i, max_tokens=self.max_tokens)).encode()
            req = urllib.request.Request(self.url + "/v1/chat/completions", data=data, headers=self._headers())
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                out.append(json.loads(r.read())["choices"][0]["message"])
            if progress is not None:
                progress(1)
        return out


# ------------------------------------------------------------------------------------ the run
def _answers(model: ChatModel, suite: str, requests: list[dict], progress: bool) -> list[dict]:
    """``model.chat(requests)``, with a progress bar (tqdm, on stderr: done / total, rate, ETA)
    when `progress` and the model reports progress."""
    import inspect

    if not progress or "progress" not in inspect.signature(model.chat).parameters:
        return model.chat(requests)
    from tqdm import tqdm

    with tqdm(total=len(requests), desc=f"eval {suite}", unit="item", file=sys.stderr, leave=True) as bar:
        return model.chat(requests, progress=bar.update)


def run_eval(model: ChatModel, *, n: int = 24, seed: int = 0, suites: tuple[str, ...] = EVAL_SUITES,
             validation: dict | None = None, progress: bool = False) -> dict:
    """The eval table: each suite's ``n`` held-out items (seed ``seed``) through ``model``
    (`progress`: a progress bar per suite on stderr).

    Raises:
        ValueError: an unknown suite or ``n`` < 1 (from :func:`~openk3.train.sft_data.eval_items`).
    """
    table: dict[str, Any] = {"seed": seed, "n_per_suite": n, "validation": validation}
    for suite in suites:
        if suite == IMAGE_SUITE:
            table[suite] = run_image_eval(model, n=n, seed=seed, progress=progress)
            continue
        items = eval_items(suite, seed, n)
        messages = _answers(model, suite, [it.request for it in items], progress)
        scores = [SCORERS[suite](it, m) for it, m in zip(items, messages)]
        table[suite] = summarize(suite, items, scores)
    return table


def run_image_eval(model: ChatModel, *, n: int = 24, seed: int = 0, progress: bool = False) -> dict:
    """The ``images`` suite: ``n`` held-out image questions (types balanced) through ``model``,
    greedy; ``{"n", "accuracy", "accuracy_by_type"}``, or ``{"skipped": reason}`` when the model
    takes no image input (``supports_images`` false)."""
    from openk3.train.vision_data import eval_image_items, score_image, summarize_images

    if not getattr(model, "supports_images", True):
        return {"skipped": "text-only model (no vision tower): image suite not run"}
    items = eval_image_items(seed, n)
    messages = _answers(model, IMAGE_SUITE, [it.request for it in items], progress)
    return summarize_images(items, [score_image(it, m) for it, m in zip(items, messages)])


def format_table(table: dict) -> str:
    """The eval table as text (percentages)."""
    pct = (lambda v: "n/a" if v is None or v != v else f"{100 * v:.1f}%")
    lines = []
    for name, v in (table.get("validation") or {}).items():
        lines.append(f"validation {name:<8} loss {v['loss']:.4f}  perplexity {v['perplexity']:.2f}  ({v['tokens']} tokens)")
    if "problems" in table:
        p = table["problems"]
        for e in EFFORTS:
            if e in p["accuracy_by_effort"]:
                lines.append(f"problems   effort {e:<6} accuracy {pct(p['accuracy_by_effort'][e]):>7}  "
                             f"mean reasoning {p['mean_reasoning_chars_by_effort'][e]:.0f} chars")
    if "tools" in table:
        t = table["tools"]
        lines.append(f"tools      name {pct(t['name_accuracy'])}  arguments {pct(t['argument_accuracy'])}  "
                     f"schema-valid {pct(t['schema_validity'])}")
    if "json" in table:
        lines.append(f"json       valid {pct(table['json']['validity'])}  keys {pct(table['json']['key_accuracy'])}")
    if "effort" in table:
        lines.append(f"effort     self-report accuracy {pct(table['effort']['accuracy'])}")
    if IMAGE_SUITE in table:
        im = table[IMAGE_SUITE]
        if "skipped" in im:
            lines.append(f"images     skipped: {im['skipped']}")
        else:
            per = "  ".join(f"{t} {pct(v)}" for t, v in im["accuracy_by_type"].items())
            lines.append(f"images     accuracy {pct(im['accuracy'])}  ({per})")
    return "\n".join(lines)


def cli_eval(args: Any) -> int:
    """``openk3 eval MODEL``: MODEL is a checkpoint directory or an ``http(s)://`` server URL.
    Prints the table, writes JSON to ``--out``. Returns 0, or 2 with a message for bad input."""
    try:
        if args.model.startswith(("http://", "https://")):
            model: Any = ServerModel(args.model, model=args.served_model_name, api_key=args.api_key,
                                     max_tokens=args.max_tokens)
            validation = None
        else:
            from openk3.runtime import setup

            device, dtype = setup(args)
            model = InProcessModel(args.model, args.tokenizer, device=device, dtype=dtype, max_tokens=args.max_tokens)
            validation = model.validation(args.corpus, args.n, args.seed)
        table = run_eval(model, n=args.n, seed=args.seed, suites=tuple(args.suites or ALL_SUITES),
                         validation=validation, progress=not getattr(args, "no_progress", False))
    except (FileNotFoundError, ValueError, OSError) as e:
        print(f"openk3 eval: {e}", file=sys.stderr)
        return 2
    table["model"] = args.model
    print(format_table(table))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(table, f, indent=2)
            f.write("\n")
    return 0


__all__ = ["ChatModel", "InProcessModel", "ServerModel", "OracleModel", "SCORERS", "score_problem", "score_tool",
           "score_json", "score_effort", "summarize", "run_eval", "run_image_eval", "format_table", "cli_eval",
           "IMAGE_SUITE", "ALL_SUITES"]
