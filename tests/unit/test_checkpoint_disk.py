"""Disk errors without filling a disk (the writers are made to fail as a full or read-only disk
does): a failed save removes its ``NAME.partial`` on every rank without hanging any, a later save
removes a killed job's stale ``*.partial`` folders, and every error is a CheckpointError (or, for
NVMe offload, an OSError) naming the file and the setting that chose it (``ModelCheckpoint
dirpath``, ``nvme_path``, consolidate's ``OUT``)."""
from __future__ import annotations

import errno
import os
import re
import sys
import threading
from pathlib import Path

import pytest
import torch

from zerotrain import CheckpointError, ModelCheckpoint
from zerotrain.strategies.offload import aio, param_swap, swapper
from zerotrain.strategies.offload.aio import AsyncFileIO, OffloadIOError
from zerotrain.strategies.offload.plan import plan_subgroups
from zerotrain.strategies.offload.swapper import KINDS, SwappedStates
from zerotrain.trainer.checkpoint import (single_file as checkpoint_file, directory as checkpoint_io,
                                          tensor_files)
from zerotrain.trainer.checkpoint.tensor_files import Entry

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_checkpoint_bounds import make_checkpoint  # noqa: E402

_SOLO = checkpoint_io.Comm(0, 1, lambda: None, lambda obj: [obj], lambda obj: obj)
ENOSPC = os.strerror(errno.ENOSPC)  # "No space left on device"
EROFS = os.strerror(errno.EROFS)  # "Read-only file system"


def _save(directory: Path, name: str, value: float, comm=_SOLO) -> Path:
    return checkpoint_io.save(directory / name, comm, [Entry.of("param/w", torch.full((1000,), value))], {},
                              lambda locals_: {"value": value})


class _FullDisk:
    """A file object whose writes fail with ENOSPC once ``room`` bytes are written (some of the
    bytes of the write that does not fit land first, as on a real disk)."""

    def __init__(self, f, room: int) -> None:
        self._f, self._room = f, room

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        if len(data) > self._room:
            self._f.write(data[:self._room])
            self._room = 0
            raise OSError(errno.ENOSPC, ENOSPC)
        self._room -= len(data)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def _fill_disk(monkeypatch, module, room: int = 2000) -> None:
    """Every file ``module`` opens for writing runs out of space after ``room`` bytes."""
    real_open = open

    def full_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        return _FullDisk(f, room) if "w" in mode else f

    monkeypatch.setattr(module, "open", full_open, raising=False)


def _dirs(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


# ---------------------------------------------------------------------------- failed saves

@pytest.mark.timeout(60)
@pytest.mark.parametrize("phase", ["shard", "meta"])
def test_a_save_failing_on_a_full_disk_removes_its_partial_and_names_the_file(tmp_path, monkeypatch, phase):
    _save(tmp_path, "a", 1.0)
    if phase == "shard":  # the shard's tensor bytes do not fit
        _fill_disk(monkeypatch, tensor_files)
        file = tmp_path / "b.partial" / checkpoint_io.rank_file(0)
    else:  # rank 0's meta.pt does not fit
        _fill_disk(monkeypatch, checkpoint_io, room=100)
        file = tmp_path / "b.partial" / "meta.pt"
    with pytest.raises(CheckpointError) as err:
        _save(tmp_path, "b", 2.0)
    msg = str(err.value)
    assert str(file) in msg and ENOSPC in msg, msg
    assert _dirs(tmp_path) == ["a", "latest"]  # no b.partial holding the space
    root, meta = checkpoint_io.load_meta(tmp_path)
    checkpoint_io.verify(root, meta)
    assert root.name == "a" and meta["value"] == 1.0
    monkeypatch.undo()  # room again: the next save works
    _save(tmp_path, "b", 2.0)
    assert checkpoint_io.load_meta(tmp_path)[1]["value"] == 2.0


class _ThreadComm:
    """``n`` ranks as threads: the collectives a save needs, each with a timeout (a rank that
    never arrives breaks the barrier instead of hanging the test)."""

    def __init__(self, n: int) -> None:
        self.n, self.barrier, self.slots, self.value = n, threading.Barrier(n, timeout=20), [None] * n, None

    def of(self, rank: int) -> checkpoint_io.Comm:
        def gather(obj):
            self.slots[rank] = obj
            self.barrier.wait()
            out = list(self.slots) if rank == 0 else None
            self.barrier.wait()
            return out

        def broadcast(obj):
            if rank == 0:
                self.value = obj
            self.barrier.wait()
            value = self.value
            self.barrier.wait()
            return value

        return checkpoint_io.Comm(rank, self.n, self.barrier.wait, gather, broadcast)


def _save_on_ranks(directory: Path, name: str, n: int = 2) -> list[BaseException | None]:
    comm, errors = _ThreadComm(n), [None] * n

    def rank(r):
        try:
            checkpoint_io.save(directory / name, comm.of(r), [Entry.of("param/w", torch.full((1000,), float(r)))],
                               {}, lambda locals_: {"value": 0.0})
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            errors[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert not any(t.is_alive() for t in threads), "a rank hangs"
    return errors


@pytest.mark.timeout(60)
@pytest.mark.parametrize("failing", ["rank 1 writes", "rank 0 creates the folder"])
def test_a_failed_save_is_agreed_on_every_rank_and_cleaned_up_without_a_hang(tmp_path, monkeypatch, failing):
    _save_on_ranks(tmp_path, "a")
    if failing == "rank 1 writes":
        write = checkpoint_io._write_shard

        def full(file, entries, rank):
            if rank == 1:
                file.write_bytes(b"\0" * 5000)  # part of it was written
                raise OSError(errno.ENOSPC, ENOSPC)
            return write(file, entries, rank)

        monkeypatch.setattr(checkpoint_io, "_write_shard", full)
        want = [str(tmp_path / "b.partial" / checkpoint_io.rank_file(1)), ENOSPC]
    else:
        real_mkdir = Path.mkdir

        def read_only(self, *args, **kwargs):
            if self.name.endswith(".partial"):
                raise OSError(errno.EROFS, EROFS, str(self))
            return real_mkdir(self, *args, **kwargs)

        monkeypatch.setattr(Path, "mkdir", read_only)
        want = [str(tmp_path / "b.partial"), EROFS]
    errors = _save_on_ranks(tmp_path, "b")
    for r, exc in enumerate(errors):  # the same CheckpointError on both ranks, naming the cause
        assert isinstance(exc, CheckpointError), (r, repr(exc))
        assert all(w in str(exc) for w in want), str(exc)
        assert str(exc) == str(errors[0])
    assert _dirs(tmp_path) == ["a", "latest"]
    assert checkpoint_io.load_meta(tmp_path)[0].name == "a"


@pytest.mark.timeout(60)
def test_a_later_save_removes_stale_partials_of_killed_jobs_only(tmp_path):
    _save(tmp_path, "a", 1.0)
    killed = tmp_path / "step=000002.partial"  # a job killed while its ranks were writing
    killed.mkdir()
    (killed / checkpoint_io.rank_file(0)).write_bytes(b"\0" * 4096)
    (killed / "meta.pt.tmp").write_bytes(b"\0" * 10)
    empty = tmp_path / "step=000003.partial"  # killed right after creating it
    empty.mkdir()
    other = tmp_path / "notes.partial"  # not a checkpoint: left alone
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    (tmp_path / "model.safetensors.partial").write_bytes(b"x")  # a file, e.g. consolidate's: left alone
    _save(tmp_path, "step=000004", 4.0)
    assert _dirs(tmp_path) == ["a", "latest", "model.safetensors.partial", "notes.partial", "step=000004"]
    assert (other / "notes.txt").read_text() == "mine"


# ---------------------------------------------------------------------------- ModelCheckpoint

class _Trainer:
    is_global_zero, current_epoch, fast_dev_run, sanity_checking, ckpt_path, loggers = True, 0, 0, False, None, []
    state = type("State", (), {"fn": "fit"})

    def __init__(self) -> None:
        self.global_step, self.callback_metrics = 0, {}
        self.strategy = type("S", (), {"barrier": staticmethod(lambda: None), "any_rank": staticmethod(bool)})

    def save_checkpoint(self, path, weights_only=False):
        _save(Path(path).parent, Path(path).name, float(self.global_step))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("disk", ["full", "read-only"])
def test_model_checkpoint_errors_name_the_path_and_dirpath(tmp_path, monkeypatch, disk):
    cb = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=1, filename="{step:06d}")
    trainer = _Trainer()
    trainer.global_step = 1
    cb.on_train_batch_end(trainer, None, None, None, 0)
    if disk == "full":
        _fill_disk(monkeypatch, checkpoint_file, room=100)  # one process: the .ckpt is one file
        want = [str(tmp_path / "ck" / "step=000002.ckpt"), ENOSPC]
    else:
        real_mkdir = Path.mkdir

        def read_only(self, *args, **kwargs):
            if str(self).startswith(str(tmp_path / "ck")):
                raise PermissionError(errno.EROFS, EROFS, str(self))
            return real_mkdir(self, *args, **kwargs)

        monkeypatch.setattr(Path, "mkdir", read_only)
        want = [str(tmp_path / "ck" / "step=000002.ckpt"), EROFS]
    trainer.global_step = 2
    with pytest.raises(CheckpointError) as err:
        cb.on_train_batch_end(trainer, None, None, None, 0)
    msg = str(err.value)
    assert all(w in msg for w in want) and f"ModelCheckpoint dirpath={str(tmp_path / 'ck')!r}" in msg, msg
    assert _dirs(tmp_path / "ck") == ["step=000001.ckpt"]  # no step=000002.ckpt.tmp left, no pointer needed


@pytest.mark.timeout(60)
def test_an_unreadable_checkpoint_directory_is_a_checkpoint_error(tmp_path, monkeypatch):
    _save(tmp_path, "a", 1.0)

    def denied(self, *args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))

    monkeypatch.setattr(Path, "open", denied)  # the `latest` pointer
    with pytest.raises(CheckpointError, match=re.escape(str(tmp_path / "latest")) + ".*Permission denied"):
        checkpoint_io.load_meta(tmp_path)
    monkeypatch.undo()
    monkeypatch.setattr(Path, "stat", denied)  # the shard files, as verify() reads them
    root = tmp_path / "a"
    meta = torch.load(root / "meta.pt", weights_only=True)
    shard = re.escape(str(root / checkpoint_io.rank_file(0)))
    with pytest.raises(CheckpointError, match=shard + ".*Permission denied"):
        checkpoint_io.verify(root, meta)


@pytest.mark.timeout(60)
def test_consolidate_on_a_full_disk_names_the_output_and_leaves_nothing(tmp_path, monkeypatch):
    from zerotrain.trainer.checkpoint import consolidate as cons

    ck = make_checkpoint(tmp_path / "ck")
    _fill_disk(monkeypatch, tensor_files, room=100)
    out = tmp_path / "out" / "model.safetensors"
    with pytest.raises(CheckpointError) as err:
        cons.consolidate(ck, out)
    assert f"{out}.partial" in str(err.value) and ENOSPC in str(err.value) and "OUT=" in str(err.value)
    assert os.listdir(tmp_path / "out") == []
    assert cons.main([str(ck), str(out)]) == 2


# ---------------------------------------------------------------------------- NVMe offload

@pytest.fixture
def io_pool():
    pool = AsyncFileIO(threads=2, block_bytes=8192)
    yield pool
    pool.close()


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, ENOSPC)


def _assert_names(exc: BaseException, nvme: Path, action: str, file: str) -> None:
    msg = str(exc)
    assert isinstance(exc, OSError) and exc.errno == errno.ENOSPC, repr(exc)
    assert f"NVMe offload (strategy nvme_path={nvme})" in msg and f"{action} {file} failed: {ENOSPC}" in msg, msg


@pytest.mark.timeout(60)
def test_nvme_swap_errors_name_the_file_and_nvme_path(tmp_path, io_pool, monkeypatch):
    numels = [1000, 37]
    states = SwappedStates(str(tmp_path), plan_subgroups(numels, 300), 2, io_pool, direct=False)
    try:
        values = {kind: [torch.randn(n) for n in numels] for kind in KINDS}
        with monkeypatch.context() as m:
            m.setattr(aio, "_pwrite_all", _no_space)
            with pytest.raises(OffloadIOError) as err:
                states.fill(values)
            _assert_names(err.value, tmp_path, "writing", states._path(0))
        states.fill(values)
        with monkeypatch.context() as m:
            m.setattr(aio, "_pread_all", _no_space)
            with pytest.raises(OffloadIOError) as err:
                states.gather_kind("exp_avg", 1, numels[1])
            _assert_names(err.value, tmp_path, "reading", states._path(4))
        with monkeypatch.context() as m:
            m.setattr(swapper, "write_tensor_at", _no_space)
            with pytest.raises(OffloadIOError) as err:
                states.snapshot(numels)
            snap = os.path.join(states.directory, "snapshot")
            _assert_names(err.value, tmp_path, "writing", os.path.join(snap, "master_0.bin"))
            assert not any(n.endswith(".tmp") for n in os.listdir(snap))  # no half-written copies left
    finally:
        states.close()
    monkeypatch.setattr(swapper, "open_swap_file", _no_space)
    with pytest.raises(OffloadIOError) as err:
        SwappedStates(str(tmp_path), plan_subgroups(numels, 300), 2, io_pool, direct=False)
    assert "nvme_path=" in str(err.value) and "sg00000.swp" in str(err.value)
    assert os.listdir(tmp_path) == []  # the swap folder of the failed set-up is gone


@pytest.mark.timeout(60)
def test_nvme_param_files_take_their_space_up_front_and_name_nvme_path(tmp_path, monkeypatch):
    """A shard file is allocated when it is made, so a full disk is an error there, not a SIGBUS
    at a later store through the mapping."""
    work = tmp_path / "zerotrain-params-rank0-x"
    work.mkdir()
    shard = param_swap.MappedShard(str(work / "unit0000.master"), 5000, torch.float32)
    assert os.stat(shard.path).st_blocks * 512 >= 5000 * 4  # blocks allocated, not a sparse file
    shard.close()
    monkeypatch.setattr(param_swap.os, "posix_fallocate", _no_space)
    with pytest.raises(OffloadIOError) as err:
        param_swap.MappedShard(str(work / "unit0001.master"), 5000, torch.float32)
    _assert_names(err.value, tmp_path, "creating", str(work / "unit0001.master"))
