"""Byte-level text data for the demo, with nothing to download.

The default corpus is the Python standard library's own ``.py`` source, found at run time, so every
machine with Python has a few megabytes of real text. Any text file can be used instead.
"""
from __future__ import annotations

import os
import sysconfig

import torch
from torch.utils.data import Dataset

_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_corpus(max_bytes: int = 8_000_000) -> bytes:
    """The standard library's ``.py`` files, concatenated (each followed by ``b"\\n"``) and cut at
    ``max_bytes``.

    Directories and files are walked in sorted order, so the result is the same on every call on
    one machine (it differs between Python versions). Third-party packages under
    ``site-packages`` / ``dist-packages`` are left out.
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
    root = sysconfig.get_paths()["stdlib"]
    parts: list[bytes] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune and sort in place: os.walk then descends in this (deterministic) order.
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
        for filename in sorted(filenames):
            if not filename.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, filename), "rb") as f:
                    text = f.read()
            except OSError:  # unreadable file: skip it (same outcome on every call)
                continue
            parts.append(text + b"\n")
            total += len(text) + 1
            if total >= max_bytes:
                return b"".join(parts)[:max_bytes]
    if total == 0:
        raise FileNotFoundError(
            f"no .py files found under the standard library directory {root!r} "
            f"(sysconfig.get_paths()['stdlib']); pass a text file path instead"
        )
    return b"".join(parts)


def load_text(path: str | None, max_bytes: int = 8_000_000) -> bytes:
    """The first ``max_bytes`` bytes of the file at ``path``, or the standard-library corpus when
    ``path`` is None."""
    if path is None:
        return stdlib_corpus(max_bytes)
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"data path {path!r} does not exist or is not a file; "
            f"pass an existing text file, or None for the standard-library corpus"
        )
    with open(path, "rb") as f:
        data = f.read(max_bytes)
    if not data:
        raise ValueError(f"data path {path!r} is empty; pass a non-empty text file")
    return data


def _as_byte_tensor(data: bytes | torch.Tensor) -> torch.Tensor:
    """A 1-D integer tensor of the bytes (uint8 for ``bytes``: 1 byte per token in memory)."""
    if isinstance(data, torch.Tensor):
        if data.dim() != 1 or data.is_floating_point() or data.is_complex():
            raise ValueError(
                f"data must be a 1-D integer tensor, got dim={data.dim()} dtype={data.dtype}"
            )
        return data
    if isinstance(data, (bytes, bytearray, memoryview)):
        if len(data) == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)
    raise TypeError(f"data must be bytes or a 1-D integer tensor, got {type(data).__name__}")


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as a 1-D int64 tensor."""
    return _as_byte_tensor(text.encode("utf-8")).long()


def decode(tokens: torch.Tensor) -> str:
    """The text of a 1-D tensor of byte values; invalid UTF-8 becomes U+FFFD."""
    if tokens.dim() != 1:
        raise ValueError(f"decode needs a 1-D tensor, got shape {tuple(tokens.shape)}")
    return bytes(tokens.tolist()).decode("utf-8", errors="replace")


def split_train_val(data: bytes, val_fraction: float = 0.1) -> tuple[bytes, bytes]:
    """``(train, val)``: the last ``int(len(data) * val_fraction)`` bytes are held out."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    n_val = int(len(data) * val_fraction)
    cut = len(data) - n_val
    return data[:cut], data[cut:]


class ByteDataset(Dataset):
    """Non-overlapping chunks of ``block_size + 1`` bytes; item ``i`` is ``(x, y)``, two int64
    tensors of length ``block_size`` with ``y`` = ``x`` shifted left by one. A trailing partial
    chunk is dropped."""

    def __init__(self, data: bytes | torch.Tensor, block_size: int) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.data = _as_byte_tensor(data)
        self.block_size = block_size
        self.chunk = block_size + 1
        if len(self.data) < self.chunk:
            raise ValueError(
                f"data has {len(self.data)} bytes, fewer than one chunk of block_size + 1 = "
                f"{self.chunk}; use more data or a smaller block_size"
            )

    def __len__(self) -> int:
        return len(self.data) // self.chunk

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self)
        i = index + n if index < 0 else index
        if not 0 <= i < n:
            raise IndexError(f"ByteDataset index {index} out of range for {n} chunks")
        start = i * self.chunk
        chunk = self.data[start:start + self.chunk].long()
        return chunk[:-1], chunk[1:]
