"""SIGTERM mid-fit: every rank saves a checkpoint at the next step boundary and leaves fit with
SIGTERMException (a SystemExit: status 0) within seconds; fit(ckpt_path="last") then continues
exactly as an uninterrupted run. The user's own handler is chained and put back. Under our launcher,
a SIGTERM sent to the launcher process (rank 0) does the same for the whole job."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from harness import run_ranks, timeout_scale
from toy import ToyModule
from zerotrain import ModelCheckpoint, Trainer
from zerotrain.trainer.checkpoint.directory import read_latest
from zerotrain.trainer.launch.signals import SIGTERMException

MAX_STEPS = 8


class Stopper(ToyModule):
    """Sends SIGTERM to its own process on ``rank`` during step ``at`` (once)."""

    def __init__(self, at: int | None = None, rank: int = 1):
        super().__init__(shuffle=True, n=96)
        self.at, self.rank, self.sent_at = at, rank, None

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == self.at and self.global_rank == self.rank and self.sent_at is None:
            self.sent_at = time.monotonic()
            os.kill(os.getpid(), signal.SIGTERM)
        return super().training_step(batch, batch_idx)


def _fit(strategy: str, ckpt_dir: str, at: int | None = None, resume: bool = False) -> dict:
    module = Stopper(at)
    trainer = Trainer(strategy=strategy, devices=2, max_steps=MAX_STEPS, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=False)])
    exit_code, elapsed = "no exit", None
    try:
        trainer.fit(module, ckpt_path="last" if resume else None)
    except SIGTERMException as exc:
        exit_code = exc.code
        elapsed = time.monotonic() - module.sent_at if module.sent_at is not None else None
    return {"params": trainer.full_state_dict(), "losses": torch.tensor(module.losses), "step": trainer.global_step,
            "seen": torch.cat(module.seen), "exit_code": exit_code, "elapsed": elapsed}


def _interrupt_and_resume(strategy: str, root: str) -> dict:
    calls: list[int] = []

    def user_handler(signum, frame):  # the user's own, on the rank that gets the signal
        calls.append(signum)

    full = _fit(strategy, os.path.join(root, "full"))
    mine = int(os.environ["RANK"]) == 1
    if mine:
        signal.signal(signal.SIGTERM, user_handler)
    first = _fit(strategy, os.path.join(root, "ck"), at=3)
    after_first = signal.getsignal(signal.SIGTERM)
    latest = str(read_latest(os.path.join(root, "ck")))
    second = _fit(strategy, os.path.join(root, "ck"), resume=True)
    return {"full": full, "first": first, "second": second, "calls": calls, "latest": latest,
            "restored": (after_first is user_handler) if mine else after_first == signal.SIG_DFL}


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_sigterm_on_one_rank_saves_on_every_rank_and_resumes_exactly(tmp_path, strategy):
    out = run_ranks("test_signals:_interrupt_and_resume", 2, tmp_path, timeout=240, strategy=strategy,
                    root=str(tmp_path))
    for r in range(2):
        full, first, second = out[r]["full"], out[r]["first"], out[r]["second"]
        assert first["exit_code"] is None  # SystemExit(): status 0 when nobody catches it
        assert first["step"] == 4  # the step in progress when the signal came completes, then the save
        assert out[r]["latest"].endswith("sigterm-step=000004")
        assert out[r]["restored"], "fit must put the previous SIGTERM handler back"
        assert second["exit_code"] == "no exit" and second["step"] == MAX_STEPS
        assert torch.equal(torch.cat([first["losses"], second["losses"]]), full["losses"])
        assert torch.equal(torch.cat([first["seen"], second["seen"]]), full["seen"])
        for k, v in full["params"].items():
            assert torch.equal(second["params"][k], v), k
    assert out[1]["calls"] == [signal.SIGTERM] and out[0]["calls"] == []  # the user's handler ran once
    assert out[1]["first"]["elapsed"] < 10 * timeout_scale()


SCRIPT = textwrap.dedent('''
    import os, sys, time
    sys.path[:0] = [{tests!r}, os.path.dirname({tests!r})]  # tests/distributed and tests/ (tolerance)
    import torch
    from toy import ToyModule
    from zerotrain import ModelCheckpoint, Trainer

    class Slow(ToyModule):
        def training_step(self, batch, batch_idx):
            if {slow} and self.trainer.global_step == 3 and not os.path.exists({marker!r} + str(self.global_rank)):
                with open({marker!r} + str(self.global_rank), "w") as f:  # the test signals rank 0 now
                    f.write(str(os.getpid()))
            if {slow}:
                time.sleep(0.3)
            return super().training_step(batch, batch_idx)

    trainer = Trainer(strategy="ddp", devices=2, max_steps=12, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[ModelCheckpoint(dirpath={ckpt!r}, save_last=False)])
    module = Slow(shuffle=True, n=96)
    trainer.fit(module, ckpt_path={ckpt_path!r})
    full = trainer.full_state_dict()
    if trainer.is_global_zero:
        torch.save(full, {result!r})
    print(f"rank {{trainer.global_rank}} finished at step {{trainer.global_step}}", flush=True)
''')


def _launch(tmp_path, name, slow, ckpt, ckpt_path=None, signal_on_marker=False, sig=signal.SIGTERM):
    marker, result = tmp_path / f"{name}.marker", tmp_path / f"{name}.pt"
    script = tmp_path / f"{name}.py"
    script.write_text(SCRIPT.format(tests=os.path.dirname(__file__), slow=slow, marker=str(marker),
                                    ckpt=str(ckpt), ckpt_path=ckpt_path, result=str(result)))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "ZEROTRAIN_LAUNCHED")}
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    sent = None
    deadline = time.monotonic() + 120 * timeout_scale()
    while signal_on_marker and sent is None and proc.poll() is None and time.monotonic() < deadline:
        if (tmp_path / f"{name}.marker0").exists() and (tmp_path / f"{name}.marker1").exists():
            proc.send_signal(sig)
            sent = time.monotonic()
        time.sleep(0.05)
    out, err = proc.communicate(timeout=180 * timeout_scale())
    elapsed = time.monotonic() - sent if sent is not None else None
    return proc.returncode, out, err, elapsed, result


@pytest.mark.slow  # ~20 s: the rank-level SIGTERM tests above run by default
def test_sigterm_to_the_launcher_stops_the_job_cleanly_and_resumes(tmp_path):
    code, out, err, elapsed, _ = _launch(tmp_path, "stopped", True, tmp_path / "ck", signal_on_marker=True)
    assert elapsed is not None, err[-3000:]
    assert code == 0, err[-3000:]
    assert elapsed < 20 * timeout_scale(), err[-3000:]
    assert "finished at step" not in out  # fit raised SIGTERMException on every rank
    assert "SIGTERM: saving a checkpoint at step" in err
    latest = read_latest(tmp_path / "ck")
    assert latest is not None and latest.name.startswith("sigterm-step=")
    code, out, err, _, resumed = _launch(tmp_path, "resumed", False, tmp_path / "ck", ckpt_path="last")
    assert code == 0, err[-3000:]
    assert "rank 0 finished at step 12" in out and "rank 1 finished at step 12" in out
    code, _, err, _, full = _launch(tmp_path, "full", False, tmp_path / "ck_full")
    assert code == 0, err[-3000:]
    a, b = torch.load(resumed, weights_only=True), torch.load(full, weights_only=True)
    for k, v in b.items():
        assert torch.equal(a[k], v), k


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet has ended)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


def test_sigkill_of_the_launcher_still_ends_its_ranks_at_once(tmp_path):
    """The ranks our launcher starts get SIGTERM when it dies (parent-death signal): that one is not
    a request to checkpoint, the rank ends at once, as before signals were handled."""
    code, _, err, _, _ = _launch(tmp_path, "killed", True, tmp_path / "ck", signal_on_marker=True,
                                 sig=signal.SIGKILL)
    assert code == -signal.SIGKILL
    child = int((tmp_path / "killed.marker1").read_text())
    deadline = time.monotonic() + 10 * timeout_scale()
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.1)
    if _alive(child):
        os.kill(child, signal.SIGKILL)
        raise AssertionError(f"rank 1 (pid {child}) outlived its launcher: {err[-2000:]}")
    assert read_latest(tmp_path / "ck") is None  # nothing was saved
