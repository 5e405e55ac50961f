"""Pipeline benchmark: a small GPT-like stack as 1 stage on 1 process vs 2 stages on 2 processes.

Launch (it starts its own processes; run it on a quiet machine)::

    python bench/pipeline_bench.py                       # defaults: 8 blocks, dim 256, m = 4 8 16
    python bench/pipeline_bench.py --layers 4 --dim 64 --seq 32 --steps 3   # a quick, small run

The model is an embedding, ``--layers`` pre-LN transformer blocks (causal attention + MLP) and an
LM head tied to the embedding (a ``TiedLayerSpec``), trained with AdamW through the pipeline
strategy's API in the Trainer's order. Every process uses ``--threads`` threads, standing for one
device per stage, so "1 stage" is one device doing all the work and "2 stages" is two devices.
Both modes see the same global batch: ``m`` micro-batches of ``--rows`` sequences.

For each number of micro-batches ``m`` the table gives the median step time of both modes, the
speed-up, and the bubble: measured as the fraction of a 2-stage step a stage spends outside its
forward/backward compute (waiting on or moving activations; averaged over the stages), against the
theoretical ``(p - 1) / (m + p - 1)`` for equal stages and free communication.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from zerotrain.strategies.environment import detect, free_port
from zerotrain.strategies.pipeline import LayerSpec, PipelineModule, PipelineStrategy, TiedLayerSpec
from zerotrain.strategies.pipeline.schedule import bubble_fraction
from zerotrain.strategies.precision import Precision
from zerotrain.trainer.api.module import TrainModule


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(att)
        return x + self.mlp(self.ln2(x))


def lm_head(emb: nn.Embedding, h: torch.Tensor) -> torch.Tensor:
    return h @ emb.weight.t()


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class GPT(TrainModule):
    def __init__(self, args: argparse.Namespace, stages: int) -> None:
        super().__init__()
        layers = [TiedLayerSpec("embed", nn.Embedding, args.vocab, args.dim)]
        layers += [LayerSpec(Block, args.dim, args.heads) for _ in range(args.layers)]
        layers += [LayerSpec(nn.LayerNorm, args.dim),
                   TiedLayerSpec("embed", nn.Embedding, args.vocab, args.dim, forward_fn=lm_head)]
        self.pipe = PipelineModule(layers, stages, partition_method="parameters", loss_fn=lm_loss)


def measure(args: argparse.Namespace, stages: int, m: int) -> dict:
    """Step times and bubble on this rank for ``m`` micro-batches (process group already up)."""
    strategy = PipelineStrategy(stages=stages, schedule=args.schedule, micro_batches=m)
    strategy.connect(detect(devices=stages), torch.device("cpu"), Precision())
    strategy.setup_environment()
    model = GPT(args, stages)
    strategy.configure_model(model)
    strategy.setup_module(model)
    strategy.setup_optimizer(torch.optim.AdamW(strategy.parameters_for_optimizer(), lr=1e-4))
    gen = torch.Generator().manual_seed(0)
    times, bubbles = [], []
    for step in range(args.warmup + args.steps):
        x = torch.randint(0, args.vocab, (m * args.rows, args.seq), generator=gen)
        y = torch.randint(0, args.vocab, (m * args.rows, args.seq), generator=gen)
        strategy.barrier()  # start every stage together; not timed
        t0 = time.perf_counter()
        loss = strategy.training_step((x, y), step)
        strategy.backward(loss)
        strategy.optimizer_step()
        elapsed = time.perf_counter() - t0
        if step >= args.warmup:
            s = strategy.last_step_stats
            times.append(elapsed)
            bubbles.append(1.0 - s.compute_s / s.wall_s)
    strategy.teardown()
    return {"step_s": statistics.median(times), "bubble": statistics.mean(bubbles)}


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ZEROTRAIN_LAUNCHED="1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    queue.put((rank, {m: measure(args, world, m) for m in args.micro_batches}))
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


def run_two_stages(args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = mp.start_processes(_worker, args=(2, free_port(), args, queue), nprocs=2, join=False,
                               start_method="spawn")
    per_rank = dict(queue.get(timeout=args.timeout) for _ in range(2))
    procs.join()
    return {m: {"step_s": max(per_rank[r][m]["step_s"] for r in per_rank),
                "bubble": statistics.mean(per_rank[r][m]["bubble"] for r in per_rank)}
            for m in args.micro_batches}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--rows", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe", "zb_h1"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="threads per process (one 'device')")
    p.add_argument("--timeout", type=float, default=1800.0)
    args = p.parse_args(argv)

    for var in ("RANK", "WORLD_SIZE", "ZEROTRAIN_LAUNCHED"):
        os.environ.pop(var, None)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    one = {m: measure(args, 1, m) for m in args.micro_batches}
    two = run_two_stages(args)

    print(f"\npipeline bench: {args.layers} blocks, dim {args.dim}, seq {args.seq}, vocab {args.vocab}, "
          f"{args.rows} rows/micro-batch, schedule {args.schedule}, {args.threads} thread(s)/process, "
          f"torch {torch.__version__}\n")
    print("| m | 1 stage step (ms) | 2 stages step (ms) | speed-up | bubble measured | bubble theory (p-1)/(m+p-1) |")
    print("|---|---|---|---|---|---|")
    for m in args.micro_batches:
        t1, t2 = one[m]["step_s"], two[m]["step_s"]
        print(f"| {m} | {t1 * 1e3:.1f} | {t2 * 1e3:.1f} | {t1 / t2:.2f}x | {two[m]['bubble']:.3f} | "
              f"{bubble_fraction(2, m):.3f} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
