"""TensorBoard event files hold the logged scalars (read back with tensorboard's reader)."""
import os

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader

from toy import ToyModule, make_data
from zerotrain import LearningRateMonitor, TensorBoardLogger, ThroughputMonitor, Trainer


def test_event_files_hold_logged_scalars(tmp_path):
    tb = TensorBoardLogger(str(tmp_path / "logs"))
    thr = ThroughputMonitor(window=2)
    trainer = Trainer(devices=1, max_steps=6, log_every_n_steps=2, val_check_interval=3, logger=tb,
                      callbacks=[LearningRateMonitor(), thr], enable_checkpointing=False,
                      enable_progress_bar=False, default_root_dir=str(tmp_path))
    module = ToyModule()
    trainer.fit(module, val_dataloaders=DataLoader(make_data(32), batch_size=8))
    files = os.listdir(tb.log_dir)
    assert any(f.startswith("events.out.tfevents") for f in files)
    acc = EventAccumulator(tb.log_dir)
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in ("train_loss", "val_loss", "lr-AdamW/pg1", "lr-AdamW/pg2", "throughput/samples_per_sec"):
        assert tag in tags, tags
    # Lightning's steps: a row carries the global_step the batch was trained at (the steps before
    # it), so every 2nd step is logged at 1, 3, 5 and the validation after steps 3 and 6 at 2, 5
    # (tests/unit/test_logging.py compares these rows with pytorch-lightning's own)
    assert [e.step for e in acc.Scalars("train_loss")] == [1, 3, 5]
    assert [e.step for e in acc.Scalars("val_loss")] == [2, 5]
    # tolerance: exact: the event file holds the logged fp32 value itself
    assert acc.Scalars("val_loss")[-1].value == float(torch.as_tensor(trainer.callback_metrics["val_loss"]).float())
    assert thr.last["throughput/samples_per_sec"] > 0
