"""gloo's own all-gather and reduce-scatter beside the forms ``strategies/zero/comm/collectives.py`` uses on
gloo, and the all-reduce DDP uses, on 2 local processes x 1 thread.

    python -m zerotrain.bench.comm_bench --sizes 4,16,64 --repeats 9

Per message size (MB of the whole buffer: an all-gather's output, a reduce-scatter's input, as
``instrument`` counts them), each rank times every case in turn, interleaved, between barriers;
the figure is the median over repeats of the slowest rank, with the algorithm bandwidth beside
it. ``zerotrain`` rows call the library's own ``comm.all_gather_into`` /
``comm.reduce_scatter_sum`` / ``comm.reduce_to_owners`` (one broadcast per rank / one all-to-all
and a rank-order sum / the same with uneven pieces), ``gloo`` rows ``all_gather_into_tensor`` /
``reduce_scatter_tensor`` / ``reduce``. "reduce to one owner" is a ZeRO-1/2 bucket that lies
wholly in the last rank's partition.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import warnings

import torch
import torch.distributed as dist

from zerotrain.strategies.zero.comm import collectives as comm


def cases(numel: int, world: int) -> dict:
    x = torch.randn(numel)
    shard = torch.randn(numel // world)
    out, full, scratch = torch.empty(numel // world), torch.empty(numel), torch.empty(numel * world)
    return {
        "all_reduce (DDP's)": lambda: dist.all_reduce(x),
        "reduce_scatter: gloo": lambda: dist.reduce_scatter_tensor(out, x),
        "reduce_scatter: zerotrain": lambda: comm.reduce_scatter_sum(out, x, scratch=scratch).wait(),
        # a zero1/zero2 bucket wholly inside the last rank's partition: every other rank sends it
        "reduce to one owner: gloo": lambda: dist.reduce(x, dst=world - 1),
        "reduce to one owner: zerotrain": lambda: comm.reduce_to_owners(x, [0] * (world - 1) + [numel],
                                                                        scratch=scratch).wait(),
        "all_gather: gloo": lambda: dist.all_gather_into_tensor(full, shard),
        "all_gather: zerotrain": lambda: comm.all_gather_into(full, shard).wait(),
    }


def worker(args: argparse.Namespace) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 renamed gloo's two here
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for mb in args.sizes:
        numel = int(mb * 2**20) // 4 // world * world
        fns = cases(numel, world)
        times: dict[str, list[float]] = {k: [] for k in fns}
        for fn in fns.values():  # warm-up: first-touch of every buffer
            fn()
        for _ in range(args.repeats):
            for name, fn in fns.items():
                dist.barrier()
                start = time.perf_counter()
                fn()
                t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times[name].append(float(t))
        for name, ts in times.items():
            med = sorted(ts)[len(ts) // 2]
            rows.append(f"| {mb:g} | {name} | {med * 1e3:.1f} | {mb * 2**20 / med / 1e9:.2f} |")
    if rank == 0:
        print("| MB | collective | median ms | algbw GB/s |\n|---|---|---|---|\n" + "\n".join(rows), flush=True)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="4,16,64", help="comma list of message sizes in MB")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sizes = [float(s) for s in str(args.sizes).split(",") if s]
    if args.worker:
        worker(args)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
           "-m", "zerotrain.bench.comm_bench", "--worker", "--sizes", ",".join(map(str, args.sizes)),
           "--repeats", str(args.repeats)]
    print(f"`python -m zerotrain.bench.comm_bench {' '.join(sys.argv[1:] if argv is None else argv)}`\n", flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=1800)


if __name__ == "__main__":
    main()
