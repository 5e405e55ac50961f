"""Offload composed with ZeRO-3 in one process: the same result as ZeRO-3 without offload, Adam
state swapped, parameter shards in files that are resident only while used, checkpoints."""
import gc
import os
import re

import pytest
import torch
from torch import nn

from harness import load_checkpoint, save_checkpoint, set_up_like_trainer
from tolerance import assert_no_worse_than_peer

from zerotrain.strategies import instrument
from zerotrain.strategies.environment import ProcessInfo
from zerotrain.strategies.offload import Offload
from zerotrain.strategies.offload.param_swap import SwappedUnit
from zerotrain.strategies.precision import BF16Mixed, Precision
from zerotrain.strategies.zero import ZeroStage3
from zerotrain.trainer.api.module import TrainModule


class Deep(TrainModule):
    """Units: the root (inp, out) and one per block of the ModuleList."""

    def __init__(self, width=16, depth=3, seed=0, foreach=None):
        super().__init__()
        torch.manual_seed(seed)
        self.foreach = foreach  # True: torch's other AdamW arithmetic (the peer of the tolerances)
        self.inp = nn.Linear(5, width)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width))
                                    for _ in range(depth))
        self.out = nn.Linear(width, 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = torch.tanh(self.inp(x))
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return nn.functional.mse_loss(self.out(h).float(), y)

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.ndim >= 2]
        rest = [p for p in self.parameters() if p.ndim < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                 {"params": rest, "lr": 2e-2, "weight_decay": 0.0}], lr=1e-2, foreach=self.foreach)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.2 * s))


def batches(n=8):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def make(strategy, module, precision=None):
    opt, sched = set_up_like_trainer(strategy, module, ProcessInfo(), precision or Precision())
    return strategy, sched


def train(strategy, sched, data):
    for b in data:
        strategy.backward(strategy.training_step(b, 0))
        if strategy.optimizer_step(0.05):
            sched.step()


def weights(strategy):
    full = strategy.full_state_dict()
    return torch.cat([full[k].float().reshape(-1) for k in sorted(full)])


CASES = {"cpu": {}, "nvme": {"optimizer_device": "nvme"},
         "nvme+params": {"optimizer_device": "nvme", "param_device": "nvme"},
         "cpu+params": {"param_device": "nvme"}, "params_cpu": {"param_device": "cpu"}}


def offload(case, tmp_path, **kw):
    kw.update(CASES[case])
    if "nvme" in kw.values():
        kw.update(nvme_path=str(tmp_path / "nvme"), buffer_count=2)
    return Offload(stage=3, sub_group_size=50, **kw)


@pytest.mark.parametrize("prec", ["32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_zero3_without_offload(tmp_path, case, prec):
    mk = Precision if prec == "32" else BF16Mixed
    ref, sched = make(ZeroStage3(), Deep(), mk())
    train(ref, sched, batches())
    s, sched = make(offload(case, tmp_path), Deep(), mk())
    train(s, sched, batches())
    assert type(s).__name__ == "ZeroStage3" and s.offload is not None and s.offload_report()["fused_adam"]
    peer, sched = make(ZeroStage3(), Deep(foreach=True), mk())
    train(peer, sched, batches())
    # tolerance: no worse than torch's own two AdamW implementations differ (PEER_FACTOR x + 4 ulps)
    assert_no_worse_than_peer(weights(s), weights(ref), weights(peer))
    rep = s.offload_report()
    assert rep["swapped_kinds"] == (["exp_avg", "exp_avg_sq"] if "nvme" in rep["optimizer_device"] else [])
    assert (rep["param_disk_bytes"] > 0) == (rep["param_device"] == "nvme")
    s.teardown()
    del s
    gc.collect()
    assert not os.path.exists(tmp_path / "nvme") or os.listdir(tmp_path / "nvme") == []


@pytest.mark.parametrize("case", ["nvme+params", "cpu"])
def test_checkpoint_resumes_exactly(tmp_path, case):
    data = batches(8)
    s, sched = make(offload(case, tmp_path), Deep())
    train(s, sched, data[:4])
    ck = save_checkpoint(s, tmp_path / "ck", sched)
    shards = s.param_shards()  # the Trainer's format: Adam state must be in it, swapped or not
    assert all({"param", "exp_avg", "exp_avg_sq"} <= set(sh.tensors) for sh in shards.values())
    assert not s.optimizer.state or case == "cpu"  # swapped state was only exposed for the call
    train(s, sched, data[4:])
    s2, sched2 = make(offload(case, tmp_path), Deep(seed=9))
    load_checkpoint(s2, ck, sched2)
    train(s2, sched2, data[4:])
    assert torch.equal(weights(s2), weights(s))
    s.teardown()  # stops the I/O threads
    s2.teardown()


def _mapped_rss(directory: str) -> int:
    """Resident bytes of this process's mappings of files under ``directory``."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):  # a mapping's header (anonymous: 5 fields)
                inside = len(head) >= 6 and head[5].startswith(directory)
            elif inside and line.startswith("Rss:"):
                total += int(head[1]) * 1024
    return total


@pytest.mark.slow
def test_parameter_shards_are_resident_only_while_used(tmp_path):
    width = 256  # each block unit ~66k params (256 KiB): pages are worth counting
    s, sched = make(offload("nvme+params", tmp_path, prefetch_bucket_size=0), Deep(width=width, depth=4))
    directory = s.offload_report()["param_dir"]
    units = [u for u in s.units if isinstance(u, SwappedUnit)]
    assert len(units) == 5 and all(u.master.data_ptr() for u in units)
    total = sum(sh.nbytes for u in units for sh in u.shards)
    assert _mapped_rss(directory) <= 8192 * len(units)  # after set-up: nothing resident
    seen = []
    for u in units:  # during forward and backward at most about one unit is resident
        for m in (s.module.get_submodule(u.name) if u.name else s.module,):
            m.register_forward_hook(lambda *a: seen.append(_mapped_rss(directory)))
    train(s, sched, batches(2))
    assert max(seen) < total / 2, (seen, total)
    assert _mapped_rss(directory) <= 8192 * len(units)  # after the step (it touched every master)
    s.teardown()  # stops the I/O threads


def _train_accumulating(strategy, sched, data, clip):
    """Two micro-batches per step (the first under no_sync), clipping by norm or by value."""
    for i in range(0, len(data), 2):
        with strategy.no_sync():
            strategy.backward(strategy.training_step(data[i], i))
        strategy.backward(strategy.training_step(data[i + 1], i + 1))
        if strategy.optimizer_step(*clip):
            sched.step()


@pytest.mark.parametrize("clip", [(0.05, "norm"), (0.01, "value"), (None, "norm")])
def test_gradients_on_disk_give_the_same_bits_as_in_ram(tmp_path, clip):
    """grad_device='nvme' against the same run with the gradient partition in RAM: equal weights
    bit for bit after accumulated micro-batches and clipping, no gradient buffer in RAM, and the
    backward wrote the reduce dtype's bytes of every sub-group per micro-batch."""
    data = batches(8)
    runs = {}
    for where, depth in (("cpu", None), ("nvme", None), ("nvme_deep", 7)):
        s, sched = make(offload("nvme+params", tmp_path, grad_device=where[:4], reduce_dtype="bf16",
                                grad_buffer_count=depth), Deep())
        _train_accumulating(s, sched, data, clip)
        runs[where] = (s, weights(s))
    s, got = runs["nvme"]
    assert torch.equal(got, runs["cpu"][1])
    assert torch.equal(runs["nvme_deep"][1], got)  # a deeper write queue changes no value
    assert len(s.stepper.swapped_grads.buffers) == 2  # buffer_count
    assert len(runs["nvme_deep"][0].stepper.swapped_grads.buffers) == 7
    assert all(u.grad.device.type == "meta" for u in s.units)
    rep = s.offload_report()
    assert rep["grad_device"] == "nvme"
    padded = sum(s.stepper.swapped_grads.states.grad_region(k)[1] for k in range(len(s.sharded.subgroups)))
    assert rep["grad_bytes_written"] == padded * len(data)  # every sub-group, every micro-batch
    for r, _ in runs.values():
        r.teardown()


def test_gradients_on_disk_refuse_fp16_loss_scaling(tmp_path):
    from zerotrain.strategies.precision import FP16Mixed

    with pytest.raises(ValueError, match="grad_device='nvme' keeps no gradient in RAM.*'16-mixed'"):
        make(offload("nvme", tmp_path, grad_device="nvme"), Deep(), FP16Mixed())


def test_partitioned_build_keeps_its_chunks_in_files(tmp_path):
    """param_device='nvme': ZeRO-3's partitioned build (the whole model on one rank) keeps its
    chunks in unlinked files, not resident between uses, and they give the eager build's values."""
    from zerotrain.examples.gpt import GPT, GPTConfig
    from zerotrain.strategies.offload.param_swap import FileChunks
    from zerotrain.strategies.zero.stage3.materialize import PartitionedBuild

    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=128, vocab_size=256, block_size=64)
    torch.manual_seed(0)
    ref = GPT(cfg)
    chunks = FileChunks(str(tmp_path), min_bytes=16 << 10)  # the 64 KiB+ matrices go to files
    with PartitionedBuild(0, 1, chunks=chunks) as build:
        torch.manual_seed(0)
        model = GPT(cfg)
    big = sum(r.numel * 4 >= 16 << 10 for r in build.params.values())  # lm_head's untied one too
    assert len(chunks._mapped) == big >= 8 and os.listdir(tmp_path) == []  # names removed at once
    assert _mapped_rss(str(tmp_path)) <= 4096 * big  # a partial page each at most
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        out = torch.empty(p.numel())
        build.take(p, out)
        assert torch.equal(out, q.detach().reshape(-1)), name
    build.release()
    assert not chunks._mapped  # the chunks are freed with their mappings


def test_one_rank_prefetch_of_file_backed_units_only_reads_ahead(tmp_path):
    """One rank, parameter files: a prefetch would be a copy overlapping nothing, so it only
    starts the file's readahead; no more than the unit in use (and the root) is ever gathered
    (RAM units gather the next block ahead), and the weights are those without prefetch."""
    ram, sched = make(ZeroStage3(prefetch_bucket_size=10**6), Deep(depth=4))
    train(ram, sched, batches(4))
    runs = {}
    for ahead in (0, 10**6):
        s, sched = make(offload("nvme+params", tmp_path / str(ahead), prefetch_bucket_size=ahead), Deep(depth=4))
        train(s, sched, batches(4))
        runs[ahead] = (s, weights(s))
        s.teardown()
    s = runs[10**6][0]
    assert torch.equal(runs[10**6][1], runs[0][1])
    root, block = s.units[0].numel, max(u.numel for u in s.units[1:])
    assert ram.runtime.peak_live > root + block
    assert s.runtime.peak_live == root + block


def test_one_rank_fp32_parameter_files_are_the_gathered_buffer(tmp_path):
    """One rank, fp32 compute: a file-backed unit's master mapping is its gathered buffer, so the
    forward's parameters are views of the file mapping (no copy into a RAM buffer); with a
    separate working copy (bf16 files) the gather still copies. Values: test_matches_zero3..."""
    s, sched = make(offload("nvme+params", tmp_path / "fp32"), Deep())
    units = [u for u in s.units if isinstance(u, SwappedUnit)]
    assert units and all(u.mapped_full and u.full.data_ptr() == u.master.data_ptr() for u in units)
    inside = []

    def check(unit):
        lo, hi = unit.master.data_ptr(), unit.master.data_ptr() + unit.master.numel() * 4
        return lambda *a: inside.append(all(lo <= p.data_ptr() < hi for p in unit.params))

    for u in units:
        (s.module.get_submodule(u.name) if u.name else s.module).register_forward_pre_hook(check(u))
    train(s, sched, batches(2))
    assert inside and all(inside)
    assert all(not u.gathered for u in units)  # resharded after backward: placeholders again
    s.teardown()
    b, _ = make(offload("nvme+params", tmp_path / "bf16", param_dtype="bf16"), Deep())
    assert not any(u.mapped_full for u in b.units if isinstance(u, SwappedUnit))
    b.teardown()


def test_step_writes_back_each_stepped_range_and_reports_a_failure(tmp_path, monkeypatch):
    """The step writes each stepped sub-group's range of the parameter files back as it goes
    (instead of leaving the kernel's flusher the whole master), once per range, and a failed
    write-back fails the step naming the error instead of being lost."""
    import errno

    from zerotrain.strategies.offload import param_swap

    seen = []
    real = param_swap.MappedShard.write_back

    def spy(self, lo=0, hi=None):
        seen.append((self.path, lo, hi))
        real(self, lo, hi)

    monkeypatch.setattr(param_swap.MappedShard, "write_back", spy)
    s, sched = make(offload("nvme+params", tmp_path), Deep())

    class Sink:  # what ResourceMonitor listens with
        events = []

        def disk(self, event):
            self.events.append(event)

    sink = Sink()
    instrument.add_sink(sink)
    try:
        train(s, sched, batches(1))
    finally:
        instrument.remove_sink(sink)
    pager = s.sharded.pager
    expected = sorted((sh.path, lo, hi) for k in range(len(s.sharded.subgroups)) for sh, lo, hi in pager._each(k))
    assert len(expected) >= len(s.sharded.subgroups) and sorted(seen) == expected
    swap_written = sum(s.sharded.states._state_span(k, 0).numel() for k in range(len(s.sharded.subgroups)))
    written = sum(e.nbytes for e in sink.events if e.kind == "write")
    assert written == swap_written + sum((hi - lo) * 4 for _, lo, hi in expected)  # the write-backs are seen

    def broken(self, lo=0, hi=None):
        raise OSError(errno.EIO, "write-back failed: disk gone")

    monkeypatch.setattr(param_swap.MappedShard, "write_back", broken)
    with pytest.raises(OSError, match="disk gone"):
        train(s, sched, batches(1))
    s.teardown()
