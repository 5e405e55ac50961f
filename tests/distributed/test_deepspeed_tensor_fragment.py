"""``deepspeed.utils``' tensor-fragment accessors (``safe_get_full_fp32_param``,
``safe_get_full_grad``, ``safe_get_full_optimizer_state``, the ``safe_set_full_*`` ones and the
ZeRO-3 ``safe_*_local_*`` ones) on 2 processes, under DeepSpeed 0.19.8 itself
(``DS_ACCELERATOR=cpu``, gloo) and under ``zerotrain.deepspeed``, the same loop with only the
import changed: ZeRO stages 0-3 in fp32 and stage 2 in bf16, a model with a frozen layer and a
parameter cut by the partition boundary.

Compared: every answer after each backward (fp32 master, averaged gradient) and after each step
(master, ``exp_avg``, ``exp_avg_sq``), a gradient set with ``safe_set_full_grad`` and doubled with
``safe_update_full_grad_vectorized`` before the last step (what that step then does with it), and
the master and ``exp_avg`` written with ``safe_set_full_*`` after it, each on a parameter whose size
is even (DeepSpeed 0.19.8's stage-3 setters fail on the last rank for any other size: they cut
``ceil(numel / 2)`` elements from ``rank * ceil(numel / 2)``, past the end; zerotrain's accept it); None where DeepSpeed answers
None (stage 0, the frozen layer, a parameter no engine holds). Asked only where every DeepSpeed rank
answers alike: its stages 1/2 raise on the ranks holding a fragment only (a gradient after the step,
an unknown state key), leaving the others in the all-reduce (tests/unit/test_deepspeed_tensor_fragment.py
covers zerotrain's answer, the same error on every rank).

Equal means within FLOOR_ULPS (4) ulps norm-wise, as test_deepspeed_compat.py (the same sums in the
same order: measured identical). Cost: ~60-90 s (DeepSpeed's five engines), so slow.
"""
from __future__ import annotations

import importlib

import pytest
import torch

import needs
from harness import run_ranks
from tolerance import EPS32, FLOOR_ULPS, rel_err

pytestmark = [needs.deepspeed, pytest.mark.slow]

CONFIGS = {"stage0": (0, False), "stage1": (1, False), "stage2": (2, False), "stage3": (3, False),
           "stage2_bf16": (2, True)}
BOUND = FLOOR_ULPS * EPS32


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = torch.nn.Linear(5, 5)
        self.frozen.requires_grad_(False)
        self.a = torch.nn.Linear(5, 8)
        self.b = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(self.frozen(x))))


def _answer(fn, *args):
    try:
        out = fn(*args)
    except Exception as exc:  # noqa: BLE001 - the kind of refusal is compared
        return type(exc).__name__
    return out.detach().float().cpu().clone() if torch.is_tensor(out) else out


def _one(ds, u, stage: int, bf16: bool, rank: int) -> dict:
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000, "zero_force_ds_cpu_optimizer": False,
              "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
              "zero_optimization": {"stage": stage}}
    if bf16:
        config["bf16"] = {"enabled": True}
    torch.manual_seed(0)
    model = _Net()
    engine = ds.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                           config=config)[0]
    named = dict(engine.module.named_parameters())
    g = torch.Generator().manual_seed(10 + rank)
    out: dict = {"steps": []}
    for step in range(3):
        x = torch.randn(4, 5, generator=g).to(torch.bfloat16 if bf16 else torch.float32)
        y = torch.randn(4, 3, generator=g)
        engine.backward(((engine(x).float() - y) ** 2).mean())
        rec = {"backward": {n: (_answer(u.safe_get_full_fp32_param, p), _answer(u.safe_get_full_grad, p))
                            for n, p in named.items()}}
        if step == 2:  # parameters of an even size: see the module's docstring
            u.safe_set_full_grad(named["b.weight"], torch.full((3, 8), 0.25))
            u.safe_update_full_grad_vectorized([named["a.bias"], named["a.weight"]], lambda old, p: 2 * old)
            rec["set_grad"] = [_answer(u.safe_get_full_grad, named[n]) for n in ("b.weight", "a.bias")]
        engine.step()
        rec["step"] = {n: [_answer(u.safe_get_full_fp32_param, p)]
                       + [_answer(u.safe_get_full_optimizer_state, p, k) for k in ("exp_avg", "exp_avg_sq")]
                       for n, p in named.items()}
        if stage == 3:
            rec["step_grad"] = {n: _answer(u.safe_get_full_grad, p) for n, p in named.items()}
        out["steps"].append(rec)
    weight = named["a.weight"]
    full = u.safe_get_full_fp32_param(weight)
    if full is not None:
        u.safe_set_full_fp32_param(weight, full + 0.5)
        u.safe_set_full_optimizer_state(weight, torch.full((8, 5), 0.125), "exp_avg")
    out["after_set"] = [_answer(u.safe_get_full_fp32_param, weight), _answer(u.safe_get_full_optimizer_state, weight, "exp_avg")]
    stray = torch.nn.Parameter(torch.ones(3))
    out["stray"] = [_answer(u.safe_get_full_fp32_param, stray), _answer(u.safe_get_full_optimizer_state, stray, "exp_avg")]
    engine.destroy()
    return out


def _run(impl: str) -> dict:
    """One rank: every config, through DeepSpeed (``impl="deepspeed"``) or zerotrain's face."""
    ds = importlib.import_module(impl)
    u = importlib.import_module(f"{impl}.utils")
    ds.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    return {name: _one(ds, u, stage, bf16, rank) for name, (stage, bf16) in CONFIGS.items()}


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    out = {}
    for impl in ("deepspeed", "zerotrain.deepspeed"):
        out[impl] = run_ranks("test_deepspeed_tensor_fragment:_run", 2, tmp_path_factory.mktemp(impl.replace(".", "_")),
                              timeout=400, env={"DS_ACCELERATOR": "cpu"}, impl=impl)
    return out


def _same(got, want, where: str) -> None:
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), where
        for k in want:
            _same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            _same(a, b, f"{where}/{i}")
    elif torch.is_tensor(want):
        assert torch.is_tensor(got) and got.shape == want.shape, (where, got, want)
        # tolerance: the same sums in the same order (measured identical); FLOOR_ULPS ulps norm-wise
        assert rel_err(got, want) <= BOUND, (where, rel_err(got, want))
    else:
        assert got == want, (where, got, want)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_accessors_answer_as_deepspeed(answers, name):
    for rank, (want, got) in enumerate(zip(answers["deepspeed"], answers["zerotrain.deepspeed"])):
        w, g = want[name], got[name]
        stage = CONFIGS[name][0]
        for i, (ws, gs) in enumerate(zip(w["steps"], g["steps"])):
            for n, (param, grad) in ws["backward"].items():
                # DeepSpeed's stage 0 bf16 module holds bf16 gradients; zerotrain's fp32 ones (compared as fp32)
                _same(gs["backward"][n], (param, grad), f"rank {rank} step {i} backward {n}")
            _same(gs["step"], ws["step"], f"rank {rank} step {i} after step")
            if "set_grad" in ws:
                _same(gs["set_grad"], ws["set_grad"], f"rank {rank} step {i} set grad")
            if "step_grad" in ws:  # DeepSpeed's stage 3 returns the gradient the step applied; zerotrain refuses
                if "set_grad" not in ws:
                    _same(ws["step_grad"], {n: v[1] for n, v in ws["backward"].items()}, f"DeepSpeed rank {rank} step {i}")
                assert [v for n, v in gs["step_grad"].items() if not n.startswith("frozen")] == ["ValueError"] * 4
                assert [v for n, v in gs["step_grad"].items() if n.startswith("frozen")] == [None, None]
        _same(g["after_set"], w["after_set"], f"rank {rank} after set")
        _same(g["stray"], w["stray"], f"rank {rank} a parameter no engine holds")
        assert w["stray"] == [None, None]
    if stage == 0:
        assert all(v[0] is None for s in w["steps"] for v in s["backward"].values())  # no separate master at stage 0
