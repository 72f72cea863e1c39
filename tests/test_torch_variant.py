"""The Makefile's torch selection (scripts/torch_variant.py): which build, from which index."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "torch_variant.py"
spec = importlib.util.spec_from_file_location("torch_variant", SCRIPT)
tv = importlib.util.module_from_spec(spec)
sys.modules["torch_variant"] = tv  # dataclasses resolve annotations through sys.modules
spec.loader.exec_module(tv)


def never(url):
    raise AssertionError(f"the index {url} should not have been probed")


def test_no_gpu_takes_the_cpu_index_when_it_answers():
    asked = []
    c = tv.choose("auto", gpu=False, reachable=lambda u: asked.append(u) or True, platform="linux")
    assert (c.variant, c.pip_args, asked) == ("cpu", ["--index-url", tv.CPU_INDEX], [tv.CPU_INDEX])


def test_no_gpu_falls_back_to_the_default_index_when_the_cpu_index_is_unreachable():
    c = tv.choose(None, gpu=False, reachable=lambda u: False, platform="linux")
    assert (c.variant, c.pip_args) == ("cpu", [])
    assert "not reachable" in c.reason and "TORCH_INDEX_URL" in c.reason


def test_gpu_takes_the_cuda_build_from_the_default_index_without_probing():
    c = tv.choose("auto", gpu=True, reachable=never, platform="linux")
    assert (c.variant, c.pip_args) == ("cuda", [])


@pytest.mark.parametrize("variant, gpu, want", [("cpu", True, "cpu"), ("CUDA", False, "cuda"), ("", True, "cuda")])
def test_override_wins_over_detection(variant, gpu, want):
    c = tv.choose(variant, gpu=gpu, reachable=lambda u: True, platform="linux")
    assert c.variant == want
    assert c.pip_args == (["--index-url", tv.CPU_INDEX] if want == "cpu" else [])


def test_cpu_off_linux_uses_the_default_index():
    assert tv.choose("cpu", gpu=False, reachable=never, platform="darwin").pip_args == []


def test_explicit_index_url_is_the_only_index():
    c = tv.choose("cuda", gpu=False, reachable=never, platform="linux", index_url="https://mirror/cu126")
    assert c.pip_args == ["--index-url", "https://mirror/cu126"]


def test_unknown_variant_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="TORCH_VARIANT.*'rocm'"):
        tv.choose("rocm", gpu=False, reachable=never)


def test_index_probe_is_false_for_an_unresolvable_host():
    assert tv.index_reachable("http://openk3-no-such-host.invalid/whl/cpu", timeout=2.0) is False


def test_cli_exit_status_and_pip_args():
    bad = subprocess.run([sys.executable, str(SCRIPT), "--variant", "rocm"], capture_output=True, text=True)
    assert bad.returncode == 2 and "must be one of auto, cpu, cuda" in bad.stderr
    ok = subprocess.run([sys.executable, str(SCRIPT), "--variant", "cuda", "--pip-args",
                         "--index-url", "https://mirror/x"], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.split() == ["--index-url", "https://mirror/x"]
    assert ok.stderr.startswith("torch: from TORCH_INDEX_URL=https://mirror/x")
