"""``openk3 eval``: the scorers give the reference answers 100 % and wrong answers 0 %; the table's
structure on a tiny random checkpoint, in-process and through the CLI."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from openk3.eval import InProcessModel, OracleModel, format_table, run_eval, score_effort, score_json, score_tool
from openk3.train.sft_data import EFFORTS, EVAL_SUITES, eval_items

N = 8


def _oracle(n: int = N) -> OracleModel:
    return OracleModel([it for s in EVAL_SUITES for it in eval_items(s, 0, n)])


def test_reference_answers_score_100_percent_and_reasoning_grows_with_effort():
    t = run_eval(_oracle(), n=N)
    p = t["problems"]
    assert set(p["accuracy_by_effort"]) == set(EFFORTS) and all(v == 1.0 for v in p["accuracy_by_effort"].values())
    r = p["mean_reasoning_chars_by_effort"]
    assert r["low"] < r["high"] < r["max"]  # the acceptance ordering (per item: tests/train/test_sft_data.py)
    assert t["tools"] == {"n": N, "name_accuracy": 1.0, "argument_accuracy": 1.0, "schema_validity": 1.0}
    assert t["json"] == {"n": N, "validity": 1.0, "key_accuracy": 1.0}
    assert t["effort"] == {"n": N, "accuracy": 1.0}
    assert "self-report accuracy 100.0%" in format_table(t)


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
                    args = {k: (v + 1 if isinstance(v, int) else "Atlantis") for k, v in args.items()}
                    c["function"]["arguments"] = json.dumps(args)
            elif req.get("response_format"):
                msg["content"] = msg["content"][:-1]  # truncated JSON
            elif "effort" in (msg.get("content") or ""):
                msg["content"] = "My current thinking effort is low or max."
            else:
                msg["content"] = "The answer is 100000."
            out.append(msg)
        return out


def test_damaged_answers_score_zero():
    t = run_eval(_Wrong(_oracle()), n=N)
    assert all(v == 0.0 for v in t["problems"]["accuracy_by_effort"].values())
    assert t["tools"]["name_accuracy"] == 1.0 and t["tools"]["argument_accuracy"] == 0.0
    assert t["json"]["validity"] == 0.0 and t["effort"]["accuracy"] == 0.0


def test_scorers_on_edge_cases():
    tool = eval_items("tools", 0, 1)[0]
    assert score_tool(tool, {"content": "no call"}) == {"name_correct": False, "args_correct": False,
                                                         "schema_valid": False}
    bad = copy.deepcopy(tool.reference)
    call = bad["tool_calls"][0]["function"]
    schema = tool.expected["schemas"][call["name"]]
    call["arguments"] = json.dumps({"not_a_field": 1})  # additionalProperties false
    s = score_tool(tool, bad)
    assert not s["schema_valid"] and not s["args_correct"]
    assert schema["additionalProperties"] is False
    js = next(it for it in eval_items("json", 0, 8) if it.request["response_format"]["type"] == "json_schema")
    fields = dict(js.expected["fields"], age="old")  # wrong type: valid JSON, not schema-valid
    s = score_json(js, {"content": json.dumps(fields)})
    assert not s["valid"] and s["key_accuracy"] == pytest.approx((len(fields) - 1) / len(fields))
    eff = eval_items("effort", 0, 1)[0]
    assert score_effort(eff, {"content": f"It is {eff.expected['effort'].upper()}."})["correct"]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from openk3.config import preset
    from openk3.pretrained import build_model
    from openk3.train.recipes import synthetic_document
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
    t = run_eval(model, n=4, validation=model.validation(None, 1, 0, seq_len=2048, max_batches=2))
    v = t["validation"]["sft"]
    assert v["tokens"] > 0 and v["perplexity"] == pytest.approx(torch.tensor(v["loss"]).exp().item(), rel=1e-6)
    assert v["loss"] > 3.0  # untrained: near log(512) = 6.2, far from a trained model
    for suite in EVAL_SUITES:
        assert t[suite]["n"] == 4
    for x in (t["tools"]["name_accuracy"], t["json"]["validity"], t["effort"]["accuracy"]):
        assert 0.0 <= x <= 1.0


def test_cli_eval_writes_the_table(tiny_checkpoint, tmp_path, capsys):
    from openk3.cli import main

    out = tmp_path / "eval.json"
    assert main(["eval", str(tiny_checkpoint), "--n", "2", "--max-tokens", "6", "--suites", "json", "effort",
                 "--out", str(out)]) == 0
    table = json.loads(out.read_text())
    assert set(table) >= {"json", "effort", "validation", "seed", "n_per_suite", "model"}
    assert "problems" not in table and "json       valid" in capsys.readouterr().out
    assert main(["eval", str(tmp_path / "missing")]) == 2


def test_server_model_posts_chat_completions_and_scores_like_in_process():
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from openk3.eval import ServerModel

    oracle, seen, seeds = _oracle(2), [], []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, obj):
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
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

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        t = run_eval(ServerModel(f"http://127.0.0.1:{server.server_port}", api_key="k", max_tokens=7), n=2)
    finally:
        server.shutdown()
    assert set(seen) == {("openk3-tiny", 0, 7, "Bearer k")} and len(seen) == 2 * len(EVAL_SUITES)
    assert seeds == [0, 1] * len(EVAL_SUITES)  # one seed per item: sampled answers are reproducible
    assert t["tools"]["argument_accuracy"] == 1.0 and t["effort"]["accuracy"] == 1.0 and t["validation"] is None


def test_in_process_constrains_json_and_tool_requests_only(tiny_checkpoint):
    model = InProcessModel(str(tiny_checkpoint), max_tokens=4)
    from openk3.chat_format import encode_request

    for suite, constrained in (("problems", False), ("effort", False), ("json", True), ("tools", True)):
        it = eval_items(suite, 0, 1)[0]
        c = model._constraint(it.request, encode_request(it.request, model.tokenizer))
        assert (c is not None) == constrained, suite
    none = next(it for it in __import__("openk3.train.sft_data", fromlist=["sft_items"]).sft_items(0, 200)
                if it.suite == "tools_none")
    assert model._constraint(none.request, encode_request(none.request, model.tokenizer)) is None
