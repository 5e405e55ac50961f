"""The CUDA paths on one GPU (skipped without one; run on a lent GPU machine, see
bench/RESULTS.md "GPU checks"): every ZeRO stage against plain PyTorch on the GPU in fp32, the
offload stepper's GPU path (``DeviceWorking``: gradients streamed to pinned host memory during
backward, the fused CPU Adam, working values uploaded back) against ZeRO-2 on the GPU in fp32,
bf16-mixed and fp16 (the host gradients still carry the loss scale), and a whole ``Trainer.fit``
with ``accelerator="cuda"``."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from zerotrain.strategies.environment import ProcessInfo
from zerotrain.strategies.offload import Offload
from zerotrain.strategies.precision import BF16Mixed, DynamicLossScaler, FP16Mixed, Precision
from zerotrain.strategies.zero import ZeroStage1, ZeroStage2, ZeroStage3
from zerotrain.trainer.api.module import TrainModule

from tolerance import assert_no_worse_than_peer, nudge_one_ulp, rel_err  # tests/ is on sys.path (conftest)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
CUDA = torch.device("cuda", 0)


class Net(TrainModule):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
                                     for _ in range(3)])
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.ndim >= 2]
        rest = [p for p in self.parameters() if p.ndim < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                  {"params": rest, "weight_decay": 0.0}], lr=3e-3)


def batches(n: int = 6):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=g).to(CUDA), torch.randn(16, 4, generator=g).to(CUDA))
            for _ in range(n)]


def run_strategy(strategy, precision=None, clip=0.5):
    module = Net()
    strategy.connect(ProcessInfo(), CUDA, precision or Precision())
    strategy.setup_environment()
    strategy.configure_model(module)
    strategy.setup_module(module)
    strategy.setup_optimizer(module.configure_optimizers())
    losses = []
    for i, b in enumerate(batches()):
        loss = strategy.training_step(b, i)
        strategy.backward(loss)
        strategy.optimizer_step(clip)
        losses.append(float(loss.detach()))
    full = strategy.full_state_dict()
    return torch.tensor(losses), torch.cat([v.float().reshape(-1).cpu() for v in full.values()])


def run_plain(clip=0.5, nudge_seed=None):
    """Plain PyTorch on the GPU. ``nudge_seed``: the peer, each parameter one fp32 ulp up or down after
    every step (tolerance.nudge_one_ulp), a step as valid as AdamW's own (it rounds each element)."""
    module = Net().to(CUDA)
    opt = module.configure_optimizers()
    gen = torch.Generator().manual_seed(nudge_seed or 0)
    losses = []
    for i, b in enumerate(batches()):
        loss = module.training_step(b, i)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        opt.step()
        if nudge_seed is not None:
            nudge_one_ulp(list(module.parameters()), gen)
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return torch.tensor(losses), torch.cat([v.float().reshape(-1).cpu() for v in module.state_dict().values()])


@pytest.mark.parametrize("make", [ZeroStage1, ZeroStage2, ZeroStage3], ids=["zero1", "zero2", "zero3"])
def test_zero_stage_on_gpu_equals_plain_pytorch(make):
    ref_losses, ref = run_plain()
    peer_losses, peer = run_plain(nudge_seed=0)
    losses, got = run_strategy(make())
    # tolerance: no worse than plain PyTorch with each step's parameters one ulp off (PEER_FACTOR x + 4 ulps)
    assert_no_worse_than_peer({"losses": losses, "params": got}, {"losses": ref_losses, "params": ref},
                              {"losses": peer_losses, "params": peer})


@pytest.mark.parametrize("prec", ["32", "bf16-mixed", "16-mixed"])
def test_offload_gpu_path_equals_zero2_on_gpu(prec):
    def plugin():
        return {"32": Precision, "bf16-mixed": BF16Mixed,
                "16-mixed": lambda: FP16Mixed(DynamicLossScaler(init_scale=2.0**10))}[prec]()

    ref_losses, ref = run_strategy(ZeroStage2(), plugin())
    strategy = Offload(stage=2, sub_group_size=1000)
    losses, got = run_strategy(strategy, plugin())
    assert type(strategy.transfer if hasattr(strategy, "transfer") else strategy.stepper.transfer).__name__ \
        == "DeviceWorking"
    if prec == "32":
        peer_losses, peer = run_plain(nudge_seed=0)
        # tolerance: no worse than plain PyTorch with each step's parameters one ulp off differs from zero2 (PEER_FACTOR x + 4 ulps)
        assert_no_worse_than_peer({"losses": losses, "params": got}, {"losses": ref_losses, "params": ref},
                                  {"losses": peer_losses, "params": peer})
        return
    u = torch.finfo(torch.bfloat16 if prec == "bf16-mixed" else torch.float16).eps / 2  # unit roundoff
    bound = len(ref_losses) * 2 * u
    # tolerance: not an equivalence: 1-ulp fp32 master differences (fused vs torch Adam) flip working-weight roundings (<= 2u each), one per step: steps x 2u
    assert float(((losses - ref_losses).abs() / ref_losses.abs()).max()) <= bound and rel_err(got, ref) <= bound


def test_trainer_fit_on_cuda(tmp_path):
    from zerotrain import Trainer

    class Fit(Net):
        def __init__(self):
            super().__init__()
            self.losses = []

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.losses.append(float(loss.detach()))
            return loss

        def train_dataloader(self):
            g = torch.Generator().manual_seed(2)
            data = torch.utils.data.TensorDataset(torch.randn(64, 32, generator=g), torch.randn(64, 4, generator=g))
            return torch.utils.data.DataLoader(data, batch_size=16)

    for strategy in ("zero2", "zero3", "offload_cpu"):
        module = Fit()
        trainer = Trainer(accelerator="cuda", devices=1, strategy=strategy, precision="bf16-mixed", max_steps=8,
                          logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          default_root_dir=str(tmp_path))
        trainer.fit(module)
        assert len(module.losses) == 8 and module.losses[-1] < module.losses[0], (strategy, module.losses)


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_engine_on_cuda_equals_plain_pytorch(strategy):
    """The Engine's own-loop path on one GPU, fp32: the same numbers as plain PyTorch."""
    from zerotrain import Engine

    ref_losses, ref = run_plain()
    engine = Engine(accelerator="cuda", devices=1, strategy=strategy, precision="32")
    with engine.init_module():
        module = Net()
    model, opt = engine.setup(module, module.configure_optimizers())
    losses = []
    for i, (x, y) in enumerate(batches()):
        loss = nn.functional.mse_loss(model(x).float(), y)
        engine.backward(loss)
        engine.clip_gradients(model, opt, max_norm=0.5)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    full = model.full_state_dict()
    peer_losses, peer = run_plain(nudge_seed=0)
    # tolerance: no worse than plain PyTorch with each step's parameters one ulp off (PEER_FACTOR x + 4 ulps)
    assert_no_worse_than_peer({"losses": torch.tensor(losses), "params": torch.cat([v.float().reshape(-1).cpu()
                                                                                    for v in full.values()])},
                              {"losses": ref_losses, "params": ref}, {"losses": peer_losses, "params": peer})
