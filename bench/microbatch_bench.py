"""What splitting a batch into pipeline micro-batches costs in compute, one process, one thread.

    python -m zerotrain.bench.microbatch_bench --repeats 6

One GPT block of the 118M model (d=1024, 16 heads, seq 256), forward and backward of 4 rows:
as one micro-batch of 4 (what a data-parallel rank runs), as 4 micro-batches of 1 (a 2-stage
pipeline's m=8 over 8 rows), with autograd's gradient accumulation or with the zero-bubble
schedule's deferred weight gradients (``DeferWeightGrads`` then ``apply_weight_grads``, which
accumulates in place), and 2 of 2 deferred. The cases run interleaved; min and median over
repeats. The ratio to the single micro-batch is the pipeline's compute overhead per stage
before any bubble.
"""
from __future__ import annotations

import argparse
import time

import torch

from zerotrain.examples.gpt import Block, GPTConfig
from zerotrain.strategies.pipeline.weight_grad import DeferWeightGrads, apply_weight_grads

CASES = {"4 rows x 1 (autograd)": (4, 1, False), "1 row x 4 (autograd)": (1, 4, False),
         "4 rows x 1 (deferred W)": (4, 1, True), "1 row x 4 (deferred W)": (1, 4, True),
         "2 rows x 2 (deferred W)": (2, 2, True)}


def run(block: Block, rows: int, micro_batches: int, defer: bool) -> float:
    for p in block.parameters():
        p.grad = None
    start = time.perf_counter()
    for _ in range(micro_batches):
        x = torch.randn(rows, 256, 1024, requires_grad=True)
        stash: list = []
        if defer:
            with DeferWeightGrads(stash):
                y = block(x)
        else:
            y = block(x)
        y.backward(torch.ones_like(y))
        apply_weight_grads(stash)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    block = Block(GPTConfig(vocab_size=8192, block_size=256, n_layer=1, n_head=16, n_embd=1024))
    times: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(args.repeats):
        for name, case in CASES.items():
            times[name].append(run(block, *case))
    base = min(times["4 rows x 1 (autograd)"])
    print("| case | min (s) | median (s) | min x 4 rows x 1 |\n|---|---|---|---|")
    for name, values in times.items():
        values.sort()
        print(f"| {name} | {values[0]:.3f} | {values[len(values) // 2]:.3f} | {values[0] / base:.3f} |")


if __name__ == "__main__":
    main()
