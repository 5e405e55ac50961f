"""Offload I/O pieces without a process group: async file round trips, the read/step/write order,
O_DIRECT detection and its fallback, atomic checkpoint copies, sub-group planning."""
import errno
import math
import os
import threading

import pytest
import torch

from zerotrain.strategies.offload import aio
from zerotrain.strategies.offload.aio import AsyncFileIO, aligned_empty, atomic_file, probe_direct_io
from zerotrain.strategies.offload.plan import SubGroup, plan_subgroups, run_pipelined
from zerotrain.strategies.offload.swapper import KINDS, SwappedStates


@pytest.fixture
def io_pool():
    pool = AsyncFileIO(threads=3, block_bytes=8192)  # tiny blocks: every request is cut in pieces
    yield pool
    pool.close()


def _refuse_o_direct(monkeypatch):
    """Make every open() with O_DIRECT fail as tmpfs (before Linux 6.6) does."""
    real_open = os.open

    def fake_open(path, flags, *args, **kwargs):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(aio.os, "open", fake_open)


# ---------------------------------------------------------------------------- async I/O
@pytest.mark.parametrize("direct", [True, False])
def test_async_write_read_round_trip(tmp_path, io_pool, direct):
    if direct and not probe_direct_io(str(tmp_path)).supported:
        pytest.skip("this file system refuses O_DIRECT")
    n = 3 * 8192 // 4 + 1024  # several blocks and a partial one
    src = aligned_empty(4 * n).view(torch.float32)
    src.copy_(torch.randn(src.numel(), generator=torch.Generator().manual_seed(0)))
    fd = aio.open_swap_file(str(tmp_path / "a.swp"), src.numel() * 4, direct)
    try:
        handle = io_pool.write(fd, src, 0)
        assert len(handle.futures) == 4  # 26 KiB -> four 8 KiB pieces in flight together
        handle.wait()
        dst = aligned_empty(4 * n).view(torch.float32).zero_()
        io_pool.read(fd, dst, 0).wait()
        assert torch.equal(dst, src)
        assert io_pool.bytes_written == io_pool.bytes_read == src.numel() * 4
    finally:
        os.close(fd)


def test_read_error_surfaces_on_wait(tmp_path, io_pool):
    fd = aio.open_swap_file(str(tmp_path / "short.swp"), 4096, direct=False)
    try:
        big = aligned_empty(3 * 4096)
        with pytest.raises(OSError, match="unexpected end of swap file"):
            io_pool.read(fd, big, 0).wait()
    finally:
        os.close(fd)


def test_o_direct_probe_falls_back_to_buffered(tmp_path, monkeypatch):
    _refuse_o_direct(monkeypatch)
    probe = probe_direct_io(str(tmp_path))
    assert not probe.supported and probe.mode == "buffered"
    assert "O_DIRECT refused" in probe.reason and "Invalid argument" in probe.reason
    assert os.listdir(tmp_path) == []  # the probe file is gone


def test_o_direct_probe_on_this_disk(tmp_path):
    probe = probe_direct_io(str(tmp_path))
    assert probe.mode == ("O_DIRECT" if probe.supported else "buffered")
    assert probe.reason and os.listdir(tmp_path) == []


def test_aligned_buffers():
    for n in (1, 4095, 4096, 10_000):
        t = aligned_empty(n)
        assert t.data_ptr() % aio.ALIGN == 0 and t.numel() % aio.ALIGN == 0 and t.numel() >= n


# ---------------------------------------------------------------------------- pipeline order
@pytest.mark.parametrize("buffers", [1, 2, 3, 4, 5])
def test_pipeline_reads_ahead_and_never_reuses_a_buffer_before_its_write(buffers):
    n, events, stepped_in = 7, [], []
    run_pipelined(n, buffers, lambda k, b: _Done(), lambda k, b: stepped_in.append(b),
                  lambda k, b: _Done(), trace=events)
    assert stepped_in == [k % buffers for k in range(n)]
    held: dict[int, int] = {}  # buffer -> sub-group whose data it holds, from read to write_done
    for ev, k in events:
        b = k % buffers
        if ev == "read":
            assert b not in held, f"read of {k} into buffer {b} still held by sub-group {held.get(b)}"
            held[b] = k
        elif ev == "write_done":
            assert held.pop(b) == k
    assert not held  # every write-back was waited for
    pos = {e: i for i, e in enumerate(events)}
    assert [k for ev, k in events if ev == "step"] == list(range(n))
    for k in range(n):
        assert pos[("read_done", k)] < pos[("step", k)] < pos[("write", k)]
        if buffers >= 2 and k + 1 < n:  # double buffering: k+1 is being read while k steps
            assert pos[("read", k + 1)] < pos[("step", k)]
        if buffers >= 3 and k + 1 < n:  # a spare buffer: write-back k overlaps the step of k+1
            assert pos[("step", k + 1)] < pos[("write_done", k)]


class _Done:
    def wait(self):
        pass


def test_pipeline_overlaps_real_io_with_the_step(tmp_path, io_pool):
    """With real threads: while sub-group k steps, the read of k+1 is already submitted."""
    sgs = plan_subgroups([5000, 3000], 2000)
    states = SwappedStates(str(tmp_path), sgs, 2, io_pool, direct=False)
    try:
        seen = []
        submitted = []
        real_read = states.read

        def read(k, b):
            submitted.append(k)
            return real_read(k, b)

        def step(k, b):
            seen.append((k, list(submitted)))

        run_pipelined(len(sgs), 2, read, step, states.write)
        assert [k for k, _ in seen] == list(range(len(sgs)))
        for k, subs in seen[:-1]:
            assert k + 1 in subs
    finally:
        states.close()


def test_plan_subgroups():
    assert plan_subgroups([5, 0, 3], 2) == [SubGroup(0, 0, 0, 2), SubGroup(1, 0, 2, 4), SubGroup(2, 0, 4, 5),
                                            SubGroup(3, 2, 0, 2), SubGroup(4, 2, 2, 3)]
    with pytest.raises(ValueError, match="sub_group_size=0"):
        plan_subgroups([4], 0)


# ---------------------------------------------------------------------------- swap store
def _values(numels, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {kind: [torch.randn(n, generator=g) for n in numels] for kind in KINDS}


@pytest.mark.parametrize("refuse_direct", [False, True])
def test_swapped_states_round_trip_and_snapshot(tmp_path, io_pool, monkeypatch, refuse_direct):
    if refuse_direct:
        _refuse_o_direct(monkeypatch)
    direct = probe_direct_io(str(tmp_path)).supported
    assert not (refuse_direct and direct)
    numels = [1000, 37]
    sgs = plan_subgroups(numels, 300)
    states = SwappedStates(str(tmp_path), sgs, 2, io_pool, direct=direct)
    try:
        vals = _values(numels)
        states.fill(vals)
        for g, n in enumerate(numels):
            for kind in KINDS:
                assert torch.equal(states.gather_kind(kind, g, n), vals[kind][g])
        snap = states.snapshot(numels)
        for kind in KINDS:
            for g in range(len(numels)):
                assert torch.equal(snap[kind][g], vals[kind][g])
        # a later snapshot replaces the files by rename: tensors mapped from the first keep their bytes
        states.fill(_values(numels, seed=1))
        snap2 = states.snapshot(numels)
        assert torch.equal(snap["master"][0], vals["master"][0])
        assert not torch.equal(snap2["master"][0], vals["master"][0])
        assert not any(name.endswith(".tmp") for name in os.listdir(os.path.join(states.directory, "snapshot")))
    finally:
        states.close()
    assert not os.path.exists(states.directory)


def test_bf16_moments_halve_their_bytes_and_snapshots_stay_fp32(tmp_path, io_pool):
    """bf16 moments: the files hold 2 bytes per moment element (the master stays 4), values are
    stochastically rounded on the way in, and snapshots (checkpoints) are fp32 that load back
    exactly (a bf16 value rounds to itself)."""
    numels = [4096, 2048]  # whole pages in either dtype: no padding, so the sizes are exact
    sgs = plan_subgroups(numels, 2048)
    sizes = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        states = SwappedStates(str(tmp_path / name), sgs, 2, io_pool, direct=False, state_dtype=dtype)
        try:
            vals = _values(numels)
            states.fill(vals)
            sizes[name] = sum(os.path.getsize(os.path.join(states.directory, f)) for f in os.listdir(states.directory))
            assert sizes[name] == states.disk_bytes()
            assert states.views(0, 0)[1].dtype == dtype and states.views(0, 0)[0].dtype == torch.float32
            snap = states.snapshot(numels)
            for g in range(len(numels)):
                assert torch.equal(snap["master"][g], vals["master"][g])
                for kind in KINDS[1:]:
                    got, want = snap[kind][g], vals[kind][g]
                    assert got.dtype == torch.float32
                    # stochastic rounding: within one bf16 step of the value, unbiased on average
                    assert torch.all((got - want).abs() <= want.abs() * 2.0**-7 + 1e-30)
                    if dtype == torch.bfloat16:
                        assert not torch.equal(got, want.bfloat16().float())  # not round-to-nearest
                        # tolerance: not an equivalence: a statistical bound (Hoeffding): n independent zero-mean
                        # errors within +-b_i = |want_i| 2^-7 have |mean| > sqrt(2 ln(2/1e-9) sum b_i^2) / n w.p. < 1e-9
                        b = want.double().abs() * 2.0**-7
                        bound = math.sqrt(2 * math.log(2 / 1e-9) * float((b * b).sum())) / want.numel()
                        assert abs(float((got - want).double().mean())) <= bound, bound
            states.fill({k: [t.clone() for t in v] for k, v in snap.items()})  # a reload of the snapshot
            for g, n in enumerate(numels):
                for kind in KINDS:
                    assert torch.equal(states.gather_kind(kind, g, n), snap[kind][g]), (name, kind)
        finally:
            states.close()
    n = sum(numels)
    assert sizes["fp32"] == 3 * 4 * n and sizes["bf16"] == (4 + 2 + 2) * n


# ---------------------------------------------------------------------------- atomic copies
def test_atomic_file_replaces_only_on_success(tmp_path):
    path = str(tmp_path / "state.bin")
    with atomic_file(path) as fd:
        os.write(fd, b"old")
    mapped = torch.from_file(path, shared=False, size=3, dtype=torch.uint8)

    with pytest.raises(RuntimeError, match="crash"):
        with atomic_file(path) as fd:
            os.write(fd, b"torn")
            raise RuntimeError("crash while writing")
    assert open(path, "rb").read() == b"old"
    assert os.listdir(tmp_path) == ["state.bin"]  # no temp file left behind

    with atomic_file(path) as fd:
        os.write(fd, b"new")
    assert open(path, "rb").read() == b"new"
    assert bytes(mapped.tolist()) == b"old"  # a reader of the old file is not torn either


def test_io_threads_are_released(tmp_path):
    before = threading.active_count()
    pool = AsyncFileIO(threads=2)
    fd = aio.open_swap_file(str(tmp_path / "x"), 4096, direct=False)
    pool.write(fd, aligned_empty(4096), 0).wait()
    os.close(fd)
    pool.close()
    assert threading.active_count() == before
