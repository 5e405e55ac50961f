"""Consolidation and clear errors, on a model with a tied weight, buffers (one int64) and a frozen
parameter, saved by zero2 on 2 ranks:

* ``consolidate`` (safetensors, torch, bf16) = ``trainer.full_state_dict()``, and plain PyTorch loads
  it into the unwrapped module with ``strict=True``;
* resuming into another model names the missing, unexpected and shape-mismatched entries, into
  another optimizer type names both types, from a truncated shard names the file - on every rank;
* a pickle with a code payload in place of a shard or of ``meta.pt`` is refused without running.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from harness import run_ranks
from toy import make_data
from zerotrain import Callback, CheckpointError, ModelCheckpoint, Trainer, TrainModule


class Tied(TrainModule):
    def __init__(self, hidden: int = 20, other: bool = False, opt: str = "adamw") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(12, hidden)
        self.bn = nn.BatchNorm1d(hidden)  # running_mean, running_var, num_batches_tracked (int64)
        self.a = nn.Linear(hidden, hidden)
        self.b = nn.Linear(hidden, hidden)
        self.b.weight = self.a.weight  # tied: state_dict has a.weight and b.weight
        self.out = nn.Linear(hidden, 3)
        if other:
            self.extra = nn.Linear(3, 3)
        else:
            self.scale = nn.Parameter(torch.full((3,), 0.5), requires_grad=False)  # frozen
        self.opt = opt

    def forward(self, x):
        h = nn.functional.gelu(self.bn(self.inp(x)))
        h = self.out(nn.functional.gelu(self.b(nn.functional.gelu(self.a(h)))))
        return h * self.scale if hasattr(self, "scale") else self.extra(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        if self.opt == "sgd":
            return torch.optim.SGD(params, lr=0.01, momentum=0.9)
        return torch.optim.AdamW(params, lr=0.01)

    def train_dataloader(self):
        return DataLoader(make_data(96), batch_size=8)


class StartStep(Callback):
    def on_fit_start(self, trainer, module) -> None:
        self.step = trainer.global_step


def _trainer(steps, cbs=()):
    return Trainer(strategy="zero2", devices=2, max_steps=steps, callbacks=list(cbs), logger=False,
                   enable_checkpointing=bool(cbs), enable_progress_bar=False)


def _error(module, ckpt) -> str:
    try:
        _trainer(6).fit(module, ckpt_path=ckpt)
    except CheckpointError as exc:
        return str(exc)
    return "no error"


def _worker(root: str) -> dict:
    import torch.distributed as dist

    trainer = _trainer(4, [ModelCheckpoint(dirpath=os.path.join(root, "ck"),
                                           filename="{step:06d}", save_top_k=-1, every_n_train_steps=4)])
    module = Tied()
    trainer.fit(module)
    out = {"full": trainer.full_state_dict()}
    ckpt = os.path.join(root, "ck", "step=000004.ckpt")
    # ckpt_path="latest": the ModelCheckpoint directory's newest (saves nothing more here)
    start = StartStep()
    _trainer(6, [ModelCheckpoint(dirpath=os.path.join(root, "ck"), every_n_epochs=0), start]).fit(
        Tied(), ckpt_path="latest")
    out["latest_resumed"] = start.step
    out["other_model"] = _error(Tied(hidden=21, other=True), ckpt)
    out["other_optimizer"] = _error(Tied(opt="sgd"), ckpt)
    bad = os.path.join(root, "truncated")
    if dist.get_rank() == 0:
        shutil.copytree(ckpt, bad)
        shard = os.path.join(bad, "rank_00001.safetensors")
        os.truncate(shard, os.path.getsize(shard) - 100)
    dist.barrier()
    out["truncated"] = _error(Tied(), bad)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("consolidate")
    return root, run_ranks("test_checkpoint_consolidate:_worker", 2, root, timeout=150, root=str(root))


def test_consolidated_weights_equal_full_state_dict_and_load_strictly(saved, tmp_path):
    root, out = saved
    full = out[0]["full"]
    from safetensors.torch import load_file
    from zerotrain.trainer.checkpoint.consolidate import consolidate

    st = consolidate(root / "ck", tmp_path / "model.safetensors")  # the ModelCheckpoint dir: its latest
    pt = consolidate(root / "ck" / "step=000004.ckpt", tmp_path / "model.pt")
    for got in (load_file(st), torch.load(pt, weights_only=True)):
        assert list(got) == list(full)  # module.state_dict() keys and order, tied names included
        for k, v in full.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        plain = Tied()
        plain.load_state_dict(got, strict=True)
    tied = torch.load(pt, weights_only=True)
    assert tied["a.weight"].data_ptr() == tied["b.weight"].data_ptr()  # one storage, as torch.save
    # the console script, with a bf16 copy
    res = subprocess.run(["zerotrain-consolidate", str(root / "ck"), str(tmp_path / "bf16.safetensors"), "--bf16"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    half = load_file(tmp_path / "bf16.safetensors")
    assert half["a.weight"].dtype == torch.bfloat16 and half["bn.num_batches_tracked"].dtype == torch.int64
    # tolerance: exact: the one round-to-nearest-even cast of the fp32 weights
    assert torch.equal(half["a.weight"], full["a.weight"].to(torch.bfloat16))


def test_other_model_optimizer_and_truncation_are_named_on_every_rank(saved):
    _, out = saved
    assert [r["latest_resumed"] for r in out] == [4, 4]
    for r in out:
        msg = r["other_model"]
        assert "different model" in msg
        assert "missing parameters (in the model, not in the checkpoint): extra.bias, extra.weight" in msg
        assert "unexpected buffers and frozen parameters (in the checkpoint, not in the model): scale" in msg
        assert "inp.weight (checkpoint [20, 12], model [21, 12])" in msg and "a.weight (checkpoint [20, 20]" in msg
        assert "optimizer torch.optim.adamw.AdamW; this run uses torch.optim.sgd.SGD" in r["other_optimizer"]
        assert "rank_00001.safetensors" in r["truncated"] and "truncated" in r["truncated"]


def test_pickled_code_in_place_of_a_shard_or_meta_is_refused(saved, tmp_path):
    root, _ = saved
    from zerotrain.trainer.checkpoint.consolidate import consolidate

    ck = tmp_path / "ck"
    shutil.copytree(root / "ck" / "step=000004.ckpt", ck)

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    torch.save({"x": Payload()}, ck / "rank_00000.safetensors")
    with pytest.raises(CheckpointError, match="rank_00000.safetensors.*(truncated|corrupt)"):
        consolidate(ck, tmp_path / "a.safetensors")
    with pytest.raises(CheckpointError, match="rank_00000.safetensors.*not a valid safetensors file"):
        consolidate(ck, tmp_path / "a.safetensors", verify=False)
    torch.save({"format": "zerotrain.sharded/1", "x": Payload()}, ck / "meta.pt")
    with pytest.raises(CheckpointError, match="meta.pt"):
        consolidate(ck, tmp_path / "a.safetensors")
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "a.safetensors").exists()
    res = subprocess.run([sys.executable, "-m", "zerotrain.trainer.checkpoint.consolidate", str(ck), str(tmp_path / "b.pt")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "meta.pt" in res.stderr
