"""One plain state dict from a sharded checkpoint, written one parameter at a time.

``zerotrain-consolidate CKPT_DIR OUT [--bf16] [--no-verify]`` (or :func:`consolidate`) writes the
model's full state dict - every key of ``module.state_dict()`` of the user's unwrapped
TrainModule, tied parameters under each of their names - as safetensors (``OUT`` ending in
``.safetensors``) or a ``torch.save`` file (``.pt``, ``.pth``, ``.bin``), so that plain PyTorch
loads it with ``module.load_state_dict(..., strict=True)``. Parameters are the fp32 master
weights; ``--bf16`` writes floating-point tensors in bf16 instead.

Memory: the output's header is written first (every shape is in ``meta.pt``), then each tensor is
assembled from the ranges the shard files hold (positioned reads, no mmap), written, and freed, so
the peak is about one parameter (1.5 with ``--bf16``), not the model. In safetensors a tied
parameter's values are written once per name (the format has no shared storage); in a torch file
its names share one storage, as ``torch.save(module.state_dict())`` does. ``CKPT_DIR`` may also be
a ModelCheckpoint directory (its ``latest`` is used). The shard files' checksums are verified
first unless ``--no-verify``; the output appears atomically (``OUT.partial``, then a rename).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from . import directory as checkpoint_io
from ..errors import CheckpointError
from ..api.hparams import hparams_metadata
from .reshard import CheckpointReader
from .tensor_files import Entry, dtype_from_name, fsync_dir, write_safetensors, write_torch

_TORCH_SUFFIXES = (".pt", ".pth", ".bin")


def output_format(out: str | os.PathLike) -> str:
    suffix = Path(out).suffix
    if suffix == ".safetensors":
        return "safetensors"
    if suffix in _TORCH_SUFFIXES:
        return "torch"
    raise ValueError(f"output {str(out)!r}: the suffix picks the format; use .safetensors or one of "
                     f"{', '.join(_TORCH_SUFFIXES)}")


def plan(meta: dict[str, Any], reader: CheckpointReader, bf16: bool = False,
         shared_aliases: bool = False) -> list[Entry]:
    """The output's entries in ``module.state_dict()`` order, each reading its tensor when asked.
    ``shared_aliases``: tied names after the first refer to it instead of re-reading."""
    entries: list[Entry] = []
    owner_of: dict[str, str] = {}  # canonical parameter -> first output key holding it
    for key in meta["keys"]:
        canonical = meta["aliases"].get(key, key)
        if canonical in meta["params"]:
            info = meta["params"][canonical]
            shape = tuple(info["shape"])
            dtype = torch.bfloat16 if bf16 else torch.float32
            if shared_aliases and canonical in owner_of:
                entries.append(Entry(key, dtype, shape, _none, alias_of=owner_of[canonical]))
                continue
            owner_of[canonical] = key

            def produce(name=canonical, shape=shape, dtype=dtype) -> torch.Tensor:
                return reader.read(name, "param", 0, math.prod(shape)).view(shape).to(dtype)

            entries.append(Entry(key, dtype, shape, produce))
        elif key in meta["extras"]:
            info = meta["extras"][key]
            dtype = dtype_from_name(info["dtype"])
            if bf16 and dtype.is_floating_point:
                dtype = torch.bfloat16
            entries.append(Entry(key, dtype, tuple(info["shape"]),
                                 lambda key=key, dtype=dtype: reader.extra(key).to(dtype)))
        else:
            raise CheckpointError(f"state-dict key {key!r} is listed in the checkpoint's metadata but "
                                  "neither saved as a parameter nor as a buffer")
    return entries


def _none() -> torch.Tensor:
    raise AssertionError("an alias entry is never produced")


def consolidate(ckpt: str | os.PathLike, out: str | os.PathLike, *, bf16: bool = False,
                verify: bool = True) -> Path:
    """Write the checkpoint's full state dict to ``out`` (see the module docstring)."""
    fmt = output_format(out)
    root, meta = checkpoint_io.load_meta(ckpt)
    if verify:
        checkpoint_io.verify(root, meta)
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with CheckpointReader(root, meta) as reader:
            entries = plan(meta, reader, bf16=bf16, shared_aliases=fmt == "torch")
            if fmt == "safetensors":
                write_safetensors(tmp, entries, {"format": "pt", "source": str(root),
                                                 "step": str(meta.get("loop", {}).get("global_step")),
                                                 **hparams_metadata(meta)})
            else:
                write_torch(tmp, entries)
        os.replace(tmp, out)
        fsync_dir(out.parent)  # the rename itself survives a power loss (callers may delete the source next)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)  # a failed write leaves nothing holding the space
        if isinstance(exc, CheckpointError) or not isinstance(exc, Exception):
            raise
        if isinstance(exc, OSError):  # the output side: checkpoint reads raise CheckpointError
            raise CheckpointError(f"writing {exc.filename or tmp} (consolidate OUT={str(out)!r}) failed: "
                                  f"{exc.strerror or exc}") from exc
        if isinstance(exc, (ValueError, KeyError, TypeError, IndexError)):
            raise CheckpointError(f"checkpoint {str(root)!r} does not match its {checkpoint_io.META}: "
                                  f"{type(exc).__name__}: {exc}") from exc
        raise
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="zerotrain-consolidate",
        description="Write one full state dict (safetensors or torch, by OUT's suffix) from a sharded "
                    "zerotrain checkpoint, one parameter at a time.")
    parser.add_argument("ckpt", help="checkpoint directory (or a ModelCheckpoint directory: its latest)")
    parser.add_argument("out", help="output file: NAME.safetensors, or NAME.pt / .pth / .bin")
    parser.add_argument("--bf16", action="store_true", help="write floating-point tensors in bf16")
    parser.add_argument("--no-verify", action="store_true", help="skip the shard files' sha256 check")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        out = consolidate(args.ckpt, args.out, bf16=args.bf16, verify=not args.no_verify)
    except (CheckpointError, ValueError) as exc:
        print(f"zerotrain-consolidate: error: {' '.join(str(exc).splitlines())}", file=sys.stderr)  # one line
        return 2
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB) in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
