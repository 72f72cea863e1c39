"""The ``openk3`` command line. Each subcommand is a thin wrapper over library functions."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _cmd_info(args: argparse.Namespace) -> int:
    from openk3.config import K3Config
    from openk3.params import count_parameters

    source = args.path or args.config
    if source is None:
        print("openk3 info: give a checkpoint directory or --config PRESET", file=sys.stderr)
        return 2
    try:
        config = K3Config.from_pretrained(source)
    except (FileNotFoundError, ValueError) as e:
        print(f"openk3 info: {e}", file=sys.stderr)
        return 2
    counts = count_parameters(config)
    if args.json:
        print(json.dumps({"source": str(source), **counts}, indent=2))
        return 0
    n_kda = config.layer_types.count("linear_attention")
    print(f"{source}: {config.num_hidden_layers} layers ({n_kda} KDA + {config.num_hidden_layers - n_kda} MLA), "
          f"hidden {config.hidden_size}, vocab {config.vocab_size}")
    print(f"{'component':<16}{'total':>22}{'active':>22}")
    for comp, v in counts["by_component"].items():
        if v["total"]:
            print(f"{comp:<16}{v['total']:>22,}{v['active']:>22,}")
    print(f"{'TOTAL':<16}{counts['total']:>22,}{counts['active']:>22,}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        from openk3.server.app import main as serve_main  # noqa: F401  (lands with the server issue)
    except ImportError:
        print("openk3 serve: the Kimi-compatible server is not implemented yet (issue 5: the API server; "
              "issue 8: the shipped default model). Nothing to serve.", file=sys.stderr)
        return 2
    return serve_main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="openk3", description="Kimi K3 reference implementation")
    sub = p.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="parameter counts (total / active) by component")
    info.add_argument("path", nargs="?", help="checkpoint directory (or preset name)")
    info.add_argument("--config", help="preset name or config.json path, e.g. kimi-k3")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(func=_cmd_info)

    serve = sub.add_parser("serve", help="Kimi-compatible API server")
    serve.add_argument("model", nargs="?")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.set_defaults(func=_cmd_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
