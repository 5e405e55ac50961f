"""Fabric.clip_gradients as Lightning Fabric: clipping by value (``clip_val``) and by norm
(``max_norm``, ``error_if_nonfinite``, the returned norm), compared with the installed
``lightning`` Fabric on the same loop, and on the ZeRO strategies (on one process a ZeRO
rank's partition is the whole gradient; the 2-rank element-wise clamp is the same code)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from zerotrain import ConfigError, Fabric

STEPS = 4


@pytest.fixture(autouse=True)
def _lightning_env(monkeypatch):
    """Lightning sets this variable at import; recorded so that it is undone after the test."""
    for name in ("LT_STRATEGY", "LT_DEVICES", "LT_ACCELERATOR", "LT_PRECISION"):
        monkeypatch.delenv(name, raising=False)


def _loop(fabric, clip: dict) -> tuple[list[float], list[torch.Tensor], list]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.5))
    g = torch.Generator().manual_seed(1)
    losses, norms = [], []
    for _ in range(STEPS):
        x, y = torch.randn(16, 6, generator=g) * 5, torch.randn(16, 2, generator=g) * 5
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        norms.append(fabric.clip_gradients(model, opt, **clip))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    # ours: the complete weights whichever way the strategy holds them (zero3 partitions them)
    state = model.full_state_dict() if isinstance(fabric, Fabric) else net.state_dict()
    return losses, [state[k].detach().clone() for k in sorted(state)], norms


def _ours(strategy: str, clip: dict):
    return _loop(Fabric(accelerator="cpu", devices=1, strategy=strategy), clip)


def _lightning(clip: dict):
    lf = pytest.importorskip("lightning.fabric")
    return _loop(lf.Fabric(accelerator="cpu", devices=1), clip)


@pytest.mark.parametrize("strategy", ["single", "zero1", "zero2", "zero3"])
def test_clip_by_value_equals_lightning_fabric(strategy):
    clip = {"clip_val": 0.05}  # well below the gradients' elements (inputs scaled by 5): every step clamps
    ref_losses, ref_params, ref_norms = _lightning(clip)
    losses, params, norms = _ours(strategy, clip)
    assert norms == ref_norms == [None] * STEPS
    # clamping is exact and SGD is one multiply-add per element: bit for bit, as the same ops run
    assert losses == ref_losses
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    unclipped, _, _ = _ours(strategy, {"max_norm": 1e9})
    assert unclipped[1:] != losses[1:]  # the clamp changed the run


@pytest.mark.parametrize("strategy", ["single", "zero2"])
def test_clip_by_norm_returns_the_norm_before_clipping_as_lightning_fabric(strategy):
    clip = {"max_norm": 0.1}
    ref_losses, ref_params, ref_norms = _lightning(clip)
    losses, params, norms = _ours(strategy, clip)
    # the norm: a sum of squares over every gradient element (fp32 eps x its length, a few hundred)
    tol = 1e-7 * 100
    torch.testing.assert_close(torch.stack(norms), torch.stack(ref_norms), rtol=tol, atol=0)
    assert min(n.item() for n in norms) > 0.1  # it clipped at every step
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=tol, atol=tol)
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p, q, rtol=tol, atol=tol)


def test_nonfinite_norm_raises_before_the_step_as_lightning_fabric():
    fabric = Fabric(accelerator="cpu", devices=1, strategy="single")
    net = nn.Linear(3, 1)
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    before = [p.detach().clone() for p in net.parameters()]
    fabric.backward(model(torch.full((2, 3), float("inf"))).sum())
    fabric.clip_gradients(model, opt, max_norm=1.0)
    with pytest.raises(RuntimeError, match="non-finite"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), before))
    # error_if_nonfinite=False clips anyway, as torch: the step runs
    fabric.clip_gradients(model, opt, max_norm=1.0, error_if_nonfinite=False)
    opt.step()


def test_clip_gradients_arguments_are_checked_as_lightning_fabric():
    fabric = Fabric(accelerator="cpu", devices=1, strategy="single")
    net = nn.Linear(3, 1)
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="only one of them"):
        fabric.clip_gradients(model, opt, clip_val=1.0, max_norm=1.0)
    with pytest.raises(ValueError, match="neither clip_val nor max_norm"):
        fabric.clip_gradients(model, opt)
    with pytest.raises(ConfigError, match="clip_val=0; valid: a number > 0"):
        fabric.clip_gradients(model, opt, clip_val=0)
    with pytest.raises(ConfigError, match="norm_type=1.0"):
        fabric.clip_gradients(model, opt, max_norm=1.0, norm_type=1.0)
