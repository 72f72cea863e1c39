"""The ``openk3`` command line. Each subcommand is a thin wrapper over library functions."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
from collections.abc import Sequence


def _cmd_info(args: argparse.Namespace) -> int:
    from openk3.config import K3Config
    from openk3.params import count_parameters

    from openk3.shipped import resolve_model_path

    source = resolve_model_path(args.path) if args.path else args.config
    if source is None:
        print("openk3 info: give a checkpoint directory or --config PRESET", file=sys.stderr)
        return 2
    vision = None
    try:
        config = K3Config.from_pretrained(source)
        if config.wrapper is not None and config.wrapper.get("vision_config") is not None:
            from openk3.vision import count_vision_parameters

            # A vision_config that is not an object, or has a bad field, is named here (one line)
            # instead of being skipped or ending in a traceback.
            vision = count_vision_parameters(config.wrapper["vision_config"])
    except (FileNotFoundError, ValueError) as e:
        print(f"openk3 info: {e}", file=sys.stderr)
        return 2
    counts = count_parameters(config)
    if args.json:
        print(json.dumps({"source": str(source), **counts, "vision": vision}, indent=2))
        return 0
    n_kda = config.layer_types.count("linear_attention")
    print(
        f"{source}: {config.num_hidden_layers} layers ({n_kda} KDA + {config.num_hidden_layers - n_kda} MLA), "
        f"hidden {config.hidden_size}, vocab {config.vocab_size}"
    )
    print(f"{'component':<16}{'total':>22}{'active':>22}")
    for comp, v in counts["by_component"].items():
        if v["total"]:
            print(f"{comp:<16}{v['total']:>22,}{v['active']:>22,}")
    print(f"{'TOTAL':<16}{counts['total']:>22,}{counts['active']:>22,}")
    if vision is not None:
        print(
            f"vision (not in the totals, as in the K3 report): MoonViT-V2 tower {vision['vision_tower']:,}, "
            f"mm_projector {vision['mm_projector']:,}"
        )
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from openk3.server.app import main as serve_main

    return serve_main(args)


def _cmd_cost(args: argparse.Namespace) -> int:
    from openk3.cost import load_prices, main as cost_main

    if not (
        args.files or args.url or args.prompt_tokens or args.cached_tokens or args.completion_tokens
    ):
        try:  # bad prices are named first, as with input
            load_prices(args.prices, args.price_cache_hit, args.price_input, args.price_output)
        except (OSError, ValueError) as e:
            print(f"openk3 cost: {e}", file=sys.stderr)
            return 2
        args.parser.print_usage(sys.stderr)
        print(
            "openk3 cost: error: nothing to price: give response/usage FILES ('-' reads stdin), --url of a "
            "running server, or --prompt-tokens / --completion-tokens",
            file=sys.stderr,
        )
        return 2

    return cost_main(args)


def _cmd_build_corpus(args: argparse.Namespace) -> int:
    from openk3.datasets.corpus import cli_build_corpus

    return cli_build_corpus(args)


def _cmd_train_tokenizer(args: argparse.Namespace) -> int:
    from openk3.train.tokenizer_train import cli_train_tokenizer

    return cli_train_tokenizer(args)


def _rank0() -> bool:
    """True in a single process and on rank 0 of a torchrun job (``RANK``)."""
    return os.environ.get("RANK", "0") == "0"


def _parse_overrides(items: Sequence[str]) -> dict:
    """``["lr=0.01", "qat=mxfp4", "warmup_steps=null"]`` -> {field: value}; values are JSON when
    they parse as JSON, strings otherwise; a later item replaces an earlier one of the same field,
    except two ``extra`` objects, which merge key by key (a script's ``extra`` plus the user's).
    Raises ValueError for an item without ``=``."""
    out: dict = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        if key == "extra" and isinstance(out.get(key), dict) and isinstance(value, dict):
            value = {**out[key], **value}
        out[key] = value
    return out


def _cmd_train(args: argparse.Namespace) -> int:
    """``openk3 train``: run a recipe (arguments: see ``openk3 train --help``).

    Works the same in one process and under ``torchrun`` (``torchrun --nproc-per-node 2 -m
    openk3.cli train --recipe smoke --out runs/x``): :func:`openk3.train.trainer.train` detects the
    launch (see :mod:`openk3.train.distributed.run`).

    Returns the exit status: 0 done, 1 stopped on a non-finite value, 2 bad arguments,
    128 + signal number after a SIGTERM/SIGINT (a checkpoint was saved; ``--resume`` continues).
    Under ``torchrun`` every rank returns the same status; only rank 0 prints the outcome.
    """
    from openk3.recipes import RECIPES, get_recipe
    from openk3.train.trainer import TrainingStopped, train

    if args.list:
        width = max(map(len, RECIPES)) + 2
        for name, fn in sorted(RECIPES.items()):
            first = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
            # docstrings use reST roles / literals and cite issues; the listing shows plain text
            first = re.sub(r":\w+:`~?([^`]+)`", r"\1", first).replace("``", "")
            first = re.sub(r"\s*\(issue [^)]*\)", "", first)
            print(f"{name:<{width}}{first}")
        return 0
    if not args.recipe:
        print("openk3 train: give --recipe NAME (see --list)", file=sys.stderr)
        return 2
    try:
        overrides = _parse_overrides(args.set)
        if args.threads is not None:
            overrides["threads"] = args.threads
        run = get_recipe(args.recipe, **overrides)
        if args.max_steps is not None and args.max_steps < 0:
            raise ValueError(f"--max-steps={args.max_steps}: must be >= 0")
    except (ValueError, TypeError) as e:
        print(f"openk3 train: {e}", file=sys.stderr)
        return 2
    from openk3.runtime import configure_threads

    # the recipe's or --threads' count, else the cores not already busy (OMP_NUM_THREADS honoured)
    configure_threads(run.threads, stream=sys.stderr if _rank0() else None)
    out = args.out or os.path.join("runs", run.name)
    if args.resume and _rank0() and run.prepare is None:
        from openk3.train.checkpointing import CheckpointManager

        if (
            not os.path.isdir(os.path.join(out, "checkpoints"))
            or CheckpointManager(os.path.join(out, "checkpoints")).latest() is None
        ):
            print(
                f"openk3 train: --resume: no checkpoint in {os.path.join(out, 'checkpoints')}; starting at step 0",
                file=sys.stderr,
            )
    try:
        result = train(
            run, out, resume=args.resume, max_steps=args.max_steps, progress=not args.no_progress
        )
    except TrainingStopped as e:
        if _rank0():  # every rank stops with the same message
            print(f"openk3 train: {e}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError, NotADirectoryError) as e:
        print(f"openk3 train: {e}", file=sys.stderr)
        return 2
    if result.signal is not None:
        if not _rank0():
            return 128 + result.signal
        name = signal.Signals(result.signal).name
        print(
            f"openk3 train: stopped by {name} after step {result.step}; checkpoint {result.checkpoint} "
            f"(continue with --resume)",
            file=sys.stderr,
        )
        return 128 + result.signal
    if not _rank0():
        return 0
    last = result.last_metrics
    loss = f", loss {last['loss']:.4f}" if last else ""
    print(
        f"openk3 train: {run.name} finished at step {result.step}/{result.end_step}{loss}; "
        f"checkpoint {result.checkpoint}; metrics {os.path.join(out, 'metrics.jsonl')}",
        file=sys.stderr,
    )
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from openk3.eval import cli_eval

    return cli_eval(args)


def _bytes(text: str) -> int:
    """``8G``, ``512M``, ``1.5GiB`` or plain bytes -> int (for --cache-memory)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if scale > 1 else t) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 8G, 512M)") from None


def _cmd_export(args: argparse.Namespace) -> int:
    from openk3.export import cli_export

    return cli_export(args)


def _cmd_plan(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from openk3.config import K3Config
    from openk3.engine.planner import format_plan, plan

    source = args.path or args.config
    if source is None:
        print("openk3 plan: give a checkpoint directory or --config PRESET", file=sys.stderr)
        return 2
    try:
        config = K3Config.from_pretrained(source)
        p = plan(
            config,
            args.gpus,
            args.context or config.max_position_embeddings,
            gpu_util=args.gpu_util,
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"openk3 plan: {e}", file=sys.stderr)
        return 2
    print(
        json.dumps({"source": str(source), **asdict(p)}, indent=2)
        if args.json
        else format_plan(p, str(source))
    )
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from openk3.engine import Engine, EngineConfig, SamplingParams
    from openk3.pretrained import load_pretrained
    from openk3.runtime import setup
    from openk3.tokenizer import IncrementalDecoder, load_tokenizer

    try:
        device, dtype = setup(args)
        tok = load_tokenizer(args.tokenizer or args.path)
        model = load_pretrained(args.path, device=device, dtype=dtype)
        engine = Engine(
            model, EngineConfig(max_num_seqs=1, enable_prefix_cache=False), detokenize=tok.decode
        )
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop_token_ids=list(tok.stop_token_ids),
        )
        engine.add_request(tok.encode_text(args.prompt), params)
    except (FileNotFoundError, ValueError) as e:
        print(f"openk3 generate: {e}", file=sys.stderr)
        return 2
    decoder = IncrementalDecoder(tok)
    usage = None
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(decoder.feed(out.new_token_ids))
            sys.stdout.flush()
            if out.finished:
                usage = out.usage
                reason = out.finish_reason
    sys.stdout.write(decoder.flush() + "\n")
    if usage is not None:
        print(
            f"[{reason}: {usage.prompt_tokens} prompt + {usage.completion_tokens} generated tokens]",
            file=sys.stderr,
        )
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from openk3.bench import BENCHMARKS, format_targets, run_benchmark
    from openk3.bench.common import write_json

    if args.list or not args.name:
        for name, (_, what) in BENCHMARKS.items():
            print(f"{name:<18}{what}")
        return 0 if args.list else 2
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"openk3 bench: --set {item!r}: expected KEY=VALUE", file=sys.stderr)
            return 2
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    from openk3.runtime import setup

    names = list(BENCHMARKS) if args.name == "all" else [args.name]
    results = []
    try:
        device, dtype = setup(args)
        # auto keeps the fp32 CPU benchmarks runnable on a GPU machine; an explicit choice is checked
        place = args.device != "auto" or args.dtype != "auto"
        for name in names:
            where = {"device": device, "dtype": dtype} if place or _placeable(name) else {}
            results.append(
                run_benchmark(name, quick=args.quick, reps=args.reps, **where, **overrides)
            )
            print(format_targets(results[-1]), file=sys.stderr, flush=True)
    except ValueError as e:
        print(f"openk3 bench: {e}", file=sys.stderr)
        return 2
    out = results[0] if len(results) == 1 else {"benchmarks": results}
    if args.out:
        write_json(out, args.out)
    else:
        print(json.dumps(out, indent=2, default=str))
    return 0


def _placeable(name: str) -> bool:
    import importlib

    from openk3.bench import BENCHMARKS

    return bool(getattr(importlib.import_module(BENCHMARKS[name][0]), "PLACEABLE", False))


def _port(text: str) -> int:
    """argparse type: a TCP port 0-65535 (0: pick a free one)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0-65535, got {port}")
    return port


def build_parser() -> argparse.ArgumentParser:
    from openk3 import __version__
    from openk3.runtime import add_runtime_args
    from openk3.shipped import DEFAULT_MODEL

    p = argparse.ArgumentParser(prog="openk3", description="Kimi K3 reference implementation")
    p.add_argument("--version", action="version", version=f"openk3 {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="parameter counts (total / active) by component")
    info.add_argument("path", nargs="?", help="checkpoint directory (or preset name)")
    info.add_argument("--config", help="preset name or config.json path, e.g. kimi-k3")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(func=_cmd_info)

    pl = sub.add_parser(
        "plan", help="memory plan: weights by format, cache bytes, sequences that fit"
    )
    pl.add_argument("path", nargs="?", help="checkpoint directory (or preset name)")
    pl.add_argument("--config", help="preset name or config.json path, e.g. kimi-k3")
    pl.add_argument(
        "--gpus", default="8xH200", help="COUNTxTYPE (e.g. 8xH200, 16xB300) or COUNTxSIZE (8x141GB)"
    )
    pl.add_argument(
        "--context", type=int, help="tokens per sequence (default: max_position_embeddings)"
    )
    pl.add_argument(
        "--gpu-util", type=float, default=0.9, help="usable fraction of GPU memory (default 0.9)"
    )
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.set_defaults(func=_cmd_plan)

    gen = sub.add_parser("generate", help="raw text completion from a checkpoint, streamed")
    gen.add_argument(
        "path",
        nargs="?",
        default=DEFAULT_MODEL,
        help=f"checkpoint directory or shipped model name (default: the shipped {DEFAULT_MODEL})",
    )
    gen.add_argument("--prompt", required=True, help="raw prompt text (no chat format)")
    gen.add_argument("--tokenizer", help="tokenizer directory (default: the checkpoint directory)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    add_runtime_args(gen)
    gen.set_defaults(func=_cmd_generate)

    from openk3.chat_repl import add_parser as add_chat_parser

    add_chat_parser(sub)

    serve = sub.add_parser("serve", help="Kimi-compatible API server (OpenAI + Anthropic surfaces)")
    serve.add_argument(
        "model",
        nargs="?",
        help="checkpoint directory or shipped model name (default: the shipped openk3-tiny)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument(
        "--port", type=_port, default=8000, help="0 picks a free port (printed at startup)"
    )
    serve.add_argument(
        "--api-key", help="require this key (Bearer or x-api-key); default $OPENK3_API_KEY"
    )
    serve.add_argument(
        "--served-model-name", help="model id clients send (default: the directory name)"
    )
    serve.add_argument("--max-num-seqs", type=int, default=16, help="requests decoded together")
    serve.add_argument(
        "--cache-memory", type=_bytes, help="bytes for the KV/KDA cache pools, e.g. 8G"
    )
    serve.add_argument(
        "--no-prefix-cache", action="store_true", help="disable automatic prefix caching"
    )
    serve.add_argument(
        "--max-waiting", type=int, help="admission queue bound; beyond it requests get 429"
    )
    serve.add_argument(
        "--max-model-len",
        type=int,
        help="context length (default: the model's); more than --cache-memory holds for one "
        "sequence is an error",
    )
    serve.add_argument(
        "--max-request-memory",
        type=_bytes,
        help="memory one request's images may need (pixels, features, vision-tower work); larger "
        "ones get a 400 (default: an eighth of the memory available at start-up)",
    )
    serve.add_argument("--quiet", action="store_true", help="no access log line per request")
    serve.add_argument(
        "--compile",
        action="store_true",
        help="decode steps as a static-shape torch.compile graph (each batch / block-table bucket "
        "compiles on first use: minutes on a small CPU); OPENK3_DECODE_BACKEND=reference "
        "forces the eager reference",
    )
    add_runtime_args(serve)
    serve.add_argument(
        "--greedy",
        action="store_true",
        help="evaluation switch, not platform behaviour: decode greedily (temperature 0) instead of the "
        "platform's fixed sampling; responses carry x-openk3-decoding: greedy",
    )
    serve.set_defaults(func=_cmd_serve)

    cost = sub.add_parser("cost", help="price a workload or a running server's recorded usage")
    cost.add_argument(
        "files", nargs="*", help="JSON / JSONL files of responses or usage objects ('-' = stdin)"
    )
    cost.add_argument(
        "--url", help="a running openk3 server: price its recorded usage (from /metrics)"
    )
    cost.add_argument("--prompt-tokens", type=int, default=0, help="add this many prompt tokens")
    cost.add_argument("--cached-tokens", type=int, default=0, help="... of which served from cache")
    cost.add_argument(
        "--completion-tokens", type=int, default=0, help="add this many output tokens"
    )
    cost.add_argument(
        "--price-cache-hit", type=float, help="USD per 1M cache-hit input tokens (default 0.30)"
    )
    cost.add_argument(
        "--price-input", type=float, help="USD per 1M cache-miss input tokens (default 3.00)"
    )
    cost.add_argument("--price-output", type=float, help="USD per 1M output tokens (default 15.00)")
    cost.add_argument(
        "--prices", help="JSON file with any of cache_hit / input / output (USD per 1M)"
    )
    cost.add_argument("--json", action="store_true", help="machine-readable output")
    cost.set_defaults(func=_cmd_cost, parser=cost)

    corpus = sub.add_parser(
        "build-corpus", help="assemble the permissively licensed offline text corpus (DATA.md)"
    )
    corpus.add_argument(
        "--out", default="data/corpus", help="output directory (default data/corpus)"
    )
    corpus.add_argument(
        "--install",
        action="store_true",
        help="apt-get install the Debian doc packages first (root)",
    )
    corpus.add_argument(
        "--no-debian", action="store_true", help="skip the Debian documentation packages"
    )
    corpus.add_argument(
        "--no-pypi", action="store_true", help="skip the installed PyPI distributions"
    )
    corpus.add_argument(
        "--add-dir",
        action="append",
        default=[],
        metavar="NAME:LICENCE:PATH",
        help="also read .txt/.md/.rst/.html files under PATH (SPDX licence, must be permissive)",
    )
    corpus.add_argument(
        "--val-fraction", type=float, default=0.01, help="validation share (default 0.01)"
    )
    corpus.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    corpus.add_argument("--json", action="store_true", help="print the manifest")
    corpus.set_defaults(func=_cmd_build_corpus)

    tokenizer = sub.add_parser(
        "train-tokenizer", help="train a byte-level BPE with the K3 special tokens"
    )
    tokenizer.add_argument(
        "--corpus",
        default="data/corpus",
        help="corpus directory or text file (default data/corpus)",
    )
    tokenizer.add_argument(
        "--vocab-size",
        type=int,
        default=8192,
        help="total ids incl. 256 special slots (default 8192)",
    )
    tokenizer.add_argument(
        "--out", default="data/tokenizer", help="output directory (default data/tokenizer)"
    )
    tokenizer.add_argument(
        "--min-frequency", type=int, default=2, help="minimum pair count to merge (default 2)"
    )
    tokenizer.add_argument(
        "--split-digits",
        action="store_true",
        help="pre-tokenize numbers into single digits (default: Kimi's runs of up to 3)",
    )
    tokenizer.add_argument("--max-mb", type=float, help="train on at most this many MB of text")
    tokenizer.set_defaults(func=_cmd_train_tokenizer)

    bench = sub.add_parser(
        "bench", help="benchmarks vs peers, side by side (JSON out; see README 'Benchmarks')"
    )
    bench.add_argument("name", nargs="?", help="benchmark name, or 'all' (see --list)")
    bench.add_argument("--out", help="write the JSON result here (default: print it)")
    bench.add_argument(
        "--quick", action="store_true", help="tiny sizes, one repetition: checks it runs and agrees"
    )
    bench.add_argument("--reps", type=int, help="timed repetitions (default 5)")
    add_runtime_args(bench)
    bench.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a benchmark setting, e.g. --set hidden=512 (JSON values)",
    )
    bench.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    bench.set_defaults(func=_cmd_bench)

    train = sub.add_parser(
        "train", help="train a model with a recipe (resumable; JSONL metrics, PNG plot)"
    )
    train.add_argument("--recipe", help="registered recipe name (see --list) or module:function")
    train.add_argument("--out", help="output directory (default runs/RECIPE)")
    train.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint in --out"
    )
    train.add_argument(
        "--max-steps", type=int, help="stop after this many completed steps (schedule unchanged)"
    )
    train.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a RunConfig field, e.g. --set lr=0.01 --set total_steps=50 (JSON values)",
    )
    train.add_argument("--threads", type=int, help="torch CPU threads")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument("--list", action="store_true", help="list the registered recipes and exit")
    train.set_defaults(func=_cmd_train)

    ev = sub.add_parser(
        "eval",
        help="held-out eval suites (arithmetic, tools, JSON, recall, images, long prompts, ...) "
        "of a checkpoint or server",
    )
    ev.add_argument(
        "model",
        nargs="?",
        default=DEFAULT_MODEL,
        help=f"checkpoint directory, shipped model name or a server URL (http://HOST:PORT); "
        f"default: the shipped {DEFAULT_MODEL}",
    )
    ev.add_argument("--tokenizer", help="tokenizer directory (default: the checkpoint directory)")
    ev.add_argument("--corpus", help="corpus directory: also report its val-split loss/perplexity")
    ev.add_argument(
        "--n",
        type=int,
        default=100,
        help="items per suite; per operation for arithmetic, per question type for images (default 100)",
    )
    ev.add_argument("--seed", type=int, default=0, help="eval-set seed (default 0)")
    ev.add_argument(
        "--suites",
        nargs="*",
        help="subset of: arithmetic reasoning tools tools_two tool_result json "
        "recall effort echo out_of_scope images long_tools long_arithmetic",
    )
    ev.add_argument(
        "--concurrency", type=int, default=8, help="requests in flight against a server (default 8)"
    )
    ev.add_argument(
        "--no-validation", action="store_true", help="skip the validation losses (in-process)"
    )
    ev.add_argument(
        "--max-tokens", type=int, default=256, help="generation cap per request (default 256)"
    )
    add_runtime_args(ev)
    ev.add_argument(
        "--served-model-name",
        help="model id sent to a server (default: its first /v1/models entry)",
    )
    ev.add_argument(
        "--served-model", dest="served_model_name", help=argparse.SUPPRESS
    )  # the old spelling
    ev.add_argument("--no-progress", action="store_true", help="no progress bar")
    ev.add_argument(
        "--api-key",
        default=os.environ.get("OPENK3_API_KEY"),
        help="server key (default $OPENK3_API_KEY)",
    )
    ev.add_argument("--out", help="write the eval table as JSON here")
    ev.set_defaults(func=_cmd_eval)

    ex = sub.add_parser(
        "export",
        help="training checkpoint -> servable directory (tokenizer, template, MXFP4 experts)",
    )
    ex.add_argument(
        "checkpoint", help="save_pretrained-format directory, e.g. OUT/checkpoints/step-N"
    )
    ex.add_argument("out", help="destination directory (written atomically)")
    ex.add_argument("--tokenizer", help="tokenizer directory (default: the checkpoint directory)")
    ex.add_argument(
        "--quantization",
        choices=("mxfp4", "none"),
        default="mxfp4",
        help="routed experts as MXFP4 packed (default, as K3 ships) or float",
    )
    ex.add_argument("--model-card", help="Markdown file written as MODEL_CARD.md")
    ex.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    ex.set_defaults(func=_cmd_export)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one ``openk3`` command; returns its exit status (130 after Ctrl-C, with one line instead
    of a traceback)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"\nopenk3 {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
