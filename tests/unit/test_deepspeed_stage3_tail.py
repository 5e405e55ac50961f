"""DeepSpeed 0.19.8's ZeRO-3 steps each sub-group's flat partition (every parameter partitioned
alone, ``ceil(numel / world)`` per rank, concatenated) in one host-kernel call, and that kernel
computes the call's last ``numel % 16`` elements with other fused products (its scalar tail). So
which elements get the tail arithmetic is a property of DeepSpeed's layout, not of the element:
zerotrain's ZeRO-3 slots (a unit's flat buffer cut into ranks) end elsewhere, and under the
DeepSpeed face the stage-3 engine passes DeepSpeed's tail elements to the kernel
(``fused_adam_step(tail=...)``, ``trainer/compat/deepspeed/ops/stage3_tail.py``). These check the
pieces on one process; tests/distributed/test_deepspeed_stage3_kernel_tail.py compares whole runs
with DeepSpeed itself. Equality is exact: the same fp32 operations on the same operands."""
from __future__ import annotations

import pytest
import torch

from zerotrain.ops import fused_adam_step
from zerotrain.trainer.compat.deepspeed.ops.stage3_tail import deepspeed_tail_elements, slot_tails

pytestmark = pytest.mark.timeout(60)

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw=True, order="deepspeed")


def _operands(n: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g).to(dtype)
    return [master, torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["native", "fallback"])
def test_a_slot_steps_deepspeeds_tail_elements_with_its_tail_products(dtype, kernel, monkeypatch):
    """DeepSpeed's call holds 53 elements (its tail: the last 5); zerotrain's slot holds the same
    elements rotated (DeepSpeed's [40, 53) first). Stepping the slot with ``tail`` = where
    DeepSpeed's tail elements sit in it gives DeepSpeed's bits; the slot's own tail does not.
    ``fallback``: the pure-torch path (no native kernel), split the same way."""
    if kernel == "fallback":
        from zerotrain.ops import builder
        monkeypatch.setattr(builder, "cpu_adam_module", lambda: None)
    n, cut = 53, 40
    ds = _operands(n, dtype, 0)
    mine = [torch.cat([t[cut:], t[:cut]]) for t in ds]
    plain = [t.clone() for t in mine]
    g = torch.Generator().manual_seed(1)
    for step in range(1, 6):
        grad = torch.randn(n, generator=g).to(dtype)
        mine_grad = torch.cat([grad[cut:], grad[:cut]])
        fused_adam_step(*ds[:1], grad, *ds[1:], step=step, **HYPER)
        fused_adam_step(*mine[:1], mine_grad, *mine[1:], step=step, tail=[(8, 13)], **HYPER)
        fused_adam_step(*plain[:1], mine_grad, *plain[1:], step=step, **HYPER)
    want = [torch.cat([t[cut:], t[:cut]]) for t in ds]
    for a, b in zip(mine, want):
        assert torch.equal(a, b), (a - b).abs().max()
    if dtype == torch.float32:  # the slot's own tail is not DeepSpeed's (in bf16 the rounding may hide it)
        assert any(not torch.equal(a, b) for a, b in zip(plain, want))


def test_deepspeeds_tail_elements_of_its_stage3_layout():
    """DeepSpeedExamples' bf16_master_weight as run in bench/CONFORMANCE.md (231016 elements, every
    parameter even, two ranks: 115508 per rank, 115508 % 16 = 4): each rank's call ends with the
    last 4 elements of its half of the last parameter (the output projection's 1000-element bias)."""
    numels = [64000, 2048] + [12288, 192, 4096, 64, 64, 64, 64, 64, 16384, 256, 16384, 64] * 2 + [64000, 1000]
    got = deepspeed_tail_elements([numels], 2)[0]
    assert got[-1] == [(496, 500), (996, 1000)]
    assert all(r == [] for r in got[:-1])
    # an odd parameter: the last rank's partition is padded; the padding is in no range
    assert deepspeed_tail_elements([[7, 5]], 2)[0] == [[(0, 4), (4, 7)], [(0, 3), (3, 5)]]
    # sub-groups: each is its own call (a cut once a sub-group reaches sub_group_size elements)
    assert deepspeed_tail_elements([[40, 40]], 2, sub_group_size=20)[0] == [[(16, 20), (36, 40)],
                                                                             [(16, 20), (36, 40)]]


def test_slot_tails_place_them_on_the_slots():
    """a: 40 elements, b: 10, two ranks: DeepSpeed's calls hold 20 + 5 elements, the last 9 of them
    tail (a[16:20] and b[0:5] on rank 0, a[36:40] and b[5:10] on rank 1)."""
    a, b = torch.nn.Parameter(torch.zeros(40)), torch.nn.Parameter(torch.zeros(10))
    assert deepspeed_tail_elements([[40, 10]], 2)[0] == [[(16, 20), (36, 40)], [(0, 5), (5, 10)]]
    # slot 0: a[10:40] then b[0:4]; slot 1: b[4:10]
    slots = [[(a, 10, 0, 30), (b, 0, 30, 4)], [(b, 4, 0, 6)]]
    assert slot_tails([[a, b]], slots, 2) == {0: [(6, 10), (26, 30), (30, 34)], 1: [(0, 1), (1, 6)]}
