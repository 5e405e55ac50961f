"""On 2 processes under ddp and zero3: a Lightning-style module whose steps take no batch_idx,
whose training_step returns None for some batches (every rank together), with two validation
loaders (dataloader_idx) and a learning-rate warm-up in optimizer_step. Evaluation runs under
no_grad, not inference_mode, on gloo (as Lightning), and zero3's gathered forward works there."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from harness import run_ranks_once

STRATEGIES = ("ddp", "zero3")
_CACHE: dict = {}
pytestmark = pytest.mark.timeout(300)


def _loader(n: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)), batch_size=2)


def _fit(strategy: str) -> dict:
    from zerotrain import Trainer, TrainModule

    class M(TrainModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1))
            self.seen = 0
            self.val: list = []
            self.lrs: list = []
            self.inference = set()

        def training_step(self, batch):
            self.seen += 1
            if self.seen % 3 == 0:  # every rank skips the same batches
                return None
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            self.val.append(dataloader_idx)
            self.inference.add(torch.is_inference_mode_enabled())
            self.log("v", nn.functional.mse_loss(self.net(batch[0]), batch[1]))

        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
            for group in optimizer.param_groups:
                group["lr"] = 0.1 * min(1.0, (self.trainer.global_step + 1) / 4)
            self.lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step(closure=optimizer_closure)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    m = M()
    t = Trainer(strategy=strategy, devices=2, max_epochs=1, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    t.fit(m, _loader(24, 1), [_loader(8, 2), _loader(4, 3)])
    return {"step": t.global_step, "val": m.val, "lrs": m.lrs, "inference": sorted(m.inference),
            "full": t.full_state_dict()}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lightning_loop_on_two_ranks(strategy, tmp_path_factory):
    out = run_ranks_once(_CACHE, strategy, "test_lightning_loop:_fit", 2, tmp_path_factory, strategy=strategy)
    for rank in out:
        assert rank["step"] == 6  # 24 samples / 2 ranks / batch 2: 6 steps, the skipped ones counted
        assert rank["val"] == [0, 0, 1]  # 8 samples / 2 ranks / batch 2; 4 / 2 / 2
        assert rank["inference"] == [False]  # gloo: no_grad, as Lightning
        assert rank["lrs"] == pytest.approx([0.1 * min(1.0, (s + 1) / 4) for s in range(6)])  # called on skipped steps too
    assert out[0]["full"]  # rank 0 holds the full state
