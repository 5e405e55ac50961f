"""Clipping by norm under ZeRO-1/2/3 and offload rounds exactly as ``torch.nn.utils.clip_grad_norm_``
in one plain process: per-parameter norms, then the norm of those in the optimizer's order
(``strategies/zero/comm/grad_norm.py``), also for parameters cut by a partition boundary.

Every rank's gradient is the same constant tensor ``c`` (the loss is linear in the parameters) with
few mantissa bits, so the averaged gradient (sum over ranks, then divide) is ``c`` exactly on 2 and 3
ranks; step 0 clips with a bound that does not bind and checks that (the parameters after it equal
the reference's bit for bit). The later steps bind: the clip norm and the updated parameters must be
bit-identical to the reference. A squared sum over partitions (the old way) rounds differently."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from harness import run_ranks

SHAPES = [(33, 17), (129,), (40, 25), (7,), (300,), (5, 61)]
CLIPS = [1e9, 0.5, 2.0, 10.0, 25.0, 45.0]  # step 0 does not bind, the others do (norms ~48)
LR = 0.125
QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def _consts(step: int) -> list[torch.Tensor]:
    """Step ``step``'s gradients, with 12 mantissa bits: 3c is exact in fp32, so the 3-rank average
    is c. A new draw each step: the old partition-wise squared sum rounds differently from torch's
    order on some of them for every strategy and world size here."""
    g = torch.Generator().manual_seed(step)
    out = []
    for s in SHAPES:
        m, e = torch.frexp(torch.randn(s, generator=g))
        out.append(torch.ldexp(torch.round(m * 4096) / 4096, e))
    return out


def _module():
    from zerotrain import TrainModule

    class Linear(TrainModule):
        def __init__(self) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.ps = nn.ParameterList([nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES])
            self.c = [_consts(k) for k in range(len(CLIPS))]
            self.norms: list[float] = []

        def forward(self, x):
            return sum((p * c).sum() for p, c in zip(self.ps, self.c[self.global_step])) + 0 * x.sum()

        def training_step(self, batch, batch_idx):
            return self(batch[0])

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            self.clip_gradients(optimizer, gradient_clip_val=CLIPS[self.global_step], gradient_clip_algorithm="norm")

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.norms.append(float(self.trainer.strategy.last_grad_norm))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    return Linear()


def _case(strategy: str, world: int):
    from zerotrain import Trainer

    module = _module()
    trainer = Trainer(strategy=strategy, devices=world, accelerator="cpu", max_steps=len(CLIPS), **QUIET)
    trainer.fit(module, DataLoader(TensorDataset(torch.zeros(4 * world, 1)), batch_size=1))
    s = trainer.strategy
    layouts = [u.layout for u in s.units] if hasattr(s, "units") else [fg.layout for fg in s.flat_groups]
    cut = sum(len(lay.pieces_of(i)) > 1 for lay in layouts for i in range(len(lay.spans)))
    return {"params": trainer.full_state_dict(), "norms": torch.tensor(module.norms, dtype=torch.float64),
            "cut": cut}


def _reference(steps: int) -> tuple[dict, list[float]]:
    module = _module()
    opt = module.configure_optimizers()
    norms = []
    for step, clip in enumerate(CLIPS[:steps]):
        opt.zero_grad()
        (sum((p * c).sum() for p, c in zip(module.ps, module.c[step]))).backward()
        assert all(torch.equal(p.grad, c) for p, c in zip(module.ps, module.c[step]))
        norms.append(float(torch.nn.utils.clip_grad_norm_(module.parameters(), clip)))
        opt.step()
    return module.state_dict(), norms


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "offload_cpu"])
def test_clip_norm_equals_pytorch_bit_for_bit(tmp_path, strategy, world):
    got = run_ranks("test_clip_norm_exact:_case", world, tmp_path, timeout=180, strategy=strategy, world=world)
    ref, ref_norms = _reference(len(CLIPS))
    assert all(c < n for c, n in zip(CLIPS[1:], ref_norms[1:])) and ref_norms[0] < CLIPS[0]  # binds where meant to
    for r, out in enumerate(got):
        assert out["cut"] >= 1, "no parameter straddles a partition boundary: the test would miss that path"
        # tolerance: exact: every rank's norm is torch's clip_grad_norm_ on the same gradients, in the same order
        assert out["norms"].tolist() == ref_norms, f"rank {r}"
    params = got[0]["params"]
    for k, v in ref.items():
        # tolerance: exact: the averaged gradients are bit-identical to the reference's (step 0 checks it), so torch's norm order gives the same bits
        assert torch.equal(params[k], v), k
