"""Device, dtype and thread choice of the command-line tools (openk3/runtime.py), and the CLI's
start-up behaviour that does not need a model: --version, --help without torch, cost's usage error."""

from __future__ import annotations

import argparse
import io
import subprocess
import sys

import pytest
import torch

from openk3 import runtime
from tests.server.conftest import REPO


def test_device_auto_is_cuda_when_available_else_cpu():
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert runtime.resolve_device("auto").type == want
    assert runtime.resolve_device(None).type == want
    assert runtime.resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_explicit_cuda_without_cuda_is_an_error_not_a_cpu_run():
    with pytest.raises(ValueError, match="--device cuda: CUDA is not available"):
        runtime.resolve_device("cuda")
    with pytest.raises(ValueError, match="--device cuda:1: CUDA is not available"):
        runtime.resolve_device("cuda:1")


def test_unknown_devices_are_value_errors_naming_the_value():
    with pytest.raises(ValueError, match="'gpu0' is not a device"):
        runtime.resolve_device("gpu0")
    with pytest.raises(ValueError, match="only cpu and cuda"):
        runtime.resolve_device("meta")


def test_dtype_auto_is_bf16_on_cuda_and_fp32_on_cpu_and_aliases_resolve():
    assert runtime.resolve_dtype("auto", torch.device("cpu")) is torch.float32
    assert runtime.resolve_dtype(None, "cuda:0") is torch.bfloat16  # a device name is enough, no GPU needed
    assert runtime.resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16
    for name, want in (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp16", torch.float16),
                       ("float32", torch.float32), ("FP32", torch.float32)):
        assert runtime.resolve_dtype(name, "cpu") is want
    with pytest.raises(ValueError, match="--dtype: 'int8' is not one of auto, float32"):
        runtime.resolve_dtype("int8", "cpu")


def test_default_threads_leave_busy_cores_alone_and_honour_omp():
    assert runtime.default_threads(physical=2, cpus=2, load=0.1, env={}) == (2, "2 physical cores, 2 usable CPUs, "
                                                                              "1-min load 0.1")
    assert runtime.default_threads(physical=2, cpus=2, load=2.3, env={})[0] == 1  # a training run on both cores
    assert runtime.default_threads(physical=8, cpus=16, load=3.0, env={})[0] == 8  # never beyond physical cores
    assert runtime.default_threads(physical=8, cpus=8, load=30.0, env={})[0] == 1
    assert runtime.default_threads(physical=8, cpus=8, load=0.0, env={"OMP_NUM_THREADS": "3"}) == (3, "OMP_NUM_THREADS")
    assert runtime.default_threads(physical=8, cpus=8, load=0.0, env={"OMP_NUM_THREADS": ""})[0] == 8
    n, why = runtime.default_threads(physical=8, cpus=8, load=0.0, env={"LOCAL_WORLD_SIZE": "2"})
    assert n == 4 and "2 processes" in why  # torchrun ranks on one machine share its cores


def test_configure_threads_sets_torch_and_announces_once(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(runtime, "_announced", False)
    out = io.StringIO()
    try:
        assert runtime.configure_threads(1, stream=out) == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert runtime.configure_threads(None, stream=out) == 1
    finally:
        torch.set_num_threads(before)
    assert out.getvalue() == "openk3: 1 CPU thread (--threads)\n"  # the second call prints nothing
    with pytest.raises(ValueError, match="--threads: must be an integer >= 1, got 0"):
        runtime.configure_threads(0, stream=None)


def test_setup_applies_flags_in_one_place(monkeypatch):
    monkeypatch.setattr(runtime, "_announced", True)
    args = argparse.Namespace(device="cpu", dtype="bf16", threads=1)
    before = torch.get_num_threads()
    try:
        assert runtime.setup(args) == (torch.device("cpu"), torch.bfloat16)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_every_compute_command_spells_the_runtime_flags_the_same():
    from openk3.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("serve", "generate", "chat", "eval", "bench"):
        flags = {s for a in sub.choices[name]._actions for s in a.option_strings}
        assert {"--device", "--dtype", "--threads"} <= flags, name
    assert "--served-model-name" in {s for a in sub.choices["eval"]._actions for s in a.option_strings}
    for name in ("generate", "chat", "eval"):  # default to the shipped model, like serve
        args = build_parser().parse_args([name] + (["--prompt", "x"] if name == "generate" else []))
        assert (args.path if name != "eval" else args.model) == "openk3-tiny"


def _run(*argv: str, code: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "openk3.cli", *argv]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_cli_import_and_help_do_not_import_torch():
    r = _run(code="import sys, openk3, openk3.cli\n"
                  "openk3.cli.build_parser().format_help()\n"
                  "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
    r = _run("--help")
    assert r.returncode == 0 and "serve" in r.stdout and "chat" in r.stdout


def test_version_and_lazy_public_names():
    import openk3

    r = _run("--version")
    assert (r.returncode, r.stdout) == (0, f"openk3 {openk3.__version__}\n")
    from importlib.metadata import version

    assert version("openk3") == openk3.__version__  # pyproject reads the same attribute
    assert openk3.K3Config is __import__("openk3.config", fromlist=["K3Config"]).K3Config
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        openk3.nope  # noqa: B018


def test_cost_without_input_is_a_usage_error():
    r = _run("cost")
    assert r.returncode == 2 and r.stderr.startswith("usage: openk3 cost")
    assert "nothing to price" in r.stderr and r.stdout == ""
