"""StochasticWeightAveraging on 2 ranks under ddp, zero1 and zero2: the averaged weights end up in
the module and, under ZeRO, in the fp32 masters a checkpoint saves (``full_state_dict``);
zero3 is refused at set-up, naming the strategy."""
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from harness import run_ranks
from zerotrain import Trainer, TrainModule
from zerotrain.callbacks import Callback, StochasticWeightAveraging


class Net(TrainModule):
    def __init__(self, bn: bool):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), *([nn.BatchNorm1d(16)] if bn else []), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)), batch_size=4)


class Grab(Callback):
    """After SWA's on_train_end: what a checkpoint would save now (the masters under ZeRO)."""

    def on_train_end(self, trainer, module):
        self.full = trainer.full_state_dict()


def _fit(strategy: str, bn: bool, precision: str = "32"):
    swa, grab = StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=2), Grab()
    trainer = Trainer(strategy=strategy, devices=2, precision=precision, max_epochs=4, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[swa, grab])
    model = Net(bn)
    try:
        trainer.fit(model)
    except Exception as exc:  # the refusal, before any step
        return {"error": f"{type(exc).__name__}: {exc}"}
    avg = {k: v.clone() for k, v in swa._average_model.state_dict().items()}
    return {"module": {k: v.clone() for k, v in model.state_dict().items()}, "full": grab.full, "avg": avg,
            "n": int(swa.n_averaged)}


@pytest.mark.parametrize("bn", [False, True])
def test_swa_averages_into_the_masters_under_zero12(tmp_path, bn):
    got = {s: run_ranks("test_swa_strategies:_fit", 2, tmp_path / s, timeout=180, strategy=s, bn=bn)[0]
           for s in ("ddp", "zero1", "zero2")}
    for s, r in got.items():
        assert r["n"] == 3, s
        for k, v in r["module"].items():
            if "running" not in k and "num_batches" not in k:  # weights: exactly the average
                assert torch.equal(v, r["avg"][k]), (s, k)
            assert torch.equal(r["full"][k], v), (s, k)  # what a checkpoint saves is what the module holds
    for s in ("zero1", "zero2"):  # the same run as ddp: fp32 sums of 2 ranks' gradients in another order
        for k, v in got["ddp"]["module"].items():
            assert torch.equal(got[s]["module"][k], v), (s, k)


def test_swa_refuses_zero3(tmp_path):
    r0, r1 = run_ranks("test_swa_strategies:_fit", 2, tmp_path, timeout=120, strategy="zero3", bn=False)
    for r in (r0, r1):
        assert "strategy='zero3'" in r["error"] and "sharded" in r["error"]


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_swa_bf16_true_writes_the_average_into_the_fp32_masters(tmp_path, strategy):
    """bf16 parameters, fp32 masters: without the write-back a checkpoint would save the last
    step's masters, not the average."""
    r = run_ranks("test_swa_strategies:_fit", 2, tmp_path, timeout=180, strategy=strategy, bn=False,
                  precision="bf16-true")[0]
    for k, v in r["module"].items():
        assert torch.equal(r["full"][k].to(v.dtype), v), k
