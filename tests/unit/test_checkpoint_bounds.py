"""Hostile checkpoints: a ``meta.pt`` that passes ``torch.load(weights_only=True)`` or a shard header
that parses as JSON, but whose numbers claim more than the files hold (a world size of 10**9, a
2**40-element parameter, ranges outside their parameter, a huge or malformed tensor in a shard
header). Loading (``load_meta`` + ``verify``, as ``Trainer.fit(ckpt_path=...)`` does), consolidating
(with and without the checksum pass) and ``zerotrain-consolidate`` must each fail with a
CheckpointError naming the file (rc 2 and one line from the console script), within seconds, and
with memory bounded: the hostile loads run in a child process whose address space is capped at
1 GiB above what it uses before them."""
from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from zerotrain.strategies.base import ParamShard
from zerotrain.trainer.checkpoint import directory as checkpoint_io, reshard
from zerotrain.trainer.errors import CheckpointError

_SOLO = checkpoint_io.Comm(0, 1, lambda: None, lambda obj: [obj], lambda obj: obj)
SHARD = checkpoint_io.rank_file(0)


def make_checkpoint(path: Path) -> Path:
    """A real (small) checkpoint as a 1-rank save writes it: a Linear's weight and bias with Adam
    state, an int64 buffer, RNG state, the layout, through ``checkpoint_io.save``."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    shards = {n: ParamShard(0, p.numel(), {"param": p.detach().reshape(-1), "exp_avg": torch.ones(p.numel()),
                                           "exp_avg_sq": torch.full((p.numel(),), 2.0)},
                            {"step": torch.tensor(3.0)})
              for n, p in model.named_parameters()}
    extras = {"count": torch.tensor(7)}
    entries, local = reshard.shard_entries(shards, extras)
    info = {"params": {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()},
            "extras": {"count": ((), torch.int64)}, "aliases": {}, "keys": ["weight", "bias", "count"]}
    local.update(model=reshard.model_info_meta(info), rng=checkpoint_io.rng_state())

    def meta(locals_):
        return {**reshard.layout_meta(locals_), "rng": [loc["rng"] for loc in locals_],
                "loop": {"global_step": 3}, "strategy": "single", "precision": "32-true", "precision_state": {},
                "optimizer": {"type": "torch.optim.adam.Adam", "param_groups": [{"lr": 0.1}],
                              "names": [["weight", "bias"]]}}

    return checkpoint_io.save(path, _SOLO, entries, local, meta)


def _load(ck: Path) -> dict:
    return torch.load(ck / checkpoint_io.META, weights_only=True)


def _store(ck: Path, meta: dict) -> None:
    torch.save(meta, ck / checkpoint_io.META)
    assert torch.load(ck / checkpoint_io.META, weights_only=True) is not None  # still a "safe" pickle


def _rewrite_header(ck: Path, edit) -> None:
    """Replace the shard's header by ``edit(header)`` (a str of JSON, or a dict dumped as JSON),
    keeping its data bytes, and record the new file's size and sha256 in meta.pt (so that only
    the header is wrong, and the checksum pass does not stop it first)."""
    file = ck / SHARD
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    new = edit(header)
    text = (new if isinstance(new, str) else json.dumps(new)).encode()
    text += b" " * (-len(text) % 8)
    blob = struct.pack("<Q", len(text)) + text + data
    file.write_bytes(blob)
    meta = _load(ck)
    meta["files"][SHARD] = {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    _store(ck, meta)


def _edit_meta(fn):
    def apply(ck: Path) -> None:
        meta = _load(ck)
        fn(meta)
        _store(ck, meta)
    return apply


def _param(meta, **kw):
    meta["params"]["weight"].update(kw)


def _huge_param_lying_sizes(meta):
    """A 2**40-element weight whose recorded file size is large enough for it: only the shard
    file itself (its size, its header) can tell."""
    _param(meta, shape=[2 ** 40], ranges=[[0, 0, 2 ** 40]])
    meta["files"][SHARD] = dict(meta["files"][SHARD], size=2 ** 46)


def _header_shape(shape):
    def edit(h):
        h["param/weight"]["shape"] = shape
        return h
    return edit


def _meta_records_compressed(ck: Path) -> None:
    """meta.pt rewritten with deflate-compressed records (what a zip bomb needs: torch reads a
    compressed record whole into memory, whatever size it unpacks to)."""
    file = ck / checkpoint_io.META
    with zipfile.ZipFile(file) as src:
        items = [(i.filename, src.read(i)) for i in src.infolist()]
    with zipfile.ZipFile(file, "w", compression=zipfile.ZIP_DEFLATED) as out:
        for name, data in items:
            out.writestr(name, data)


def _meta_byte_flipped(ck: Path) -> None:
    """One byte of a tensor record in meta.pt (an RNG state) flipped: torch's reader loads it."""
    file = ck / checkpoint_io.META
    with zipfile.ZipFile(file) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size > 0)
    raw = bytearray(file.read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
    raw[info.header_offset + 30 + name_len + extra_len] ^= 0x01
    file.write_bytes(bytes(raw))


def _header_huge(h):
    h["param/weight"] = {"dtype": "F32", "shape": [2 ** 40], "data_offsets": [0, 2 ** 42]}
    return h


# name -> (how to spoil the checkpoint, the file the error must name)
CASES = {
    "world_size_1e9": (_edit_meta(lambda m: m.update(world_size=10 ** 9)), "meta.pt"),
    "world_size_0": (_edit_meta(lambda m: m.update(world_size=0)), "meta.pt"),
    "world_size_str": (_edit_meta(lambda m: m.update(world_size="1")), "meta.pt"),
    "param_2e40": (_edit_meta(lambda m: _param(m, shape=[2 ** 40], ranges=[[0, 0, 2 ** 40]])), "meta.pt"),
    "param_2e40_lying_file_size": (_edit_meta(_huge_param_lying_sizes), SHARD),
    "negative_shape": (_edit_meta(lambda m: _param(m, shape=[-1, 12])), "meta.pt"),
    "negative_range": (_edit_meta(lambda m: _param(m, ranges=[[0, -5, 12]])), "meta.pt"),
    "huge_range_end": (_edit_meta(lambda m: _param(m, ranges=[[0, 0, 2 ** 62]])), "meta.pt"),
    "range_on_missing_rank": (_edit_meta(lambda m: _param(m, ranges=[[7, 0, 12]])), "meta.pt"),
    "range_not_a_triple": (_edit_meta(lambda m: _param(m, ranges=[[0, 12]])), "meta.pt"),
    "ranges_do_not_cover": (_edit_meta(lambda m: _param(m, ranges=[[0, 0, 5]])), "meta.pt"),
    "buffer_2e40": (_edit_meta(lambda m: m["extras"]["count"].update(shape=[2 ** 40])), "meta.pt"),
    "buffer_dtype_not_a_dtype": (_edit_meta(lambda m: m["extras"]["count"].update(dtype="load")), "meta.pt"),
    "buffer_dtype_int": (_edit_meta(lambda m: m["extras"]["count"].update(dtype=123)), "meta.pt"),
    "files_unlisted": (_edit_meta(lambda m: m.update(files={})), "meta.pt"),
    "no_loop": (_edit_meta(lambda m: m.pop("loop")), "meta.pt"),
    "rng_not_a_state": (_edit_meta(lambda m: m.update(rng=[{"torch": torch.zeros(3)}])), "meta.pt"),
    "meta_records_compressed": (_meta_records_compressed, "meta.pt"),
    "meta_byte_flipped": (_meta_byte_flipped, "meta.pt"),
    "header_huge_tensor": (lambda ck: _rewrite_header(ck, _header_huge), SHARD),
    "header_infinite_shape": (lambda ck: _rewrite_header(ck, _header_shape([float("inf")])), SHARD),
    "header_negative_shape": (lambda ck: _rewrite_header(ck, _header_shape([-3, -4])), SHARD),  # 12 elements
    "header_deeply_nested": (lambda ck: _rewrite_header(ck, lambda h: '{"a":' + "[" * 200_000 + "]" * 200_000
                                                        + "}"), SHARD),
    "header_length_2e63": (lambda ck: (ck / SHARD).write_bytes(struct.pack("<Q", 2 ** 63) + b" " * 64), SHARD),
}

_HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = """
import sys
sys.path.insert(0, {here!r})
import test_checkpoint_bounds as t
t.child({dirs!r})
"""


def child(dirs: list[str]) -> None:
    """In a fresh process: cap the address space 1 GiB above the current one, then try each way
    of loading each checkpoint; print one JSON line per try."""
    import contextlib
    import io
    import resource
    import time

    from zerotrain import CheckpointError
    from zerotrain.trainer.checkpoint import consolidate as cons

    torch.set_num_threads(1)
    torch.zeros(8).add_(1)  # the intra-op pool and allocator are set up before the cap
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def load(ck, out):  # what trainer/checkpointing.load does before reading its ranges
        root, meta = checkpoint_io.load_meta(ck)
        checkpoint_io.verify(root, meta, range(0, meta["world_size"], 1))

    def cli(ck, out):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = cons.main([ck, out])
        raise SystemExit(f"rc={rc} {err.getvalue()}")

    ways = {"load": load, "consolidate": lambda ck, out: cons.consolidate(ck, out),
            "consolidate_no_verify": lambda ck, out: cons.consolidate(ck, out, verify=False), "cli": cli}
    for d in dirs:
        for way, fn in ways.items():
            start = time.perf_counter()
            try:
                fn(d, os.path.join(d + ".out", f"{way}.safetensors"))
                kind, msg = "no error", ""
            except CheckpointError as exc:
                kind, msg = "CheckpointError", str(exc)
            except SystemExit as exc:
                kind, msg = "exit", str(exc)
            except BaseException as exc:  # noqa: BLE001 - what the test reports
                kind, msg = type(exc).__name__, str(exc)[:300]
            print(json.dumps({"dir": d, "way": way, "kind": kind, "msg": msg,
                              "seconds": time.perf_counter() - start}), flush=True)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
    print(json.dumps({"rss_growth_kib": grown}), flush=True)


@pytest.mark.timeout(60)
def test_the_real_checkpoint_loads_and_consolidates(tmp_path):
    from safetensors.torch import load_file

    from zerotrain.trainer.checkpoint.consolidate import consolidate

    ck = make_checkpoint(tmp_path / "ck")
    root, meta = checkpoint_io.load_meta(ck)
    checkpoint_io.verify(root, meta)
    got = load_file(consolidate(ck, tmp_path / "out.safetensors"))
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    assert torch.equal(got["weight"], model.weight.detach()) and got["count"].item() == 7


@pytest.mark.timeout(60)
def test_hostile_meta_and_headers_fail_cleanly_with_bounded_memory(tmp_path):
    dirs = {}
    for name, (spoil, _) in CASES.items():
        ck = make_checkpoint(tmp_path / name)
        spoil(ck)
        dirs[name] = str(ck)
    res = subprocess.run([sys.executable, "-c", CHILD.format(here=_HERE, dirs=list(dirs.values()))],
                         capture_output=True, text=True, timeout=50)
    lines = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert lines and "rss_growth_kib" in lines[-1], res.stdout[-2000:] + res.stderr[-3000:]
    by = {(r["dir"], r["way"]): r for r in lines[:-1]}
    failures = []
    for name, (_, named) in CASES.items():
        for way in ("load", "consolidate", "consolidate_no_verify", "cli"):
            r = by.get((dirs[name], way))
            if r is None:
                failures.append(f"{name}/{way}: no result")
                continue
            if way == "cli":
                ok = r["kind"] == "exit" and r["msg"].startswith("rc=2 zerotrain-consolidate: error:") and \
                    r["msg"].count("\n") == 1 and named in r["msg"] and dirs[name] in r["msg"]
            else:
                ok = r["kind"] == "CheckpointError" and named in r["msg"] and dirs[name] in r["msg"]
            if not ok or r["seconds"] > 10:
                failures.append(f"{name}/{way}: {r['kind']} after {r['seconds']:.1f} s: {r['msg'][:300]}")
    assert not failures, "\n".join(failures)
    assert lines[-1]["rss_growth_kib"] < 512 * 1024  # nothing near what the files claim was allocated
    for d in dirs.values():  # no output, and no partial output, was left behind
        assert not os.path.exists(d + ".out") or os.listdir(d + ".out") == []


@pytest.mark.timeout(60)
def test_a_flipped_byte_loads_silently_without_the_crc_check(tmp_path):
    """What the meta_byte_flipped case guards against: torch's own reader takes the flipped byte."""
    ck = make_checkpoint(tmp_path / "ck")
    before = _load(ck)
    _meta_byte_flipped(ck)
    after = _load(ck)  # no error from torch
    assert any(not torch.equal(a, b) for a, b in zip(before["rng"][0].values(), after["rng"][0].values())
               if torch.is_tensor(a))


@pytest.mark.timeout(60)
def test_a_checkpoint_saved_with_torchs_crc_turned_off_loads(tmp_path):
    """torch.serialization.set_crc32_options(False) speeds up saves; meta.pt keeps its CRC-32s
    anyway (the load checks them), and the user's setting is put back."""
    torch.serialization.set_crc32_options(False)
    try:
        ck = make_checkpoint(tmp_path / "ck")
        assert torch.serialization.get_crc32_options() is False
    finally:
        torch.serialization.set_crc32_options(True)
    root, meta = checkpoint_io.load_meta(ck)
    checkpoint_io.verify(root, meta)


@pytest.mark.timeout(60)
def test_optimizer_kinds_the_shards_do_not_hold_fail_before_any_buffer_is_sized(tmp_path):
    """A meta.pt listing 3000 optimizer-state kinds for a weight would have a loader size 3000
    buffers over its partition; the reader checks each against the shard's header first."""
    ck = make_checkpoint(tmp_path / "ck")
    root, meta = checkpoint_io.load_meta(ck)
    assert reshard.CheckpointReader(root, meta).kinds("weight") == ["exp_avg", "exp_avg_sq", "param"]
    meta["params"]["weight"]["kinds"] = ["exp_avg", "exp_avg_sq", "param"] + [f"k{i}" for i in range(3000)]
    with pytest.raises(CheckpointError, match=r"lists 3003 per-element kinds for 'weight' \(at most 64"):
        reshard.CheckpointReader(root, meta).kinds("weight")
    meta["params"]["weight"]["kinds"] = ["exp_avg", "exp_avg_sq", "param", "k0"]
    with pytest.raises(CheckpointError, match=re.escape(str(root / SHARD)) + r".*holds 0 elements of 'k0/weight'"):
        reshard.CheckpointReader(root, meta).kinds("weight")


@pytest.mark.timeout(60)
def test_a_value_a_safe_load_refuses_fails_the_save_and_keeps_the_previous_checkpoint(tmp_path):
    import numpy as np

    good = make_checkpoint(tmp_path / "ck" / "step=1")
    entries, local = reshard.shard_entries({}, {"count": torch.tensor(1)})

    def meta(locals_):
        return {"loop": {"global_step": 2, "extra": {"score": np.float64(0.5)}}, "files": {}}

    with pytest.raises(CheckpointError, match=r"\['loop'\]\['extra'\]\['score'\] \(numpy\.[\w.]*float64\)"):
        checkpoint_io.save(tmp_path / "ck" / "step=2", _SOLO, entries, local, meta)
    assert checkpoint_io.resolve(tmp_path / "ck") == good  # latest still names the good one
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["latest", "step=1"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pointer", ["latest", "a" * 5000, "loop"])
def test_a_bad_latest_pointer_is_a_checkpoint_error(tmp_path, pointer):
    make_checkpoint(tmp_path / "ck" / "step=1")
    if pointer == "loop":  # ck/latest -> a, a/latest -> b, and a/b is a link to a itself
        (tmp_path / "ck" / "latest").write_text("a\n")
        (tmp_path / "ck" / "a").mkdir()
        (tmp_path / "ck" / "a" / "latest").write_text("b\n")
        (tmp_path / "ck" / "a" / "b").symlink_to(".")
        want = "pointers in a row"
    else:
        (tmp_path / "ck" / "latest").write_text(pointer + "\n")
        want = "not a pointer zerotrain wrote" if len(pointer) > 4096 else "does not name a checkpoint"
    with pytest.raises(CheckpointError, match=want):
        checkpoint_io.load_meta(tmp_path / "ck")


def test_cuda_rng_states_beyond_the_visible_devices_are_skipped(monkeypatch):
    """Saved on a process that saw 2 GPUs, resumed on one that sees 1: device 0's state only."""
    set_calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: set_calls.append((state, device)))
    state = checkpoint_io.rng_state()
    state["cuda"] = [torch.zeros(8, dtype=torch.uint8), torch.ones(8, dtype=torch.uint8)]
    checkpoint_io.set_rng_state(state)
    assert len(set_calls) == 1 and set_calls[0][1] == 0 and torch.equal(set_calls[0][0], state["cuda"][0])
