"""A set-up model's own methods that run its submodules around the strategy are refused on several
processes, as Fabric refuses them (``mark_forward_method`` makes one a forward method).

Found running Lightning's examples/fabric/reinforcement_learning on 2 ranks (bench/CONFORMANCE.md):
real Fabric stops at ``agent.get_action_and_value()`` with its "from outside the model" error;
zerotrain ran it around the strategy (under ddp no gradient averaged) and under zero3 the run ended
in a gloo "Connection closed by peer" when rank 0 alone ran the model after training.
"""
from __future__ import annotations

import pytest
import torch

from harness import run_ranks
from test_fabric_ranks import _Agent as _Base  # forward: head(tanh(body(x)))


class _Agent(_Base):
    def act(self, x):  # runs submodules outside forward
        return self.body(x).argmax(-1)

    def width(self):  # runs none
        return self.body.out_features


def _outcome(fn):
    try:
        fn()
        return "ran"
    except RuntimeError as exc:
        return str(exc)


def _rank(strategy: str) -> dict:
    from zerotrain import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    agent = _Agent()
    model, _ = fabric.setup(agent, torch.optim.SGD(agent.parameters(), lr=0.1))
    x = torch.randn(3, 4)
    hooks = sum(len(m._forward_hooks) for m in agent.modules())
    out = {"act": _outcome(lambda: model.act(x)), "width": model.width(),
           "params": len(list(model.parameters())), "forward": _outcome(lambda: model(x))}
    model.mark_forward_method("act")
    out["marked"] = _outcome(lambda: model.act(x))
    out["hooks_added"] = sum(len(m._forward_hooks) for m in agent.modules()) - hooks
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_other_methods_that_run_submodules_are_refused(tmp_path, strategy):
    for got in run_ranks("test_fabric_outside_calls:_rank", 2, tmp_path, timeout=240, strategy=strategy):
        assert got["act"].startswith("You are calling the method `_Agent.act()` from outside the model")
        assert "mark_forward_method('act')" in got["act"]
        assert got["width"] == 8 and got["params"] == 4 and got["forward"] == "ran"
        assert got["marked"] == "ran"
        assert got["hooks_added"] == 0  # the watch removes its hooks


@pytest.mark.timeout(120)
def test_one_process_runs_them_as_fabric_does():
    from zerotrain import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    agent = _Agent()
    model, _ = fabric.setup(agent, torch.optim.SGD(agent.parameters(), lr=0.1))
    assert model.act(torch.randn(3, 4)).shape == (3,)
