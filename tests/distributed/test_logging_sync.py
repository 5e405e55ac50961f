"""``self.log(..., sync_dist=True)`` on 2 real processes: each reduce_fx reduces over ranks as
Lightning's does (mean, sum, max, min of the step values; the epoch mean weighted by every rank's
batch sizes), a name logged without it (or with ``rank_zero_only``) keeps each rank's own value,
and the rows the loggers get on rank 0 carry the synced values. The values are rank-dependent,
so every expected number is worked out by hand below."""
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from harness import run_ranks


def _fit(strategy: str) -> dict:
    from zerotrain import Trainer, TrainModule
    from zerotrain.callbacks.base import Logger

    class Rows(Logger):
        def __init__(self):
            self.rows = []

        def log_metrics(self, metrics, step=None):
            self.rows.append((step, dict(metrics)))

    class Synced(TrainModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            r = float(self.global_rank + 1)  # 1 on rank 0, 2 on rank 1
            self.log("s_mean", r, sync_dist=True)
            self.log("s_sum", r, reduce_fx="sum", sync_dist=True)
            self.log("s_max", r, reduce_fx="max", sync_dist=True)
            self.log("s_min", r, reduce_fx=torch.min, sync_dist=True)
            self.log("weighted", r, on_step=False, on_epoch=True, sync_dist=True, batch_size=int(r))
            self.log("e_sum", r, on_step=False, on_epoch=True, reduce_fx="sum", sync_dist=True)
            self.log("local", r, on_step=False, on_epoch=True)
            self.log("zero_only", r, sync_dist=True, rank_zero_only=True)
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            return DataLoader(TensorDataset(torch.randn(8, 2, generator=g), torch.randn(8, 1, generator=g)),
                              batch_size=2)

    rows = Rows()
    trainer = Trainer(strategy=strategy, devices=2, accelerator="cpu", max_epochs=1, log_every_n_steps=1,
                      logger=rows, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)
    trainer.fit(Synced())
    return {"callback": {k: float(v) for k, v in trainer.callback_metrics.items()}, "rows": rows.rows}


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_sync_dist_reduces_over_ranks_as_each_reduce_fx(tmp_path, strategy):
    r0, r1 = run_ranks("test_logging_sync:_fit", 2, tmp_path, timeout=120, strategy=strategy)
    synced = {"s_mean": 1.5, "s_sum": 3.0, "s_max": 2.0, "s_min": 1.0,
              "weighted": (1 * 1 + 2 * 2) / 3,  # each rank's value times its batch size, over both
              "e_sum": 2 * (1 + 2)}  # 2 batches per rank, summed over the epoch and the ranks
    for rank, out in enumerate((r0, r1)):
        got = out["callback"]
        for name, value in synced.items():
            # tolerance: exact: small-integer operands (exact in fp32), one division rounding once = fp32(value)
            assert got[name] == float(torch.tensor(value, dtype=torch.float32)), (rank, name)
        assert got["local"] == rank + 1 and got["zero_only"] == rank + 1  # not synced
    assert r1["rows"] == []  # only global rank 0 writes rows
    steps = [s for s, m in r0["rows"] if "s_mean" in m]
    assert steps == [0, 1]  # 8 samples / 2 ranks / batch 2: 2 steps
    epoch_row = next(m for s, m in r0["rows"] if "weighted" in m)
    # tolerance: exact: 10 / 6 from integer sums, one fp32 rounding (as above)
    assert epoch_row["weighted"] == float(torch.tensor(5 / 3, dtype=torch.float32)) and epoch_row["epoch"] == 0
