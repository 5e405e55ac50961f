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
import sys
from typing import Sequence

from ..memory.formula import PRECISION_BYTES, STAGES, ModelStates, estimate_model_states, format_bytes
from ..memory.mesh import ParamSplit, format_mesh_table, gpt_activation_bytes, gpt_param_split
from ..offload.config import GRAD_DEVICES, OPTIMIZER_DEVICES, PARAM_DEVICES, PARAM_DTYPES
from ..offload.estimate import (OFFLOAD_STAGES, POLICY_DEFAULTS, STATE_DTYPE_BYTES, OffloadBytes, estimate_offload,
                                largest_offload_model)

__all__ = ["PRECISION_BYTES", "STAGES", "ModelStates", "OffloadBytes", "estimate_model_states", "estimate_offload",
           "format_bytes", "gpt_num_params", "largest_offload_model", "main"]


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


class _Parser(argparse.ArgumentParser):
    """Bad input is one line on stderr and rc 2 (no usage block)."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def _positive(flag: str):
    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag}={text!r}; valid: a whole number >= 1")
        return value
    return check


def _divisors(n: int, *others: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if not n % d and not any(o % d for o in others))


def _check_mesh(ap: argparse.ArgumentParser, args: argparse.Namespace, gpt: bool) -> None:
    """The mesh options against the model and the world sizes, each refused in one line."""
    t, s, p = args.tensor_parallel, args.sequence_parallel, args.stages
    _check_model(ap, args, gpt)
    inner = t * s * p
    for n in args.world_size:
        if n % inner:
            ap.error(f"--world-size={n}: not a multiple of --tensor-parallel x --sequence-parallel x --stages = "
                     f"{inner}; valid: a multiple of {inner}, e.g. {inner}, {2 * inner}")


def _check_model(ap: argparse.ArgumentParser, args: argparse.Namespace, gpt: bool) -> None:
    t, s, p = args.tensor_parallel, args.sequence_parallel, args.stages
    if p > 1 and s > 1:
        ap.error(f"--sequence-parallel={s}: the pipeline (--stages={p}) runs over the data and tensor axes only; "
                 "valid: --sequence-parallel 1 with --stages > 1")
    if args.expert_params is not None or args.offload_stage is not None:
        ap.error(f"--tensor-parallel={t} --sequence-parallel={s} --stages={p}: the mesh table is the ZeRO "
                 "stages'; valid: no --expert-params or offload options with a mesh")
    if not gpt:
        if t > 1 and args.sharded_params is None:
            ap.error(f"--tensor-parallel={t}: which parameters the tensor plan cuts is unknown with --num-params; "
                     "valid: a GPT config (--n-layer, --n-embd) or --sharded-params N")
        return
    if args.sharded_params is not None:
        ap.error(f"--sharded-params={args.sharded_params:g}: a GPT config's split is its plan's; valid: "
                 "--sharded-params only with --num-params")
    heads, c, v = args.n_head, args.n_embd, args.vocab_size
    if c % heads:
        ap.error(f"--n-head={heads}: does not divide --n-embd={c}; valid: {_divisors(c)}")
    if heads % t or v % t or c % t:
        ap.error(f"--tensor-parallel={t}: does not divide --n-head={heads}, --vocab-size={v} and --n-embd={c} "
                 f"(the plan cuts heads and vocabulary); valid: {_divisors(heads, v, c)}")
    if heads % s:
        ap.error(f"--sequence-parallel={s}: does not divide --n-head={heads} (Ulysses exchanges heads); "
                 f"valid: {_divisors(heads)}")
    if args.seq_len > args.block_size or args.seq_len % s:
        ap.error(f"--seq-len={args.seq_len}: must be at most --block-size={args.block_size} and a multiple of "
                 f"--sequence-parallel={s}; valid: a multiple of {s} up to {args.block_size}")
    if args.tp_sequence_parallel and (t == 1 or args.seq_len % (t * s)):
        ap.error(f"--tp-sequence-parallel: cuts the sequence over --tensor-parallel={t} (x --sequence-parallel={s}) "
                 f"ranks; valid: with --tensor-parallel > 1 and --seq-len a multiple of {t * s}")
    if p > args.n_layer + 4:
        ap.error(f"--stages={p}: exceeds the {args.n_layer + 4} pipeline layers of the GPT (wte, positions, "
                 f"--n-layer={args.n_layer} blocks, ln_f, lm_head); valid: 1 .. {args.n_layer + 4}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = _Parser(prog="zerotrain-estimate", description=__doc__.split("\n\n")[0],
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
    ap.add_argument("--expert-params", type=float, help="how many of the parameters are experts' (all "
                    "experts, every rank's): prints the dense/expert split (with --ep-size)")
    ap.add_argument("--ep-size", type=int, default=1, help="expert parallelism: ranks sharing the experts")
    mesh = ap.add_argument_group("mesh (any of these prints the per-rank table of a data x sequence x tensor x "
                                 "pipeline mesh; the CLI's strategy.tensor_parallel, sequence_parallel, stages)")
    mesh.add_argument("--tensor-parallel", type=_positive("--tensor-parallel"), help="ranks a tensor group cuts the "
                      "planned layers over (the demo GPT's GPT.tp_plan)")
    mesh.add_argument("--sequence-parallel", type=_positive("--sequence-parallel"),
                      help="Ulysses: ranks a sequence is cut over")
    mesh.add_argument("--stages", type=_positive("--stages"), help="pipeline stages")
    mesh.add_argument("--tp-sequence-parallel", action="store_true", help="the sequence-parallel variant of "
                      "tensor parallelism (the CLI's model.tp_sequence_parallel): norms on sequence shards")
    mesh.add_argument("--sharded-params", type=float, help="with --num-params: how many the tensor plan cuts")
    mesh.add_argument("--n-head", type=_positive("--n-head"), help="GPT config: heads (default n_embd // 64, at "
                      "least 1)")
    mesh.add_argument("--batch-size", type=_positive("--batch-size"), default=1,
                      help="sequences per rank's step, for the activations (default 1)")
    mesh.add_argument("--seq-len", type=_positive("--seq-len"), help="tokens per sequence (default --block-size)")
    off = ap.add_argument_group("offload (any of these prints the Offload strategy's RAM and disk)")
    off.add_argument("--offload-stage", type=int, choices=OFFLOAD_STAGES, help="ZeRO stage under Offload")
    off.add_argument("--optimizer-device", choices=OPTIMIZER_DEVICES, help="default nvme")
    off.add_argument("--param-device", choices=PARAM_DEVICES, help="default nvme with stage 3, else none")
    off.add_argument("--optimizer-state-dtype", choices=sorted(STATE_DTYPE_BYTES),
                     default=POLICY_DEFAULTS["optimizer_state_dtype"])
    off.add_argument("--grad-bytes", type=int, help="gradient partition bytes/param (default: the precision's)")
    off.add_argument("--grad-device", choices=GRAD_DEVICES, default=POLICY_DEFAULTS["grad_device"],
                     help="where the gradient partition waits for the step (nvme: stage 3, in the swap files)")
    off.add_argument("--param-dtype", choices=list(PARAM_DTYPES), default=POLICY_DEFAULTS["param_dtype"],
                     help="ZeRO-3 parameter files' working dtype (bf16: beside an fp32 master in fp32 compute)")
    off.add_argument("--sub-group-size", type=int, default=POLICY_DEFAULTS["sub_group_size"])
    off.add_argument("--buffer-count", type=int, default=POLICY_DEFAULTS["buffer_count"])
    off.add_argument("--grad-buffer-count", type=int, default=POLICY_DEFAULTS["grad_buffer_count"],
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
    if args.tp_sequence_parallel or any(v is not None for v in (args.tensor_parallel, args.sequence_parallel,
                                                                 args.stages)):
        return _mesh_table(ap, args, num_params, gpt=args.num_params is None)
    if args.expert_params is not None:
        from ..moe.estimate import format_expert_table  # the dense/expert split (issue 46)
        experts = int(args.expert_params)
        if not 0 <= experts <= num_params or any(v is not None for v in offload):
            ap.error(f"--expert-params={args.expert_params:g}: expected a count in [0, the parameters "
                     f"{num_params}], without offload options")
        try:
            print(format_expert_table(num_params, experts, args.ep_size, args.world_size,
                                      args.precision or "bf16-mixed", args.optimizer_bytes))
        except ValueError as exc:
            ap.error(str(exc))
        return 0
    if all(v is None for v in offload) and all(getattr(args, k) == POLICY_DEFAULTS[k]
                                               for k in ("optimizer_state_dtype", "param_dtype")):
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


def _mesh_table(ap: argparse.ArgumentParser, args: argparse.Namespace, num_params: int, gpt: bool) -> int:
    args.tensor_parallel = args.tensor_parallel or 1
    args.sequence_parallel = args.sequence_parallel or 1
    args.stages = args.stages or 1
    if gpt:
        args.n_head = args.n_head or max(1, args.n_embd // 64)
        args.seq_len = args.seq_len or args.block_size
    _check_mesh(ap, args, gpt)
    precision = args.precision or "bf16-mixed"
    if gpt:
        split = gpt_param_split(args.n_layer, args.n_embd, args.vocab_size, args.block_size, bias=not args.no_bias)

        def activations(tensor: int, sequence: int) -> int:
            return gpt_activation_bytes(args.batch_size, args.seq_len, args.n_layer, args.n_embd, args.n_head,
                                        args.vocab_size, tensor, sequence, 4 if precision == "32" else 2,
                                        tensor_sequence=args.tp_sequence_parallel)
    else:
        sharded = int(args.sharded_params or 0)
        if not 0 <= sharded <= num_params or float(args.sharded_params or 0) != sharded:
            ap.error(f"--sharded-params={args.sharded_params:g}: valid: a whole number in [0, --num-params]")
        split, activations = ParamSplit(sharded, num_params - sharded), None
    print(format_mesh_table(split, args.world_size, sequence=args.sequence_parallel, tensor=args.tensor_parallel,
                            stages=args.stages, precision=precision, optimizer_bytes=args.optimizer_bytes,
                            activations=activations))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
