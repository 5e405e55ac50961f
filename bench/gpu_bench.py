"""One GPU: NCCL on a single rank, the demo GPT at 124M in bf16, and the largest GPT that trains
with CPU offload. Run by ``bench/gpu_check.sh`` (which says how); each part also runs alone:

    python -m zerotrain.bench.gpu_bench nccl
    python -m zerotrain.bench.gpu_bench measure --steps 10 --warmup 3 --out /tmp/gpu.md
    python -m zerotrain.bench.gpu_bench ladder --budget-s 150 --out /tmp/gpu.md

``measure``: the GPT (``--n-layer 12 --n-embd 768 --seq 1024``, vocab 50304: GPT-2 small's 124M)
on one GPU in bf16-mixed, each system in a process of its own: ``torch`` (a plain loop, fused
AdamW, bf16 autocast), ``zt_single`` and ``zt_offload`` (zerotrain's Trainer, strategy ``single``
and ``offload_cpu``: ZeRO-2 with the optimizer on the host), ``ds_offload`` (DeepSpeed ZeRO-2 with
its optimizer offloaded, only where ``import deepspeed`` works). Tokens/s, TFLOP/s and MFU against
the GPU's table peak (``callbacks/measure/flops.py``), peak GPU memory (``max_memory_allocated``).

``ladder``: ``torch`` and ``zt_offload`` on GPTs of growing width (24 layers; 2 steps each) until
one fails (out of memory) or ``--budget-s`` is spent: the largest size each trains, its TFLOP/s
and the ratio of the two (ZeRO-Offload's claim: about 10x plain PyTorch's).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SYSTEMS = ("torch", "zt_single", "zt_offload", "ds_offload")


def nccl_check() -> None:
    """A single-rank NCCL group: every collective zerotrain uses, on CUDA tensors, checked."""
    import datetime

    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    dev = torch.device("cuda", 0)
    x = torch.arange(8.0, device=dev)
    dist.all_reduce(x)
    dist.broadcast(x, 0)
    out = torch.empty(8, device=dev)
    dist.all_gather_into_tensor(out, x)
    red = torch.empty(8, device=dev)
    dist.reduce_scatter_tensor(red, x)
    dist.barrier()
    assert torch.equal(out, torch.arange(8.0, device=dev)) and torch.equal(red, out), (out, red)
    dist.destroy_process_group()
    print(f"nccl single rank: all_reduce, broadcast, all_gather_into_tensor, reduce_scatter_tensor, barrier ok "
          f"(torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}, {torch.cuda.get_device_name(0)})")


def _config(args: argparse.Namespace):
    from zerotrain.examples.gpt import GPTConfig
    return GPTConfig(vocab_size=50304, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_embd // 64,
                     n_embd=args.n_embd)


def worker(args: argparse.Namespace) -> dict:
    """One system's run on this process's GPU; returns its figures."""
    import torch

    from zerotrain.ops.peak import gpu_peak_flops
    from zerotrain.examples.gpt import GPT

    cfg, dev, steps = _config(args), torch.device("cuda", 0), args.warmup + args.steps
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size + 1), generator=g) for _ in range(steps)]
    batches = [(d[:, :-1].to(dev), d[:, 1:].to(dev)) for d in data]
    times: list[float] = []
    torch.manual_seed(0)
    model = GPT(cfg)
    flops_per_step = model.flops_per_token() * args.batch * cfg.block_size
    n_params = model.num_params()

    def timed(step_fn):
        for x, y in batches:
            torch.cuda.synchronize()
            start = time.perf_counter()
            step_fn(x, y)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)

    if args.worker == "torch":
        model = model.to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def step(x, y):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, y)[1]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        timed(step)
    elif args.worker == "ds_offload":
        import deepspeed
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
            "train_micro_batch_size_per_gpu": args.batch, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}})

        def step(x, y):
            loss = engine(x, y)[1]
            engine.backward(loss)
            engine.step()
        timed(step)
    else:
        from zerotrain import Callback, Trainer, TrainModule

        class Module(TrainModule):
            def __init__(self) -> None:
                super().__init__()
                self.model = model

            def training_step(self, batch, batch_idx):
                return self.model(*batch)[1]

            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=args.worker == "zt_single")

        class Timer(Callback):
            def on_train_batch_start(self, trainer, module, batch, batch_idx):
                torch.cuda.synchronize()
                self.start = time.perf_counter()

            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
                torch.cuda.synchronize()
                times.append(time.perf_counter() - self.start)

        strategy = "single" if args.worker == "zt_single" else "offload_cpu"
        Trainer(accelerator="cuda", devices=1, strategy=strategy, precision="bf16-mixed", max_steps=steps,
                logger=False, enable_checkpointing=False, enable_progress_bar=False, num_sanity_val_steps=0,
                callbacks=[Timer()]).fit(Module(), train_dataloaders=batches)
    timed_steps = sorted(times[args.warmup:]) or times
    step_s = timed_steps[len(timed_steps) // 2]
    peak = gpu_peak_flops(dev, "bf16")
    return {"system": args.worker, "params": n_params, "step_s": step_s, "tokens_s": args.batch * cfg.block_size / step_s,
            "tflops": flops_per_step / step_s / 1e12, "mfu": flops_per_step / step_s / peak if peak else None,
            "peak_gpu_gb": torch.cuda.max_memory_allocated(dev) / 1e9, "gpu": torch.cuda.get_device_name(dev)}


def _spawn(args: argparse.Namespace, system: str, **shape) -> dict | str:
    """``system`` in a process of its own: its figures, or why it failed."""
    flags = {"--n-layer": args.n_layer, "--n-embd": args.n_embd, "--seq": args.seq, "--batch": args.batch,
             "--steps": args.steps, "--warmup": args.warmup, **{f"--{k.replace('_', '-')}": v for k, v in shape.items()}}
    cmd = [sys.executable, "-m", "zerotrain.bench.gpu_bench", "worker", "--worker", system,
           *[str(a) for kv in flags.items() for a in kv]]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {args.timeout} s"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"exit {proc.returncode}: {tail[0][:200]}"
    return json.loads(lines[-1])


def _row(r: dict) -> str:
    mfu = f"{r['mfu'] * 100:.1f}%" if r.get("mfu") else "-"
    return (f"| {r['system']} | {r['params'] / 1e6:.0f}M | {r['step_s']:.4f} | {r['tokens_s']:,.0f} | "
            f"{r['tflops']:.1f} | {mfu} | {r['peak_gpu_gb']:.2f} |")


HEADER = ["| system | params | step (s) | tokens/s | TFLOP/s | MFU | peak GPU mem (GB) |", "|---|---|---|---|---|---|---|"]


def measure(args: argparse.Namespace) -> str:
    lines = [f"GPT {args.n_layer}x{args.n_embd}, seq {args.seq}, batch {args.batch}, bf16-mixed, "
             f"{args.warmup} warm-up + {args.steps} timed steps (median)", "", *HEADER]
    for system in args.systems.split(","):
        r = _spawn(args, system)
        lines.append(_row(r) if isinstance(r, dict) else f"| {system} | - | {r} | | | | |")
        print(lines[-1], flush=True)
    return "\n".join(lines) + "\n"


def ladder(args: argparse.Namespace) -> str:
    """Growing widths (24 layers, 2 steps), plain torch and zt_offload, until a failure or the budget."""
    start, best, lines = time.perf_counter(), {}, ["Largest GPT per system (24 layers, seq 1024, batch 1, 2 steps)",
                                                   "", *HEADER]
    for system in ("torch", "zt_offload"):
        width = 1024
        while time.perf_counter() - start < args.budget_s:
            r = _spawn(args, system, n_layer=24, n_embd=width, batch=1, steps=1, warmup=1)
            print(f"  {system} width {width}: {_row(r) if isinstance(r, dict) else r}", flush=True)
            if not isinstance(r, dict):
                break
            best[system] = r
            width = int(width * 1.5) // 64 * 64
    lines += [_row(r) for r in best.values()]
    if len(best) == 2:
        lines.append(f"\nzt_offload / torch: {best['zt_offload']['params'] / best['torch']['params']:.1f}x the "
                     f"parameters (each the largest width that completed within the {args.budget_s:.0f} s budget)")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=("nccl", "measure", "ladder", "worker"))
    p.add_argument("--worker", choices=SYSTEMS)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=150.0)
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per system's process")
    p.add_argument("--out", help="append the tables to this markdown file")
    args = p.parse_args(argv)
    bad = [s for s in args.systems.split(",") if s not in SYSTEMS]
    if bad:
        p.error(f"--systems: unknown {bad}; valid choices: {', '.join(SYSTEMS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.what == "nccl":
        return nccl_check()
    if args.what == "worker":
        print(json.dumps(worker(args)), flush=True)
        return None
    text = measure(args) if args.what == "measure" else ladder(args)
    print(text, flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "a") as f:
            f.write("\n" + text)
    return None


if __name__ == "__main__":
    main()
