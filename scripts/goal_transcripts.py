"""The shipped model's eight reference prompts, as a new user meets them: a running ``openk3 serve``
with its default sampling (the platform's temperature with thinking on), one fixed ``seed`` per
prompt, printed as a Markdown transcript for MODEL_CARD.md ("Before and after").

    openk3 serve &                                   # the shipped openk3-tiny on :8000
    python scripts/goal_transcripts.py http://127.0.0.1:8000 > transcripts.md

The prompts: three sums and products at the default effort, one sum at efforts low / high / max,
a name given in an earlier turn and asked back, a dynamic tool (declared in a system message) and a
weather call whose city has to come from the user's words. Each request goes through the official
``openai`` SDK (``extra_body`` for the K3 fields), exactly as a client sends it.
"""

from __future__ import annotations

import argparse
import json

from openai import OpenAI

from openk3.datasets.sft_tasks import TOOLS

PROMPTS: list[tuple[str, dict]] = [
    ("What is 17 * 23?", {"messages": [{"role": "user", "content": "What is 17 * 23?"}]}),
    ("Compute 14 + 23.", {"messages": [{"role": "user", "content": "Compute 14 + 23."}]}),
    *[
        (
            f"Compute 38 + 45. (effort {e})",
            {
                "messages": [{"role": "user", "content": "Compute 38 + 45."}],
                "extra_body": {"reasoning_effort": e},
            },
        )
        for e in ("low", "high", "max")
    ],
    (
        "My name is Alice. / What is my name?",
        {
            "messages": [
                {"role": "user", "content": "My name is Alice."},
                {"role": "assistant", "content": "Nice to meet you, Alice!"},
                {"role": "user", "content": "What is my name?"},
            ]
        },
    ),
    (
        "dynamic get_time (tools in a system message)",
        {
            "messages": [
                {"role": "system", "content": "", "tools": [TOOLS["get_time"]]},
                {"role": "user", "content": "What time is it in Europe/Berlin?"},
            ]
        },
    ),
    (
        "get_weather for Berlin",
        {
            "messages": [{"role": "user", "content": "What is the weather in Berlin?"}],
            "tools": [TOOLS["get_weather"], TOOLS["get_time"], TOOLS["search_web"]],
        },
    ),
]


def transcript(url: str, model: str | None) -> str:
    """The Markdown transcript of :data:`PROMPTS` against the server at ``url``."""
    client = OpenAI(base_url=url.rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=300)
    model = model or client.models.list().data[0].id
    out = []
    for seed, (title, req) in enumerate(PROMPTS, start=1):
        kwargs = {k: v for k, v in req.items() if k != "extra_body"}
        resp = client.chat.completions.create(
            model=model, seed=seed, extra_body=req.get("extra_body"), **kwargs
        )
        msg = resp.choices[0].message
        reasoning = getattr(msg, "reasoning_content", None) or (msg.model_extra or {}).get(
            "reasoning_content"
        )
        calls = [
            f"{c.function.name}({c.function.arguments})" for c in (msg.tool_calls or [])
        ]
        out.append(f"**{seed}. {title}** (seed {seed})")
        out.append("")
        out.append(f"- reasoning: `{json.dumps(reasoning)[1:-1] if reasoning else ''}`")
        out.append(f"- content: `{json.dumps(msg.content)[1:-1] if msg.content else ''}`")
        if calls:
            out.append(f"- tool calls: `{'; '.join(calls)}`")
        out.append("")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("url", help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model id (default: the server's first)")
    args = p.parse_args()
    print(transcript(args.url, args.model))


if __name__ == "__main__":
    main()
