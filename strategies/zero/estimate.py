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
    ap.add_argument("--precision", choices=sorted(PRECISION_BYTES), default="bf16-mixed")
    ap.add_argument("--optimizer-bytes", type=int, default=8,
                    help="optimizer state bytes per parameter (Adam 8, SGD+momentum 4, SGD 0)")
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
    print(format_table(num_params, args.world_size, args.precision, args.optimizer_bytes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
