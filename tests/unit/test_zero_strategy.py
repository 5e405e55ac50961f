"""ZeRO stages in one process (no process group): options, set-up checks, the step, the log."""
import logging

import pytest
import torch
from torch import nn

from harness import load_checkpoint, save_checkpoint
from tolerance import assert_no_worse_than_peer, backward_as_ranks

from zerotrain.strategies import strategy_from_name
from zerotrain.strategies.environment import ProcessInfo
from zerotrain.strategies.precision import BF16Mixed, Precision
from zerotrain.strategies.zero import BucketConfig, ZeroConfig, ZeroStage1, ZeroStage2
from zerotrain.trainer.errors import CheckpointError
from zerotrain.trainer.api.module import TrainModule


class Net(TrainModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)


def make(cls, module, precision=None, **kwargs):
    s = cls(**kwargs)
    s.connect(ProcessInfo(), torch.device("cpu"), precision or Precision())
    s.setup_environment()
    s.configure_model(module)
    s.setup_module(module)
    s.setup_optimizer(module.configure_optimizers())
    return s


def batches(n=6):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


@pytest.mark.parametrize("cls", [ZeroStage1, ZeroStage2])
def test_one_process_matches_pytorch_with_accumulation_and_clipping(cls):
    ref, model, peer = Net(), Net(), Net()
    opt, peer_opt = ref.configure_optimizers(), peer.configure_optimizers()
    s = make(cls, model, reduce_bucket_size=20, allgather_bucket_size=9)
    data = batches()
    norms = {"got": [], "ref": [], "peer": []}
    for i in range(0, len(data), 2):
        for k, b in enumerate(data[i:i + 2]):
            (ref.training_step(b, 0) / 2).backward()
            ctx = s.no_sync() if k == 0 else torch.enable_grad()
            with ctx:
                s.backward(s.training_step(b, 0) / 2)
        # the peer: the same step, each gradient summed as torch DDP would on 2 ranks
        backward_as_ranks(peer.parameters(), data[i:i + 2], lambda b: peer.training_step(b, 0), 2)
        norms["ref"].append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1))
        norms["peer"].append(torch.nn.utils.clip_grad_norm_(peer.parameters(), 0.1))
        for o in (opt, peer_opt):
            o.step()
            o.zero_grad()
        norms["got"].append(s.clip_grad_norm_(0.1))
        assert s.optimizer_step() is True
    # tolerance: no worse than torch DDP's order of the same sums (tolerance.PEER_FACTOR x its error + 4 ulps)
    assert_no_worse_than_peer(*(torch.stack(norms[k]) for k in ("got", "ref", "peer")), "norms")
    # tolerance: no worse than torch DDP's order of the same sums (tolerance.PEER_FACTOR x its error + 4 ulps)
    assert_no_worse_than_peer(*(dict(m.named_parameters()) for m in (model, ref, peer)))


def test_stage1_grads_are_views_and_stage2_frees_them():
    m1, m2 = Net(), Net()
    s1, s2 = make(ZeroStage1, m1), make(ZeroStage2, m2)
    b = batches(1)[0]
    s1.backward(s1.training_step(b, 0))
    s2.backward(s2.training_step(b, 0))
    buf = s1.grads.buffers[0]
    assert all(p.grad is not None and p.grad.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
               for p in m1.parameters())
    assert all(p.grad is None for p in m2.parameters())  # only the partition holds gradients
    torch.testing.assert_close(s1.grads.partitions()[0], s2.grads.partitions()[0])
    first = s1.grads.partitions()[0].clone()
    m1.zero_grad()  # someone drops the views: the next backward re-attaches them, values fresh
    s1.backward(s1.training_step(b, 0))
    assert m1.net[0].weight.grad.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    torch.testing.assert_close(s1.grads.partitions()[0], first, rtol=0, atol=0)


class Branchy(Net):
    """``extra`` gets a gradient only when the batch asks for it."""

    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(5, 3)

    def training_step(self, batch, batch_idx):
        x, y, use = batch
        out = self.net(x) + (self.extra(x) if use else 0)
        return nn.functional.mse_loss(out, y)


def test_stage1_zero_grad_sets_none_and_copies_the_next_gradient():
    """zero_grad leaves the buffer as it is and sets p.grad to None; the next gradient is copied in
    (not added to the last step's), a parameter without one reads zeros, a replaced p.grad is kept
    with the new gradient added, and a step taken without a backward sees zeros."""
    ref, model = Branchy(), Branchy()
    s = make(ZeroStage1, model, reduce_bucket_size=20)
    x, y = batches(1)[0]
    for use in (True, False, True):
        ref.zero_grad()
        s.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        nn.functional.mse_loss(ref.net(x) + (ref.extra(x) if use else 0), y).backward()
        s.backward(s.training_step((x, y, use), 0))
        expected = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                              for p in ref.parameters()])
        got = s.grads.partitions()[0]
        torch.testing.assert_close(got[:expected.numel()], expected, rtol=0, atol=0)
        assert not got[expected.numel():].any()  # padding
    # a replaced gradient survives into the buffer, with the next backward added to it
    s.zero_grad()
    ref.zero_grad()
    model.extra.bias.grad = torch.full((3,), 2.0)
    ref.extra.bias.grad = torch.full((3,), 2.0)
    nn.functional.mse_loss(ref.net(x) + ref.extra(x), y).backward()
    s.backward(s.training_step((x, y, True), 0))
    torch.testing.assert_close(model.extra.bias.grad, ref.extra.bias.grad, rtol=0, atol=0)
    assert model.extra.bias.grad.data_ptr() != ref.extra.bias.grad.data_ptr()
    # zero_grad, then a step without any backward: the optimizer sees zeros, not the last gradient
    s.zero_grad()
    assert not s.grads.partitions()[0].any()


def test_bf16_working_params_with_fp32_masters():
    model = Net()
    fp32 = [p.detach().clone() for p in model.parameters()]
    s = make(ZeroStage2, model, BF16Mixed(), reduce_dtype="bf16")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    master = s.sharded.masters[0]
    assert master.dtype == torch.float32
    torch.testing.assert_close(master[:35], fp32[0].reshape(-1))  # exact copy of the fp32 init
    assert s.grads.partitions()[0].dtype == torch.bfloat16
    s.backward(s.training_step(batches(1)[0], 0))
    assert s.optimizer_step(1.0)
    full = s.full_state_dict()
    assert all(v.dtype == torch.float32 for v in full.values())
    torch.testing.assert_close(full["net.0.weight"].to(torch.bfloat16), model.net[0].weight.detach())


def test_setup_log_states_measured_and_formula(caplog):
    with caplog.at_level(logging.INFO, logger="zerotrain"):
        s = make(ZeroStage1, Net(), BF16Mixed())
        s.backward(s.training_step(batches(1)[0], 0))
        s.optimizer_step()
    lines = [r.getMessage() for r in caplog.records if r.name == "zerotrain"]
    assert len(lines) == 2 and "at setup" in lines[0] and "after the first step" in lines[1]
    assert "formula" in lines[1] and "optimizer" in lines[1]
    assert set(s.memory_report()) == {"params", "grads", "master", "optimizer", "comm_buffers", "total"}


def test_optimizer_must_cover_the_trainable_parameters():
    model = Net()
    s = ZeroStage1()
    s.connect(ProcessInfo(), torch.device("cpu"), Precision())
    s.setup_module(model)
    with pytest.raises(ValueError, match=r"\['net.2.weight', 'net.2.bias'\] are in no optimizer"):
        s.setup_optimizer(torch.optim.SGD(model.net[0].parameters(), lr=0.1))
    with pytest.raises(ValueError, match="not a parameter of the module"):
        s.setup_optimizer(torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1))


class Wider(Net):
    def __init__(self):
        super().__init__()
        self.net[2] = nn.Linear(7, 4)


def test_checkpoint_loads_into_another_layout_and_refuses_another_model(tmp_path):
    """The checkpoint reshards: ZeRO-2's loads into ZeRO-1 with another partition padding and
    training continues as without the stop; a checkpoint of another model is refused by name."""
    data = batches(8)
    model, other = Net(), Net()
    s = make(ZeroStage2, model)
    for b in data[:4]:
        s.backward(s.training_step(b, 0))
        assert s.optimizer_step(0.1)
    ck = save_checkpoint(s, tmp_path / "ck")
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)  # another start: everything must come from the checkpoint
    s2 = make(ZeroStage1, other, partition_alignment=16)
    assert s2.flat_groups[0].layout.padded_numel != s.flat_groups[0].layout.padded_numel
    load_checkpoint(s2, ck)
    for b in data[4:]:
        for strategy in (s, s2):
            strategy.backward(strategy.training_step(b, 0))
            assert strategy.optimizer_step(0.1)
    for a, b in zip(other.parameters(), model.parameters()):  # tolerance: exact: same gradients, same step order
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    refusal = r"different model:\n  shape mismatch: .*net\.2\.weight \(checkpoint \[3, 7\], model \[4, 7\]\)"
    with pytest.raises(CheckpointError, match=refusal):
        load_checkpoint(make(ZeroStage2, Wider()), ck)


def test_options_are_validated_with_field_and_value():
    assert BucketConfig(reduce_bucket_size=5e7).reduce_bucket_size == 50_000_000
    cases = [
        (dict(reduce_bucket_size=0), ValueError, "reduce_bucket_size=0"),
        (dict(allgather_bucket_size=1.5), ValueError, "allgather_bucket_size=1.5"),
        (dict(reduce_bucket_size="big"), TypeError, "reduce_bucket_size='big'"),
        (dict(overlap_comm="yes"), TypeError, "overlap_comm='yes'"),
        (dict(reduce_dtype="fp8"), ValueError, "reduce_dtype='fp8'"),
        (dict(reduce_mode="ring"), ValueError, "reduce_mode='ring'"),
        (dict(contiguous_gradients=True), TypeError, "contiguous_gradients=True is not an option"),
        (dict(process_group_timeout_s=0), ValueError, "process_group_timeout_s=0"),
    ]
    for kwargs, err, match in cases:
        with pytest.raises(err, match=match):
            ZeroStage2(**kwargs)
    # on gloo an all-to-all that sends each piece to its owner only: every stage on 2 ranks,
    # stage 3 (even pieces) on more; stages 1/2 beyond 2 ranks keep the all-reduce
    assert ZeroConfig().resolved_reduce_mode("nccl", 8) == "reduce_scatter"
    assert ZeroConfig().resolved_reduce_mode("gloo", 2) == "reduce_scatter"
    assert ZeroConfig().resolved_reduce_mode("gloo", 3) == "all_reduce"
    assert ZeroConfig().resolved_reduce_mode("gloo", 3, even_pieces=True) == "reduce_scatter"
    assert ZeroConfig(reduce_mode="all_reduce").resolved_reduce_mode("gloo", 2, even_pieces=True) == "all_reduce"


def test_registered_names():
    assert isinstance(strategy_from_name("zero1"), ZeroStage1)
    assert isinstance(strategy_from_name("zero2", overlap_comm=False), ZeroStage2)
