"""DeepSpeed's AutoTP training face (issue 45): deepspeed_autotp_script.py (a tiny Hugging Face Llama,
``"tensor_parallel": {"autotp_size": 2}``) on 2 CPU ranks under DeepSpeed 0.19.8 and, with its
deepspeed imports renamed, under zerotrain.deepspeed, at ZeRO stages 0, 1, 2 and 3: each rank holds
the shard DeepSpeed gives it (the model's HF ``tp_plan``; the untied embedding left whole, as
DeepSpeed leaves it; at stage 3 read inside ``GatheredParameters``) and the losses and every rank's
parameters after 3 AdamW steps equal DeepSpeed's, also with gradient clipping (stages 0, 2 and 3).

# tolerance: 1e-4 relative (the issue's bound for DeepSpeed's faces); measured: identical (0.0)
# unclipped, 5e-7 clipped.
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

SCRIPT = Path(__file__).with_name("deepspeed_autotp_script.py")
RTOL = 1e-4


def _config(stage: int, clip: float = 0.0, offload: bool = False) -> dict:
    """``offload``: the optimizer on the CPU (DeepSpeed's DeepSpeedCPUAdam then, not torch's)."""
    zero = {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": clip, "steps_per_print": 100,
            "tensor_parallel": {"autotp_size": 2}, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, **({} if offload else {"torch_adam": True})}}}


def _zerotrain_script() -> str:
    text, n = re.subn(r"^(import|from) deepspeed\b", r"\1 zerotrain.deepspeed", SCRIPT.read_text(), flags=re.MULTILINE)
    assert n == 2
    return text.replace("import zerotrain.deepspeed\n", "import zerotrain.deepspeed as deepspeed\n")


def _run(script: str, config: str, out: str, model: str) -> dict:
    sys.argv = [script, "--deepspeed_config", config, "--out", out, "--model", model]
    runpy.run_path(script, run_name="__main__")
    import torch.distributed as dist
    return torch.load(f"{out}.{dist.get_rank()}.pt", weights_only=True)


#: (ZeRO stage, gradient_clipping, offload_optimizer cpu, ranks): also clipped by the whole model's
#: norm (0.1: active, measured 3% off the unclipped weights), the sharded parameters' squares summed
#: over the tensor group as DeepSpeed sums them; 4 ranks: dp=2 x tp=2 (DeepSpeed's mesh: tensor
#: groups [0, 1] and [2, 3]), each replica its own batches; a fifth item: the script's --model (GQA
#: Qwen2, its q/k/v biased, and Mistral; default Llama)
CASES = {"stage0": (0, 0.0, False, 2), "stage2-clipped": (2, 0.1, False, 2), "stage0-clipped": (0, 0.1, False, 2),
         "stage1": (1, 0.0, False, 2), "stage2": (2, 0.0, False, 2), "stage3": (3, 0.0, False, 2),
         "stage3-clipped": (3, 0.1, False, 2), "offload-stage3-clipped": (3, 0.1, True, 2),
         "qwen2-stage2-clipped": (2, 0.1, False, 2, "qwen2"), "mistral-stage3-clipped": (3, 0.1, False, 2, "mistral"),
         "dp2xtp2-stage3-clipped": (3, 0.1, False, 4), "dp2xtp2-offload-stage2-clipped": (2, 0.1, True, 4)}
SLOW = tuple(c for c in CASES if c != "stage2-clipped")  # default: stage2-clipped


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CASES])
def test_autotp_script_trains_as_with_deepspeed(tmp_path, case):
    stage, clip, offload, ranks, *model = CASES[case]
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(_config(stage, clip, offload)))
    zt = tmp_path / "zt_script.py"
    zt.write_text(_zerotrain_script())
    out = {side: run_ranks("test_deepspeed_autotp:_run", ranks, tmp_path / side, timeout=400,
                           env={"DS_ACCELERATOR": "cpu"}, script=str(script), config=str(config),
                           out=str(tmp_path / side / "result"), model=model[0] if model else "llama")
           for side, script in (("ds", SCRIPT), ("zt", zt))}
    for ds, ours in zip(out["ds"], out["zt"]):
        assert rel_err(ours["losses"], ds["losses"]) <= RTOL
        assert torch.equal(ours["batch"], ds["batch"])  # DeepSpeed's batch arithmetic counts every rank
        assert {n: p.shape for n, p in ours["params"].items()} == {n: p.shape for n, p in ds["params"].items()}
        assert ours["params"]["model.layers.0.self_attn.q_proj.weight"].shape == (8, 16)  # 2 of 4 heads
        assert ours["params"]["model.embed_tokens.weight"].shape == (32, 16)  # untied: whole, as DeepSpeed
        for name, p in ds["params"].items():
            assert rel_err(ours["params"][name], p) <= RTOL, name
    assert not torch.equal(out["zt"][0]["params"]["lm_head.weight"], out["zt"][1]["params"]["lm_head.weight"])


def test_autotp_with_parameter_or_nvme_offload_is_refused():
    from zerotrain.trainer.compat.deepspeed.config import parse
    from zerotrain.trainer.errors import ConfigError

    cpu = {"device": "cpu"}
    for bad in ({**_config(3), "zero_optimization": {"stage": 3, "offload_optimizer": cpu, "offload_param": cpu}},
                {**_config(2), "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme",
                                                                                      "nvme_path": "/tmp"}}}):
        with pytest.raises(ConfigError, match=r"tensor_parallel.autotp_size=2: zerotrain runs AutoTP under ZeRO stage "
                                              r"0 .*1, 2 or 3, with at most the optimizer offloaded to the CPU"):
            parse(bad, 2)
    for stage in (1, 2, 3):  # DeepSpeed's CPU optimizer offload: zerotrain's offload at stage 2 (1, 2) or 3
        cfg = parse(_config(stage, offload=True), 2)
        assert cfg.strategy == "offload" and cfg.strategy_options["tensor_parallel"] == 2
        assert cfg.strategy_options["stage"] == max(stage, 2)
    assert parse(_config(2), 2).strategy_options["tensor_parallel"] == 2
    assert parse(_config(3), 2).strategy == "zero3" and parse(_config(3), 2).strategy_options["tensor_parallel"] == 2
    assert parse({**_config(1), "tensor_parallel": {"autotp_size": 2, "tp_grain_size": 8}}, 2).ignored == (
        "tensor_parallel.tp_grain_size (not implemented)",)


def _tiny_llama_engine(stage: int):
    """zerotrain.deepspeed's engine over a one-layer Llama (4 heads, 2 key-value heads), autotp_size 2."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import zerotrain.deepspeed as deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(7)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                         tie_word_embeddings=False))
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(stage))[0]


def _write_through_gathered(out: str) -> dict:
    import torch.distributed as dist

    import zerotrain.deepspeed as deepspeed

    engine = _tiny_llama_engine(3)
    norm, q = engine.module.model.norm.weight, engine.module.model.layers[0].self_attn.q_proj.weight
    with deepspeed.zero.GatheredParameters([norm, q], modifier_rank=0):
        norm.data.fill_(2.0)
        q.data.fill_(float(dist.get_rank()))
    with deepspeed.zero.GatheredParameters([norm, q]):
        return {"norm": norm.detach().clone(), "q": q.detach().clone()}


@pytest.mark.slow
def test_gathered_parameters_modifier_rank_is_a_rank_of_the_replicas(tmp_path):
    """At stage 3 with AutoTP each tensor rank's parameters are partitioned over its replicas (here
    itself alone); ``modifier_rank`` is a rank of that group, as in DeepSpeed (which converts it with
    ``get_global_rank``): rank 1 keeps its own write to its q_proj shard (it broadcast from global rank
    0, outside its group, before)."""
    out = run_ranks("test_deepspeed_autotp:_write_through_gathered", 2, tmp_path, timeout=200,
                    env={"DS_ACCELERATOR": "cpu"}, out=str(tmp_path))
    for rank, r in enumerate(out):
        assert torch.equal(r["norm"], torch.full((16,), 2.0)) and r["q"].shape == (8, 16)
        assert torch.equal(r["q"], torch.full((8, 16), float(rank)))


def _forward_with_inputs_of_this_rank() -> str:
    import torch.distributed as dist

    from zerotrain.trainer.errors import ConfigError

    engine = _tiny_llama_engine(0)
    ids = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    try:
        engine(input_ids=ids, labels=ids)
    except ConfigError as e:
        return str(e)
    return "no error"


@pytest.mark.slow
def test_inputs_differing_within_the_tensor_group_raise_at_the_first_forward(tmp_path):
    """DeepSpeed's AutoTP engine compares the first forward's inputs across each tensor group and
    fails on a mismatch (a loader sharded by global rank rather than data-parallel rank); so does
    the face, on every rank of the group, naming the input (it trained on mismatched halves
    silently before)."""
    out = run_ranks("test_deepspeed_autotp:_forward_with_inputs_of_this_rank", 2, tmp_path, timeout=200,
                    env={"DS_ACCELERATOR": "cpu"})
    assert "inputs differ within the tensor-parallel group [0, 1]" in out[0], out[0]
    assert "kwargs['input_ids']" in out[1] and "kwargs['labels']" in out[1], out[1]
