"""ZeRO-3 with ``torch.utils.checkpoint`` written in the user's own model (not zerotrain's
``activation_checkpointing`` option), driven the way a DeepSpeed script drives it: through
``zerotrain.deepspeed.initialize`` and a plain ``loss.backward()``.

The recomputation runs the unit's forward again inside backward, with its forward hooks. Before the
fix its forward hook freed the unit at once (``reshard_after_forward``), so the backward that
followed read the saved weight views of a freed buffer (``RuntimeError: ... storage of size 0`` /
"data is not allocated yet"), and its pre-forward routed the recomputed inputs through a
post-backward node that never runs (the unit's reduction then waited for the end of backward).

Expected result: the same losses and weights, bit for bit, as the same model without checkpointing
under ZeRO-3 (the recomputation repeats the same operations on the same values), and each unit
reduced and freed at its own post-backward, as without checkpointing.
"""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from harness import init_dist, run_ranks

STEPS = 3


class Net(nn.Module):
    """Three unit-sized layers; ``mode`` says how the user's forward checkpoints them."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.inp = nn.Linear(8, 16)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.mode == "region":  # one checkpoint around two units
            h = checkpoint(lambda t: self.layers[1](self.layers[0](t)), h, use_reentrant=False)
            h = self.layers[2](h)
        else:
            for layer in self.layers:
                if self.mode == "none":
                    h = layer(h)
                else:
                    h = checkpoint(layer, h, use_reentrant=self.mode == "reentrant")
        return self.out(h)


def _train(mode: str) -> dict:
    import zerotrain.deepspeed as deepspeed

    init_dist()
    torch.manual_seed(0)
    model = Net(mode)
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
              "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
              "zero_optimization": {"stage": 3}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    strategy = engine.zerotrain_engine.strategy
    runtime = strategy.runtime
    g = torch.Generator().manual_seed(1 + int(os.environ["RANK"]))
    losses = []
    for step in range(STEPS):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        if step == STEPS - 1:
            runtime.trace = []
        loss = nn.functional.mse_loss(engine(x), y)
        loss.backward()  # plain: no engine.backward
        engine.step()
        losses.append(loss.item())
    names = {u.index: u.name for u in runtime.units}
    with strategy.gathered(model):
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "weights": weights, "trace": [(e, names[i]) for e, i in runtime.trace]}


def _freed_at_post_backward(trace: list) -> set[str]:
    """The units freed right after their own post-backward (before the end of backward)."""
    return {u for (e, u), (f, v) in zip(trace, trace[1:]) if e == "backward_done" and f == "free" and u == v}


@pytest.mark.timeout(240)
def test_user_checkpoint_under_zero3_equals_no_checkpoint(tmp_path):
    runs = {mode: run_ranks("test_zero3_user_checkpoint:_train", 2, tmp_path / mode, timeout=200, mode=mode)
            for mode in ("none", "non_reentrant", "region", "reentrant")}
    for mode in ("non_reentrant", "region", "reentrant"):
        for got, want in zip(runs[mode], runs["none"]):
            assert got["losses"] == want["losses"], mode
            for k in want["weights"]:
                assert torch.equal(got["weights"][k], want["weights"][k]), (mode, k)
    layers = {f"layers.{i}" for i in range(3)}
    assert _freed_at_post_backward(runs["none"][0]["trace"]) >= layers
    for mode in ("non_reentrant", "region", "reentrant"):
        assert _freed_at_post_backward(runs[mode][0]["trace"]) >= layers, (mode, runs[mode][0]["trace"])
