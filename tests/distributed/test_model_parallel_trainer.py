"""Lightning's ``ModelParallelStrategy`` on zerotrain's Trainer (issue 45): a module whose
``configure_model`` parallelizes itself with torch's own ``parallelize_module`` on
``self.device_mesh["tensor_parallel"]`` trains on 2 processes (tensor_parallel_size=2) as the plain
single-process loop over the same batches: the strategy lends the mesh, shards the loaders by the
data axis only (both ranks see every batch) and steps the DTensor parameters as they are.
Clipping by norm takes the whole model's norm (each sharded gradient's norm reduced over the mesh).
A checkpoint holds every DTensor whole (zerotrain's reshardable format): resuming from it on the
same mesh continues as the plain loop does.

# tolerance: rel <= 1e-5 (issue 45's bound for fp32 against the plain loop), on the losses and on
# every parameter after the steps (the tensor-parallel matmuls sum over half the inner dimension
# and add the halves: a reordered fp32 reduction of length <= 64, error ~ 64 x 6e-8 = 4e-6).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from harness import run_ranks
from toy import global_batches
from zerotrain import Trainer, TrainModule

pytestmark = pytest.mark.timeout(300)

V, D, H, B, S, N, STEPS, LR, RTOL, CLIP = 32, 16, 64, 4, 8, 24, 4, 1e-2, 1e-5, 0.05


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.w1 = nn.Linear(D, H)
        self.w2 = nn.Linear(H, D)
        self.head = nn.Linear(D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return self.head(x + self.w2(F.gelu(self.w1(x))))


def _net() -> Net:
    torch.manual_seed(3)
    return Net()


def _data() -> TensorDataset:
    ids = torch.randint(0, V, (N, S + 1), generator=torch.Generator().manual_seed(4))
    return TensorDataset(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())


def _loss(net: nn.Module, batch) -> torch.Tensor:
    ids, targets = batch
    return F.cross_entropy(net(ids).reshape(-1, V), targets.reshape(-1))


class Parallelized(TrainModule):
    """Lightning's pattern: the layers in ``__init__``, the user's plan in ``configure_model``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()
        self.losses: list[float] = []

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if self.device_mesh["tensor_parallel"].size() > 1:
            parallelize_module(self.net, self.device_mesh["tensor_parallel"],
                               {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        if self.device_mesh["data_parallel"].size() > 1:
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        loss = _loss(self.net, batch)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)

    def train_dataloader(self):
        return DataLoader(_data(), batch_size=B, shuffle=False)


def _reference(steps: int, clip: float | None = None, data_parallel: int = 1, shuffle: bool = True) -> dict:
    """The plain loop over the global batches the Trainer's samplers make (``toy.global_batches``):
    shuffled, as Lightning's DistributedSampler on any multi-process job, even with one data-parallel
    replica (the loader itself does not shuffle)."""
    net, data = _net(), _data()
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    losses = []
    for idx in global_batches(N, data_parallel, B, shuffle=shuffle)[:steps]:
        loss = _loss(net, data[idx])
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        if clip is not None:
            assert torch.nn.utils.clip_grad_norm_(net.parameters(), clip) > clip  # it clips at every step
        opt.step()
    return {"params": {k: v.detach() for k, v in net.state_dict().items()}, "losses": losses}


def _fit(steps: int = STEPS, clip: float | None = None, save: str | None = None, resume: str | None = None,
         data: int = 1, tensor: int = 2) -> dict:
    from torch.distributed.tensor import DTensor

    from zerotrain.strategies import ModelParallelStrategy

    module = Parallelized()
    strategy = ModelParallelStrategy(data_parallel_size=data, tensor_parallel_size=tensor)
    trainer = Trainer(strategy=strategy, devices=data * tensor, max_steps=steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, precision="32", gradient_clip_val=clip)
    trainer.fit(module, ckpt_path=resume)
    if save:
        trainer.save_checkpoint(save)
    w1 = module.net.w1.weight
    return {"params": {k.removeprefix("net."): v for k, v in trainer.full_state_dict().items()},
            "losses": module.losses, "mesh": strategy.device_mesh.mesh_dim_names,
            "same_mesh": module.device_mesh is strategy.device_mesh, "dp": strategy.data_parallel_world_size,
            "w1": (type(w1).__name__, tuple(w1.to_local().shape) if isinstance(w1, DTensor) else None)}


def _assert_as_reference(results: list[dict], ref: dict, first: int = 0, data_parallel: int = 1) -> None:
    got = results[0]["params"]
    assert set(got) == set(ref["params"])
    for name, want in ref["params"].items():
        err = ((got[name] - want).norm() / want.norm().clamp_min(1e-30)).item()
        assert err <= RTOL, (name, err)
    for t in range(len(results) // data_parallel):  # the ranks of a tensor group see the same batches
        group = results[t::len(results) // data_parallel]
        mean = [sum(r["losses"][i] for r in group) / len(group) for i in range(len(group[0]["losses"]))]
        assert mean == pytest.approx(ref["losses"][first:], rel=RTOL)


def test_tp2_on_2_ranks_trains_as_one_process(tmp_path):
    results = run_ranks("test_model_parallel_trainer:_fit", 2, tmp_path, timeout=240)
    for r in results:
        assert r["mesh"] == ("data_parallel", "tensor_parallel") and r["same_mesh"] and r["dp"] == 1
        assert r["w1"] == ("DTensor", (H // 2, D))  # the user's plan cut it: half the rows on each rank
    _assert_as_reference(results, _reference(STEPS))


@pytest.mark.slow
def test_tp2_clipped_by_norm_trains_as_the_plain_clipped_loop(tmp_path):
    results = run_ranks("test_model_parallel_trainer:_fit", 2, tmp_path, timeout=240, clip=CLIP)
    _assert_as_reference(results, _reference(STEPS, CLIP))


@pytest.mark.slow
def test_a_checkpoint_resumes_as_the_plain_loop_continues(tmp_path):
    path = str(tmp_path / "mp.ckpt")
    run_ranks("test_model_parallel_trainer:_fit", 2, tmp_path / "a", timeout=240, steps=2, save=path)
    results = run_ranks("test_model_parallel_trainer:_fit", 2, tmp_path / "b", timeout=240, resume=path)
    _assert_as_reference(results, _reference(STEPS), first=2)


@pytest.mark.slow
def test_dp2_with_fully_shard_on_2_ranks_trains_as_one_process(tmp_path):
    """FSDP2 (``fully_shard`` on the data axis) averages the gradients: the plain loop over the
    global batch of both ranks' samples."""
    steps = N // (2 * B)  # one epoch of global batches
    results = run_ranks("test_model_parallel_trainer:_fit", 2, tmp_path, timeout=240, steps=steps, data=2, tensor=1)
    assert [r["dp"] for r in results] == [2, 2]
    _assert_as_reference(results, _reference(steps, data_parallel=2), data_parallel=2)


def _parallelize(net: nn.Module, mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(net, mesh["tensor_parallel"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})


def _fabric_fit() -> dict:
    """Fabric's face: ``ModelParallelStrategy(parallelize_fn, ...)``, the model set up alone, the
    optimizer built on its DTensor parameters afterwards (Fabric's order)."""
    from zerotrain import Fabric
    from zerotrain.fabric.strategies import ModelParallelStrategy
    from zerotrain.strategies.model_parallel.checkpoint import local_of, local_tensor

    fabric = Fabric(accelerator="cpu", devices=2, precision="32",
                    strategy=ModelParallelStrategy(_parallelize, data_parallel_size=1, tensor_parallel_size=2))
    fabric.launch()
    with fabric.init_module(empty_init=True):  # built on meta, materialized by reset_parameters at setup
        net = _net()
    model = fabric.setup_module(net)
    plain = dict(_net().named_parameters())
    with torch.no_grad():  # the plain loop's weights, each rank keeping its shard
        for name, p in net.named_parameters():
            local_tensor(p).copy_(local_tensor(local_of(p, plain[name].detach())))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    data, losses = _data(), []
    for idx in global_batches(N, 1, B, shuffle=False)[:STEPS]:
        loss = _loss(model, data[idx])
        losses.append(loss.item())
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
    return {"params": fabric.strategy.full_state_dict(), "losses": losses,
            "meta_built": type(net.w1.weight).__name__}


@pytest.mark.slow
def test_fabric_face_tp2_on_2_ranks_trains_as_one_process(tmp_path):
    results = run_ranks("test_model_parallel_trainer:_fabric_fit", 2, tmp_path, timeout=240)
    assert results[0]["meta_built"] == "DTensor"
    _assert_as_reference(results, _reference(STEPS, shuffle=False))  # its own loop over the batches in order
