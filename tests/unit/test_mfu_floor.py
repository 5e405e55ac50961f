"""bench/mfu_floor.py's accounting: the matmuls it times are the model's own, and their FLOPs add up
to the model's 6 N per token (the linear part of ``GPT.flops_per_token``)."""
from __future__ import annotations

import torch

from zerotrain.bench import mfu_floor
from zerotrain.bench.common import MODELS, gpt_class


def test_the_timed_matmuls_are_the_models_linear_flops(monkeypatch):
    spec = MODELS["tiny"]
    with torch.device("meta"):
        model = gpt_class(spec.tied)(spec.config())
    shapes = mfu_floor.linear_shapes(model)
    c = spec.config()
    assert shapes[(c.n_embd, 3 * c.n_embd)] == c.n_layer and sum(shapes.values()) == 4 * c.n_layer + 1  # + the head
    monkeypatch.setattr(mfu_floor, "timed", lambda fn, **kw: 1.0)
    tokens = 8
    seconds, flops = mfu_floor.matmul_time(shapes, tokens, torch.float32)
    assert seconds == 3 * sum(shapes.values())  # three matmuls per layer
    # 6 N per token over the linear weights: the model's non-embedding count, less the position table
    # and the norms and biases (not matmuls), plus the tied head (counted once among the parameters)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert flops == 6 * linear * tokens


def test_the_attention_and_step_timers_run_on_the_tiny_model():
    spec = MODELS["tiny"]
    assert mfu_floor.attention_time(spec, torch.float32) > 0
    assert mfu_floor.real_step(spec, "32", compiled=False, steps=1) > 0


def test_an_untied_models_flops_count_its_head_once_and_its_lookup_table_never():
    spec = MODELS["tiny_untied"]
    with torch.device("meta"):
        model = gpt_class(spec.tied)(spec.config())
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    c = spec.config()
    attention = 12 * c.n_layer * c.n_embd * c.block_size
    norms = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.LayerNorm) for p in m.parameters())
    assert model.flops_per_token() == 6 * (linear + norms) + attention  # the norms: the PaLM count's N
