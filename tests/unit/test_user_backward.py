"""``Strategy.user_backward``: the public way to run the strategy's parts around an autograd pass
the user starts themselves (issue 43); the precision plugin hands out the scale."""
from __future__ import annotations

import torch

from zerotrain.strategies import SingleDevice, precision_from_name
from zerotrain.strategies.environment import ProcessInfo


class Recording(SingleDevice):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def _before_manual_backward(self, loss):
        self.calls.append("before_manual")

    def _before_backward(self):
        self.calls.append("before")

    def _after_backward(self):
        self.calls.append("after")


def _strategy(precision: str) -> Recording:
    torch.manual_seed(0)
    s = Recording()
    s.connect(ProcessInfo(), torch.device("cpu"), precision_from_name(precision))
    s.setup_module(torch.nn.Linear(4, 3))
    s.setup_optimizer(torch.optim.SGD(s.module.parameters(), lr=0.1))
    return s


def _loss(s: Recording) -> torch.Tensor:
    torch.manual_seed(1)
    return s.module(torch.randn(5, 4)).square().mean()


def test_user_backward_equals_the_strategy_backward_under_loss_scaling():
    """fp16: the scale it yields is the plugin's, and a user's ``(loss * scale).backward()`` inside
    it leaves the gradients ``Strategy.backward`` leaves, bit for bit, between the same parts."""
    ref, mine = _strategy("16-mixed"), _strategy("16-mixed")
    ref.backward(_loss(ref))
    loss = _loss(mine)
    with mine.user_backward() as scale:
        assert mine.calls == ["before"]
        (loss * scale).backward()
    assert scale == mine.precision.loss_scale == 2.0**16
    assert mine.calls == ref.calls == ["before", "after"]
    for a, b in zip(ref.module.parameters(), mine.module.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_begin_user_backward_with_the_loss_is_a_manual_backward():
    s = _strategy("32")
    assert s.begin_user_backward(_loss(s)) == 1.0
    s.end_user_backward()
    assert s.calls == ["before_manual", "before", "after"]
