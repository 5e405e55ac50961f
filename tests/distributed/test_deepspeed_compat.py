"""A DeepSpeed script (deepspeed_script.py: ``deepspeed.initialize`` with a JSON config,
``engine.backward`` (or a plain ``loss.backward()``) and ``engine.step`` with accumulation and
clipping, a warm-up LR schedule, ``save_checkpoint``/``load_checkpoint``, ``zero.Init``,
``GatheredParameters`` and ``deepspeed.checkpointing``) runs on 2
processes with DeepSpeed 0.19.8 itself (``DS_ACCELERATOR=cpu``, gloo) and again with only its three
deepspeed import lines renamed to zerotrain.deepspeed, under ZeRO stages 1, 2, 3 and CPU offload.

Equal within fp32 rounding means: the per-micro-batch losses and every final weight within
FLOOR_ULPS (4) ulps of DeepSpeed's, norm-wise: DeepSpeed's other valid order of the same sums
(``reduce_scatter: false``, an all-reduce) reproduces its own numbers bit for bit on 2 ranks, so
the peer bound (tolerance.py) is its floor alone; the learning rates, the data order, the
counters and the accessors' answers identical. DeepSpeed is not a dependency of zerotrain
(it is in the ``bench`` extra): without it these tests skip.

Cost: one DeepSpeed run (~20 s; the first run on a machine also compiles DeepSpeed's CPU
shared-memory op once, ~100 s, cached in ~/.cache/torch_extensions) and one zerotrain run (~15 s)
per config: about 50 s for the two that run by default (ZeRO-2; ZeRO-3 under zero.Init with
activation checkpointing, which costs no extra run); stage 1
and CPU offload are ``slow``.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness import run_ranks
from tolerance import EPS32, FLOOR_ULPS, gamma, rel_err

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed is not installed (it is in zerotrain's `dev` extra: "
                                       "pip install -e '.[dev]'); these tests compare against it")

SCRIPT = Path(__file__).with_name("deepspeed_script.py")
#: the only lines the zerotrain run changes (the import changes the README tells users to make)
RENAMES = ((r"^import deepspeed$", "import zerotrain.deepspeed as deepspeed"),
           (r"^from deepspeed import comm as dist$", "from zerotrain.deepspeed import comm as dist"),
           (r"^from deepspeed\.accelerator import ", "from zerotrain.deepspeed.accelerator import "))

ADAM = {"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.1, "torch_adam": True}}
CONFIGS = {
    "stage1": {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
               "optimizer": ADAM, "steps_per_print": 100, "zero_optimization": {"stage": 1},
               "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01,
                                                            "warmup_num_steps": 4, "warmup_type": "linear"}}},
    "stage2": {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.3,
               "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "betas": [0.8, 0.95], "weight_decay": 0.05,
                                                         "torch_adam": True}},
               "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 12, "warmup_max_lr": 0.02,
                                                                 "warmup_num_steps": 3}},
               "zero_optimization": {"stage": 2, "reduce_bucket_size": 500, "allgather_bucket_size": 500,
                                     "overlap_comm": True, "contiguous_gradients": True}},
    "stage3": {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
               "optimizer": ADAM,
               "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 12, "warmup_num_steps": 3,
                                                                  "warmup_min_ratio": 0.1}},
               "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1000,
                                     "stage3_max_live_parameters": 100000, "stage3_param_persistence_threshold": 10},
               # read by deepspeed.checkpointing.configure (--checkpoint_activations); partitioning
               # over one model-parallel rank keeps every input whole in DeepSpeed too
               "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                            "number_checkpoints": 1, "synchronize_checkpoint_boundary": True}},
    # DeepSpeed refuses a torch optimizer under offload unless told (zero_force_ds_cpu_optimizer): its
    # CPU Adam would be compiled; torch's AdamW is the same update
    "offload": {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
                "optimizer": ADAM, "zero_force_ds_cpu_optimizer": False,
                "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01,
                                                             "warmup_num_steps": 4}},
                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}}},
}


#: ZeRO-3 builds the model under zero.Init and runs its hidden layer under
#: deepspeed.checkpointing.checkpoint (with dropout); ZeRO-2 trains its first steps with a plain loss.backward()
FLAGS = {"stage3": ["--zero_init", "--checkpoint_activations"], "stage2": ["--plain_backward"]}


def zerotrain_script() -> str:
    text = SCRIPT.read_text()
    for pattern, replacement in RENAMES:
        text, n = re.subn(pattern, replacement, text, flags=re.MULTILINE)
        assert n == 1, pattern
    return text


def test_only_the_import_lines_differ():
    before, after = SCRIPT.read_text().splitlines(), zerotrain_script().splitlines()
    changed = [(a, b) for a, b in zip(before, after) if a != b]
    assert len(before) == len(after) and len(changed) == 3, changed
    assert all("import" in a and "deepspeed" in a for a, _ in changed)


def _run_script(script: str, config: str, out: str, ckpt: str, flags: list[str]) -> dict:
    """One rank: run ``script`` as its own ``__main__`` and return what it saved."""
    sys.argv = [script, "--deepspeed_config", config, "--out", out, "--ckpt", ckpt, *flags]
    runpy.run_path(script, run_name="__main__")
    import torch.distributed as dist
    result = torch.load(f"{out}.{dist.get_rank()}.pt", weights_only=True)
    result["client"] = {k: result["client"][k] for k in ("note", "at")}  # DeepSpeed adds its own keys
    return result


def _both(tmp_path: Path, name: str) -> tuple[list[dict], list[dict], Path]:
    config = tmp_path / f"{name}.json"
    config.write_text(json.dumps(CONFIGS[name]))
    scripts = {"ds": SCRIPT, "zt": tmp_path / "zt_script.py"}
    scripts["zt"].write_text(zerotrain_script())
    out = {}
    for side, script in scripts.items():
        out[side] = run_ranks("test_deepspeed_compat:_run_script", 2, tmp_path / side,
                              timeout=400 if side == "ds" else 200, env={"DS_ACCELERATOR": "cpu"},
                              script=str(script), config=str(config), out=str(tmp_path / side / "result"),
                              ckpt=str(tmp_path / side / "ckpt"), flags=FLAGS.get(name, []))
    return out["ds"], out["zt"], tmp_path / "zt" / "ckpt"


#: the peer bound against DeepSpeed: its other valid order (reduce_scatter: false) is bit-equal to
#: it on 2 ranks (measured: PEER_FACTOR x 0), leaving the floor; measured 0.13-0.64 ulps (ZeRO-2)
BOUND = FLOOR_ULPS * EPS32


def _close_losses(got: list[float], want: list[float]) -> None:
    err = rel_err(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64))
    # tolerance: no worse than DeepSpeed's other valid order (bit-equal to it: PEER_FACTOR x 0) + 4 ulps, norm-wise
    assert err <= BOUND, f"losses: relative error {err:.2e} > {BOUND:.2e}"


def _check_phase(got: dict, want: dict) -> None:
    _close_losses(got["losses"], want["losses"])
    # tolerance: two float64 evaluations of the schedule's formula, each <= 8 roundings (logs, /, *, +, -): 2 gamma(8) in float64
    torch.testing.assert_close(got["lrs"], want["lrs"], rtol=2 * gamma(8, eps=2.0**-52), atol=0)
    assert got["firsts"] == want["firsts"]  # DeepSpeed's data order, batch by batch


def _check_weights(got: dict, want: dict, skip: tuple[str, ...] = ()) -> None:
    assert sorted(got) == sorted(want)
    for name in got:
        if name not in skip:
            # tolerance: no worse than DeepSpeed's other valid order (bit-equal to it: PEER_FACTOR x 0) + 4 ulps, norm-wise
            assert rel_err(got[name], want[name]) <= BOUND, (name, rel_err(got[name], want[name]))


def _check_equal(ds: list[dict], zt: list[dict]) -> None:
    for rank, (want, got) in enumerate(zip(ds, zt)):
        for phase in ("first", "after_save", "after_load"):
            _check_phase(got[phase], want[phase])
        _check_weights(got["weights_after_save"], want["weights_after_save"])
        _check_weights(got["weights"], want["weights"])
        assert got["client"] == want["client"] == {"note": "saved", "at": 6}
        assert got["steps_after_load"] == want["steps_after_load"] == 6
        assert got["facts"] == want["facts"], rank
        # the checkpoint resumed where it was written: the two steps after it repeat exactly
        assert got["after_load"]["losses"] == got["after_save"]["losses"]


@pytest.mark.parametrize("name", [pytest.param("stage1", marks=pytest.mark.slow), "stage2",
                                  pytest.param("offload", marks=pytest.mark.slow)])
def test_script_trains_as_with_deepspeed(tmp_path, name):
    ds, zt, ckpt = _both(tmp_path, name)
    _check_equal(ds, zt)
    assert zt[0]["facts"]["global_steps"] == 8 and zt[0]["facts"]["saved_tag_file"] == "global_step6"


@pytest.mark.slow
def test_zero3_under_zero_init_trains_as_with_deepspeed(tmp_path):
    ds, zt, ckpt = _both(tmp_path, "stage3")
    _check_equal(ds, zt)
    for want, got in zip(ds, zt):
        # after GatheredParameters(modifier_rank=0) the forward sees rank 0's change in both ...
        _check_phase(got["after_modify"], want["after_modify"])
        _check_weights(got["weights_modified"], want["weights_modified"], skip=("layers.0.bias",))
        # ... and zerotrain also wrote it into the fp32 master partitions, so the step keeps it;
        # DeepSpeed's step overwrites it from its fp32 copy (a deliberate difference, README)
        kept = got["weights_modified"]["layers.0.bias"] - got["weights"]["layers.0.bias"]
        lost = want["weights_modified"]["layers.0.bias"] - want["weights"]["layers.0.bias"]
        assert (kept - 0.5).abs().max() < 0.01 and lost.abs().max() < 0.01
    _check_checkpoint_in_the_engine(ckpt, ds_ckpt=ckpt.parent.parent / "ds" / "ckpt")


def _check_checkpoint_in_the_engine(ckpt: Path, ds_ckpt: Path) -> None:
    """The DeepSpeed engine's checkpoint is zerotrain's format: a single-process zerotrain Engine
    loads it (resharded from 2 ranks) and holds the weights DeepSpeed's own checkpoint holds."""
    from zerotrain import Engine

    net = runpy.run_path(str(ckpt.parent.parent / "zt_script.py"), run_name="the_model_only")["Net"]
    engine = Engine(strategy="single", devices=1, accelerator="cpu")
    model = net()
    wrapped, opt = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    rest = engine.load(str(ckpt / "global_step6"), {"model": wrapped, "optimizer": opt})
    assert rest["client_state"] == {"note": "saved", "at": 6}
    assert rest["deepspeed_counters"]["global_steps"] == 6
    _check_weights({k: v.detach() for k, v in model.state_dict().items()}, _deepspeed_weights(ds_ckpt, ckpt.parent))


def _deepspeed_weights(ds_ckpt: Path, work: Path) -> dict:
    """The full fp32 weights of DeepSpeed's ZeRO-3 checkpoint, read by DeepSpeed's own zero_to_fp32
    (in a process of its own: this one does not import DeepSpeed)."""
    out = work / "ds_weights.pt"
    code = ("import sys, torch\n"
            "from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as g\n"
            "torch.save({k: v.float() for k, v in g(sys.argv[1], tag='global_step6').items()}, sys.argv[2])")
    proc = subprocess.run([sys.executable, "-c", code, str(ds_ckpt), str(out)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=True)
