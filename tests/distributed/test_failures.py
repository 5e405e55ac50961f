"""Faults end the job within seconds and say what happened: a stalled rank (progress watchdog),
a rank-0-only forward under zero3, a rank killed by a signal, a non-finite loss, an empty loader.

Each case runs a real 2-process job (our launcher, or torchrun) of a small script and checks the
exit status, the time it took and the message."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from zerotrain.trainer.launch.watchdog import STALL_EXIT_CODE, Progress, find_stuck

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent('''
    import os, signal, sys, time
    sys.path.insert(0, {tests!r}); sys.path.insert(0, os.path.join({tests!r}, "distributed"))
    import torch
    from toy import ToyModule
    from zerotrain import Trainer
    from zerotrain.callbacks.base import Callback

    FAULT, AT_STEP = {fault!r}, 3

    def announce(what):
        sys.stderr.write(f"FAULT {{what}} rank {{int(os.environ.get('RANK', 0))}} at {{time.time():.3f}}\\n")
        sys.stderr.flush()

    class Faulty(ToyModule):
        def training_step(self, batch, batch_idx):
            step, rank = self.trainer.global_step, self.trainer.global_rank
            if step == (0 if FAULT == "sleep_first" else AT_STEP) and rank == 1:
                if FAULT in ("sleep", "sleep_first"):
                    announce(FAULT)
                    time.sleep(600)
                if FAULT == "sigkill":
                    announce("sigkill")
                    os.kill(os.getpid(), signal.SIGKILL)
                if FAULT == "exit0":  # a script that ends early on one rank, status 0
                    announce("exit0")
                    os._exit(0)
                if FAULT == "exit3":  # a rank's own exit status, which the job must end with
                    announce("exit3")
                    os._exit(3)
            loss = super().training_step(batch, batch_idx)
            if FAULT == "nan" and step == AT_STEP and rank == 1:
                announce("nan")
                loss = loss * float("nan")
            return loss

    class RankZeroForward(Callback):  # the classic ZeRO-3 trap: a forward on rank 0 alone
        def on_train_batch_end(self, trainer, module, out, batch, batch_idx):
            if FAULT == "rank0_forward" and trainer.global_step == AT_STEP and trainer.is_global_zero:
                announce("rank0_forward")
                with torch.no_grad():
                    for _ in range(50):
                        module.net(torch.randn(2, 12))

    trainer = Trainer(strategy={strategy!r}, devices=2, max_steps=8, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, callbacks=[RankZeroForward()], **{kwargs!r})
    trainer.fit(Faulty())
    full = trainer.full_state_dict()  # collective: every rank calls it
    print(f"rank {{trainer.global_rank}} done: step {{trainer.global_step}} skipped {{trainer.state.skipped_steps}} "
          f"params {{sum(float(p.double().sum()) for p in full.values()):.12e}}", flush=True)
''')


def _env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "ZEROTRAIN_LAUNCHED", "MASTER_ADDR",
            "MASTER_PORT", "TORCHELASTIC_RUN_ID")
    return {k: v for k, v in os.environ.items() if k not in drop}


def run_job(tmp_path, fault: str, strategy: str = "ddp", launcher: str = "local", timeout: float = 150,
            **kwargs):
    """Run the script; returns (process, seconds from the fault's announcement to the job's end)."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT.format(tests=TESTS, fault=fault, strategy=strategy, kwargs=kwargs))
    cmd = [sys.executable, str(script)]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--monitor-interval", "0.5", str(script)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=timeout)
    end = time.time()
    m = re.search(r"FAULT \S+ rank \d at ([0-9.]+)", proc.stderr)
    return proc, (end - float(m.group(1))) if m else None


# ---------------------------------------------------------------------------------------------- unit


def test_find_stuck_names_the_idle_rank_behind_the_others():
    busy, idle = 1.0, 30.0
    assert find_stuck({0: Progress(10, 3, "backward", busy), 1: Progress(10, 3, "backward", busy)}, 20) is None
    # everybody idle at the same point: slow work (a long NVMe step), not a stall
    assert find_stuck({0: Progress(10, 3, "optimizer_step", idle), 1: Progress(10, 3, "optimizer_step", idle)},
                      20) is None
    # rank 1 idle behind rank 0, which waits in a collective it issued
    assert find_stuck({0: Progress(11, 3, "all_reduce", idle), 1: Progress(10, 3, "training_step", idle)}, 20) == 1
    assert find_stuck({0: Progress(9, 3, "on_train_batch_end", idle), 1: Progress(14, 4, "all_gather", idle),
                       2: Progress(14, 4, "all_gather", idle)}, 20) == 0
    # behind and idle for long, but the rank ahead issued its collective only 2 s ago (a pipeline
    # stage still in its last backward of a long schedule, the other already at the step's
    # all-reduce): slow work, not yet a stall
    assert find_stuck({0: Progress(10, 3, "training_step", idle), 1: Progress(11, 3, "all_reduce", 2.0)}, 20) is None
    # behind, but not yet idle for long enough
    assert find_stuck({0: Progress(11, 3, "all_reduce", idle), 1: Progress(10, 3, "training_step", 5.0)}, 20) is None
    assert Progress.decode(Progress(7, 2, "x|y", 1.5).encode()) == Progress(7, 2, "x|y", 1.5)
    assert Progress.decode(Progress(7, 0, "x", 1.5, False).encode()) == Progress(7, 0, "x", 1.5, False)


def test_the_watchdog_exit_code_is_its_own():
    """Not timeout(1)'s (124; 125-127; 137 = 128 + SIGKILL for its -k), nor a signal's 128 + n,
    Python's 1 / 120, the CLI's configuration error 2, or a sysexits.h code (64-78)."""
    taken = {0, 1, 2, 120, 124, 125, 126, 127, 255, *range(64, 79), *range(128, 193)}
    assert STALL_EXIT_CODE not in taken and 0 < STALL_EXIT_CODE < 256


def test_before_its_first_step_a_rank_gets_the_longer_allowance():
    ahead = Progress(5, 0, "all_reduce", 30.0)
    behind = Progress(4, 0, "training_step", 30.0, warm=False)
    assert find_stuck({0: ahead, 1: behind}, 20) == 1  # without a first-step allowance: 20 s
    assert find_stuck({0: ahead, 1: behind}, 20, 60) is None  # 30 s of its 60 s
    assert find_stuck({0: ahead._replace(idle_s=61.0), 1: behind._replace(idle_s=61.0)}, 20, 60) == 1
    assert find_stuck({0: ahead, 1: behind._replace(warm=True)}, 20, 60) == 1  # warm: 20 s again


# ---------------------------------------------------------------------------------------------- stalls


@pytest.mark.timeout(200)
#: each strategy and launcher once; the default run keeps zero3 under torchrun (the others are
#: `slow`: 4 minutes of sleeping ranks; ddp under our launcher waits the default 20 s timeout)
@pytest.mark.parametrize("strategy,launcher", [
    ("zero3", "torchrun"),
    *(pytest.param(s, launcher, marks=pytest.mark.slow)
      for s, launcher in (("ddp", "local"), ("zero3", "local"), ("zero2", "local"), ("ddp", "torchrun"),
                          ("zero2", "torchrun")))],
    ids=lambda v: v)
def test_a_rank_sleeping_in_training_step_ends_the_job_naming_it(tmp_path, strategy, launcher):
    # the default timeout (20 s) once per launcher, a shorter one for the other cases
    kwargs = {} if strategy == "ddp" else {"stall_timeout_s": 8.0}
    proc, after_fault = run_job(tmp_path, "sleep", strategy, launcher, **kwargs)
    err = proc.stderr
    assert proc.returncode != 0, err[-3000:]
    assert "rank 1 made no progress" in err, err[-3000:]
    assert "last step 3, in training_step" in err
    assert "Stack of rank 1:" in err and "time.sleep(600)" in err  # its own Python stack
    assert after_fault is not None and after_fault < 30, (after_fault, err[-3000:])
    if launcher == "local":
        assert f"rank 1 was ended by the progress watchdog (exit code {STALL_EXIT_CODE}" in err
        assert proc.returncode == STALL_EXIT_CODE, proc.returncode


@pytest.mark.slow  # 25 s; the default suite keeps the rank stuck in training_step (15-minute budget)
@pytest.mark.timeout(120)
def test_a_rank_stuck_before_its_first_step_ends_the_job_naming_it(tmp_path):
    """Before the first optimizer step the watchdog allows 6x stall_timeout_s (12 s here); the
    job used to wait for the process group's timeout (5 minutes), naming no rank."""
    proc, after_fault = run_job(tmp_path, "sleep_first", stall_timeout_s=2.0)
    err = proc.stderr
    assert proc.returncode != 0, err[-3000:]
    assert "rank 1 made no progress" in err and "last step 0, in training_step, before its first optimizer step" \
        in err, err[-3000:]
    assert "Stack of rank 1:" in err and "time.sleep(600)" in err
    assert after_fault is not None and 12 <= after_fault < 40, (after_fault, err[-3000:])


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_rank_zero_only_forward_under_zero3_ends_with_the_hint(tmp_path):
    proc, after_fault = run_job(tmp_path, "rank0_forward", "zero3", stall_timeout_s=8.0)
    err = proc.stderr
    assert proc.returncode != 0, err[-3000:]
    assert "made no progress" in err and "Stack of rank" in err, err[-3000:]
    assert "hint: under zero3 every forward gathers parameters collectively" in err
    assert after_fault is not None and after_fault < 30, (after_fault, err[-3000:])


# ---------------------------------------------------------------------------------------------- deaths


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault,said", [
    ("sigkill", "rank 1 was killed by signal 9 (SIGKILL)"),
    # a script that ends early on one rank, with status 0, while rank 0 is still training
    ("exit0", "rank 1 had exited with code 0 before rank 0's fit ended"),
    pytest.param("exit3", "rank 1 exited with code 3", marks=pytest.mark.slow)])
def test_a_rank_that_leaves_is_reported_by_name(tmp_path, fault, said):
    proc, after_fault = run_job(tmp_path, fault)
    # the rank's own status: it lost the race to rank 0's gloo error ("Connection reset"), exit 1
    assert proc.returncode == (3 if fault == "exit3" else 1), (proc.returncode, proc.stderr[-3000:])
    assert said in proc.stderr, proc.stderr[-3000:]
    assert after_fault is not None and after_fault < 30


# ---------------------------------------------------------------------------------------------- losses


@pytest.mark.timeout(120)
def test_nan_loss_raises_naming_step_and_rank(tmp_path):
    proc, after_fault = run_job(tmp_path, "nan")
    err = proc.stderr
    assert proc.returncode != 0
    assert "NonFiniteLossError: rank 1: the training loss is nan at step 3" in err, err[-3000:]
    assert after_fault is not None and after_fault < 30


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.slow), pytest.param("zero2", marks=pytest.mark.slow)])
def test_nan_loss_skip_drops_the_step_on_every_rank(tmp_path, strategy):
    proc, _ = run_job(tmp_path, "nan", strategy, on_nonfinite="skip")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 1: the training loss is nan at step 3" in proc.stderr
    for rank in (0, 1):
        assert f"rank {rank} done: step 8 skipped 1" in proc.stdout, proc.stdout
    total = float(re.search(r"rank 0 done: .* params (\S+)", proc.stdout).group(1))
    assert total == total  # finite weights saved, not nan


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_nan_loss_warn_trains_on(tmp_path):
    proc, _ = run_job(tmp_path, "nan", on_nonfinite="warn")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "training goes on (on_nonfinite='warn')" in proc.stderr
    assert "rank 1 done: step 8 skipped 0" in proc.stdout
