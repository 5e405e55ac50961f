"""The Trainer refuses what would spin forever or silently differ: an empty training loader, limits
and intervals out of range, unknown policies; and it leaves the user's thread count alone."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from zerotrain import Trainer, TrainModule
from zerotrain.trainer.errors import ConfigError
from zerotrain.trainer.loop.trainer import NonFiniteLossError


class Tiny(TrainModule):
    def __init__(self, loader=None, nan_at: int | None = None):
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.loader, self.nan_at = loader, nan_at

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.trainer.global_step == self.nan_at:
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return self.loader


def _data(n: int) -> TensorDataset:
    return TensorDataset(torch.randn(n, 4), torch.randn(n, 1))


def _trainer(**kw) -> Trainer:
    kw.setdefault("max_steps", 5)
    return Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, **kw)


class Nothing(IterableDataset):
    def __iter__(self):
        return iter(())


@pytest.mark.timeout(30)
def test_an_empty_map_style_loader_fails_at_once_naming_its_length():
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"training loader has no batch \(len\(train_dataloader\)=0"):
        _trainer().fit(Tiny(DataLoader(_data(0), batch_size=4)))
    assert time.monotonic() - t0 < 10


@pytest.mark.timeout(30)
def test_an_iterable_loader_that_yields_nothing_fails_at_once():
    with pytest.raises(ConfigError, match=r"\(DataLoader\) yielded no batch in epoch 0"):
        _trainer().fit(Tiny(DataLoader(Nothing(), batch_size=4)))


@pytest.mark.parametrize("kwargs, field", [
    ({"limit_train_batches": -3}, "limit_train_batches=-3"),
    ({"limit_train_batches": 1.5}, "limit_train_batches=1.5"),
    ({"limit_val_batches": -1}, "limit_val_batches=-1"),
    ({"val_check_interval": 0}, "val_check_interval=0"),
    ({"val_check_interval": -2}, "val_check_interval=-2"),
    ({"on_nonfinite": "ignore"}, "on_nonfinite='ignore'; valid choices: raise, skip, warn"),
    ({"stall_timeout_s": 0}, "stall_timeout_s=0"),
    # not finite, not a number, a bool: each used to pass the > 0 check and fail after launch
    ({"stall_timeout_s": float("nan")}, "stall_timeout_s=nan must be a finite number > 0"),
    ({"stall_timeout_s": "5"}, "stall_timeout_s='5' must be a finite number > 0"),
    ({"collective_timeout_s": float("inf")}, "collective_timeout_s=inf must be a finite number > 0"),
    ({"gradient_clip_val": float("nan")}, "gradient_clip_val=nan must be a finite number >= 0"),
    ({"gradient_clip_val": True}, "gradient_clip_val=True must be a finite number >= 0"),
])
def test_out_of_range_settings_are_rejected_naming_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=f"Trainer: {field}".replace("(", r"\(").replace(".", r"\.")):
        _trainer(**kwargs)


def test_limit_val_batches_zero_is_allowed():
    _trainer(limit_val_batches=0, stall_timeout_s=None)


@pytest.mark.timeout(30)
def test_nan_loss_raises_naming_rank_and_step_single_process():
    with pytest.raises(NonFiniteLossError, match="rank 0: the training loss is nan at step 2"):
        _trainer().fit(Tiny(DataLoader(_data(64), batch_size=4), nan_at=2))


@pytest.mark.timeout(30)
def test_nan_loss_skip_leaves_the_weights_as_they_were():
    def run(max_steps, **kw):
        torch.manual_seed(0)
        module = Tiny(DataLoader(_data(64), batch_size=4), **kw)
        trainer = _trainer(max_steps=max_steps, on_nonfinite="skip", seed=0)
        trainer.fit(module)
        return trainer, [p.detach().clone() for p in module.parameters()]

    trainer, skipped = run(3, nan_at=2)  # the last step's loss is nan: that step is dropped
    assert trainer.state.skipped_steps == 1 and trainer.global_step == 3
    _, two_steps = run(2)
    for a, b in zip(skipped, two_steps):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.timeout(60)
def test_the_users_thread_count_is_kept(tmp_path):
    script = tmp_path / "threads.py"
    script.write_text(textwrap.dedent(f'''
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import torch
        from torch.utils.data import DataLoader
        from test_trainer_guards import Tiny, _data, _trainer
        torch.set_num_threads(1)
        t = _trainer(max_steps=2)
        t.fit(Tiny(DataLoader(_data(16), batch_size=4)))
        print("threads", torch.get_num_threads())
    '''))
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "threads 1" in out.stdout


@pytest.mark.parametrize("value", [float("inf"), float("nan"), "x", True, 0])
def test_a_strategy_timeout_must_be_a_finite_number_of_seconds(value):
    from zerotrain.strategies.zero import ZeroStage2

    with pytest.raises(ValueError, match=r"process_group_timeout_s=.* must be a finite number > 0"):
        ZeroStage2(process_group_timeout_s=value)


@pytest.mark.parametrize("kwargs, match", [
    ({"strategy": "single", "devices": 2}, "strategy='single' runs one process but 2 were requested"),
    ({"devices": 2, "strategy_stages": 3},
     "world_size=2 is not a multiple of stages=3"),
    ({"val_check_interval": "abc"}, "val_check_interval='abc'; valid: an int"),
    ({"val_check_interval": True}, "val_check_interval=True; valid: an int"),
    ({"default_root_dir": "/proc/zt"}, "default_root_dir='/proc/zt' is under /proc"),
    ({"default_root_dir": 123}, "default_root_dir=123 must name a directory"),
])
def test_settings_that_failed_after_the_ranks_started_are_refused_at_construction(kwargs, match):
    from zerotrain.strategies.pipeline import PipelineStrategy

    if kwargs.pop("strategy_stages", None):
        kwargs["strategy"] = PipelineStrategy(stages=3)
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace(")", r"\)")):
        Trainer(**kwargs)
