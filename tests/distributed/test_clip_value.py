"""``Trainer(gradient_clip_algorithm="value")`` on 2 real processes: each rank clamps only the
gradient it steps on (its partition under zero1/2/3 and offload, whose host copies are clamped),
which equals clamping the full gradient because clamping is element-wise. The trained weights
equal one process of plain PyTorch with ``clip_grad_value_`` over the global batches."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from harness import run_ranks
from tolerance import assert_no_worse_than_peer, backward_as_ranks
from toy import build_net, global_batches, make_data

N, BS, STEPS, CLIP = 32, 4, 3, 0.002
QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def _module():
    from zerotrain import TrainModule

    class Net(TrainModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = build_net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.01)

    return Net()


def _case(strategy: str):
    from zerotrain import Trainer

    module = _module()
    trainer = Trainer(strategy=strategy, devices=2, accelerator="cpu", max_steps=STEPS, gradient_clip_val=CLIP,
                      gradient_clip_algorithm="value", **QUIET)
    trainer.fit(module, DataLoader(make_data(N), batch_size=BS))
    return trainer.full_state_dict()


def _reference(as_ranks: int = 0) -> dict:
    """``as_ranks=k``: the peer, each gradient summed as torch DDP sums it on k ranks."""
    module = _module()
    opt = module.configure_optimizers()
    x, y = make_data(N).tensors
    # the loader does not shuffle, yet the training DistributedSampler does, as Lightning's (seed 0, epoch 0)
    for step, idx in enumerate(global_batches(N, 2, BS)[:STEPS]):
        opt.zero_grad()
        if as_ranks:  # the global batch interleaved by rank: rank r's shard is every 2nd sample from r
            batch = (x[idx], y[idx])
            backward_as_ranks(module.parameters(), [batch], lambda b: module.training_step(b, step), as_ranks)
        else:
            module.training_step((x[idx], y[idx]), step).backward()
        assert max(float(p.grad.abs().max()) for p in module.parameters()) > CLIP  # the clamp binds
        torch.nn.utils.clip_grad_value_(module.parameters(), CLIP)
        opt.step()
    return module.state_dict()


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("zero1", marks=pytest.mark.slow), "zero2", "zero3",
                                      pytest.param("offload_cpu", marks=pytest.mark.slow)])
def test_value_clipping_on_two_ranks_equals_pytorch(tmp_path, strategy):
    got = run_ranks("test_clip_value:_case", 2, tmp_path, timeout=180, strategy=strategy)[0]
    # tolerance: no worse than torch DDP's order of the same sums (tolerance.PEER_FACTOR x its error + 4 ulps)
    assert_no_worse_than_peer(got, _reference(), _reference(as_ranks=2))
