"""Checkpoint integrity and run-directory ownership: every checkpoint file's SHA-256 is recorded at
save and verified before a resume reads anything (a flipped byte is an error naming the file), and
one trainer at a time holds a run directory (a second is refused with the holder's pid; a killed
holder leaves no stale lock)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from openk3.train.checkpointing import CHECKSUMS, LOCK, CheckpointManager, RunLock, verify_checksums
from tests.train.test_trainer import _cli, _tiny_run

REPO = Path(__file__).resolve().parents[2]


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    run = _tiny_run()
    model, opt, bals = run.build()
    mgr = CheckpointManager(tmp_path_factory.mktemp("ck"), keep=None)
    return run, Path(mgr.save(2, model, opt, bals, run.data(run, "train"), run)), model


def test_checksums_cover_every_file_and_match_sha256sum(saved):
    _, ck, _ = saved
    listed = sorted(line.split("  ", 1)[1].strip() for line in (ck / CHECKSUMS).read_text().splitlines())
    assert listed == sorted(str(p.relative_to(ck)) for p in ck.rglob("*") if p.is_file() and p.name != CHECKSUMS)
    assert {"model.safetensors", "trainer_state.pt", "trainer_state.json", "config.json"} <= set(listed)
    assert verify_checksums(ck) is True
    if shutil.which("sha256sum"):  # the operator's own tool agrees
        r = subprocess.run(["sha256sum", "--quiet", "-c", CHECKSUMS], cwd=ck, capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("name, what", [("model.safetensors", "damaged model weights"),
                                        ("trainer_state.pt", "damaged optimizer state"),
                                        ("trainer_state.json", "damaged training state")])
def test_a_flipped_byte_is_an_error_naming_the_file(saved, tmp_path, name, what):
    """One bit flipped in the middle of a file (for the weights: inside a tensor, where the
    safetensors reader itself would not notice) makes the resume fail naming that file, before
    the model or optimizer is touched."""
    run, ck, model = saved
    copy = tmp_path / ck.name
    shutil.copytree(ck, copy)
    target = copy / name
    _flip(target, target.stat().st_size // 2)
    fresh, opt, bals = run.build()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ValueError) as e:
        CheckpointManager(tmp_path).load(copy, fresh, opt, bals)
    assert str(e.value).startswith(f"{target}: {what}: its SHA-256 differs from the one recorded in {CHECKSUMS}")
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())  # nothing was loaded
    assert not opt.state


def test_a_checkpoint_without_checksums_loads_unverified(saved, tmp_path):
    """A checkpoint saved before checksums existed still resumes (bit-exact); a listed file that
    is missing is named."""
    run, ck, model = saved
    copy = tmp_path / ck.name
    shutil.copytree(ck, copy)
    (copy / CHECKSUMS).unlink()
    fresh, opt, bals = run.build()
    assert CheckpointManager(tmp_path).load(copy, fresh, opt, bals)["step"] == 2
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items())
    shutil.copy(ck / CHECKSUMS, copy / CHECKSUMS)
    (copy / "config.json").unlink()
    with pytest.raises(ValueError, match=rf"{copy / 'config.json'}: missing from the checkpoint"):
        verify_checksums(copy)


def _holder(directory: Path) -> subprocess.Popen:
    """A separate process that takes the run lock, says so, and holds it until stdin closes."""
    code = ("import sys; from openk3.train.checkpointing import RunLock; lock = RunLock(sys.argv[1]).acquire(); "
            "print('locked', flush=True); sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code, str(directory)], cwd=REPO, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def test_run_lock_is_exclusive_across_processes_and_never_stale(tmp_path):
    holder = _holder(tmp_path)
    with pytest.raises(ValueError) as e:
        RunLock(tmp_path).acquire()
    assert f"is in use by another trainer (pid {holder.pid}, lock {tmp_path / LOCK})" in str(e.value)
    holder.stdin.close()  # a clean exit releases it
    assert holder.wait(30) == 0
    with RunLock(tmp_path):
        with pytest.raises(ValueError, match=f"pid {os.getpid()}"):
            RunLock(tmp_path).acquire()  # a second lock in the same process is refused too
    killed = _holder(tmp_path)
    killed.send_signal(signal.SIGKILL)  # a killed holder: the kernel drops its lock
    killed.wait(30)
    assert (tmp_path / LOCK).read_text().strip() == str(killed.pid)  # the file stays, the lock does not
    RunLock(tmp_path).acquire().release()


def test_a_second_trainer_on_a_run_directory_is_refused(tmp_path):
    """Two real ``openk3 train`` processes on one --out: the second exits 2 naming the first's pid
    and touches nothing; once the first has stopped, --resume continues the run."""
    out = tmp_path / "run"
    first = _cli(out, env_extra={"OPENK3_TEST_STEP_DELAY": "0.5"}, popen=True)
    deadline = time.monotonic() + 120
    while not ((out / LOCK).is_file() and (out / LOCK).read_text().strip() == str(first.pid)):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.05)
    metrics_before = (out / "metrics.jsonl").read_text() if (out / "metrics.jsonl").exists() else None
    second = _cli(out, "--resume")
    assert second.returncode == 2, second.stderr
    assert f"is in use by another trainer (pid {first.pid}" in second.stderr
    first.send_signal(signal.SIGTERM)  # stops after saving a checkpoint
    first.communicate(timeout=120)
    if metrics_before is not None:
        assert (out / "metrics.jsonl").read_text().startswith(metrics_before)
    again = _cli(out, "--resume", "--max-steps", "4")
    assert again.returncode == 0, again.stderr
