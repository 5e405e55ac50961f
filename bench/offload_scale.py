"""How large a GPT trains on this machine: plain fp32 vs ZeRO + CPU offload vs ZeRO + NVMe offload.

    python -m zerotrain.bench.offload_scale --mem-cap-gb 2            # a quick proof that it works
    python -m zerotrain.bench.offload_scale --mem-cap-gb 20 --nvme-path /local_nvme/zt   # the search

For each configuration it walks a ladder of GPT sizes (parameter counts growing by ``--growth``,
25% by default) and runs each candidate, 2 training steps with AdamW through the real Trainer, in
its own process under a memory cap. The first size that fails (out of memory, killed by the cap,
timed out) ends that configuration's search; the table shows the largest size that completed,
with its peak RSS and the time of its last step.

Configurations (``--configs``):

  plain         Trainer(strategy="single"): fp32 params + fp32 grads + torch AdamW(fused) state,
                16 B/param, all in RAM (what DDP holds per process)
  offload_cpu   Offload(stage=S, optimizer_device="cpu"): master weights and Adam state in RAM,
                stepped sub-group by sub-group by the fused kernel
  offload_nvme  Offload(stage=S, optimizer_device="nvme", param_device="nvme" if S == 3): Adam
                state (and with ZeRO-3 the parameter shards) in files under --nvme-path

S is 3 when ZeRO-3 is built (strategies/zero/stage3/*.py), else 2; the header says which. With
stage 2 the fp32 working parameters and the gradient partition stay in RAM (4 + 2 B/param with
the default ``--reduce-dtype bf16``), which bounds what NVMe offload can gain (about 2.5x).
Everything runs in fp32 compute: bf16 matmuls are ~70x slower than fp32 on this AVX2-only CPU.
The offload configurations reduce gradients in bf16 by default (``--reduce-dtype``), halving the
gradient partitions they keep in RAM; plain keeps fp32 gradients.

Measured here (bench/RESULTS.md): with ``--mem-cap-gb 20`` (ZeRO-3, quiet machine) plain 1085M
params (16.61 GiB), offload_cpu 1085M, offload_nvme 3330M (16.51 GiB; the next rung, 4174M, hit
the cap): 3.07x. With ``--mem-cap-gb 2``: plain 101M, offload_nvme 309M (3.06x).

Memory safety: every candidate runs in a child process in its own session, with (1) an RSS
watchdog in the parent polling ``/proc/<pid>/status`` every 20 ms and killing the child's process
group above ``--mem-cap-gb``, and (2) ``RLIMIT_AS`` set in the child to the cap plus
``--as-headroom-gb`` of address space (virtual size runs ~1-3 GiB above RSS for torch), so an
allocation burst between two polls fails inside the child instead of growing (ZeRO-3's parameter
files are memory-mapped, so their size is added to that limit: address space, not RAM). The cap may not be
set above 20 GiB: other people work on this machine. NVMe candidates whose swap files would not
fit on the disk (with 10 GiB to spare) are skipped; each offload_nvme rung prints its disk bytes
per parameter (``zerotrain-estimate``'s, and the measured files') and the largest model the free
disk holds. ``--optimizer-state-dtype bf16`` keeps Adam's moments in bf16 on disk (8 instead of
12 B/param with ZeRO-3 in fp32 compute); ``--grad-device nvme`` moves the gradient partition from
RAM into the swap files (2 B/param more on disk with the bf16 reduction). ``--disk-bound`` first
measures the swap disk's O_DIRECT bandwidth (2 GiB written and read back through zerotrain's I/O
threads; again after each offload_nvme run, the bound using the mean of the two), and puts each
offload_nvme step beside the time the disk needs for the bytes that step
made it move (``/proc/self/io``: O_DIRECT swaps, the parameter files' page faults and readahead,
their dirty pages).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

GiB = 1 << 30
MAX_CAP_GB = 20.0
CONFIGS = ("plain", "offload_cpu", "offload_nvme")


# ---------------------------------------------------------------------------- sizes
@dataclass(frozen=True)
class Shape:
    n_layer: int
    n_embd: int
    vocab_size: int = 256
    block_size: int = 64

    @property
    def n_head(self) -> int:
        return max(1, self.n_embd // 32)  # head dim 32

    def num_params(self) -> int:
        """Exact count for the demo GPT (no biases; tied embedding counted once): per block
        12 d^2 + two LayerNorm weights, plus the embeddings and the final LayerNorm."""
        d = self.n_embd
        return self.n_layer * (12 * d * d + 2 * d) + d * (self.vocab_size + self.block_size) + d


def ladder(start: float, growth: float, count: int, n_layer: int, seq: int) -> list[Shape]:
    """Shapes whose parameter counts grow by about ``growth`` per rung (width a multiple of 32)."""
    shapes: list[Shape] = []
    target = start
    while len(shapes) < count:
        d = max(64, int(round(math.sqrt(target / (12 * n_layer)) / 32)) * 32)
        shape = Shape(n_layer, d, block_size=seq)
        if not shapes or shape.num_params() > shapes[-1].num_params():
            shapes.append(shape)
        target *= growth
    return shapes


# ---------------------------------------------------------------------------- one candidate (child)
def run_child(spec: dict) -> dict:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from zerotrain import Callback, Trainer
    from zerotrain.examples.gpt import GPT, GPTConfig
    from zerotrain.strategies.offload import Offload
    from zerotrain.trainer.api.module import TrainModule

    torch.set_num_threads(spec["threads"])
    shape = Shape(**spec["shape"])
    cfg = GPTConfig(vocab_size=shape.vocab_size, block_size=shape.block_size, n_layer=shape.n_layer,
                    n_head=shape.n_head, n_embd=shape.n_embd)
    steps, batch = spec["steps"], spec["batch"]

    class ScaleGPT(TrainModule):
        def configure_model(self) -> None:
            torch.manual_seed(0)
            self.gpt = GPT(cfg)

        def training_step(self, b, i):
            return self.gpt(b[0], b[1])[1]

        def configure_optimizers(self):
            params = list(self.gpt.parameters())
            groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                      {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
            return torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), fused=True)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            tok = torch.randint(shape.vocab_size, (steps * batch, shape.block_size + 1), generator=g)
            return DataLoader(TensorDataset(tok[:, :-1], tok[:, 1:]), batch_size=batch)

    class Timer(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: list[float] = []

            self.disk: list[dict[str, int]] = []  # per step: bytes this process made the disk move

            #: per step: (phase, seconds, bytes read, bytes written) between the step's marks
            self.phases: list[list[tuple[str, float, int, int]]] = []

        def _mark(self, phase: str) -> None:
            """Close the phase that ran since the last mark (its time and disk traffic)."""
            t, io = time.perf_counter(), proc_io()
            self.phases[-1].append((phase, t - self._mt, io["read"] - self._mio["read"],
                                    io["written"] - self._mio["written"]))
            self._mt, self._mio = t, io

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            self._io = proc_io()
            self._t = time.perf_counter()
            self._mt, self._mio = self._t, self._io
            self.phases.append([])

        def on_before_backward(self, trainer, module, loss) -> None:
            self._mark("forward")

        def on_after_backward(self, trainer, module) -> None:
            self._mark("backward")

        def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
            self._mark("before step")

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self._mark("step")
            self.times.append(time.perf_counter() - self._t)
            io = proc_io()
            self.disk.append({k: io[k] - self._io[k] for k in io})
            self.losses.append(float(outputs.detach()) if torch.is_tensor(outputs) else float("nan"))

    stage = 3
    config = spec["config"]
    if config == "plain":
        strategy = "single"
    else:
        kw = dict(stage=stage, sub_group_size=spec["sub_group_size"], buffer_count=spec["buffer_count"],
                  reduce_dtype=spec["reduce_dtype"])
        if stage == 2:
            kw.update(reduce_bucket_size=spec["bucket"], allgather_bucket_size=spec["bucket"])
        else:
            kw.update(prefetch_bucket_size=spec["bucket"])
        if config == "offload_nvme":
            kw.update(optimizer_device="nvme", nvme_path=spec["nvme_path"],
                      param_device="nvme" if stage == 3 else "none",
                      optimizer_state_dtype=spec["optimizer_state_dtype"], grad_device=spec["grad_device"],
                      param_dtype=spec.get("param_dtype", "auto"), grad_buffer_count=spec.get("grad_buffer_count"))
        strategy = Offload(**kw)
    timer = Timer()
    trainer = Trainer(strategy=strategy, devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, callbacks=[timer])
    trainer.fit(ScaleGPT())
    report = trainer.strategy.offload_report() if config != "plain" else {}
    if config != "plain":
        trainer.strategy.teardown()  # removes the swap files now
    return {"ok": True, "stage": stage if config != "plain" else None, "step_s": timer.times[-1],
            "step_times": timer.times, "losses": timer.losses, "disk_io": timer.disk,
            "phases": timer.phases,
            "io_mode": report.get("io_mode"),
            "disk_bytes": report.get("disk_bytes", 0) + report.get("param_disk_bytes", 0),
            "child_peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "vm_peak": _status_bytes("self", "VmPeak")}


def _child_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    limit = int(spec["as_limit"])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        out = run_child(spec)
    except MemoryError as exc:
        out = {"ok": False, "status": "oom (MemoryError)", "error": str(exc)[:300]}
    except RuntimeError as exc:  # torch reports a failed allocation as RuntimeError
        oom = "alloc" in str(exc).lower() or "memory" in str(exc).lower()
        out = {"ok": False, "status": "oom (allocation failed)" if oom else "error", "error": str(exc)[:300]}
    except Exception as exc:  # noqa: BLE001 - a broken configuration is a result too, not a crash
        out = {"ok": False, "status": f"error: {type(exc).__name__}", "error": str(exc)[:300]}
    print("RESULT " + json.dumps(out), flush=True)


# ---------------------------------------------------------------------------- the parent
def _status_bytes(pid: "int | str", key: str) -> int:
    """A ``kB`` field of ``/proc/<pid>/status`` in bytes (0 if the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def proc_io() -> dict[str, int]:
    """Bytes this process has made the storage read and write so far (``/proc/self/io``:
    ``read_bytes``; ``write_bytes`` less ``cancelled_write_bytes``): O_DIRECT transfers, page
    faults and readahead on the mapped parameter files, and the dirty pages it leaves for writeback."""
    fields = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, value = line.split(":")
            fields[key] = int(value)
    return {"read": fields["read_bytes"], "written": fields["write_bytes"] - fields["cancelled_write_bytes"]}


def measure_disk(directory: str, nbytes: int = 2 * GiB, threads: int = 2, block: int = 8 << 20) -> dict[str, float]:
    """Sequential O_DIRECT bandwidth of the disk under ``directory`` (bytes/s): write ``nbytes``
    (then fsync), read them back, through zerotrain's own I/O threads and block size, as the
    swapper moves its files; the file is removed after."""
    import torch  # noqa: F401  (aio's buffers are tensors)

    from zerotrain.strategies.offload.aio import AsyncFileIO, aligned_empty, open_swap_file

    path = os.path.join(directory, "zt-disk-probe.bin")
    buf = aligned_empty(block * 8)  # 64 MiB of staging, reused
    io = AsyncFileIO(threads=threads, block_bytes=block)
    fd = open_swap_file(path, nbytes, direct=True)
    try:
        out = {}
        for kind in ("write", "read"):
            start = time.perf_counter()
            for offset in range(0, nbytes, buf.numel()):
                (io.write if kind == "write" else io.read)(fd, buf, offset).wait()
            if kind == "write":
                os.fsync(fd)
            out[kind] = nbytes / (time.perf_counter() - start)
        return out
    finally:
        io.close()
        os.close(fd)
        os.remove(path)


def disk_bound(row: dict, bandwidth: dict[str, float]) -> dict[str, float]:
    """The last step's disk traffic, the time the disk needs for it at the measured sequential
    bandwidths (reads and writes one after the other: one device), and the step against it."""
    io = row["disk_io"][-1]
    bound = io["read"] / bandwidth["read"] + io["written"] / bandwidth["write"]
    return {"step_read": io["read"], "step_written": io["written"], "bound_s": bound,
            "vs_bound": row["step_s"] / bound if bound else float("inf")}


def _rss(pid: int) -> int:
    return _status_bytes(pid, "VmRSS")


def run_candidate(spec: dict, cap_bytes: int, timeout_s: float) -> dict:
    """Run one candidate in a child process under the watchdog; returns its result + peak RSS."""
    cmd = [sys.executable, "-m", "zerotrain.bench.offload_scale", "--child", json.dumps(spec)]
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]))
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    peak, status = 0, None
    try:
        while proc.poll() is None:
            rss = _rss(proc.pid)
            peak = max(peak, rss)
            if rss > cap_bytes:
                os.killpg(proc.pid, signal.SIGKILL)
                status = f"killed: RSS {rss / GiB:.2f} GiB > cap"
                break
            if time.monotonic() - start > timeout_s:
                os.killpg(proc.pid, signal.SIGKILL)
                status = f"timeout after {timeout_s:.0f} s"
                break
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    result: dict = {"ok": False, "status": status or f"exit {proc.returncode}", "error": err[-400:]}
    for line in out.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
    if status:
        result.update(ok=False, status=status)
    result["peak_rss"] = max(peak, result.get("child_peak_rss", 0))
    result["wall_s"] = time.monotonic() - start
    return result


#: disk kept free beside the swap and parameter files
DISK_MARGIN = 10 * GiB


def disk_plan(n: int, args: argparse.Namespace) -> dict:
    """Bytes offload_nvme puts on disk for ``n`` parameters (``zerotrain-estimate``'s: Adam state
    in swap files, parameter shards in files), per parameter, and the largest model the free disk
    holds less :data:`DISK_MARGIN` (RAM is not counted: the cap decides that by running). Imported
    here: the parent process stays free of torch."""
    from zerotrain.strategies.zero.estimate import estimate_offload, largest_offload_model

    opts = dict(stage=3, precision="32", optimizer_device="nvme", param_device="nvme",
                optimizer_state_dtype=args.optimizer_state_dtype, grad_bytes=2 if args.reduce_dtype == "bf16" else 4,
                sub_group_size=args.sub_group_size, buffer_count=args.buffer_count, grad_device=args.grad_device,
                param_dtype=args.param_dtype, grad_buffer_count=args.grad_buffer_count)
    disk = estimate_offload(n, 1, **opts).disk.total
    free = shutil.disk_usage(args.nvme_path).free
    bound = largest_offload_model(float("inf"), max(0, free - DISK_MARGIN), 1, **opts)
    return {"disk_need": disk, "disk_per_param": disk / n, "disk_free": free, "disk_bound_params": bound}


def search(config: str, shapes: list[Shape], args: argparse.Namespace, cap: int) -> list[dict]:
    rows = []
    for shape in shapes:
        n = shape.num_params()
        row = {"config": config, "params": n, "shape": asdict(shape)}
        if config == "offload_nvme":
            row.update(disk_plan(n, args))
            need, free = row["disk_need"] + DISK_MARGIN, row["disk_free"]
            if need > free:
                row.update(ok=False, status=f"skipped: swap needs {need / GiB:.0f} GiB, disk has "
                                            f"{free / GiB:.0f} GiB free")
                rows.append(row)
                _print_row(row)
                break
        spec = {"config": config, "shape": asdict(shape), "steps": args.steps, "batch": args.batch,
                "threads": args.threads, "nvme_path": args.nvme_path, "sub_group_size": args.sub_group_size,
                "buffer_count": args.buffer_count, "reduce_dtype": args.reduce_dtype, "bucket": args.bucket,
                "optimizer_state_dtype": args.optimizer_state_dtype, "grad_device": args.grad_device,
                "param_dtype": args.param_dtype, "grad_buffer_count": args.grad_buffer_count,
                # address space: the cap + headroom, + the parameter files ZeRO-3 maps (not RAM)
                "as_limit": int(cap + args.as_headroom_gb * GiB
                                + ((6 if args.param_dtype == "bf16" else 4) * n if config == "offload_nvme" else 0))}
        row.update(run_candidate(spec, cap, args.timeout_s))
        if row.get("ok") and config == "offload_nvme" and args.disk_bandwidth:
            # the disk's speed drifts (a shared virtual disk: 0.30-0.56 GB/s for writes within an
            # hour here), so it is probed again after the run and the bound uses the mean of the
            # two probes; the bound at each probe alone is reported beside it
            before, after = args.disk_bandwidth, measure_disk(args.nvme_path)
            mean = {k: (before[k] + after[k]) / 2 for k in before}
            row["disk_bandwidth"] = {"before": before, "after": after, "mean": mean}
            row.update(disk_bound(row, mean))
            row["vs_bound_each"] = [disk_bound(row, bw)["vs_bound"] for bw in (before, after)]
        rows.append(row)
        _print_row(row)
        if not row["ok"]:
            break
    return rows


def _print_row(row: dict) -> None:
    s = row["shape"]
    what = (f"ok   step {row['step_s']:.2f} s" if row.get("ok") else f"FAIL {row.get('status')}")
    disk = ""
    if "disk_per_param" in row:  # offload_nvme: estimated (and, once run, measured) disk bytes
        measured = f", measured {row['disk_bytes'] / row['params']:.2f}" if row.get("disk_bytes") else ""
        disk = (f"  disk {row['disk_per_param']:.2f} B/param{measured}; free disk holds "
                f"{row['disk_bound_params'] / 1e6:.0f}M")
    print(f"  {row['config']:<13} {row['params'] / 1e6:9.1f}M  (L={s['n_layer']}, d={s['n_embd']})  "
          f"peak RSS {row.get('peak_rss', 0) / GiB:6.2f} GiB  {what}{disk}", flush=True)
    if row.get("ok"):
        print(f"                losses {', '.join(f'{x:.4f}' for x in row['losses'])}", flush=True)
    if row.get("ok") and row.get("phases"):  # the last step, phase by phase
        parts = [f"{name} {sec:.1f} s ({rd / 1e9:.1f} GB r, {wr / 1e9:.1f} GB w)"
                 for name, sec, rd, wr in row["phases"][-1] if sec >= 0.05 or rd or wr]
        print(f"                last step: {'; '.join(parts)}", flush=True)
    if "bound_s" in row:
        after, mean = row["disk_bandwidth"]["after"], row["disk_bandwidth"]["mean"]
        each = row["vs_bound_each"]
        print(f"                disk after the run: write {after['write'] / 1e9:.2f} GB/s, read {after['read'] / 1e9:.2f} GB/s "
              f"(mean of the two probes: write {mean['write'] / 1e9:.2f}, read {mean['read'] / 1e9:.2f})", flush=True)
        print(f"                last step moved {row['step_read'] / 1e9:.1f} GB read + {row['step_written'] / 1e9:.1f} GB "
              f"written: disk bound {row['bound_s']:.1f} s, step {row['vs_bound']:.2f}x the bound "
              f"({each[0]:.2f}x at the probe before the run, {each[1]:.2f}x at the one after)", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mem-cap-gb", type=float, default=None, help=f"RSS cap per candidate (<= {MAX_CAP_GB}; required)")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--nvme-path", default=None, help="swap directory (default: a temp dir on /tmp's disk)")
    p.add_argument("--start-params", type=float, default=None, help="first rung (default: cap / 64 B)")
    p.add_argument("--growth", type=float, default=1.25)
    p.add_argument("--max-rungs", type=int, default=40)
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sub-group-size", type=int, default=4_000_000)
    p.add_argument("--buffer-count", type=int, default=4)
    p.add_argument("--reduce-dtype", default="bf16", choices=("fp32", "bf16"))
    p.add_argument("--optimizer-state-dtype", default="fp32", choices=("fp32", "bf16"),
                   help="offload_nvme: dtype of Adam's moments in the swap files (bf16: half the bytes)")
    p.add_argument("--grad-device", default="cpu", choices=("cpu", "nvme"),
                   help="offload_nvme: where the gradient partition waits for the step (nvme: in the swap "
                        "files, --reduce-dtype bytes/param more on disk, none in RAM)")
    p.add_argument("--param-dtype", default="auto", choices=("auto", "bf16"),
                   help="offload_nvme: the parameter files' working dtype (bf16: a bf16 shard the gathers read, "
                        "beside the fp32 master: 2 B/param more on disk, half the bytes read per gather)")
    p.add_argument("--grad-buffer-count", type=int, default=None,
                   help="offload_nvme with --grad-device nvme: staging buffers for backward's gradient writes "
                        "(how many sub-groups' writes may be in flight; default: --buffer-count)")
    p.add_argument("--bucket", type=int, default=5_000_000,
                   help="elements: ZeRO-2 reduce/all-gather buckets, ZeRO-3 prefetch")
    p.add_argument("--as-headroom-gb", type=float, default=3.0)
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--json", default=None, help="write every row here")
    p.add_argument("--disk-bound", action="store_true",
                   help="measure the swap disk's O_DIRECT bandwidth first and put each offload_nvme step "
                        "beside the time its measured disk traffic needs at that bandwidth")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        _child_main(args.child)
        return 0
    if args.mem_cap_gb is None or not 0 < args.mem_cap_gb <= MAX_CAP_GB:
        p.error(f"--mem-cap-gb={args.mem_cap_gb} must be in (0, {MAX_CAP_GB}]: others share this machine")
    configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        p.error(f"--configs: unknown {bad}; valid choices: {', '.join(CONFIGS)}")
    cap = int(args.mem_cap_gb * GiB)
    made_tmp = args.nvme_path is None
    if made_tmp:
        args.nvme_path = tempfile.mkdtemp(prefix="zt-offload-bench-")
    os.makedirs(args.nvme_path, exist_ok=True)
    start = args.start_params or cap / 64
    shapes = ladder(start, args.growth, args.max_rungs, args.n_layer, args.seq)
    args.disk_bandwidth = measure_disk(args.nvme_path) if args.disk_bound else None
    if args.disk_bandwidth:
        print(f"disk under {args.nvme_path}: O_DIRECT sequential write {args.disk_bandwidth['write'] / 1e9:.2f} GB/s, "
              f"read {args.disk_bandwidth['read'] / 1e9:.2f} GB/s (2 GiB, 8 MiB blocks, 2 threads)", flush=True)

    stage = 3
    print(f"offload_scale: cap {args.mem_cap_gb} GiB RSS per run, {args.steps} steps, fp32 compute, "
          f"GPT L={args.n_layer} seq={args.seq} batch={args.batch}, {args.threads} threads; offload uses "
          f"ZeRO stage {stage}" + ("" if stage == 3 else " (ZeRO-3 is not built: stage 2 fallback, "
                                   "no parameter offload)") + f"; swap dir {args.nvme_path}", flush=True)
    rows = []
    try:
        for config in configs:
            rows += search(config, shapes, args, cap)
    finally:
        if made_tmp:
            shutil.rmtree(args.nvme_path, ignore_errors=True)
    best = {c: max((r for r in rows if r["config"] == c and r.get("ok")), key=lambda r: r["params"],
                   default=None) for c in configs}
    base = best.get("plain")
    print("\nlargest size that completed:")
    print(f"  {'config':<13} {'params':>10} {'x plain':>8} {'peak RSS':>10} {'step':>9}")
    for c in configs:
        r = best[c]
        if r is None:
            print(f"  {c:<13} {'none':>10}")
            continue
        ratio = f"{r['params'] / base['params']:.2f}" if base else "-"
        print(f"  {c:<13} {r['params'] / 1e6:9.1f}M {ratio:>8} {r['peak_rss'] / GiB:8.2f} GiB "
              f"{r['step_s']:8.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "stage": stage, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
