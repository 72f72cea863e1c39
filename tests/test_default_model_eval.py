"""``openk3 eval``: the scorers give the reference answers 100 % and damaged answers 0 %; Wilson
intervals; the long-prompt suites; the table's structure on a tiny random checkpoint, in-process
and through the CLI; the server client's concurrency and greedy detection."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from openk3.eval import (
    ALL_SUITES, IMAGE_SUITE, LONG_SUITES, InProcessModel, OracleModel, check_targets, format_table, long_prompt,
    run_eval, score_arith, score_echo, score_effort, score_json, score_out_of_scope, score_recall, score_tool,
    suite_items, wilson,
)
from openk3.datasets.sft_data import EFFORTS, EVAL_SUITES, eval_items

N = 6
TEXT = EVAL_SUITES + LONG_SUITES


def _oracle(n: int = N) -> OracleModel:
    return OracleModel([it for s in TEXT for it in suite_items(s, 0, n)])


def test_wilson_interval_matches_the_closed_form():
    lo, hi = wilson(90, 100)
    assert lo == pytest.approx(0.8256, abs=1e-4) and hi == pytest.approx(0.9448, abs=1e-4)
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == 1.0 and wilson(10, 10)[0] == pytest.approx(0.7225, abs=1e-4)
    assert all(math.isnan(x) for x in wilson(0, 0))


def test_reference_answers_score_100_percent_and_meet_every_target():
    t = run_eval(_oracle(), n=N, suites=TEXT)
    a = t["arithmetic"]
    assert a["n"] == 3 * N and all(a[k]["rate"] == 1.0 for k in ("correct_add", "correct_sub", "correct_mul", "consistent"))
    assert a["correct_add"]["n"] == N and a["correct_add"]["ci95"][1] == 1.0
    r = t["reasoning"]["mean_reasoning_chars_by_effort"]
    assert list(r) == list(EFFORTS) and r["low"] < r["medium"] < r["high"] < r["max"]
    for suite, key in (("tools", "args_correct"), ("tools_two", "both_correct"), ("tool_result", "uses_result"),
                       ("json", "all_fields"), ("recall", "correct"), ("effort", "correct"), ("echo", "correct"),
                       ("out_of_scope", "honest"), ("long_tools", "args_correct"), ("long_arithmetic", "correct")):
        assert t[suite][key]["rate"] == 1.0, suite
    assert all(x["met"] for x in t["targets"]) and len(t["targets"]) >= 20
    text = format_table(t)
    assert "echo             correct       100.0% [61.0, 100.0] (6/6)" in text and "missed: none" in text


class _Wrong:
    """Answers with the reference message damaged in each suite's scored part."""

    def __init__(self, oracle: OracleModel):
        self.oracle = oracle

    def chat(self, requests):
        out = []
        for req, msg in zip(requests, self.oracle.chat(requests)):
            msg = copy.deepcopy(msg)
            if msg.get("tool_calls"):
                for c in msg["tool_calls"]:
                    args = json.loads(c["function"]["arguments"])
                    args = {k: (v + 1 if isinstance(v, (int, float)) else "Atlantis") for k, v in args.items()}
                    c["function"]["arguments"] = json.dumps(args)
            elif req.get("response_format"):
                msg["content"] = msg["content"][:-1]  # truncated JSON
            elif "effort" in (msg.get("content") or ""):
                msg["content"] = "My current thinking effort is low or max."
            elif "know" in (msg.get("content") or ""):
                msg["content"] = "The population is 12345 and growing fast, according to the census." * 3
            else:
                msg["content"] = "The answer is 100000."
                if msg.get("reasoning_content"):
                    msg["reasoning_content"] += "\nso 7"
            out.append(msg)
        return out


def test_damaged_answers_score_zero():
    t = run_eval(_Wrong(_oracle()), n=N, suites=TEXT)
    a = t["arithmetic"]
    assert a["correct"]["rate"] == 0.0 and a["consistent"]["rate"] == 0.0
    assert t["tools"]["name_correct"]["rate"] == 1.0 and t["tools"]["args_correct"]["rate"] == 0.0
    assert t["tools_two"]["both_correct"]["rate"] == 0.0 and t["long_tools"]["args_correct"]["rate"] == 0.0
    assert t["json"]["valid"]["rate"] == 0.0 and t["effort"]["correct"]["rate"] == 0.0
    for suite, key in (("tool_result", "uses_result"), ("recall", "correct"), ("echo", "correct"),
                       ("out_of_scope", "honest")):
        assert t[suite][key]["rate"] == 0.0, suite
    assert [f"{x['suite']}.{x['metric']}" for x in t["targets"] if "rate" in x and x["met"]] == ["tools.name_correct"]


def test_scorers_on_edge_cases():
    tool = eval_items("tools", 0, 1)[0]
    assert score_tool(tool, {"content": "no call"})["name_correct"] is False
    bad = copy.deepcopy(tool.reference)
    call = bad["tool_calls"][0]["function"]
    call["arguments"] = json.dumps({"not_a_field": 1})  # additionalProperties false
    s = score_tool(tool, bad)
    assert not s["schema_valid"] and not s["args_correct"]
    js = next(it for it in eval_items("json", 0, 12) if it.request["response_format"]["type"] == "json_schema"
              and "age" in it.expected["fields"])
    fields = dict(js.expected["fields"], age="old")  # wrong type: valid JSON, not schema-valid
    s = score_json(js, {"content": json.dumps(fields)})
    assert not s["valid"] and not s["all_fields"] and s["key_accuracy"] == pytest.approx((len(fields) - 1) / len(fields))
    eff = eval_items("effort", 0, 1)[0]
    assert score_effort(eff, {"content": f"It is {eff.expected['effort'].upper()}."})["correct"]
    ar = eval_items("arithmetic", 0, 1)[0]
    v = ar.expected["answer"]
    assert score_arith(ar, {"content": f"The answer is {v}.", "reasoning_content": f"so x = {v + 1}"}) == {
        "correct": True, "consistent": False, "reasoning_chars": len(f"so x = {v + 1}"), "op": ar.expected["op"]}
    rec = eval_items("recall", 0, 1)[0]
    value = str(rec.expected["value"])
    assert score_recall(rec, {"content": f"It is {value.upper()}!"})["correct"]
    assert not score_recall(rec, {"content": f"It is {value}x."})["correct"]  # a whole word only
    echo = eval_items("echo", 0, 1)[0]
    assert score_echo(echo, {"content": f" {echo.expected['content']}\n"})["correct"]
    assert not score_echo(echo, {"content": f"{echo.expected['content']}."})["correct"]
    oos = eval_items("out_of_scope", 0, 1)[0]
    assert score_out_of_scope(oos, {"content": "I don't know."})["honest"]
    assert not score_out_of_scope(oos, {"content": "I don't know.", "tool_calls": [{"function": {"name": "x"}}]})["honest"]
    assert not score_out_of_scope(oos, {"content": "It is 4."})["honest"]


def test_long_prompt_suites_share_one_prompt_with_every_tool():
    from openk3.tokenizer import load_tokenizer
    from openk3.datasets.sft_tasks import TOOLS

    p = long_prompt()
    assert p == long_prompt()  # deterministic
    tok = load_tokenizer("openk3-tiny")
    items = suite_items("long_tools", 0, 3) + suite_items("long_arithmetic", 0, 1)
    assert len(items) == 6
    for it in items:
        assert it.request["messages"][0] == {"role": "system", "content": p["system"]}
        assert it.request["tools"] == p["tools"] and set(TOOLS) <= {t["function"]["name"] for t in p["tools"]}
        assert not any("tools" in m for m in it.request["messages"])
    n_tokens = len(tok.encode_text(p["system"]))
    assert 10_000 < n_tokens < 20_000  # ~16K with the tool declarations (exact count: MODEL_CARD.md)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from openk3.config import preset
    from openk3.pretrained import build_model
    from openk3.recipes import synthetic_document
    from openk3.train.tokenizer_train import train_tokenizer

    d = tmp_path_factory.mktemp("ckpt")
    tok = train_tokenizer([synthetic_document(0, i) for i in range(50)], 512, d / "tok")
    cfg = preset("k3-test-tiny").replace(eos_token_id=tok.eos_id)  # the 512-id layout of a 512-id BPE
    assert (tok.vocab_size, tok.bos_id, tok.pad_id) == (cfg.vocab_size, cfg.bos_token_id, cfg.pad_token_id)
    build_model(cfg, seed=0).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_in_process_eval_on_a_random_checkpoint(tiny_checkpoint):
    torch.set_num_threads(1)
    model = InProcessModel(str(tiny_checkpoint), max_tokens=12)
    suites = ("arithmetic", "tools", "json", "effort", "echo")
    t = run_eval(model, n=2, suites=suites, validation=model.validation(None, 1, 0, seq_len=2048, max_batches=2))
    v = t["validation"]["sft"]
    assert v["tokens"] > 0 and v["perplexity"] == pytest.approx(torch.tensor(v["loss"]).exp().item(), rel=1e-6)
    assert v["loss"] > 3.0  # untrained: near log(512) = 6.2, far from a trained model
    assert t["arithmetic"]["n"] == 6 and t["tools"]["n"] == 2 and t["decoding"] == "greedy"
    for x in (t["tools"]["name_correct"], t["json"]["valid"], t["effort"]["correct"]):
        assert 0.0 <= x["rate"] <= 1.0 and x["n"] == 2


def test_in_process_eval_takes_more_requests_than_the_engine_queue(tiny_checkpoint):
    """A suite larger than the engine's waiting queue (300 arithmetic items at --n 100 against
    max_waiting 256) is fed as slots free up instead of raising EngineOverloaded."""
    torch.set_num_threads(1)
    model = InProcessModel(str(tiny_checkpoint), max_tokens=1, max_num_seqs=4)
    requests = [{"messages": [{"role": "user", "content": f"Say '{i}' and nothing else."}]} for i in range(300)]
    answers = model.chat(requests)
    assert len(answers) == 300 and all(a["role"] == "assistant" for a in answers)
    assert model._engine.config.max_waiting < 300  # the case the window exists for


def test_cli_eval_writes_the_table(tiny_checkpoint, tmp_path, capsys):
    from openk3.cli import main

    out = tmp_path / "eval.json"
    assert main(["eval", str(tiny_checkpoint), "--n", "2", "--max-tokens", "6", "--suites", "json", "effort",
                 "--out", str(out)]) == 0
    table = json.loads(out.read_text())
    assert set(table) >= {"json", "effort", "validation", "seed", "n_per_suite", "model", "targets", "decoding"}
    assert "arithmetic" not in table and "json             valid" in capsys.readouterr().out
    assert main(["eval", str(tmp_path / "missing")]) == 2
    assert main(["eval", str(tiny_checkpoint), "--suites", "poetry"]) == 2
    assert main(["eval", str(tiny_checkpoint), "--n", "0"]) == 2


def test_server_model_posts_concurrently_and_detects_greedy_decoding():
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from openk3.eval import ServerModel

    oracle, seen, seeds = _oracle(2), [], []
    greedy = {"on": True}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, obj):
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if greedy["on"]:
                self.send_header("x-openk3-decoding", "greedy")
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send({"object": "list", "data": [{"id": "openk3-tiny"}]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((body.pop("model"), body.pop("temperature"), body.pop("max_tokens"),
                         self.headers.get("Authorization")))
            seeds.append(body.pop("seed"))
            self._send({"choices": [{"message": oracle.chat([body])[0]}]})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    suites = ("tools", "json", "echo")
    try:
        m = ServerModel(f"http://127.0.0.1:{server.server_port}", api_key="k", max_tokens=7, concurrency=3)
        t = run_eval(m, n=2, suites=suites)
        greedy["on"] = False
        sampled = run_eval(ServerModel(f"http://127.0.0.1:{server.server_port}"), n=2, suites=("echo",))
    finally:
        server.shutdown()
    assert ("openk3-tiny", 0, 7, "Bearer k") in seen and len(seen) == 2 * len(suites) + 2
    assert sorted(seeds[:6]) == [0, 0, 0, 1, 1, 1]  # one seed per item: sampled answers are reproducible
    assert t["tools"]["args_correct"]["rate"] == 1.0 and t["validation"] is None
    assert t["decoding"] == "greedy" and sampled["decoding"] == "sampled"


def test_in_process_constrains_json_and_tool_requests_only(tiny_checkpoint):
    from openk3.chat_format import encode_request
    from openk3.datasets.sft_data import sft_items

    model = InProcessModel(str(tiny_checkpoint))
    for suite, constrained in (("arithmetic", False), ("effort", False), ("json", True), ("tools", True)):
        it = eval_items(suite, 0, 1)[0]
        c = model._constraint(it.request, encode_request(it.request, model.tokenizer))
        assert (c is not None) == constrained, suite
    none = next(it for it in sft_items(0, 300) if it.suite == "tools_none")
    assert model._constraint(none.request, encode_request(none.request, model.tokenizer)) is None


def test_every_suite_is_known_to_the_cli_help():
    from openk3.cli import build_parser

    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["eval"].format_help().split())
    assert all(s in help_text for s in ALL_SUITES) and IMAGE_SUITE in ALL_SUITES
    assert check_targets({}) == []
