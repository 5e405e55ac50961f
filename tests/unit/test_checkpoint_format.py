"""The checkpoint format without process groups: streaming tensor files, the save protocol killed
at each of its phases, ModelCheckpoint's pruning, the data-position and compatibility rules."""
from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path

import pytest
import torch

from zerotrain import CheckpointError, ModelCheckpoint
from zerotrain.trainer.checkpoint import directory as checkpoint_io
from zerotrain.trainer.checkpoint.reshard import check_compatible, layout_meta, resume_position
from zerotrain.trainer.checkpoint.tensor_files import Entry, SafetensorsFile, write_safetensors, write_torch


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(7, 5, generator=g), "h": torch.randn(9, generator=g).bfloat16(),
            "n": torch.arange(6, dtype=torch.int64), "b": torch.tensor([True, False, True]),
            "s": torch.tensor(3.0), "e": torch.zeros(0, 4)}


def test_safetensors_written_streaming_read_by_safetensors_and_by_slices(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    ts = _tensors()
    path = tmp_path / "t.safetensors"
    digest = write_safetensors(path, [Entry.of(k, v) for k, v in ts.items()], {"note": "x"})
    assert digest == checkpoint_io.file_digest(path)
    back = load_file(path)
    assert all(torch.equal(back[k], v) for k, v in ts.items())
    with safe_open(str(path), "pt") as f:
        assert torch.equal(f.get_slice("w")[2:4], ts["w"][2:4]) and f.metadata() == {"note": "x"}
    with SafetensorsFile(path) as f:
        assert torch.equal(f.read("w"), ts["w"]) and torch.equal(f.read("s"), ts["s"])
        assert torch.equal(f.read("w", 3, 17), ts["w"].reshape(-1)[3:17])
        out = torch.zeros(4, dtype=torch.float32)
        f.read("h", 2, 6, out=out)  # cast into another dtype
        assert torch.equal(out, ts["h"][2:6].float())
        with pytest.raises(CheckpointError, match="outside"):
            f.read("w", 30, 40)
        with pytest.raises(CheckpointError, match="no tensor 'nope'"):
            f.read("nope")
    data = path.read_bytes()
    for bad, why in ((data[:-3], "truncated"), (data + b"\0", "appended"), (b"\x80\x04K\x01.", "shorter"),
                     (b"\xff" * 16, "does not fit")):
        path.write_bytes(bad)
        with pytest.raises(CheckpointError, match=why):
            SafetensorsFile(path)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.uint16, torch.uint32, torch.uint64,
                                   torch.float8_e4m3fn, torch.float8_e5m2])
def test_safetensors_holds_every_dtype_safetensors_names(dtype, tmp_path):
    """A complex64 buffer (Llama's rotary ``freqs_cis``, found in Lightning's Fabric tensor_parallel
    example), unsigned and float8 tensors round-trip, whole and by element ranges, and safetensors
    itself reads them; before, saving such a model raised ``cannot be stored in safetensors``."""
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(0)
    t = (torch.randn(3, 5, dtype=torch.complex64, generator=g) if dtype.is_complex
         else torch.randint(0, 100, (3, 5), generator=g).to(dtype))
    path = tmp_path / "t.safetensors"
    write_safetensors(path, [Entry.of("t", t)])
    assert load_file(path)["t"].view(torch.uint8).equal(t.view(torch.uint8))
    with SafetensorsFile(path) as f:
        assert f.read("t").view(torch.uint8).equal(t.view(torch.uint8))
        assert f.read("t", 4, 9).view(torch.uint8).equal(t.reshape(-1)[4:9].view(torch.uint8))


def test_torch_file_written_streaming_loads_with_weights_only_and_shares_tied_storage(tmp_path):
    ts = _tensors()
    calls = []

    def entry(k):
        return Entry(k, ts[k].dtype, tuple(ts[k].shape), lambda: calls.append(k) or ts[k])

    entries = [entry(k) for k in ts] + [Entry("tied", torch.float32, (7, 5), None, alias_of="w")]
    write_torch(tmp_path / "t.pt", entries)
    back = torch.load(tmp_path / "t.pt", weights_only=True)
    assert list(back) == list(ts) + ["tied"] and calls == list(ts)  # each produced once, in order
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in ts.items())
    assert back["tied"].data_ptr() == back["w"].data_ptr()


# ---------------------------------------------------------------------------- the save protocol

_SOLO = checkpoint_io.Comm(0, 1, lambda: None, lambda obj: [obj], lambda obj: obj)


def _save(directory: Path, name: str, value: float) -> None:
    t = torch.full((1000,), value)
    checkpoint_io.save(directory / name, _SOLO, [Entry.of("param/w", t)], {},
                       lambda locals_: {"value": value})


def _die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def _killed_save(directory: Path, name: str, phase: str) -> None:
    """In a forked child: start a save of value 2.0 and die (SIGKILL) at ``phase``."""
    if phase == "shard":  # half of the shard written
        write = checkpoint_io._write_shard

        def half(file, entries, rank):
            d = write(file, entries, rank)
            os.truncate(file, d.size // 2)
            _die()
        checkpoint_io._write_shard = half
    elif phase == "meta":
        checkpoint_io._fsync_save = _die
    elif phase == "publish":
        checkpoint_io._publish = _die
    elif phase in ("between_renames", "latest_tmp"):
        real, seen = os.replace, []

        def replace(src, dst):
            seen.append(dst)
            if (phase == "between_renames" and str(src).endswith(".partial")) or \
                    (phase == "latest_tmp" and str(dst).endswith("latest")):
                _die()
            real(src, dst)
        os.replace = replace
    elif phase == "pointer":
        checkpoint_io.write_latest = _die
    _save(directory, name, 2.0)
    os._exit(0)  # not reached


PHASES = ["shard", "meta", "publish", "between_renames", "pointer", "latest_tmp"]


@pytest.mark.parametrize("same_name", [False, True], ids=["new-name", "overwrite"])
def test_a_save_killed_at_any_phase_leaves_latest_complete(tmp_path, same_name):
    ctx = multiprocessing.get_context("fork")
    for phase in PHASES:
        directory = tmp_path / f"{phase}-{same_name}"
        directory.mkdir()
        _save(directory, "a", 1.0)
        child = ctx.Process(target=_killed_save, args=(directory, "a" if same_name else "b", phase))
        child.start()
        child.join(60)
        assert child.exitcode == -signal.SIGKILL, (phase, child.exitcode)
        root, meta = checkpoint_io.load_meta(directory / "latest")
        checkpoint_io.verify(root, meta)
        with SafetensorsFile(root / checkpoint_io.rank_file(0)) as f:
            assert torch.equal(f.read("param/w"), torch.full((1000,), meta["value"]))
        # the old checkpoint, or (overwritten in place, killed after publishing) the new one
        assert meta["value"] == (2.0 if same_name and phase in ("pointer", "latest_tmp") else 1.0), phase
        _save(directory, "c", 3.0)  # and the next save works over the debris
        assert checkpoint_io.load_meta(directory)[1]["value"] == 3.0


def test_latest_pointer_and_resolution(tmp_path):
    _save(tmp_path, "step=1", 1.0)
    _save(tmp_path, "step=2", 2.0)
    assert (tmp_path / "latest").read_text().strip() == "step=2"
    for p in (tmp_path, tmp_path / "latest", tmp_path / "last", tmp_path / "step=2"):
        assert checkpoint_io.resolve(p) == tmp_path / "step=2"
    checkpoint_io.save(tmp_path / "step=3", _SOLO, [], {}, lambda loc: {"value": 3.0}, update_latest=False)
    assert checkpoint_io.resolve(tmp_path) == tmp_path / "step=2"
    with pytest.raises(CheckpointError, match="no checkpoint"):
        checkpoint_io.resolve(tmp_path / "nothing")


class _FakeTrainer:
    """What ModelCheckpoint touches, saving real (tiny) checkpoint directories."""

    is_global_zero, current_epoch, fast_dev_run, sanity_checking, ckpt_path, loggers = True, 0, 0, False, None, []
    state = type("State", (), {"fn": "fit"})

    def __init__(self):
        self.global_step, self.callback_metrics = 0, {}
        self.strategy = type("S", (), {"barrier": staticmethod(lambda: None), "any_rank": staticmethod(bool)})

    def save_checkpoint(self, path, weights_only=False):
        _save(Path(path).parent, Path(path).name, float(self.global_step))


def test_model_checkpoint_keeps_top_k_as_lightning(tmp_path):
    cb = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=1, monitor="loss", save_top_k=1, filename="{step}")
    trainer = _FakeTrainer()
    for step, loss in enumerate([3.0, 1.0, 2.0, 5.0], start=1):
        trainer.global_step, trainer.callback_metrics = step, {"loss": loss}
        cb.on_train_batch_end(trainer, None, None, None, 0)
    kept = sorted(p.name for p in tmp_path.iterdir() if p.name != "latest")
    assert kept == ["step=2.ckpt"]  # the best; a worse one is not saved (Lightning's)
    assert cb.best_model_path.endswith("step=2.ckpt") and cb.latest_path.endswith("step=2.ckpt")
    trainer.global_step, trainer.callback_metrics = 5, {"loss": 0.5}
    cb.on_train_batch_end(trainer, None, None, None, 0)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "latest") == ["step=5.ckpt"]


# ---------------------------------------------------------------------------- rules

def test_resume_position_keeps_the_global_sample_position():
    loop = {"global_step": 10, "epoch": 1, "batches_in_epoch": 3, "total_batches": 10}
    assert resume_position(loop, {"batch_size": 6, "world": 4}, 6, 4) == (loop, None)
    out, note = resume_position(loop, {"batch_size": 6, "world": 4}, 12, 2)  # same global batch
    assert out["batches_in_epoch"] == 3 and out["total_batches"] == 10 and "resuming at sample 72" in note
    out, note = resume_position(loop, {"batch_size": 6, "world": 4}, 10, 2)  # 24 -> 20
    assert out["batches_in_epoch"] == 3 and "12 samples before it are seen again" in note
    out, note = resume_position(loop, {"batch_size": None, "world": 4}, 6, 2)
    assert out == loop and "unknown batch size" in note


def test_resume_position_after_a_max_steps_cut_keeps_the_cut_epochs_position():
    """A fit that max_steps cut after 3 of epoch 1's batches ended that epoch (epoch 2 counted); a
    later fit continues epoch 1 (cut_batches): that position is rescaled, not the new epoch's."""
    loop = {"global_step": 10, "epoch": 2, "batches_in_epoch": 0, "total_batches": 10, "cut_batches": 3}
    out, note = resume_position(loop, {"batch_size": 6, "world": 4}, 4, 3)  # 24 -> 12: 6 batches
    assert (out["epoch"], out["batches_in_epoch"], out["cut_batches"]) == (2, 0, 6)
    assert "resuming at sample 72 of epoch 1" in note
    out, note = resume_position(loop, {"batch_size": 6, "world": 4}, 25, 4)  # 24 -> 100: none whole
    assert (out["epoch"], out["batches_in_epoch"], out["cut_batches"]) == (1, 0, 0)
    assert "72 samples before it are seen again" in note


def _meta(**params):
    return {"params": {n: {"shape": s} for n, s in params.items()}, "extras": {"bn.n": {"shape": []}},
            "optimizer": {"type": "torch.optim.adamw.AdamW", "names": [sorted(params)]}}


def test_check_compatible_names_every_difference():
    model = {"params": {"a": ([2, 3], "float32"), "c": ([4], "float32")}, "extras": {"bn.n": ([], "int64")}}
    opt = {"type": "torch.optim.adamw.AdamW", "names": [["a", "c"]]}
    check_compatible(Path("ck"), _meta(a=[2, 3], c=[4]), model, opt)
    with pytest.raises(CheckpointError) as err:
        check_compatible(Path("ck"), _meta(a=[3, 3], b=[4]), model, opt)
    msg = str(err.value)
    assert "missing parameters (in the model, not in the checkpoint): c" in msg
    assert "unexpected parameters (in the checkpoint, not in the model): b" in msg
    assert "a (checkpoint [3, 3], model [2, 3])" in msg
    with pytest.raises(CheckpointError, match="optimizer torch.optim.adamw.AdamW; this run uses .*SGD"):
        check_compatible(Path("ck"), _meta(a=[2, 3], c=[4]), model, dict(opt, type="torch.optim.sgd.SGD"))
    with pytest.raises(CheckpointError, match="param group 0 holds other parameters .*: a"):
        check_compatible(Path("ck"), _meta(a=[2, 3], c=[4]), model, dict(opt, names=[["c"]]))


def test_layout_meta_merges_ranges_and_checks_coverage():
    model = {"params": {"w": [[10], "float32"]}, "extras": {}, "aliases": {}, "keys": ["w"]}
    loc = lambda s, e: {"model": model, "ranges": {"w": [s, e]}, "kinds": {"w": ["param"]},  # noqa: E731
                        "scalars": {"w": ["step"]}, "extras": []}
    meta = layout_meta([loc(0, 4), loc(4, 10)])
    assert meta["params"]["w"]["ranges"] == [[0, 0, 4], [1, 4, 10]]
    with pytest.raises(ValueError, match="cover 4 of the 10"):
        layout_meta([loc(0, 4), loc(5, 10)])


def test_optimizer_state_splits_into_elements_and_scalars_or_is_refused():
    from zerotrain.strategies.base import split_optimizer_state

    p = torch.zeros(3, 4)
    per, scalars = split_optimizer_state("w", p, {"step": torch.tensor(5.0), "exp_avg": torch.ones(3, 4),
                                                  "count": 2})
    assert per["exp_avg"].shape == (12,) and scalars["step"].item() == 5.0 and scalars["count"].item() == 2.0
    zero_dim = torch.zeros(())  # a 0-dim parameter: its moments are 0-dim too, its step a scalar
    per, scalars = split_optimizer_state("s", zero_dim, {"step": torch.tensor(1.0), "exp_avg": torch.ones(())})
    assert set(per) == {"exp_avg"} and set(scalars) == {"step"}
    with pytest.raises(ValueError, match="'row' of w has shape \\(3,\\), neither the parameter's \\(3, 4\\)"):
        split_optimizer_state("w", p, {"row": torch.ones(3)})  # Adafactor-like factored state
