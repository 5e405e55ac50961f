"""Signals on one process: where the checkpoint goes without a ModelCheckpoint, a signal after the
last step, SIGUSR1 under SLURM (save, then ``scontrol requeue``), and a fit outside the main thread
(no handler can be installed there: it trains as before)."""
from __future__ import annotations

import os
import signal
import stat
import threading

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zerotrain import Trainer, TrainModule
from zerotrain.trainer.checkpoint import single_file as checkpoint_file, directory as checkpoint_io
from zerotrain.trainer.launch.signals import SIGTERMException, handled_signals, slurm_job_id


class Net(TrainModule):
    def __init__(self, send: int | None = None, at: int = 2, in_train_end: bool = False):
        super().__init__()
        self.lin = nn.Linear(3, 1)
        self.send, self.at, self.in_train_end = send, at, in_train_end

    def training_step(self, batch, batch_idx):
        if self.send and not self.in_train_end and self.trainer.global_step == self.at:
            os.kill(os.getpid(), self.send)
            self.send = None
        return self.lin(batch[0]).pow(2).mean()

    def on_train_end(self):
        if self.send and self.in_train_end:
            os.kill(os.getpid(), self.send)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(40, 3)), batch_size=4)


def _trainer(tmp_path, **kwargs) -> Trainer:
    return Trainer(max_steps=6, logger=False, enable_progress_bar=False, enable_model_summary=False,
                   default_root_dir=str(tmp_path), **kwargs)


def test_without_a_model_checkpoint_it_saves_under_default_root_dir(tmp_path):
    trainer = _trainer(tmp_path, enable_checkpointing=False)
    with pytest.raises(SIGTERMException) as info:
        trainer.fit(Net(send=signal.SIGTERM))
    assert info.value.code is None and trainer.global_step == 3
    assert checkpoint_io.read_latest(tmp_path / "checkpoints").name == "sigterm-step=000003"
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_signal_after_the_last_step_ends_the_process_after_a_complete_fit(tmp_path):
    trainer = _trainer(tmp_path)
    with pytest.raises(SIGTERMException):
        trainer.fit(Net(send=signal.SIGTERM, in_train_end=True))
    assert trainer.global_step == 6
    assert checkpoint_file.newest(tmp_path / "checkpoints").name == "epoch=0-step=6.ckpt"  # the epoch-end save only


def test_sigusr1_under_slurm_saves_and_requeues(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "scontrol"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'scontrol.args'}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    assert signal.SIGUSR1 in handled_signals()
    trainer = _trainer(tmp_path)
    with pytest.raises(SIGTERMException):
        trainer.fit(Net(send=signal.SIGUSR1))
    assert checkpoint_io.read_latest(tmp_path / "checkpoints").name == "sigusr1-step=000003"
    assert (tmp_path / "scontrol.args").read_text().split() == ["requeue", "4242"]
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert slurm_job_id() == "77_3"


def test_no_sigusr1_handler_outside_slurm(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert handled_signals() == [signal.SIGTERM]


def test_fit_outside_the_main_thread_installs_nothing(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    done = []
    thread = threading.Thread(target=lambda: done.append(_trainer(tmp_path).fit(Net()) or True))
    thread.start()
    thread.join(120)
    assert done == [True] and signal.getsignal(signal.SIGTERM) is before


@pytest.mark.timeout(60)
def test_a_sigterm_repeated_before_the_step_boundary_ends_the_process(tmp_path):
    """A rank stuck inside its step never reaches the boundary where the first SIGTERM is acted
    on; one that comes 5 s or more later ends it at once (a fresh process: it dies of the signal).
    The same signal delivered twice at once (to the process group, and forwarded) does not."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent('''
        import os, signal, sys, time, types
        from zerotrain.trainer.launch.signals import SignalCheckpoint
        handler = SignalCheckpoint(types.SimpleNamespace(global_rank=0, _launcher=None))
        handler.install()
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # the same signal delivered twice (group and forward)
        time.sleep(0.2)
        print("after the first: received", handler.received, flush=True)  # recorded, still running
        time.sleep(5)
        os.kill(os.getpid(), signal.SIGTERM)  # asked again, 5 s later: the step never ended
        time.sleep(5)
        print("still alive", flush=True)
    ''')
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, cwd=tmp_path)
    assert f"after the first: received {int(signal.SIGTERM)}" in proc.stdout, proc.stdout + proc.stderr
    assert "still alive" not in proc.stdout and proc.returncode == -signal.SIGTERM, (proc.returncode, proc.stderr)
    assert "rank 0: SIGTERM again, 5 s or more after the first, and no step boundary came; ending now" in proc.stderr
