"""Where a GPT step's time goes on one core, against the matmul peak: the floor under issue 47's MFU
and step-time targets.

    python -m zerotrain.bench.mfu_floor --model gpt_118m --precision 32 --out bench/RESULTS.md

One process, one thread (what each of the bench's ranks has), no communication. It times:

* every matmul the step runs, alone, at the model's own shapes (T = micro-batch x sequence tokens):
  each linear layer's forward ``X W^T``, its input gradient ``dY W`` and its weight gradient
  ``dY^T X``, each repeated until stable;
* attention (``scaled_dot_product_attention``, causal) forward and backward, per layer;
* the optimizer step (torch's fused AdamW) over all parameters (DDP, ZeRO-1's share is half at 2 ranks);
* the real step of the same process, eager and with each block compiled (inductor).

The sum of the first three is what the step cannot go below with these kernels (element-wise work,
casts and the time between kernels removed by a perfect compiler); its MFU is the ceiling for this
model at this micro-batch. The matmul peak is an ``n x n`` fp32 (or bf16) matmul on one thread
(``gpt_compiled.matmul_peak``, the bench's MFU denominator).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from zerotrain.bench.common import MODELS, gpt_class
from zerotrain.bench.gpt_compiled import matmul_peak


def timed(fn: Callable[[], object], seconds: float = 0.4, rounds: int = 5) -> float:
    """Median seconds of one ``fn()`` over ``rounds`` rounds of about ``seconds / rounds`` each."""
    fn()
    times = []
    for _ in range(rounds):
        reps, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds / rounds or reps == 0:
            fn()
            reps += 1
        times.append(elapsed / reps)
    return statistics.median(times)


def linear_shapes(model: nn.Module) -> collections.Counter:
    """(in, out) -> how many linear layers of that shape the step runs (a tied head counts once)."""
    return collections.Counter((m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear))


def matmul_time(shapes: collections.Counter, tokens: int, dtype: torch.dtype) -> tuple[float, float]:
    """(seconds, FLOPs) of every linear layer's three matmuls at these shapes."""
    total_s = total_f = 0.0
    for (d_in, d_out), count in shapes.items():
        x, w = torch.randn(tokens, d_in, dtype=dtype), torch.randn(d_out, d_in, dtype=dtype)
        dy = torch.randn(tokens, d_out, dtype=dtype)
        s = timed(lambda: x @ w.t()) + timed(lambda: dy @ w) + timed(lambda: dy.t() @ x)
        total_s += count * s
        total_f += count * 3 * 2 * tokens * d_in * d_out
    return total_s, total_f


def attention_time(spec, dtype: torch.dtype) -> float:
    """Seconds of one step's attention (every layer), forward and backward."""
    b, h, t, q = spec.micro_batch, spec.n_head, spec.block_size, spec.n_embd // spec.n_head
    qkv = [torch.randn(b, h, t, q, dtype=dtype, requires_grad=True) for _ in range(3)]
    grad = torch.randn(b, h, t, q, dtype=dtype)

    def fwd_bwd() -> None:
        F.scaled_dot_product_attention(*qkv, is_causal=True).backward(grad)
    return spec.n_layer * timed(fwd_bwd)


def optimizer_time(n_params: int) -> float:
    p = nn.Parameter(torch.zeros(n_params))
    p.grad = torch.randn(n_params) * 1e-3
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    return timed(opt.step, seconds=1.0)


def real_step(spec, precision: str, compiled: bool, steps: int = 6) -> float:
    torch.manual_seed(0)
    model = gpt_class(spec.tied)(spec.config())
    if compiled:
        for i, block in enumerate(list(model.blocks)):
            model.blocks[i] = torch.compile(block)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, spec.vocab_size, (spec.micro_batch, spec.block_size + 1))
    autocast = torch.autocast("cpu", torch.bfloat16) if precision == "bf16-mixed" else contextlib.nullcontext()
    times = []
    for _ in range(steps + 2):  # the first two compile / touch memory
        start = time.perf_counter()
        with autocast:
            _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def measure(args: argparse.Namespace) -> str:
    torch.set_num_threads(1)
    spec = MODELS[args.model]
    dtype = torch.bfloat16 if args.precision == "bf16-mixed" else torch.float32
    with torch.device("meta"):
        meta = gpt_class(spec.tied)(spec.config())
    tokens = spec.micro_batch * spec.block_size
    flops = meta.flops_per_token() * tokens
    peak = matmul_peak("bf16" if dtype == torch.bfloat16 else "fp32")
    mm_s, mm_f = matmul_time(linear_shapes(meta), tokens, dtype)
    attn_s = attention_time(spec, dtype)
    n = meta.num_params()
    opt_full, opt_half = optimizer_time(n), optimizer_time(n // 2)
    eager, comp = real_step(spec, args.precision, False), real_step(spec, args.precision, True)
    floor_ddp, floor_zero = mm_s + attn_s + opt_full, mm_s + attn_s + opt_half

    def row(what: str, s: float) -> str:
        return f"| {what} | {s * 1e3:.1f} | {flops / s / peak:.1%} | {s / eager:.2f} |"
    lines = [
        f"model {args.model} ({n / 1e6:.1f}M params), {tokens} tokens a step, precision {args.precision}, "
        f"1 thread; matmul peak {peak / 1e9:.1f} GFLOP/s; model FLOPs {flops / 1e9:.2f} G a step",
        "",
        "| part (one process, one thread) | ms | MFU if the step took only this | x eager step |",
        "|---|---|---|---|",
        row("linear matmuls alone, model shapes", mm_s),
        row("+ attention (SDPA fwd+bwd)", mm_s + attn_s),
        row("+ fused AdamW, all params (DDP): floor", floor_ddp),
        row("+ fused AdamW, half the params (ZeRO-1/2 at 2 ranks): floor", floor_zero),
        row("real step, compiled per block", comp),
        row("real step, eager", eager),
        "",
        f"The matmuls alone run at {mm_f / mm_s / peak:.1%} of the peak at these shapes: no schedule of this "
        f"model's step on these kernels exceeds {flops / floor_zero / peak:.1%} MFU (ZeRO at 2 ranks, no "
        f"communication), and the compiled step is {comp / floor_zero:.2f}x that floor.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt_118m", choices=sorted(MODELS))
    ap.add_argument("--precision", default="32", choices=["32", "bf16-mixed"])
    ap.add_argument("--out", default=None, help="append the table, command, date and CPU to this file")
    args = ap.parse_args(argv)
    table = measure(args)
    print(table, flush=True)
    if args.out:
        import subprocess
        import sys

        from zerotrain.ops.peak import cpu_model
        cpu = cpu_model()
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(args.out, "a") as f:
            f.write(f"\n## MFU floor: {args.model}, precision {args.precision}, "
                    f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC\n\n{table}\n\n"
                    f"Command: `python -m zerotrain.bench.mfu_floor {' '.join(sys.argv[1:])}`; CPU {cpu}; "
                    f"torch {torch.__version__}; commit {commit}.\n")


if __name__ == "__main__":
    main()
