"""``openk3 eval``: the held-out suites of the default model against a checkpoint or a server.

Runs the eval sets of :mod:`openk3.datasets.sft_data` (values from the held-out pools, prompts
disjoint from training by hash) through a model and writes the eval table; every rate comes with
its 95 % Wilson score interval (:func:`wilson`), because at n = 100 a rate is only known to about
+-8 points.

Suites (``--n`` items each; ``arithmetic`` n per operation, ``images`` n per question type):

* ``arithmetic``: two-operand problems at effort max (+ and - with operands 0-99, a 2-digit number
  times a digit 2-9): ``correct`` (the last integer of the content is the value) and
  ``consistent`` (it equals the last integer of the reasoning: the answer is the result its own
  reasoning reached);
* ``reasoning``: the same kind of problems with efforts cycling: mean reasoning length
  (characters of ``reasoning_content``) and accuracy per effort;
* ``tools``: one call needed: ``name_correct`` (the called names are the expected ones),
  ``args_correct`` (every expected call made with equal arguments), ``schema_valid``;
* ``tools_two``: two calls needed in one turn: ``both_correct`` (both calls with their arguments);
* ``tool_result``: the turn after a tool result: ``uses_result`` (the answer contains the
  result's value), no new call;
* ``json``: ``valid`` (an object; schema-valid for json_schema) and ``all_fields`` (every
  requested key with the value stated in the request); ``key_accuracy`` is the per-field mean;
* ``recall``: a fact from an earlier turn (name, city, number, pet, code) in the answer;
* ``effort``: the answer names the request's effort and no other;
* ``echo``: "Say 'X' and nothing else." answered exactly ``X``;
* ``out_of_scope``: a question the model cannot know: a short (<= 160 characters) answer that
  says it does not know, and no tool call;
* ``images``: exact match per question type (:mod:`openk3.datasets.vision_data`), skipped with a
  note for a text-only model;
* ``long_tools`` / ``long_arithmetic``: the ``tools`` and ``arithmetic`` items behind a ~16K-token
  synthetic agent-harness prompt (:mod:`openk3.datasets.harness`, held-out seed): a system text plus
  harness tools and every task tool declared, the same for every item (as an agent sends it).

Models: :class:`InProcessModel` (a checkpoint directory: engine + chat format + output parser,
greedy, constrained as the server constrains) or :class:`ServerModel` (``POST
/v1/chat/completions`` of a running ``openk3 serve``, concurrent requests). The platform samples at
a fixed temperature; ``openk3 serve --greedy`` is the operator switch for evaluation that decodes
greedily (and says so in an ``x-openk3-decoding: greedy`` response header, which the table
records as ``decoding``). Every score is a function of ``(item, message)``, so the reference
answers score 100 % (:class:`OracleModel`).
"""

from __future__ import annotations

import json
import math
import random
import re
import sys
import urllib.error
import urllib.request
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from openk3.datasets.sft_data import EFFORTS, EVAL_SUITES, Item, eval_items

IMAGE_SUITE = "images"
LONG_SUITES = ("long_tools", "long_arithmetic")
ALL_SUITES = EVAL_SUITES + (IMAGE_SUITE,) + LONG_SUITES
LONG_PROMPT_CHARS = (
    43_000  # system text of the long-prompt suites: ~16K prompt tokens with its tools
)
LONG_PROMPT_SEED = 7_000_003  # never a training seed (training uses the SFT data seeds)

_INT = re.compile(r"-?\d+")

# The targets: (suite, metric, threshold). Rates in [0, 1].
TARGETS = (
    ("arithmetic", "correct_add", 0.90),
    ("arithmetic", "correct_sub", 0.90),
    ("arithmetic", "correct_mul", 0.80),
    ("arithmetic", "consistent", 0.95),
    ("tools", "name_correct", 0.95),
    ("tools", "args_correct", 0.90),
    ("tools_two", "both_correct", 0.80),
    ("tool_result", "uses_result", 0.90),
    ("json", "valid", 1.0),
    ("json", "all_fields", 0.90),
    ("recall", "correct", 0.90),
    ("effort", "correct", 0.95),
    ("echo", "correct", 0.95),
    ("out_of_scope", "honest", 0.95),
    ("images", "color", 0.90),
    ("images", "shape", 0.90),
    ("images", "count", 0.90),
    ("images", "position", 0.90),
    ("images", "digit", 0.80),
)


class ChatModel(Protocol):
    """Anything that answers a chat-completions request body with an OpenAI assistant message."""

    def chat(self, requests: list[dict]) -> list[dict]:
        """May also take ``progress``: a callable called with 1 per answered request."""
        ...


# ---------------------------------------------------------------------------------- intervals
def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95 % Wilson score interval of a binomial rate ``k / n`` (``(nan, nan)`` for ``n`` = 0)."""
    if n == 0:
        return (math.nan, math.nan)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (0.0 if k == 0 else max(0.0, c - h), 1.0 if k == n else min(1.0, c + h))


def rate(flags: list[bool]) -> dict:
    """``{"k", "n", "rate", "ci95": [lo, hi]}`` of a list of per-item outcomes."""
    k = sum(bool(f) for f in flags)
    n = len(flags)
    lo, hi = wilson(k, n)
    return {"k": k, "n": n, "rate": k / n if n else math.nan, "ci95": [lo, hi]}


# ------------------------------------------------------------------------------------ scoring
def _last_int(text: str | None) -> int | None:
    nums = _INT.findall(text or "")
    return int(nums[-1]) if nums else None


def score_arith(item: Item, msg: dict) -> dict:
    """``correct`` (the content's last integer is the value), ``consistent`` (it equals the
    reasoning's last integer), ``reasoning_chars``."""
    got = _last_int(msg.get("content"))
    reached = _last_int(msg.get("reasoning_content"))
    return {
        "correct": got == item.expected["answer"],
        "consistent": got is not None and got == reached,
        "reasoning_chars": len(msg.get("reasoning_content") or ""),
        "op": item.expected.get("op"),
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, str) and isinstance(b, str):
        return a.strip().lower() == b.strip().lower()
    if (
        isinstance(a, (int, float))
        and isinstance(b, (int, float))
        and not isinstance(a, bool)
        and not isinstance(b, bool)
    ):
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
    """``name_correct``, ``args_correct``, ``schema_valid`` of the message's tool calls
    (``both_correct`` = ``args_correct``, the ``tools_two`` metric)."""
    import jsonschema

    got = _calls(msg)
    want = item.expected["calls"]
    name_ok = sorted(str(n) for n, _ in got) == sorted(c["name"] for c in want)
    remaining = list(got)
    args_ok = name_ok
    for c in want:
        hit = next(
            (
                g
                for g in remaining
                if g[0] == c["name"]
                and isinstance(g[1], dict)
                and set(g[1]) == set(c["arguments"])
                and all(_same(g[1][k], v) for k, v in c["arguments"].items())
            ),
            None,
        )
        if hit is None:
            args_ok = False
        else:
            remaining.remove(hit)
    schema_ok = bool(got)
    for name, args in got:
        schema = item.expected["schemas"].get(name)
        if (
            schema is None
            or not isinstance(args, dict)
            or not jsonschema.Draft202012Validator(schema).is_valid(args)
        ):
            schema_ok = False
    return {
        "name_correct": name_ok,
        "args_correct": args_ok,
        "schema_valid": schema_ok,
        "both_correct": args_ok,
    }


def score_tool_result(item: Item, msg: dict) -> dict:
    """``uses_result``: no tool call and every expected result value appears in the content."""
    content = msg.get("content") or ""
    return {
        "uses_result": not msg.get("tool_calls")
        and all(str(v) in content for v in item.expected["values"])
    }


def score_json(item: Item, msg: dict) -> dict:
    """``valid`` (an object; schema-valid for json_schema), ``all_fields``, ``key_accuracy``."""
    import jsonschema

    try:
        value = json.loads(msg.get("content") or "")
    except json.JSONDecodeError:
        return {"valid": False, "all_fields": False, "key_accuracy": 0.0}
    if not isinstance(value, dict):
        return {"valid": False, "all_fields": False, "key_accuracy": 0.0}
    valid = True
    if item.request["response_format"]["type"] == "json_schema":
        valid = jsonschema.Draft202012Validator(item.expected["schema"]).is_valid(value)
    fields = item.expected["fields"]
    hits = [k in value and _same(value[k], v) for k, v in fields.items()]
    return {"valid": valid, "all_fields": all(hits), "key_accuracy": sum(hits) / len(hits)}


def score_effort(item: Item, msg: dict) -> dict:
    """``correct``: the content names the request's effort and no other effort."""
    words = set(re.findall(r"[a-z]+", (msg.get("content") or "").lower()))
    return {"correct": words & set(EFFORTS) == {item.expected["effort"]}}


def score_recall(item: Item, msg: dict) -> dict:
    """``correct``: the remembered value appears in the content as a whole word (any case)."""
    v = re.escape(str(item.expected["value"]).lower())
    return {
        "correct": re.search(rf"(?<![\w]){v}(?![\w])", (msg.get("content") or "").lower())
        is not None
    }


def score_echo(item: Item, msg: dict) -> dict:
    """``correct``: the content is exactly the requested text (surrounding whitespace ignored)."""
    return {"correct": (msg.get("content") or "").strip() == item.expected["content"]}


_HONEST = re.compile(
    r"\b(don't know|do not know|cannot|can't|no way|not sure|unable|no information|not know)\b"
)


def score_out_of_scope(item: Item, msg: dict) -> dict:
    """``honest``: no tool call, a non-empty answer of at most 160 characters saying it does not know."""
    c = (msg.get("content") or "").strip()
    return {
        "honest": not msg.get("tool_calls")
        and 0 < len(c) <= 160
        and _HONEST.search(c.lower()) is not None
    }


SCORERS = {
    "arithmetic": score_arith,
    "reasoning": score_arith,
    "tools": score_tool,
    "tools_two": score_tool,
    "tool_result": score_tool_result,
    "json": score_json,
    "recall": score_recall,
    "effort": score_effort,
    "echo": score_echo,
    "out_of_scope": score_out_of_scope,
    "long_tools": score_tool,
    "long_arithmetic": score_arith,
}


def summarize(suite: str, items: list[Item], scores: list[dict]) -> dict:
    """One suite's per-item scores -> its rows of the eval table (rates with intervals)."""
    n = len(scores)
    col = lambda key, ss=scores: rate([s[key] for s in ss])
    if suite in ("arithmetic", "long_arithmetic"):
        out = {"n": n, "correct": col("correct"), "consistent": col("consistent")}
        for op, name in (("+", "add"), ("-", "sub"), ("*", "mul")):
            sub = [s for s in scores if s["op"] == op]
            if sub:
                out[f"correct_{name}"] = col("correct", sub)
        out["mean_reasoning_chars"] = (
            sum(s["reasoning_chars"] for s in scores) / n if n else math.nan
        )
        return out
    if suite == "reasoning":
        by: dict[str, list[dict]] = defaultdict(list)
        for it, s in zip(items, scores):
            by[it.request.get("reasoning_effort", "none")].append(s)
        return {
            "n": n,
            "mean_reasoning_chars_by_effort": {
                e: sum(s["reasoning_chars"] for s in by[e]) / len(by[e])
                for e in EFFORTS
                if by.get(e)
            },
            "correct_by_effort": {e: col("correct", by[e]) for e in EFFORTS if by.get(e)},
        }
    if suite in ("tools", "long_tools"):
        return {
            "n": n,
            "name_correct": col("name_correct"),
            "args_correct": col("args_correct"),
            "schema_valid": col("schema_valid"),
        }
    if suite == "tools_two":
        return {"n": n, "name_correct": col("name_correct"), "both_correct": col("both_correct")}
    if suite == "json":
        return {
            "n": n,
            "valid": col("valid"),
            "all_fields": col("all_fields"),
            "key_accuracy": sum(s["key_accuracy"] for s in scores) / n if n else math.nan,
        }
    key = {"tool_result": "uses_result", "out_of_scope": "honest"}.get(suite, "correct")
    return {"n": n, key: col(key)}


# ------------------------------------------------------------------------------- long prompts
def long_prompt(chars: int | None = None, seed: int = LONG_PROMPT_SEED) -> dict:
    """The eval's agent-harness prompt: ``{"system": text, "tools": harness tools + every task
    tool}``, the same for every model (about 16K tokens with the default model's tokenizer;
    ``chars`` of system text, default :data:`LONG_PROMPT_CHARS`)."""
    from openk3.datasets.harness import harness_prose, harness_tools
    from openk3.datasets.sft_tasks import TOOLS

    tools = harness_tools(random.Random(seed)) + list(TOOLS.values())
    return {
        "system": harness_prose(random.Random(seed + 1), chars or LONG_PROMPT_CHARS),
        "tools": tools,
    }


def long_items(suite: str, seed: int, n: int, prompt: dict) -> list[Item]:
    """The ``tools`` / ``arithmetic`` items of ``suite`` (``long_tools`` / ``long_arithmetic``)
    behind ``prompt``: its system text first, its tools declared instead of the item's own."""
    from openk3.datasets.harness import wrap_request

    base = suite.removeprefix("long_")
    out = []
    for it in eval_items(base, seed, 3 * n if base == "arithmetic" else n):
        req = wrap_request(it.request, prompt["system"], prompt["tools"], replace_tools=[])
        expected = dict(it.expected)
        if "schemas" in expected:
            expected["schemas"] = {
                t["function"]["name"]: t["function"]["parameters"] for t in prompt["tools"]
            }
        out.append(Item(suite, req, it.reference, expected))
    return out


# ------------------------------------------------------------------------------------- models
class OracleModel:
    """Answers every eval request with its item's reference message (checks the scorers)."""

    def __init__(self, items: list[Item]):
        self._ref = {json.dumps(it.request, sort_keys=True): it.reference for it in items}

    def chat(self, requests: list[dict]) -> list[dict]:
        return [self._ref[json.dumps(r, sort_keys=True)] for r in requests]


class InProcessModel:
    """A checkpoint directory served in-process: :func:`~openk3.chat_format.encode_request` ->
    :class:`~openk3.engine.Engine` (greedy, batched, prefix cache on) ->
    :class:`~openk3.chat_format.OutputParser`. JSON response formats and tool calls (unless
    ``tool_choice: none``) are constrained as the server does
    (:func:`~openk3.engine.constraints.make_constraint`).

    Raises:
        FileNotFoundError / ValueError: from loading the checkpoint or tokenizer.
    """

    decoding = "greedy"

    def __init__(
        self,
        path: str,
        tokenizer: str | None = None,
        *,
        device: Any = "cpu",
        dtype: Any = None,
        max_tokens: int = 256,
        max_num_seqs: int = 32,
    ):
        from openk3.pretrained import load_pretrained
        from openk3.server.images import image_config_for
        from openk3.shipped import resolve_model_path
        from openk3.tokenizer import load_tokenizer

        path = resolve_model_path(path)
        self.tokenizer = load_tokenizer(tokenizer or path)
        self.model = load_pretrained(path, device=device, dtype=dtype)
        self.model.eval()
        self.image_config = image_config_for(self.model, path)  # None: text-only model
        self.supports_images = self.image_config is not None
        self.max_tokens = max_tokens
        self.max_num_seqs = max_num_seqs
        self._engine = None

    def _constraint(self, request: dict, prompt: Any):
        from openk3.engine.constraints import make_constraint

        rf = request.get("response_format") or {}
        kind = rf.get("type") if rf.get("type") in ("json_object", "json_schema") else None
        schema = rf["json_schema"]["schema"] if kind == "json_schema" else None
        tools = list(request.get("tools") or [])
        tools += [
            t
            for m in request["messages"]
            if m.get("role") == "system"
            for t in (m.get("tools") or [])
        ]
        use_tools = tools if tools and prompt.tool_choice != "none" else None
        if kind is None and use_tools is None:
            return None
        return make_constraint(
            self.tokenizer,
            kind or "text",
            schema=schema,
            tools=use_tools,
            tool_choice=prompt.tool_choice,
            thinking=prompt.channel == "think",
            vocab_size=self.model.config.vocab_size,
        )

    def chat(self, requests: list[dict], progress: Any = None) -> list[dict]:
        from openk3.chat_format import OutputParser, encode_request
        from openk3.engine import Engine, EngineConfig, SamplingParams

        if self._engine is None:  # one engine for the whole run: the prefix cache spans suites
            self._engine = Engine(
                self.model, EngineConfig(max_num_seqs=self.max_num_seqs, enable_prefix_cache=True)
            )
        engine = self._engine
        parsers = {}

        def add(i: int, req: dict) -> None:
            prompt = encode_request(req, self.tokenizer)
            params = SamplingParams(
                max_tokens=self.max_tokens,
                temperature=0.0,
                stop_token_ids=list(self.tokenizer.stop_token_ids),
            )
            ids = prompt.token_ids
            mm = None
            if prompt.image_slots:  # the server's path: decode, preprocess, expand the slots
                from openk3.server.images import expand_images

                if not self.supports_images:
                    raise ValueError("model: a text-only model cannot take image input")
                expanded = expand_images(prompt, self.tokenizer, self.image_config, pixels=True)
                ids = expanded.token_ids
                mm = expanded.mm_inputs
            engine.add_request(
                ids, params, self._constraint(req, prompt), request_id=str(i), mm_inputs=mm
            )
            parsers[str(i)] = OutputParser(
                self.tokenizer,
                start_channel=prompt.channel or "think",
                tool_index_start=prompt.history_tool_calls,
                tools_enabled=prompt.tool_choice != "none",
            )

        # Requests go in as slots free up, at most ``2 * max_num_seqs`` in flight: a suite may hold
        # more items than the engine's waiting queue takes (300 arithmetic items at --n 100 against
        # max_waiting 256 raised EngineOverloaded), and a short queue keeps the prefix cache warm.
        window = 2 * self.max_num_seqs
        next_i = 0
        in_flight = 0
        while next_i < len(requests) or engine.has_unfinished():
            while next_i < len(requests) and in_flight < window:
                add(next_i, requests[next_i])
                next_i += 1
                in_flight += 1
            for out in engine.step():
                parsers[out.request_id].feed(out.new_token_ids)
                if out.finished:
                    in_flight -= 1
                    if progress is not None:
                        progress(1)
        messages = []
        for i in range(len(requests)):
            p = parsers[str(i)]
            p.finish()
            messages.append(p.message().to_openai())
        return messages

    def validation(
        self,
        corpus: str | None,
        n_items: int,
        seed: int,
        *,
        seq_len: int = 512,
        max_batches: int = 16,
    ) -> dict:
        """Loss / perplexity on the corpus ``val`` split (if given) and the held-out SFT answers."""
        from openk3.train.data import DocumentStore, PackedLoader
        from openk3.train.trainer import evaluate

        def run(store) -> dict:
            loader = PackedLoader(
                store,
                seq_len,
                1,
                shuffle=False,
                loop=False,
                split_documents=True,
                pad_id=self.model.config.pad_token_id or 0,
            )
            batches = []
            for b in loader:
                batches.append(b.packed())
                if len(batches) >= max_batches:
                    break
            ev = evaluate(self.model, batches)
            return {
                "loss": ev["eval_loss"],
                "perplexity": math.exp(min(ev["eval_loss"], 50.0)),
                "tokens": ev["eval_tokens"],
            }

        out: dict = {}
        if corpus:
            out["corpus"] = run(DocumentStore.from_corpus(corpus, self.tokenizer, "val"))
        convs = [it.conversation() for s in EVAL_SUITES for it in eval_items(s, seed, n_items)]
        out["sft"] = run(DocumentStore.from_conversations(convs, self.tokenizer))
        return out


class ServerModel:
    """A running openk3 (or any OpenAI-compatible) server: ``POST {url}/v1/chat/completions`` per
    request (``concurrency`` in flight, so the server batches them), ``temperature`` 0 and
    ``seed`` = the item's index; the model id is the first of ``GET /v1/models`` unless given.
    ``decoding`` is ``"greedy"`` when every response carried ``x-openk3-decoding: greedy``
    (``openk3 serve --greedy``), else ``"sampled"`` (a K3 server samples at its fixed
    temperature whatever is asked; the seeds make it reproducible)."""

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        max_tokens: int = 256,
        timeout: float = 1800.0,
        concurrency: int = 8,
    ):
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.max_tokens = max_tokens
        self.timeout = timeout
        self.concurrency = max(1, int(concurrency))
        models = self._get("/v1/models")["data"]
        self.model = model or models[0]["id"]
        self.supports_images = any(
            m.get("id") == self.model and m.get("supports_image_in") for m in models
        )
        self._greedy: list[bool] = []

    @property
    def decoding(self) -> str:
        return "greedy" if self._greedy and all(self._greedy) else "sampled"

    def _headers(self) -> dict:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def _open(self, req: urllib.request.Request) -> Any:
        """``urlopen(req)``. Raises ValueError naming the URL and the server's own error message
        for an HTTP error status, OSError naming the URL when the server cannot be reached."""
        try:
            return urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            try:
                err = json.loads(e.read()).get("error")
                message = err.get("message") if isinstance(err, dict) else None
            except (ValueError, AttributeError, OSError):
                message = None
            raise ValueError(f"{req.full_url}: HTTP {e.code}: {message or e.reason}") from None
        except urllib.error.URLError as e:
            raise OSError(
                f"cannot reach {self.url}: {getattr(e.reason, 'strerror', None) or e.reason} "
                "(is the server running there?)"
            ) from None

    def _get(self, path: str) -> dict:
        req = urllib.request.Request(self.url + path, headers=self._headers())
        with self._open(req) as r:
            return json.loads(r.read())

    def _post(self, i: int, body: dict, progress: Any = None) -> tuple[dict, bool]:
        data = json.dumps(
            dict(body, model=self.model, temperature=0, seed=i, max_tokens=self.max_tokens)
        ).encode()
        req = urllib.request.Request(
            self.url + "/v1/chat/completions", data=data, headers=self._headers()
        )
        with self._open(req) as r:
            greedy = (r.headers.get("x-openk3-decoding") or "").lower() == "greedy"
            msg = json.loads(r.read())["choices"][0]["message"]
        if progress is not None:
            progress(1)
        return msg, greedy

    def chat(self, requests: list[dict], progress: Any = None) -> list[dict]:
        with ThreadPoolExecutor(self.concurrency) as pool:
            results = list(
                pool.map(lambda i: self._post(i, requests[i], progress), range(len(requests)))
            )
        self._greedy += [g for _, g in results]
        return [m for m, _ in results]


# ------------------------------------------------------------------------------------ the run
def suite_items(suite: str, seed: int, n: int) -> list[Item]:
    """The held-out items of ``suite`` (``n`` per suite; ``arithmetic`` / ``long_arithmetic``:
    ``n`` per operation)."""
    if suite in LONG_SUITES:
        return long_items(suite, seed, n, long_prompt())
    return eval_items(suite, seed, 3 * n if suite == "arithmetic" else n)


def _answers(model: ChatModel, suite: str, requests: list[dict], progress: bool) -> list[dict]:
    """``model.chat(requests)``, with a progress bar (tqdm, on stderr: done / total, rate, ETA)
    when `progress` and the model reports progress."""
    import inspect

    if not progress or "progress" not in inspect.signature(model.chat).parameters:
        return model.chat(requests)
    from tqdm import tqdm

    with tqdm(
        total=len(requests), desc=f"eval {suite}", unit="item", file=sys.stderr, leave=True
    ) as bar:
        return model.chat(requests, progress=bar.update)


def run_eval(
    model: ChatModel,
    *,
    n: int = 100,
    seed: int = 0,
    suites: tuple[str, ...] = ALL_SUITES,
    validation: dict | None = None,
    progress: bool = False,
) -> dict:
    """The eval table: each suite's held-out items (seed ``seed``) through ``model``
    (`progress`: a progress bar per suite on stderr).

    Raises:
        ValueError: an unknown suite or ``n`` < 1.
    """
    unknown = [s for s in suites if s not in ALL_SUITES]
    if unknown:
        raise ValueError(f"suite {unknown[0]!r}: unknown (known: {', '.join(ALL_SUITES)})")
    table: dict[str, Any] = {"seed": seed, "n_per_suite": n, "validation": validation}
    for suite in suites:
        if suite == IMAGE_SUITE:
            table[suite] = run_image_eval(model, n=n, seed=seed, progress=progress)
            continue
        items = suite_items(suite, seed, n)
        messages = _answers(model, suite, [it.request for it in items], progress)
        scores = [SCORERS[suite](it, m) for it, m in zip(items, messages)]
        table[suite] = summarize(suite, items, scores)
    table["decoding"] = getattr(model, "decoding", "unknown")
    table["targets"] = check_targets(table)
    return table


def run_image_eval(
    model: ChatModel, *, n: int = 100, seed: int = 0, progress: bool = False
) -> dict:
    """The ``images`` suite: ``n`` held-out image questions per type through ``model`` at effort
    low; ``{"n", "accuracy", "by_type": {type: rate}}``, or ``{"skipped": reason}`` when the model
    takes no image input (``supports_images`` false)."""
    from openk3.datasets.vision_data import QUESTION_TYPES, eval_image_items, score_image

    if not getattr(model, "supports_images", True):
        return {"skipped": "text-only model (no vision tower): image suite not run"}
    items = eval_image_items(seed, n * len(QUESTION_TYPES))
    messages = _answers(model, IMAGE_SUITE, [it.request for it in items], progress)
    flags = [score_image(it, m)["correct"] for it, m in zip(items, messages)]
    by = {
        t: rate([f for it, f in zip(items, flags) if it.expected["type"] == t])
        for t in QUESTION_TYPES
    }
    return {"n": len(items), "accuracy": rate(flags), "by_type": by}


def _metric(table: dict, suite: str, metric: str) -> dict | None:
    row = table.get(suite)
    if not isinstance(row, dict) or "skipped" in row:
        return None
    if suite == IMAGE_SUITE:
        return row["by_type"].get(metric)
    return row.get(metric)


def check_targets(table: dict) -> list[dict]:
    """Every target of :data:`TARGETS` present in ``table`` with its rate, interval and ``met``
    (rate >= target), plus the reasoning-length ordering and the long-prompt gaps (long within
    10 points of short for the tool and arithmetic rates)."""
    out = []
    for suite, metric, want in TARGETS:
        r = _metric(table, suite, metric)
        if r is not None:
            out.append(
                {
                    "suite": suite,
                    "metric": metric,
                    "target": want,
                    "rate": r["rate"],
                    "ci95": r["ci95"],
                    "met": r["rate"] >= want,
                }
            )
    if "reasoning" in table:
        m = table["reasoning"]["mean_reasoning_chars_by_effort"]
        vals = [m.get(e, math.nan) for e in EFFORTS]
        out.append(
            {
                "suite": "reasoning",
                "metric": "low < medium < high < max",
                "value": vals,
                "met": all(a < b for a, b in zip(vals, vals[1:])),
            }
        )
    for long, short, metrics in (
        ("long_tools", "tools", ("name_correct", "args_correct")),
        ("long_arithmetic", "arithmetic", ("correct_add", "correct_sub", "correct_mul")),
    ):
        for metric in metrics:
            a = _metric(table, long, metric)
            b = _metric(table, short, metric)
            if a is not None and b is not None:
                out.append(
                    {
                        "suite": long,
                        "metric": f"{metric} gap to {short}",
                        "value": b["rate"] - a["rate"],
                        "met": b["rate"] - a["rate"] <= 0.10,
                    }
                )
    return out


def _fmt(r: dict | None) -> str:
    if r is None:
        return "n/a"
    lo, hi = r["ci95"]
    return f"{100 * r['rate']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}] ({r['k']}/{r['n']})"


def format_table(table: dict) -> str:
    """The eval table as text: percentages with 95 % intervals and counts."""
    lines = []
    for name, v in (table.get("validation") or {}).items():
        lines.append(
            f"validation {name:<8} loss {v['loss']:.4f}  perplexity {v['perplexity']:.2f}  ({v['tokens']} tokens)"
        )
    for suite in ("arithmetic", "long_arithmetic"):
        if suite in table:
            a = table[suite]
            for key in ("correct_add", "correct_sub", "correct_mul", "consistent"):
                if key in a:
                    lines.append(f"{suite:<16} {key:<13} {_fmt(a[key])}")
    if "reasoning" in table:
        r = table["reasoning"]
        for e, chars in r["mean_reasoning_chars_by_effort"].items():
            lines.append(
                f"{'reasoning':<16} effort {e:<6} mean {chars:.0f} chars  correct {_fmt(r['correct_by_effort'][e])}"
            )
    for suite in (
        "tools",
        "long_tools",
        "tools_two",
        "tool_result",
        "json",
        "recall",
        "effort",
        "echo",
        "out_of_scope",
    ):
        if suite in table:
            for key, v in table[suite].items():
                if isinstance(v, dict):
                    lines.append(f"{suite:<16} {key:<13} {_fmt(v)}")
                elif key == "key_accuracy":
                    lines.append(f"{suite:<16} {key:<13} {100 * v:.1f}%")
    if IMAGE_SUITE in table:
        im = table[IMAGE_SUITE]
        if "skipped" in im:
            lines.append(f"images           skipped: {im['skipped']}")
        else:
            lines.append(f"{'images':<16} {'all':<13} {_fmt(im['accuracy'])}")
            for t, v in im["by_type"].items():
                lines.append(f"{'images':<16} {t:<13} {_fmt(v)}")
    if table.get("targets"):
        met = sum(t["met"] for t in table["targets"])
        lines.append(
            f"targets met: {met}/{len(table['targets'])}; missed: "
            + (
                ", ".join(f"{t['suite']}.{t['metric']}" for t in table["targets"] if not t["met"])
                or "none"
            )
        )
    if "decoding" in table:
        lines.append(f"decoding: {table['decoding']}")
    return "\n".join(lines)


def cli_eval(args: Any) -> int:
    """``openk3 eval MODEL``: MODEL is a checkpoint directory, a shipped model name or an
    ``http(s)://`` server URL. Prints the table, writes JSON to ``--out``. Returns 0, or 2 with a
    message for bad input."""
    try:
        if args.n < 1:
            raise ValueError(f"--n={args.n}: must be >= 1")
        if args.model.startswith(("http://", "https://")):
            model: Any = ServerModel(
                args.model,
                model=args.served_model_name,
                api_key=args.api_key,
                max_tokens=args.max_tokens,
                concurrency=getattr(args, "concurrency", 8),
            )
            validation = None
        else:
            from openk3.runtime import setup

            device, dtype = setup(args)
            model = InProcessModel(
                args.model, args.tokenizer, device=device, dtype=dtype, max_tokens=args.max_tokens
            )
            validation = (
                model.validation(args.corpus, 16, args.seed)
                if not getattr(args, "no_validation", False)
                else None
            )
        table = run_eval(
            model,
            n=args.n,
            seed=args.seed,
            suites=tuple(args.suites or ALL_SUITES),
            validation=validation,
            progress=not getattr(args, "no_progress", False),
        )
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


__all__ = [
    "ChatModel",
    "InProcessModel",
    "ServerModel",
    "OracleModel",
    "SCORERS",
    "TARGETS",
    "wilson",
    "rate",
    "score_arith",
    "score_tool",
    "score_tool_result",
    "score_json",
    "score_effort",
    "score_recall",
    "score_echo",
    "score_out_of_scope",
    "summarize",
    "long_prompt",
    "long_items",
    "suite_items",
    "run_eval",
    "run_image_eval",
    "check_targets",
    "format_table",
    "cli_eval",
    "IMAGE_SUITE",
    "LONG_SUITES",
    "ALL_SUITES",
]
