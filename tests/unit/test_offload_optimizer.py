"""The offloaded optimizer in one process (no process group), against ZeRO-2 without offload:
the step, hyperparameters read from the user's optimizer, the fallback for other optimizers,
mixed precision, checkpoints, the memory report and clean-up of swap files."""
import gc
import os

import pytest
import torch
from torch import nn

from harness import load_checkpoint, save_checkpoint, set_up_like_trainer
from tolerance import assert_no_worse_than_peer

from zerotrain.ops import CPUAdam
from zerotrain.strategies.environment import ProcessInfo
from zerotrain.strategies.memory import count_bytes
from zerotrain.strategies.offload import Offload
from zerotrain.strategies.precision import BF16Mixed, DynamicLossScaler, FP16Mixed, Precision
from zerotrain.strategies.zero import ZeroStage2
from zerotrain.trainer.checkpoint import directory as checkpoint_io
from zerotrain.trainer.api.module import TrainModule
from zerotrain.trainer.checkpoint.reshard import CheckpointReader

from zerotrain.strategies.offload import aio

OPTIMS = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2),
    "adam": lambda groups: torch.optim.Adam(groups, lr=1e-2),
    "cpuadam": lambda groups: CPUAdam(groups, lr=1e-2),
    "sgd": lambda groups: torch.optim.SGD(groups, lr=1e-2, momentum=0.9),
    "amsgrad": lambda groups: torch.optim.Adam(groups, lr=1e-2, amsgrad=True),
    # torch's other arithmetic of the same steps (the peers of the tolerances below)
    "adamw-foreach": lambda groups: torch.optim.AdamW(groups, lr=1e-2, foreach=True),
    "adam-foreach": lambda groups: torch.optim.Adam(groups, lr=1e-2, foreach=True),
    "sgd-foreach": lambda groups: torch.optim.SGD(groups, lr=1e-2, momentum=0.9, foreach=True),
    "amsgrad-foreach": lambda groups: torch.optim.Adam(groups, lr=1e-2, amsgrad=True, foreach=True),
}
#: the peer of each optimizer: torch's foreach implementation (CPUAdam's: AdamW's, whose update it is)
PEER = {"adamw": "adamw-foreach", "adam": "adam-foreach", "cpuadam": "adamw-foreach", "sgd": "sgd-foreach",
        "amsgrad": "amsgrad-foreach"}


class Net(TrainModule):
    def __init__(self, optim="adamw", seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
        self.optim = optim

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.ndim >= 2]
        rest = [p for p in self.parameters() if p.ndim < 2]
        opt = OPTIMS[self.optim]([{"params": decay, "weight_decay": 0.1},
                                  {"params": rest, "lr": 2e-2, "weight_decay": 0.0}])
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.2 * s))


def _refuse_o_direct(monkeypatch):
    """Make every open() with O_DIRECT fail as tmpfs (before Linux 6.6) does."""
    real_open = os.open

    def fake_open(path, flags, *args, **kwargs):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(aio.os, "open", fake_open)


def batches(n=8, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def make(strategy, module, precision=None):
    opt, sched = set_up_like_trainer(strategy, module, ProcessInfo(), precision or Precision())
    return strategy, opt, sched


def train(strategy, sched, data, clip=0.05, accum=1):
    losses = []
    for i in range(0, len(data), accum):
        for k, b in enumerate(data[i:i + accum]):
            ctx = strategy.no_sync() if k < accum - 1 else torch.enable_grad()
            with ctx:
                loss = strategy.training_step(b, 0) / accum
                strategy.backward(loss)
            losses.append(float(loss.detach()))
        if strategy.optimizer_step(clip):
            sched.step()
    return torch.tensor(losses)


def flat(module):
    return torch.cat([p.detach().float().reshape(-1) for p in module.parameters()])


def rel(a, b):
    return float((a - b).norm() / b.norm())


def offload(kind, tmp_path, **kw):
    if kind == "nvme":
        kw = dict(optimizer_device="nvme", nvme_path=str(tmp_path / "nvme"), buffer_count=2, **kw)
    return Offload(sub_group_size=kw.pop("sub_group_size", 9), **kw)


def twin(optim="adamw", precision=None, data=None, accum=1):
    model = Net(optim)
    s, _, sched = make(ZeroStage2(reduce_bucket_size=20), model, precision)
    losses = train(s, sched, data or batches(), accum=accum)
    return model, losses


# ---------------------------------------------------------------------------- the step
@pytest.mark.parametrize("kind", ["cpu", "nvme"])
@pytest.mark.parametrize("optim", ["adamw", "adam", "cpuadam"])
def test_matches_zero2_without_offload(tmp_path, kind, optim):
    ref, _ = twin(optim, accum=2)
    model = Net(optim)
    s, opt, sched = make(offload(kind, tmp_path, reduce_bucket_size=20), model)
    train(s, sched, batches(), accum=2)
    assert s.offload_report()["fused_adam"]
    peer, _ = twin(PEER[optim], accum=2)
    # tolerance: no worse than torch's own two implementations of the optimizer differ (PEER_FACTOR x + 4 ulps)
    assert_no_worse_than_peer(flat(model), flat(ref), flat(peer))
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 / (1 + 0.2 * 4))  # the scheduler drove it


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
def test_hyperparameters_are_read_from_the_users_optimizer_every_step(tmp_path, kind):
    model = Net()
    s, opt, _ = make(offload(kind, tmp_path), model)
    data = batches(4)
    train(s, type("NoSched", (), {"step": lambda self: None})(), data[:2])
    before = flat(model)
    for g in opt.param_groups:
        g["lr"] = 0.0
    train(s, type("NoSched", (), {"step": lambda self: None})(), data[2:])
    assert torch.equal(flat(model), before)  # lr=0 (and decoupled decay scaled by lr) -> no change
    opt.param_groups[1]["lr"] = torch.tensor(1e-2)  # a tensor lr, as torch allows
    train(s, type("NoSched", (), {"step": lambda self: None})(), data[:1])
    changed = flat(model) != before
    assert changed.any() and not changed[:35].any()  # only group 1 (the biases) moved


def test_other_optimizers_fall_back_on_cpu_and_are_refused_on_nvme(tmp_path):
    for optim in ("sgd", "amsgrad"):
        ref, _ = twin(optim)
        model = Net(optim)
        s, _, sched = make(offload("cpu", tmp_path), model)
        train(s, sched, batches())
        assert not s.offload_report()["fused_adam"]
        # tolerance: no worse than torch's own two implementations of the optimizer differ (PEER_FACTOR x + 4 ulps)
        assert_no_worse_than_peer(flat(model), flat(ref), flat(twin(PEER[optim])[0]))
        with pytest.raises(ValueError, match="optimizer_device='nvme' swaps Adam state only.*(SGD is not Adam|amsgrad=True)"):
            make(offload("nvme", tmp_path), Net(optim))


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
@pytest.mark.parametrize("prec", ["bf16", "fp16"])
def test_mixed_precision_tracks_its_twin(tmp_path, kind, prec):
    mk = (lambda: BF16Mixed()) if prec == "bf16" else (lambda: FP16Mixed(DynamicLossScaler(init_scale=2.0**10)))
    ref, ref_losses = twin(precision=mk())
    model = Net()
    s, _, sched = make(offload(kind, tmp_path), model, mk())
    losses = train(s, sched, batches())
    assert model.net[0].weight.dtype == (torch.bfloat16 if prec == "bf16" else torch.float16)
    # tolerance: not an equivalence bound: bf16/fp16 weights, where a 1-ulp fp32 master difference (fused vs torch
    # Adam) flips a rounding of up to 2^-8 relative; a sanity bound, a few x 2^-8 (1e-2 = 2.6 x 2^-8)
    assert ((losses - ref_losses).abs() / ref_losses.abs()).max() < 1e-2
    assert rel(flat(model), flat(ref)) < 1e-2


def test_fp16_overflow_skips_the_step(tmp_path):
    model = Net()
    s, _, _ = make(offload("nvme", tmp_path), model, FP16Mixed(DynamicLossScaler(init_scale=2.0**10, hysteresis=1)))
    before = flat(model)
    s.backward(s.training_step(batches(1)[0], 0) * float("inf"))
    assert not s.optimizer_step(1.0)
    assert torch.equal(flat(model), before) and s.precision.loss_scale == 2.0**9
    assert s.sharded.steps == [0, 0]


# ---------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("kind", ["cpu", "nvme"])
def test_checkpoint_resumes_exactly(tmp_path, kind):
    data = batches(8)
    model = Net()
    s, _, sched = make(offload(kind, tmp_path), model)
    train(s, sched, data[:4])
    shards = s.param_shards()
    ck = save_checkpoint(s, tmp_path / "ck", sched)
    train(s, sched, data[4:])
    if kind == "nvme":  # mapped from a snapshot: later steps did not change what was saved
        with CheckpointReader(ck, checkpoint_io.load_meta(ck)[1]) as reader:
            for name, sh in shards.items():
                for k, t in sh.tensors.items():
                    assert torch.equal(t, reader.read(name, k, sh.start, sh.end)), (name, k)
    full = s.full_state_dict()

    resumed = Net(seed=7)
    s2, _, sched2 = make(offload(kind, tmp_path), resumed)
    load_checkpoint(s2, ck, sched2)
    train(s2, sched2, data[4:])
    assert torch.equal(flat(resumed), flat(model))
    ref, _ = twin(data=data)
    # tolerance: no worse than torch's own two AdamW implementations differ (PEER_FACTOR x + 4 ulps)
    assert_no_worse_than_peer({k: full[k] for k in ref.state_dict()}, ref.state_dict(),
                              twin(PEER["adamw"], data=data)[0].state_dict())


@pytest.mark.parametrize("direction", ["zero2->nvme", "nvme->zero2", "cpu->nvme"])
def test_checkpoints_move_between_zero2_and_offload(tmp_path, direction):
    src, dst = direction.split("->")
    build = {"zero2": lambda: ZeroStage2(), "cpu": lambda: offload("cpu", tmp_path),
             "nvme": lambda: offload("nvme", tmp_path)}
    data = batches(8)
    model = Net()
    s, _, sched = make(build[src](), model)
    train(s, sched, data[:4])
    ck = save_checkpoint(s, tmp_path / "ck", sched)
    train(s, sched, data[4:])
    other = Net(seed=7)
    s2, _, sched2 = make(build[dst](), other)
    load_checkpoint(s2, ck, sched2)
    train(s2, sched2, data[4:])
    # tolerance: each run is torch's AdamW or the fused one for 8 steps: both no worse than torch's own two AdamW
    # implementations differ from the plain zero2 run (PEER_FACTOR x + 4 ulps)
    want, peer = twin(data=data)[0], twin(PEER["adamw"], data=data)[0]
    for got in (other, model):
        assert_no_worse_than_peer(flat(got), flat(want), flat(peer))


# ---------------------------------------------------------------------------- memory and files
def test_memory_report_says_where_the_state_is(tmp_path):
    cpu, _, _ = make(offload("cpu", tmp_path), Net(), BF16Mixed())
    train(cpu, type("S", (), {"step": lambda self: None})(), batches(1))
    padded = cpu.flat_groups[0].layout.padded_numel + cpu.flat_groups[1].layout.padded_numel
    got = count_bytes(cpu)
    assert got["master"] == 4 * padded and got["optimizer"] == 8 * padded

    nv, _, _ = make(offload("nvme", tmp_path, sub_group_size=1000), Net(), BF16Mixed())
    train(nv, type("S", (), {"step": lambda self: None})(), batches(1))
    got, rep = count_bytes(nv), nv.offload_report()
    assert got["master"] == 0
    # two staging buffers, each one sub-group file (3 aligned regions) + a page for the alignment
    assert got["optimizer"] == 2 * (3 * 4096 + 4096)
    assert rep["disk_bytes"] == 2 * 3 * 4096 and rep["bytes_read"] > 0 and rep["bytes_written"] > 0


def test_o_direct_fallback_trains_and_swap_files_go_with_the_strategy(tmp_path, monkeypatch):
    _refuse_o_direct(monkeypatch)
    ref, _ = twin()
    model = Net()
    s, _, sched = make(offload("nvme", tmp_path), model)
    rep = s.offload_report()
    assert rep["io_mode"] == "buffered" and "O_DIRECT refused" in rep["io_reason"]
    assert os.listdir(rep["swap_dir"])  # one file per sub-group
    train(s, sched, batches())
    peer, _ = twin(PEER["adamw"])
    # tolerance: no worse than torch's own two AdamW implementations differ (PEER_FACTOR x + 4 ulps)
    assert_no_worse_than_peer(flat(model), flat(ref), flat(peer))
    s.teardown()  # as at the end of fit(): the state stays readable
    assert os.path.exists(rep["swap_dir"])
    # tolerance: exact: the weights the strategy trained (checked against the twin just above)
    assert torch.equal(s.full_state_dict()["net.0.weight"], model.net[0].weight.detach())
    del s
    gc.collect()
    assert os.listdir(tmp_path / "nvme") == []  # gone with the strategy


# ---------------------------------------------------------------------------- bf16 moments on disk
#: bf16-moment run against the fp32-moment run, worst relative loss gap over 16 steps (the
#: moments' stochastic rounding is the only difference): 1.0e-4 measured here, 10x margin
BF16_STATE_LOSS_RTOL = 1e-3


def test_bf16_moments_track_fp32_state(tmp_path):
    data = batches(16)
    fp32, _, sched = make(offload("nvme", tmp_path), Net())
    ref = train(fp32, sched, data)
    model = Net()
    s, _, sched = make(offload("nvme", tmp_path, optimizer_state_dtype="bf16"), model)
    got = train(s, sched, data)
    gap = float(((got - ref).abs() / ref.abs()).max())
    assert 0 < gap <= BF16_STATE_LOSS_RTOL, gap
    assert s.offload_report()["optimizer_state_dtype"] == "bf16"
    print(f"bf16 moments: worst relative loss gap {gap:.2e}")


@pytest.mark.parametrize("direction", ["fp32->bf16", "bf16->fp32", "bf16->bf16"])
def test_checkpoints_hold_fp32_state_whatever_the_disk_dtype(tmp_path, direction):
    """Saved state is fp32 (upcast); loading into bf16 moments rounds it as the kernel would, and a
    bf16->bf16 save/load round trip continues exactly like the run that did not stop."""
    src, dst = direction.split("->")
    data = batches(8)
    model = Net()
    s, _, sched = make(offload("nvme", tmp_path, optimizer_state_dtype=src), model)
    train(s, sched, data[:4])
    ck = save_checkpoint(s, tmp_path / "ck", sched)
    for sh in s.param_shards().values():
        assert all(t.dtype == torch.float32 for t in sh.tensors.values())
    train(s, sched, data[4:])
    other = Net(seed=7)
    s2, _, sched2 = make(offload("nvme", tmp_path, optimizer_state_dtype=dst), other)
    load_checkpoint(s2, ck, sched2)
    train(s2, sched2, data[4:])
    if direction == "bf16->bf16":
        assert torch.equal(flat(other), flat(model))
    else:  # the moments went through one rounding to bf16 and differ after that
        # tolerance: not an equivalence: one bf16 rounding of the moments (2^-8 relative) carried through 4 Adam
        # steps; a sanity bound, a few x 2^-8
        assert 0 < rel(flat(other), flat(model)) < 1e-2
