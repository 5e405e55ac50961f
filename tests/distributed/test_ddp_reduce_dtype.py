"""DDP's ``reduce_dtype``: gradients summed in bf16/fp16, then divided by the world size, as
DeepSpeed's engine reduces them without ZeRO (``communication_data_type``, by default the 16-bit
training type). Found on DeepSpeedExamples' cifar with bf16 at ZeRO stage 0 (bench/CONFORMANCE.md):
zerotrain's ddp averaged fp32 gradients and differed from DeepSpeed by one bf16 ulp from step 15."""
from __future__ import annotations

import pytest
import torch

from harness import run_ranks


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(4, 32, generator=torch.Generator().manual_seed(10 + rank))


def _rank(reduce_dtype: str) -> dict:
    import torch.distributed as dist

    from zerotrain import Engine
    from zerotrain.strategies.ddp import DDP

    engine = Engine(strategy=DDP(reduce_dtype=reduce_dtype), devices=2, accelerator="cpu")
    model = _model()
    wrapped, _ = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    engine.backward(wrapped(_batch(dist.get_rank())).square().sum())
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _local_grads(rank: int) -> dict:
    model = _model()
    model(_batch(rank)).square().sum().backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("reduce_dtype", ["fp32", "bf16", "fp16"])
def test_gradients_are_summed_in_the_reduce_dtype_then_divided(tmp_path, reduce_dtype):
    got = run_ranks("test_ddp_reduce_dtype:_rank", 2, tmp_path, timeout=200, reduce_dtype=reduce_dtype)
    g0, g1 = _local_grads(0), _local_grads(1)
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(reduce_dtype)
    for name in g0:
        if low is None:
            want = g0[name] / 2 + g1[name] / 2
        else:
            want = ((g0[name].to(low) + g1[name].to(low)) * 0.5).float()
            assert not torch.equal(want, g0[name] / 2 + g1[name] / 2)  # the type matters here
        for rank in (0, 1):
            # tolerance: exact: the reference sums the two ranks' gradients in the reduce type, in rank order, as gloo does on 2 ranks
            assert torch.equal(got[rank][name], want), (name, rank)


def test_reduce_dtype_is_checked():
    from zerotrain.strategies.ddp import DDP

    with pytest.raises(ValueError, match="reduce_dtype"):
        DDP(reduce_dtype="int8")
