"""Tensor files written and read one tensor at a time, so that neither side holds more than one
tensor (or one slice of it) in memory.

* :func:`write_safetensors` writes the safetensors format: an 8-byte little-endian header length,
  a JSON header (every key's dtype, shape and byte range; all shapes are known up front), then the
  tensors' bytes back to back. Each tensor comes from its entry's ``produce()`` just before its
  bytes are written, and the file's sha256 is computed on the way.
* :class:`SafetensorsFile` parses and checks such a header, then reads any element range
  ``[start, end)`` of any (flattened) tensor with positioned reads into a buffer the caller may
  provide. No ``mmap``: pages read are not mapped into the process, so reading a model piece by
  piece keeps the resident set at the pieces' size. The files are ordinary safetensors files
  (``safetensors.safe_open(...).get_slice`` reads them too).
* :func:`write_torch` writes a ``torch.save`` zip file the same streaming way: the archive is
  first written without storage bytes (``torch.serialization.skip_data`` over fake tensors of the
  right shapes), then each storage's bytes are written in place at the offset the archive
  reserved. ``torch.load(..., weights_only=True)`` reads it like any other; entries that are
  ``alias_of`` another share its storage, as tied parameters do in ``module.state_dict()``.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch

from ..errors import CheckpointError

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
           torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
           torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
           torch.complex64: "C64"}  # as safetensors names them (C64: rotary tables such as Llama's freqs_cis)
_BY_CODE = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER = 100 << 20  # safetensors' own limit


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint metadata")
    return dtype


@dataclass(frozen=True)
class Entry:
    """One tensor to write: its key, dtype and shape now, its values from ``produce()`` later."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]
    alias_of: str | None = None  # torch files only: share the storage of this earlier key

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @classmethod
    def of(cls, key: str, tensor: torch.Tensor) -> "Entry":
        return cls(key, tensor.dtype, tuple(tensor.shape), lambda: tensor)


@dataclass(frozen=True)
class FileDigest:
    size: int
    sha256: str


def _as_bytes(entry: Entry, t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.dtype != entry.dtype or t.numel() != entry.numel:
        raise ValueError(f"{entry.key}: produced {t.dtype} with {t.numel()} elements, the header says "
                         f"{entry.dtype} with {entry.numel}")
    flat = t.to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_safetensors(path: str | os.PathLike, entries: Sequence[Entry],
                      metadata: dict[str, str] | None = None) -> FileDigest:
    """Write ``entries`` in order to ``path`` (flushed and fsynced); returns its size and sha256."""
    header: dict = {"__metadata__": dict(metadata or {})} if metadata else {}
    offset = 0
    for e in entries:
        if e.dtype not in _DTYPES:
            raise ValueError(f"{e.key}: dtype {e.dtype} cannot be stored in safetensors")
        if e.key in header:
            raise ValueError(f"duplicate key {e.key!r}")
        header[e.key] = {"dtype": _DTYPES[e.dtype], "shape": list(e.shape),
                         "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
    digest = hashlib.sha256()
    size = 0
    with open(path, "wb") as f:
        for chunk in (struct.pack("<Q", len(raw)), raw):
            f.write(chunk)
            digest.update(chunk)
            size += len(chunk)
        for e in entries:
            data = _as_bytes(e, e.produce())
            f.write(data)
            digest.update(data)
            size += len(data)
        f.flush()
        os.fsync(f.fileno())
    return FileDigest(size, digest.hexdigest())


def file_digest(path: str | os.PathLike, block: int = 8 << 20) -> FileDigest:
    """Size and sha256 of a file, read in blocks (constant memory)."""
    digest = hashlib.sha256()
    size = 0
    buf = bytearray(block)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
            size += n
    return FileDigest(size, digest.hexdigest())


def _count(x: object) -> int:
    """A non-negative JSON integer (a shape dimension or a byte offset), else ValueError."""
    if not isinstance(x, int) or isinstance(x, bool) or x < 0:
        raise ValueError(x)
    return x


class SafetensorsFile:
    """Reads element ranges of the tensors of one safetensors file (see the module docstring)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(path)
        try:
            self._f = open(self.path, "rb", buffering=0)
        except OSError as exc:
            raise CheckpointError(f"cannot open checkpoint file {self.path!r}: {exc.strerror or exc}") from None
        try:
            self._parse()
        except OSError as exc:
            self._f.close()
            raise CheckpointError(f"cannot read checkpoint file {self.path!r}: {exc.strerror or exc}") from None
        except BaseException:
            self._f.close()
            raise

    def _bad(self, why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint file {self.path!r} is not a valid safetensors file: {why}")

    def _parse(self) -> None:
        size = os.fstat(self._f.fileno()).st_size
        head = self._f.read(8)
        if len(head) < 8:
            raise self._bad(f"{size} bytes, shorter than a header")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise self._bad(f"header length {n} does not fit in its {size} bytes")
        try:
            header = json.loads(self._f.read(n))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # deep nesting: RecursionError
            raise self._bad(f"header is not JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
        if not isinstance(header, dict):
            raise self._bad("header is not a JSON object")
        self.metadata = header.pop("__metadata__", {}) or {}
        self._data_start = 8 + n
        self._tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
        end_of_data = 0
        for key, info in header.items():
            try:  # every number checked before it sizes anything: JSON ints only, no bools or floats
                dtype = _BY_CODE[info["dtype"]]
                shape = tuple(_count(d) for d in info["shape"])
                begin, stop = (_count(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise self._bad(f"bad header entry for {key[:100]!r}: {repr(info)[:200]}") from None
            if stop - begin != math.prod(shape) * dtype.itemsize or stop > size:
                raise self._bad(f"{key!r}: byte range {begin}..{stop} does not hold shape {list(shape)}")
            end_of_data = max(end_of_data, stop)
            self._tensors[key] = (dtype, shape, begin)
        if self._data_start + end_of_data != size:
            raise self._bad(f"the header describes {self._data_start + end_of_data} bytes, the file has "
                            f"{size} (truncated or appended to)")

    def keys(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, key: str) -> bool:
        return key in self._tensors

    def info(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        dtype, shape, _ = self._lookup(key)
        return dtype, shape

    def _lookup(self, key: str) -> tuple[torch.dtype, tuple[int, ...], int]:
        try:
            return self._tensors[key]
        except KeyError:
            raise CheckpointError(f"checkpoint file {self.path!r} has no tensor {key!r}") from None

    def read(self, key: str, start: int = 0, end: int | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[start, end)`` of the flattened tensor ``key`` (the whole tensor, in its
        shape, when neither is given), read into ``out`` if given (a contiguous tensor of that
        many elements; its dtype may differ, the values are then cast)."""
        dtype, shape, begin = self._lookup(key)
        numel = math.prod(shape)
        whole = start == 0 and end is None
        end = numel if end is None else end
        if not 0 <= start <= end <= numel:
            raise CheckpointError(f"{self.path!r}: range [{start}, {end}) is outside {key!r} "
                                  f"({numel} elements)")
        direct = out is not None and out.dtype == dtype and out.is_contiguous() and out.device.type == "cpu"
        buf = out.view(-1) if direct else torch.empty(end - start, dtype=dtype)
        if buf.numel() != end - start:
            raise ValueError(f"out has {buf.numel()} elements for a range of {end - start}")
        if end > start:
            view = memoryview(buf.view(torch.uint8).numpy())
            pos = self._data_start + begin + start * dtype.itemsize
            got = 0
            while got < len(view):
                try:
                    n = os.preadv(self._f.fileno(), [view[got:]], pos + got)
                except OSError as exc:
                    raise CheckpointError(f"cannot read checkpoint file {self.path!r}: {exc.strerror or exc}") from None
                if n <= 0:
                    raise self._bad(f"{key!r} ends early")
                got += n
        if out is not None:
            if not direct:
                out.view(-1).copy_(buf)
            return out
        return buf.view(shape) if whole else buf

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_torch(path: str | os.PathLike, entries: Iterable[Entry]) -> None:
    """Write a ``torch.save`` file of ``{key: tensor}`` in the entries' order, one tensor in
    memory at a time (see the module docstring). Aliases must come after the key they alias."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    entries = list(entries)
    skeleton: dict[str, torch.Tensor] = {}
    owners: list[Entry] = []  # entries owning a storage, in the order torch.save numbers them
    with FakeTensorMode():
        for e in entries:
            if e.alias_of is not None:
                skeleton[e.key] = skeleton[e.alias_of]
                continue
            skeleton[e.key] = torch.empty(e.shape, dtype=e.dtype)
            owners.append(e)
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(skeleton, path)
    del skeleton
    reader = torch._C.PyTorchFileReader(str(path))
    offsets = []
    for i, e in enumerate(owners):
        name = f"data/{i}"
        size = reader.get_record_size(name) if reader.has_record(name) else -1
        if size != e.nbytes:
            raise RuntimeError(f"torch.save numbered storages unexpectedly: record {name} holds {size} "
                               f"bytes, {e.key!r} needs {e.nbytes}")
        offsets.append(reader.get_record_offset(name))
    del reader
    fd = os.open(path, os.O_WRONLY)
    try:
        for e, offset in zip(owners, offsets):
            data = _as_bytes(e, e.produce())
            done = 0
            while done < len(data):
                done += os.pwrite(fd, data[done:], offset + done)
        os.fsync(fd)
    finally:
        os.close(fd)
