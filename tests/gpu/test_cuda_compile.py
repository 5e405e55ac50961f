"""``Trainer(compile=...)`` on one GPU (skipped without one; ``bench/gpu_check.sh`` runs it): zero3 and
zero2 with the blocks compiled by inductor (Triton kernels) against eager plain PyTorch on the GPU,
fp32, 4 AdamW steps.

# tolerance: no worse than the peer: plain PyTorch with the whole model compiled by inductor
# (what a torch user runs) against the same eager reference (``assert_no_worse_than_peer``)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zerotrain import Callback, Trainer, TrainModule

from tolerance import assert_no_worse_than_peer  # tests/ is on sys.path (conftest)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
STEPS, D = 4, 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, D), nn.Sequential(*(Block() for _ in range(3))), nn.Linear(D, 1))


def batches() -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)) for _ in range(STEPS)]


class Module(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = build()

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Losses(Callback):
    def __init__(self) -> None:
        self.losses = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))


def plain(compiled: bool) -> tuple[list[float], dict]:
    net = build().cuda()
    run = torch.compile(net) if compiled else net
    opt, losses = torch.optim.AdamW(net.parameters(), lr=1e-2), []
    for x, y in batches():
        loss = F.mse_loss(run(x.cuda()), y.cuda())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, {k: v.detach().cpu() for k, v in net.state_dict().items()}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_compiled_blocks_on_the_gpu_equal_eager(strategy):
    torch._dynamo.reset()
    rec = Losses()
    trainer = Trainer(accelerator="cuda", devices=1, strategy=strategy, max_steps=STEPS, compile=True,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, callbacks=[rec])
    trainer.fit(Module(), train_dataloaders=batches())
    assert trainer.strategy.compiled.names == ["net.1.0", "net.1.1", "net.1.2"]
    graphs = trainer.strategy.compile.stats.graphs
    (want, want_p), (peer, peer_p) = plain(False), plain(True)
    got_p = {k.removeprefix("net."): v.cpu() for k, v in trainer.full_state_dict().items()}
    assert_no_worse_than_peer(torch.tensor(rec.losses), torch.tensor(want), torch.tensor(peer), "losses ")
    assert_no_worse_than_peer(got_p, want_p, peer_p)
    assert graphs == 1  # one graph for the three blocks, compiled once
