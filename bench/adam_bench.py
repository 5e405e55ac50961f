"""The mixed-precision offload optimizer step, per parameter: bf16 gradient in, fp32 master and
Adam state updated, bf16 parameter out.

Rows (each at 1 and 2 threads by default):
  fused      zerotrain.ops.fused_adam_step(..., param_out=bf16): one pass, 28 B/param
             (read master 4 + grad 2 + m 4 + v 4, write master 4 + m 4 + v 4 + param 2)
  torch      grad.float() into a reused fp32 buffer, torch.optim.AdamW(fused=True), copy to bf16
  deepspeed  the same pipeline with DeepSpeedCPUAdam (only when `deepspeed` imports)
  plain      torch AdamW(fused=True) on an fp32 grad with no conversions: the plain Adam step,
             also 28 B/param, for comparison with MACHINE_FACTS

"B/param" is what each row must move at least (no write-allocate counted); "GB/s" is that over the
median step time; "% roofline" divides the useful 28 B/param rate by the one-pass roofline
measured in MACHINE_FACTS.md (a C loop moving exactly 28 B/param at 64M params); "% triad" divides
it by a STREAM-like triad (a = b + s*c, 12 B/element counted) measured here in the same run.

    python bench/adam_bench.py                      # 64M params, 1 and 2 threads
    python bench/adam_bench.py --numel 16000000 --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Optional

import torch

ADAM_BYTES = 28  # the fused step's bytes per parameter (see module docstring)
# MACHINE_FACTS.md: one-pass 28 B/param C loop, 64M params (GB/s) by thread count.
ROOFLINE_GBPS = {1: 25.8, 2: 47.4}
HYPER = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def median_ms(fn: Callable[[], None], repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def triad_gbps(numel: int, repeats: int) -> float:
    a, b, c = torch.empty(numel), torch.rand(numel), torch.rand(numel)
    ms = median_ms(lambda: torch.add(b, c, alpha=3.0, out=a), repeats, warmup=2)
    return 12 * numel / (ms * 1e-3) / 1e9


class Buffers:
    """One parameter's worth of offload buffers (values are irrelevant to speed)."""

    def __init__(self, numel: int) -> None:
        self.master = torch.randn(numel)
        self.grad = (torch.randn(numel) * 1e-3).to(torch.bfloat16)
        self.exp_avg = torch.zeros(numel)
        self.exp_avg_sq = torch.zeros(numel)
        self.param = torch.empty(numel, dtype=torch.bfloat16)
        self.grad32 = self.grad.float()


def fused_step(buf: Buffers, threads: int) -> Callable[[], None]:
    from zerotrain.ops import fused_adam_step

    step = [0]

    def run() -> None:
        step[0] += 1
        fused_adam_step(buf.master, buf.grad, buf.exp_avg, buf.exp_avg_sq, step=step[0],
                        adamw=True, param_out=buf.param, n_threads=threads, **HYPER)

    return run


def pipeline_step(buf: Buffers, make_opt: Callable[[list], torch.optim.Optimizer],
                  convert: bool = True) -> Callable[[], None]:
    master = torch.nn.Parameter(buf.master)
    master.grad = buf.grad32
    opt = make_opt([master])

    def run() -> None:
        if convert:
            buf.grad32.copy_(buf.grad)  # grad.float(), into a reused buffer
        opt.step()
        if convert:
            buf.param.copy_(master.detach())

    return run


def torch_adamw(params: list) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                             eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], fused=True)


def deepspeed_adam() -> tuple[Optional[Callable[[list], torch.optim.Optimizer]], str]:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as exc:  # noqa: BLE001 - any import failure means "skip the row"
        return None, f"deepspeed is not importable ({type(exc).__name__}: {exc})"

    def make(params: list) -> torch.optim.Optimizer:
        return DeepSpeedCPUAdam(params, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                                eps=HYPER["eps"], weight_decay=HYPER["weight_decay"],
                                adamw_mode=True)

    return make, ""


def thp_setting() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=64_000_000)
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    threads_list = [int(t) for t in args.threads.split(",")]

    from zerotrain import ops

    info = ops.kernel_info()
    ds_make, ds_reason = deepspeed_adam()
    n = args.numel
    print(f"numel={n:,}  kernel={info['provider']}/{info['isa']}  torch={torch.__version__}  "
          f"THP: {thp_setting()}")
    if info["error"]:
        print(f"native kernel unavailable: {info['error']}")
    if ds_make is None:
        print(f"DeepSpeedCPUAdam row skipped: {ds_reason}")

    rows = []
    for threads in threads_list:
        torch.set_num_threads(threads)
        triad = triad_gbps(n, args.repeats)
        candidates = [
            ("fused (zerotrain, one pass)", ADAM_BYTES, lambda b: fused_step(b, threads)),
            ("torch: grad.float() + AdamW(fused) + copy to bf16", 40,
             lambda b: pipeline_step(b, torch_adamw)),
        ]
        if ds_make is not None:
            candidates.append(("DeepSpeedCPUAdam pipeline (same conversions)", 40,
                               lambda b: pipeline_step(b, ds_make)))
        candidates.append(("plain torch AdamW(fused), fp32 grad, no copies", ADAM_BYTES,
                           lambda b: pipeline_step(b, torch_adamw, convert=False)))
        for name, bytes_per_param, build in candidates:
            buf = Buffers(n)
            ms = median_ms(build(buf), args.repeats, args.warmup)
            del buf
            useful = ADAM_BYTES * n / (ms * 1e-3) / 1e9
            roof = ROOFLINE_GBPS.get(threads)
            rows.append((threads, name, ms, bytes_per_param, bytes_per_param * n / (ms * 1e-3) / 1e9,
                         f"{100 * useful / roof:.0f}%" if roof else "n/a",
                         f"{100 * useful / triad:.0f}%", triad))

    print()
    print("| threads | method | ms/step | B/param | GB/s | % roofline (28 B) | % triad | triad GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for threads, name, ms, bpp, gbps, roof, tri, triad in rows:
        print(f"| {threads} | {name} | {ms:.1f} | {bpp} | {gbps:.1f} | {roof} | {tri} | {triad:.1f} |")
    print()
    print("B/param: least bytes each method moves (the torch pipeline adds the bf16->fp32 grad "
          "copy, 2+4, and the fp32->bf16 param copy, 4+2). Roofline: MACHINE_FACTS.md's one-pass "
          f"28 B/param loop ({', '.join(f'{t} thread(s): {g} GB/s' for t, g in ROOFLINE_GBPS.items())}"
          "), measured on the reference machine, not here.")


if __name__ == "__main__":
    main()
