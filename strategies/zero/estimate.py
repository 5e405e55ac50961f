"""Per-rank memory of the model states (parameters, gradients, fp32 masters, optimizer state) for
each way of distributing them, from the ZeRO paper's formulas.

With Adam in mixed precision a parameter costs 2 (working copy) + 2 (gradient) + 12 (fp32 master,
exp_avg, exp_avg_sq) bytes. On N ranks, with Psi parameters:

    ddp    2Psi + 2Psi + 12Psi          (everything replicated)
    zero1  2Psi + 2Psi + 12Psi/N        (optimizer states partitioned)
    zero2  2Psi + 14Psi/N               (... and gradients)
    zero3  16Psi/N                      (... and parameters)

In fp32 the working copy is the master, so a parameter costs 4 + 4 + 8 bytes. Activations,
communication buckets and allocator slack are not model states and are not counted.

``zerotrain-estimate --num-params 1.3e9 --world-size 8`` or
``zerotrain-estimate --n-layer 12 --n-embd 768 --vocab-size 50257 --world-size 2,4``.

With the Offload strategy part of the state is on disk (:func:`estimate_offload`): e.g.
``zerotrain-estimate --num-params 3.3e9 --offload-stage 3 --optimizer-state-dtype bf16
--ram-gb 20 --disk-gb 74`` prints the RAM and disk per rank and the largest model that fits.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Sequence

#: precision -> bytes per parameter of (working param, gradient, fp32 master, optimizer state)
PRECISION_BYTES = {
    "32": (4, 4, 0, 8),
    "bf16-mixed": (2, 2, 4, 8),
    "16-mixed": (2, 2, 4, 8),
}
STAGES = ("ddp", "zero1", "zero2", "zero3")
#: which of (params, grads, master, optimizer) each stage partitions over the ranks
_PARTITIONED = {
    "ddp": (False, False, False, False),
    "zero1": (False, False, True, True),
    "zero2": (False, True, True, True),
    "zero3": (True, True, True, True),
}


@dataclass(frozen=True)
class ModelStates:
    """Bytes one rank holds."""

    params: int
    grads: int
    master: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master + self.optimizer


def estimate_model_states(num_params: int, world_size: int, precision: str = "bf16-mixed", *,
                          param_bytes: int | None = None, grad_bytes: int | None = None,
                          master_bytes: int | None = None, optimizer_bytes: int | None = None,
                          ) -> dict[str, ModelStates]:
    """Per-rank model-state bytes for every stage. ``optimizer_bytes`` is the optimizer's state
    per parameter (Adam: 8, SGD with momentum: 4); the other ``*_bytes`` override the precision's
    defaults (e.g. ``grad_bytes=4`` for ZeRO-2 gradient partitions kept in fp32)."""
    if num_params < 0:
        raise ValueError(f"num_params={num_params} must be >= 0")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision={precision!r}; valid choices: {', '.join(PRECISION_BYTES)}")
    defaults = PRECISION_BYTES[precision]
    given = (param_bytes, grad_bytes, master_bytes, optimizer_bytes)
    per_param = [d if g is None else g for d, g in zip(defaults, given)]
    for name, b in zip(("param_bytes", "grad_bytes", "master_bytes", "optimizer_bytes"), per_param):
        if b < 0:
            raise ValueError(f"{name}={b} must be >= 0")
    shard = math.ceil(num_params / world_size)
    return {stage: ModelStates(*(b * (shard if part else num_params)
                                 for b, part in zip(per_param, _PARTITIONED[stage])))
            for stage in STAGES}


#: bytes per element of Adam's moments in each ``optimizer_state_dtype``
STATE_DTYPE_BYTES = {"fp32": 4, "bf16": 2}
OFFLOAD_STAGES = (2, 3)
OPTIMIZER_DEVICES = ("cpu", "nvme")
PARAM_DEVICES = ("none", "cpu", "nvme")
GRAD_DEVICES = ("cpu", "nvme")
#: ZeRO-3 parameter files' working dtype (``OffloadPolicy.param_dtype``)
PARAM_DTYPES = ("auto", "bf16")


@dataclass(frozen=True)
class OffloadBytes:
    """Bytes one rank holds in RAM and on disk with the Offload strategy (``ram.optimizer``
    includes the swap staging buffers; ``disk.params`` is the ZeRO-3 parameter files, which hold
    the working shard and, in mixed precision, the fp32 master shard)."""

    ram: ModelStates
    disk: ModelStates


def estimate_offload(num_params: int, world_size: int = 1, stage: int = 3, precision: str = "32", *,
                     optimizer_device: str = "nvme", param_device: str = "nvme",
                     optimizer_state_dtype: str = "fp32", grad_bytes: int | None = None,
                     sub_group_size: int = 10_000_000, buffer_count: int = 4,
                     grad_device: str = "cpu", param_dtype: str = "auto",
                     grad_buffer_count: int | None = None) -> OffloadBytes:
    """Per-rank bytes of ``Offload(stage, optimizer_device, param_device, optimizer_state_dtype)``
    as it lays things out (page padding of the swap files aside). With ``Psi`` parameters, shard
    ``S = ceil(Psi / world_size)``, working bytes ``p`` (4 fp32, 2 mixed), gradient bytes ``g``
    (the reduce dtype; the precision's by default) and moment bytes ``s`` (4 fp32, 2 bf16):

    * working parameters: ``p * Psi`` in RAM (stage 2); ``p * S`` (stage 3), on disk with
      ``param_device="nvme"``;
    * gradient partition: ``g * S``, in RAM, or in the swap files with ``grad_device="nvme"``
      (stage 3 with ``optimizer_device="nvme"``), ``grad_buffer_count`` (``buffer_count`` by
      default) sub-groups of it staged in RAM;
    * fp32 master: none of its own in fp32 compute (the working parameters are the master);
      mixed: ``4 * S`` beside the working shard (stage 3 parameter files), in the swap files
      (stage 2 with ``optimizer_device="nvme"``) or in RAM; ``param_dtype="bf16"`` in fp32
      compute: a bf16 working shard (``p = 2``) beside the fp32 master in the parameter files;
    * Adam's moments: ``2 * s * S``, in the swap files with ``optimizer_device="nvme"``, else in
      RAM (fp32: ``optimizer_state_dtype="bf16"`` needs NVMe);
    * with swap files, ``buffer_count`` staging buffers of one sub-group's swapped bytes in RAM.
    """
    if stage not in OFFLOAD_STAGES:
        raise ValueError(f"stage={stage!r}; valid choices: 2, 3")
    for name, value, valid in (("optimizer_device", optimizer_device, OPTIMIZER_DEVICES),
                               ("param_device", param_device, PARAM_DEVICES),
                               ("optimizer_state_dtype", optimizer_state_dtype, tuple(STATE_DTYPE_BYTES)),
                               ("grad_device", grad_device, GRAD_DEVICES),
                               ("param_dtype", param_dtype, PARAM_DTYPES)):
        if value not in valid:
            raise ValueError(f"{name}={value!r}; valid choices: {', '.join(valid)}")
    if param_device != "none" and stage != 3:
        raise ValueError(f"param_device={param_device!r} needs stage=3; valid with stage={stage}: 'none'")
    if optimizer_state_dtype != "fp32" and optimizer_device != "nvme":
        raise ValueError(f"optimizer_state_dtype={optimizer_state_dtype!r} needs optimizer_device='nvme'; "
                         f"valid with optimizer_device={optimizer_device!r}: 'fp32'")
    if grad_device == "nvme" and (stage != 3 or optimizer_device != "nvme"):
        raise ValueError(f"grad_device='nvme' needs stage=3 and optimizer_device='nvme'; valid with stage={stage}, "
                         f"optimizer_device={optimizer_device!r}: 'cpu'")
    if param_dtype != "auto" and param_device != "nvme":
        raise ValueError(f"param_dtype={param_dtype!r} needs param_device='nvme'; valid with "
                         f"param_device={param_device!r}: 'auto'")
    p, g, m, _ = PRECISION_BYTES[_precision(precision)]
    g = g if grad_bytes is None else grad_bytes
    if param_dtype == "bf16" and m == 0:  # fp32 compute: a bf16 working shard beside the fp32 master
        p, m = 2, 4
    shard = math.ceil(_whole(num_params, "num_params") / _whole(world_size, "world_size", 1))
    params = p * (num_params if stage == 2 else shard)
    master, moments = m * shard, 2 * STATE_DTYPE_BYTES[optimizer_state_dtype] * shard
    params_on_disk = param_device == "nvme"
    # stage 3 keeps the master beside its working shard (the unit's, in files or RAM); stage 2
    # swaps it with the moments when it is a separate copy
    master_on_disk = params_on_disk if stage == 3 else optimizer_device == "nvme"
    on_disk = optimizer_device == "nvme"
    swapped_per_elem = (m if master_on_disk and stage == 2 else 0) + 2 * STATE_DTYPE_BYTES[optimizer_state_dtype]
    staging = buffer_count * min(sub_group_size, shard) * swapped_per_elem if on_disk else 0
    grads_on_disk = grad_device == "nvme"
    grad_buffers = buffer_count if grad_buffer_count is None else grad_buffer_count
    grad_staging = grad_buffers * min(sub_group_size, shard) * g
    ram = ModelStates(0 if params_on_disk else params, grad_staging if grads_on_disk else g * shard,
                      0 if master_on_disk else master, staging if on_disk else moments)
    disk = ModelStates(params if params_on_disk else 0, g * shard if grads_on_disk else 0,
                       master if master_on_disk else 0, moments if on_disk else 0)
    return OffloadBytes(ram, disk)


def largest_offload_model(ram_bytes: float, disk_bytes: float, world_size: int = 1, **options) -> int:
    """The largest parameter count whose ``estimate_offload(...)`` fits, all ``world_size`` ranks
    together, in ``ram_bytes`` of RAM and ``disk_bytes`` of disk (both are one machine's, shared by
    its ranks). Found by bisection, so it holds for any option combination: it fits, one more
    parameter per rank does not."""
    def fits(n: int) -> bool:
        est = estimate_offload(n, world_size, **options)
        return est.ram.total * world_size <= ram_bytes and est.disk.total * world_size <= disk_bytes

    if not fits(0):
        return 0
    hi = 1
    while fits(hi):
        hi *= 2
        if hi > 1 << 60:
            raise ValueError("no bound: nothing that grows with the model is counted against RAM or disk")
    lo = hi // 2  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _precision(precision: str) -> str:
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision={precision!r}; valid choices: {', '.join(PRECISION_BYTES)}")
    return precision


def _whole(value: int, name: str, low: int = 0) -> int:
    if value < low:
        raise ValueError(f"{name}={value} must be >= {low}")
    return value


def gpt_num_params(n_layer: int, n_embd: int, vocab_size: int, block_size: int = 1024,
                   bias: bool = True, tied_embeddings: bool = True) -> int:
    """Parameters of a GPT-2-style model (nanoGPT's): token and position embeddings, ``n_layer``
    blocks of attention (qkv + projection) and a 4x MLP with two LayerNorms, a final LayerNorm,
    and an LM head tied to the token embedding unless ``tied_embeddings=False``."""
    d = n_embd
    ln = 2 * d if bias else d
    block = 12 * d * d + (9 * d if bias else 0) + 2 * ln  # qkv 3d^2, proj d^2, mlp 8d^2
    head = 0 if tied_embeddings else vocab_size * d
    return vocab_size * d + block_size * d + n_layer * block + ln + head


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_table(num_params: int, world_sizes: Sequence[int], precision: str = "bf16-mixed",
                 optimizer_bytes: int = 8) -> str:
    p, g, m, _ = PRECISION_BYTES[precision]
    lines = [f"Model states per rank for {num_params:,} parameters, precision {precision} "
             f"({p}+{g}+{m}+{optimizer_bytes} bytes/param: param+grad+master+optimizer state)",
             f"{'ranks':>6} {'stage':>6} {'params':>12} {'grads':>12} {'master':>12} "
             f"{'optimizer':>12} {'total':>12}"]
    for n in world_sizes:
        for stage, s in estimate_model_states(num_params, n, precision,
                                              optimizer_bytes=optimizer_bytes).items():
            lines.append(f"{n:>6} {stage:>6} " + " ".join(
                f"{format_bytes(v):>12}" for v in (s.params, s.grads, s.master, s.optimizer, s.total)))
    lines.append("Activations, communication buckets and temporary buffers come on top.")
    return "\n".join(lines)


def format_offload_table(num_params: int, world_sizes: Sequence[int], precision: str = "32",
                         ram_gb: float | None = None, disk_gb: float | None = None, **options) -> str:
    """Per-rank RAM and disk of the Offload strategy for each world size, bytes per parameter, and
    (with ``ram_gb`` and ``disk_gb``: one machine's) the largest model that fits."""
    opts = ", ".join(f"{k}={v}" for k, v in options.items())
    lines = [f"Offload, per rank, for {num_params:,} parameters, precision {precision} ({opts})",
             f"{'ranks':>6} {'where':>5} {'params':>12} {'grads':>12} {'master':>12} "
             f"{'optimizer':>12} {'total':>12} {'B/param':>8}"]
    for n in world_sizes:
        est = estimate_offload(num_params, n, precision=precision, **options)
        for where, st in (("ram", est.ram), ("disk", est.disk)):
            per_param = st.total * n / num_params if num_params else 0.0
            lines.append(f"{n:>6} {where:>5} " + " ".join(
                f"{format_bytes(v):>12}" for v in (st.params, st.grads, st.master, st.optimizer, st.total))
                + f" {per_param:>8.2f}")
        if ram_gb is not None and disk_gb is not None:
            top = largest_offload_model(ram_gb * 2**30, disk_gb * 2**30, n, precision=precision, **options)
            lines.append(f"{n:>6} largest model in {ram_gb:g} GiB RAM and {disk_gb:g} GiB disk "
                         f"(all {n} ranks): {top:,} parameters")
    lines.append("RAM optimizer = swap staging buffers when the state is on disk. Activations, "
                 "communication buckets and allocator slack come on top; swap files are page-padded.")
    return "\n".join(lines)


def _world_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--world-size={text!r}: expected integers like 8 or 2,4,8")
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--world-size={text!r}: every size must be >= 1")
    return sizes


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="zerotrain-estimate", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-params", type=float, help="parameter count, e.g. 1.3e9")
    ap.add_argument("--n-layer", type=int, help="GPT config: number of blocks")
    ap.add_argument("--n-embd", type=int, help="GPT config: model width")
    ap.add_argument("--vocab-size", type=int, default=50257, help="GPT config (default 50257)")
    ap.add_argument("--block-size", type=int, default=1024, help="GPT config: context (default 1024)")
    ap.add_argument("--no-bias", action="store_true", help="GPT config: no biases")
    ap.add_argument("--world-size", type=_world_sizes, default=[1], help="ranks, e.g. 8 or 2,4,8")
    ap.add_argument("--precision", choices=sorted(PRECISION_BYTES),
                    help="default bf16-mixed; with the offload options 32 (what offload runs on CPUs)")
    ap.add_argument("--optimizer-bytes", type=int, default=8,
                    help="optimizer state bytes per parameter (Adam 8, SGD+momentum 4, SGD 0)")
    off = ap.add_argument_group("offload (any of these prints the Offload strategy's RAM and disk)")
    off.add_argument("--offload-stage", type=int, choices=OFFLOAD_STAGES, help="ZeRO stage under Offload")
    off.add_argument("--optimizer-device", choices=OPTIMIZER_DEVICES, help="default nvme")
    off.add_argument("--param-device", choices=PARAM_DEVICES, help="default nvme with stage 3, else none")
    off.add_argument("--optimizer-state-dtype", choices=sorted(STATE_DTYPE_BYTES), default="fp32")
    off.add_argument("--grad-bytes", type=int, help="gradient partition bytes/param (default: the precision's)")
    off.add_argument("--grad-device", choices=GRAD_DEVICES, default="cpu",
                     help="where the gradient partition waits for the step (nvme: stage 3, in the swap files)")
    off.add_argument("--param-dtype", choices=PARAM_DTYPES, default="auto",
                     help="ZeRO-3 parameter files' working dtype (bf16: beside an fp32 master in fp32 compute)")
    off.add_argument("--sub-group-size", type=int, default=10_000_000)
    off.add_argument("--buffer-count", type=int, default=4)
    off.add_argument("--grad-buffer-count", type=int, default=None,
                     help="with --grad-device nvme: staging buffers of backward's gradient writes (default: --buffer-count)")
    off.add_argument("--ram-gb", type=float, help="the machine's RAM for model states (GiB): with "
                     "--disk-gb, print the largest model that fits")
    off.add_argument("--disk-gb", type=float, help="the machine's free disk for swap files (GiB)")
    args = ap.parse_args(argv)
    gpt = (args.n_layer, args.n_embd)
    if args.num_params is not None and any(v is not None for v in gpt):
        ap.error("give either --num-params or a GPT config (--n-layer, --n-embd), not both")
    if args.num_params is not None:
        if args.num_params < 0 or not float(args.num_params).is_integer():
            ap.error(f"--num-params={args.num_params}: expected a whole number >= 0")
        num_params = int(args.num_params)
    elif all(v is not None for v in gpt):
        num_params = gpt_num_params(args.n_layer, args.n_embd, args.vocab_size, args.block_size,
                                    bias=not args.no_bias)
    else:
        ap.error("give --num-params, or both --n-layer and --n-embd")
    offload = [args.offload_stage, args.optimizer_device, args.param_device, args.ram_gb, args.disk_gb]
    if all(v is None for v in offload) and args.optimizer_state_dtype == "fp32" and args.param_dtype == "auto":
        print(format_table(num_params, args.world_size, args.precision or "bf16-mixed", args.optimizer_bytes))
        return 0
    if (args.ram_gb is None) != (args.disk_gb is None):
        ap.error("give both --ram-gb and --disk-gb (the largest model must fit both), or neither")
    stage = args.offload_stage or 3
    options = dict(stage=stage, optimizer_device=args.optimizer_device or "nvme",
                   param_device=args.param_device or ("nvme" if stage == 3 else "none"),
                   optimizer_state_dtype=args.optimizer_state_dtype, grad_bytes=args.grad_bytes,
                   sub_group_size=args.sub_group_size, buffer_count=args.buffer_count, grad_device=args.grad_device,
                   grad_buffer_count=args.grad_buffer_count,
                   param_dtype=args.param_dtype)
    try:
        print(format_offload_table(num_params, args.world_size, args.precision or "32", args.ram_gb, args.disk_gb,
                                   **options))
    except ValueError as exc:
        ap.error(str(exc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
