"""Where DeepSpeed's ``initialize`` asserts, zerotrain's face refuses with a ConfigError that is
also an AssertionError (ported DeepSpeed tests expect ``pytest.raises(AssertionError)``), and the
version attributes scripts read. Found porting DeepSpeed's tests/unit/runtime/test_ds_config_dict.py
(TestNoModel, TestBasicConfig) and test_ds_initialize.py (TestClientLrScheduler), issue 42."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zerotrain.deepspeed as deepspeed
from zerotrain import ConfigError

from deepspeed_unit_common import _own_group_and_checkpointing  # noqa: F401 - autouse fixture

CONFIG = {"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.001}}}


def test_version_attributes_are_there():
    for name in ("__version__", "__version_major__", "__version_minor__", "__version_patch__", "__git_hash__",
                 "__git_branch__"):
        assert hasattr(deepspeed, name), name
    assert deepspeed.__version__ == f"{deepspeed.__version_major__}.{deepspeed.__version_minor__}." \
                                    f"{deepspeed.__version_patch__}"


@pytest.mark.parametrize("call", ["model=None", "positional"])
def test_no_model_is_an_assertion_and_a_config_error(call):
    with pytest.raises(AssertionError, match="valid: an nn.Module") as info:
        if call == "model=None":
            deepspeed.initialize(model=None, config=CONFIG)
        else:  # the first positional argument is args, as in DeepSpeed
            deepspeed.initialize(nn.Linear(2, 2), config=CONFIG)
    assert isinstance(info.value, ConfigError)


def test_a_built_scheduler_needs_a_built_optimizer():
    model = nn.Linear(2, 2)
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(other, lambda i: 1.0)
    with pytest.raises(AssertionError, match="lr_scheduler=LambdaLR .built. with optimizer=NoneType"):
        deepspeed.initialize(model=model, config=CONFIG, lr_scheduler=sched)
    engine, opt, _, got = deepspeed.initialize(model=model, config=CONFIG, optimizer=other, lr_scheduler=sched)
    assert got is sched


def _engine(stage):
    model = nn.Linear(4, 4)
    config = {**CONFIG, "zero_optimization": {"stage": stage}}
    return deepspeed.initialize(model=model, config=config)[0]


def test_no_sync_refusals_are_deepspeeds():
    """DeepSpeed's three no_sync rules (test_no_sync_ctxt.py): ZeRO 2/3 refuse it, it does not
    nest, and step() inside it is refused; each an AssertionError with DeepSpeed's phrase."""
    engine = _engine(1)
    x = torch.randn(1, 4)
    with engine.no_sync():
        engine.backward(engine(x).sum())
        with pytest.raises(AssertionError, match="It is illegal to call Engine.step.. inside no_sync context manager"):
            engine.step()
        with pytest.raises(AssertionError, match="no_sync context manager reentry is unsupported"):
            with engine.no_sync():
                pass
    engine.step()  # after the block: allowed
    assert engine.global_steps == 1
    engine.destroy()
    import torch.distributed as dist

    dist.destroy_process_group()
    with pytest.raises(AssertionError, match="no_sync context manager is incompatible"):
        with _engine(2).no_sync():
            pass
