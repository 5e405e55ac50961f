"""The face's ZeRO 1-3 clip (``trainer/compat/deepspeed/ops/zero_clip.py``) computes DeepSpeed
0.19.8's global norm and clip multiplier to the last bit: checked against DeepSpeed's own methods
(``get_grad_norm_direct``, ``complete_grad_norm_calculation_for_cpu_offload``,
``combine_grad_norm_groups``, ``unscale_and_clip_grads`` of ``stage_1_and_2.py`` and ``stage3.py``)
called in one process for each of two ranks, with a stand-in for ``deepspeed.comm`` whose
all-reduce sums what the two ranks' calls gave it. The gradients are partitioned as DeepSpeed
partitions them (the module's ``zero12_owners`` / ``zero3_owners``, checked here against
DeepSpeed's ``get_data_parallel_partitions``/``get_partition_info``).

torch's order (``clip_grad_norm_``: the norm of per-parameter fp32 norms, what the strategies
compute) rounds differently in the last bit in some of these cases (asserted: at least one of
them), which Adam amplifies (bench/CONFORMANCE.md: DeepSpeed's DistributedAttention through
``initialize``). Skipped without deepspeed (the ``dev`` extra)."""
from __future__ import annotations

import os
import types

import pytest
import torch

from zerotrain.trainer.compat.deepspeed.ops import zero_clip

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator: fp64 norms on the host
ds_zero = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
ds_zero3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
from deepspeed.runtime.utils import combine_grad_norm_groups  # noqa: E402

WORLD = 2
#: parameter sizes of two param groups: pieces cut by the partition boundary, odd sizes
GROUPS = [[13, 7, 40, 3], [5, 17]]
MAX_NORM = 0.7


class _TwoRanks:
    """``deepspeed.comm`` for one process playing both ranks: ``rank``'s call records its operand
    (``collect``), or (``finish``) gets the sum of the recorded ones in rank order."""

    class ReduceOp:
        SUM, MAX = "sum", "max"

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []
        self.finish = False

    def all_reduce(self, tensor, op=None, group=None, **kwargs):
        if not self.finish:
            self.seen.append(tensor.clone())
            return
        total = self.seen[0].clone()
        for t in self.seen[1:]:
            total = total + t
        tensor.copy_(total)


def _deepspeed_norm(monkeypatch, module, method, per_rank_args, fake_self):
    """DeepSpeed's ``method`` run for both ranks: the first pass records each rank's operand of its
    all-reduce, the second returns rank 0's result (every rank's, after the all-reduce)."""
    comm = _TwoRanks()
    monkeypatch.setattr(module, "dist", comm)
    for args in per_rank_args:
        method(fake_self, *args)
    comm.finish = True
    return method(fake_self, *per_rank_args[0])


def _fake_self(stage: int, norms: dict | None = None):
    return types.SimpleNamespace(
        dp_process_group=None, model_parallel_rank=0, model_parallel_group=None, device="cpu",
        ignore_unused_parameters=True, norm_for_param_grads=norms or {}, get_param_id=id,
        _model_parallel_all_reduce=lambda tensor, op: None, _assert_same_partition_group=lambda params: None,
        _get_param_partition_group=lambda p: None, _grad_norm_counts_every_rank=lambda params, group: False,
        _autoep_expert_parallel_group=lambda params: None, clip_grad=MAX_NORM, loss_scale=1.0)


def _grads(seed: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(n, generator=g) * 10.0 ** torch.randint(-3, 1, (), generator=g).item() for n in group]
            for group in GROUPS]


def _ours(grads, stage: int, offload: bool, zero: dict | None = None) -> torch.Tensor:
    """The module's multiplier, one process holding every gradient whole (one slot per parameter)."""
    params = [[torch.nn.Parameter(torch.zeros(g.numel())) for g in group] for group in grads]
    buckets, where = zero_clip.norm_buckets(params, stage, WORLD, zero or {})
    flat = [g for group in grads for g in group]
    pieces = [[(p, 0, 0, p.numel())] for group in params for p in group]

    def read(ranges, visit):
        for i, (slot, off, n) in enumerate(ranges):
            visit(i, flat[slot][off:off + n])
    sums = zero_clip.rank_sums(pieces, read, buckets * WORLD, where, torch.device("cpu"))
    return zero_clip.coefficient(zero_clip.deepspeed_norm(sums, WORLD, stage, offload), MAX_NORM)


def _multiplier_12(total: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's ``unscale_and_clip_grads`` (stage 1/2) on a ones vector: its multiplier."""
    ones = torch.ones(1)
    ds_zero.DeepSpeedZeroOptimizer.unscale_and_clip_grads(_fake_self(1), [ones], total)
    return ones[0]


def _multiplier_3(total: torch.Tensor) -> torch.Tensor:
    ones = torch.ones(1)
    fake = _fake_self(3)
    fake.fp32_partitioned_groups_flat = [types.SimpleNamespace(grad=ones)]
    ds_zero3.DeepSpeedZeroOptimizer_Stage3.unscale_and_clip_grads(fake, 0, total)
    return ones[0]


def _slices_12(group, world=WORLD):
    """Each rank's pieces of ``group``'s gradients as DeepSpeed's stage 1/2 cuts them."""
    owners = zero_clip.zero12_owners([g.numel() for g in group], world)
    return [[(g[lo:hi], g) for g, pcs in zip(group, owners) for r, lo, hi in pcs if r == rank] for rank in range(world)]


def _slices_3(group, world=WORLD):
    owners = zero_clip.zero3_owners([g.numel() for g in group], world)
    out = []
    for rank in range(world):
        mine = []
        for g, pcs in zip(group, owners):
            pn = -(-g.numel() // world)
            piece = torch.zeros(pn)  # DeepSpeed's padded partition (zeros past the end)
            for r, lo, hi in pcs:
                if r == rank:
                    piece[:hi - lo] = g[lo:hi]
            mine.append((piece, g))
        out.append(mine)
    return out


@pytest.mark.parametrize("aligned", [False, True], ids=["plain", "parameter_alignment"])
def test_partitions_are_deepspeeds(aligned):
    """``zero12_owners`` cuts as DeepSpeed's flat buffer (``flatten_dense_tensors_aligned``: each
    parameter but the last padded to 16 bytes under ``parameter_alignment``, the whole to 2 x world)
    and ``get_data_parallel_partitions``: the same elements per rank."""
    fake = types.SimpleNamespace(real_dp_process_group=[None], flatten=torch.cat)
    for numels in ([13, 7, 40, 3], [5, 17], [1], [8, 8]):
        # elements numbered from 1: DeepSpeed's padding (zeros) tells itself apart
        tensors = [torch.arange(1.0 + sum(numels[:i]), 1.0 + sum(numels[:i + 1])) for i in range(len(numels))]
        padding, at = [], 0  # DeepSpeed's __init__: fp32, 4 elements to 16 bytes
        for i, n in enumerate(numels):
            at += n
            padding.append(0 if i == len(numels) - 1 or not aligned else (-at) % 4)
            at += padding[-1]
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ds_zero.dist, "get_world_size", lambda group=None: WORLD)
            flat = ds_zero.DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned(
                fake, tensors, 2 * WORLD, param_padding=padding)
            parts = ds_zero.DeepSpeedZeroOptimizer.get_data_parallel_partitions(fake, flat, 0)
        owners = zero_clip.zero12_owners(numels, WORLD, parameter_alignment=aligned)
        for rank in range(WORLD):
            mine = [t[lo:hi] for t, pcs in zip(tensors, owners) for r, lo, hi in pcs if r == rank]
            want = parts[rank][parts[rank] != 0]
            assert torch.equal(torch.cat(mine or [torch.zeros(0)]), want), (numels, aligned, rank)


def _deepspeed_group_norm(monkeypatch, group, stage: int, offload: bool) -> torch.Tensor:
    """DeepSpeed's norm of one param group (stage 1/2) or sub-group (stage 3), over two ranks."""
    module, cls = (ds_zero, ds_zero.DeepSpeedZeroOptimizer) if stage < 3 else \
        (ds_zero3, ds_zero3.DeepSpeedZeroOptimizer_Stage3)
    ranks = _slices_12(group) if stage < 3 else _slices_3(group)
    if offload:  # DeepSpeed keeps each piece's fp64 norm when it copies it to the host
        fake = _fake_self(stage, {id(p): p.to(torch.float64).norm(2) for mine in ranks for p, _ in mine})
        return _deepspeed_norm(monkeypatch, module, cls.complete_grad_norm_calculation_for_cpu_offload,
                               [([p for p, _ in mine],) for mine in ranks], fake)
    return _deepspeed_norm(monkeypatch, module, cls.get_grad_norm_direct,
                           [([p for p, _ in mine], [whole for _, whole in mine]) for mine in ranks], _fake_self(stage))


@pytest.mark.parametrize("offload", [False, True], ids=["direct", "offload"])
@pytest.mark.parametrize("stage", [1, 3], ids=["stage12", "stage3"])
def test_norm_and_multiplier_are_deepspeeds(monkeypatch, stage, offload):
    """24 random cases, two param groups (stage 3: one sub-group each, ``sub_group_size``'s
    default), pieces cut by partition boundaries, magnitudes 1e-3 to 1."""
    differs = 0
    for seed in range(24):
        grads = _grads(seed)
        norms = [_deepspeed_group_norm(monkeypatch, group, stage, offload) for group in grads]
        want = (_multiplier_12 if stage < 3 else _multiplier_3)(combine_grad_norm_groups(norms))
        got = _ours(grads, stage, offload)
        assert torch.equal(got.to(torch.float32), want), (seed, got.item(), want.item())
        torchs = torch.clamp(MAX_NORM / (torch.nn.utils.get_total_norm([g for gr in grads for g in gr]) + 1e-6),
                             max=1.0)
        differs += not torch.equal(torchs, want)
    assert differs, "torch's order must round differently in some case (else this tests nothing)"
