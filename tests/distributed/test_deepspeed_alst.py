"""ALST through DeepSpeed's engine (issue 45): deepspeed_alst_script.py (a tiny Hugging Face Llama,
``UlyssesSPAttentionHF`` + ``UlyssesSPDataLoaderAdapter``, ``deepspeed.initialize(..., mpu=mpu)``,
sp = 2) on 2 CPU ranks under DeepSpeed 0.19.8 and, with its deepspeed imports renamed, under
zerotrain.deepspeed, at ZeRO stages 0-3: the losses of 4 steps and every parameter after them equal
DeepSpeed's. The mpu becomes the strategy's sequence axis (ZeRO over data x sequence, the gradients
divided by the data-parallel size world / sp as DeepSpeed divides them): the SGD cases fail when
the gradients are averaged over every rank instead (AdamW and clipping by norm hide that factor;
the clipped AdamW cases clip at 0.05, active: 6% off the unclipped weights). Stage 3 is compared
under AdamW only (see CASES).

# tolerance: 1e-4 relative (the issue's bound for DeepSpeed's faces); measured: losses within
# 7e-8, parameters within 3e-7 (stages 0-2) and 2e-6 (stage 3).
"""
from __future__ import annotations

import importlib.util
import json
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch

from harness import run_ranks
from tolerance import rel_err

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None or
                                 importlib.util.find_spec("transformers") is None,
                                 reason="deepspeed or transformers is not installed; these tests compare against them")]

SCRIPT = Path(__file__).with_name("deepspeed_alst_script.py")
RTOL = 1e-4


def _config(stage: int, clip: float | None, sgd: bool) -> dict:
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 100,
              "zero_optimization": {"stage": stage}, "sequence_parallel_size": 2}
    if clip is not None:  # else DeepSpeed's default (1.0), as DeepSpeed's own ALST test leaves it
        config["gradient_clipping"] = clip
    if sgd:  # the script's client torch.optim.SGD
        return {**config, "zero_allow_untested_optimizer": True}
    return {**config, "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}}


def _zerotrain_script() -> str:
    text, n = re.subn(r"^(import|from) deepspeed\b", r"\1 zerotrain.deepspeed", SCRIPT.read_text(), flags=re.MULTILINE)
    assert n == 3
    return text.replace("import zerotrain.deepspeed\n", "import zerotrain.deepspeed as deepspeed\n")


def _run(script: str, config: str, out: str, sgd: bool, plain: bool) -> dict:
    sys.argv = [script, "--deepspeed_config", config, "--out", out] + ["--sgd"] * sgd + ["--loss-backward"] * plain
    runpy.run_path(script, run_name="__main__")
    import torch.distributed as dist
    return torch.load(f"{out}.{dist.get_rank()}.pt", weights_only=True)


#: (ZeRO stage, gradient_clipping, the client SGD rather than the config's AdamW, loss.backward()
#: rather than engine.backward)
#: (no stage-3 SGD case: DeepSpeed 0.19.8's stage 3 under ALST updates by a gradient 4x smaller than
#: its own stages 0-2 on the same script, bench/CONFORMANCE.md; zerotrain's stage 3 follows stages 0-2.
#: Stage 3 under AdamW with DeepSpeed's default clipping matches within 2e-6; unclipped, Adam's eps
#: shows that factor: 1.5e-3)
CASES = {"stage0-sgd": (0, 0.0, True, False), "stage1-sgd": (1, 0.0, True, False), "stage2-sgd": (2, 0.0, True, False),
         "stage2-sgd-loss-backward": (2, 0.0, True, True), "stage3-adamw": (3, None, False, False),
         "stage0-adamw-clipped": (0, 0.05, False, False), "stage2-adamw-clipped": (2, 0.05, False, False)}
# every case runs with -m slow (36 s each on 2 cores); the default suite checks the ALST faces against
# DeepSpeed in test_ulysses_alst.py. stage2-sgd fails without the sp factor.
SLOW = ("stage0-sgd", "stage1-sgd", "stage2-sgd", "stage2-sgd-loss-backward", "stage3-adamw", "stage0-adamw-clipped",
        "stage2-adamw-clipped")


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CASES])
def test_alst_script_trains_as_with_deepspeed(tmp_path, case):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(_config(*CASES[case][:3])))
    zt = tmp_path / "zt_script.py"
    zt.write_text(_zerotrain_script())
    out = {side: run_ranks("test_deepspeed_alst:_run", 2, tmp_path / side, timeout=400,
                           env={"DS_ACCELERATOR": "cpu"}, script=str(script), config=str(config),
                           out=str(tmp_path / side / "result"), sgd=CASES[case][2],
                           plain=CASES[case][3])
           for side, script in (("ds", SCRIPT), ("zt", zt))}
    for ds, ours in zip(out["ds"], out["zt"]):
        assert ours["dp"] == ds["dp"] == (1, 0)
        assert rel_err(ours["losses"], ds["losses"]) <= RTOL
        assert ours["params"].keys() == ds["params"].keys()
        for name, p in ds["params"].items():
            assert rel_err(ours["params"][name], p) <= RTOL, name
    # the sequence group trained one model: both ranks hold the same weights
    assert all(torch.equal(p, out["zt"][1]["params"][n]) for n, p in out["zt"][0]["params"].items())
