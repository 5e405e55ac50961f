"""zerotrain.Fabric on one process: the Fabric surface a script renamed from
``lightning.fabric`` uses (the examples under Lightning's examples/fabric run in bench/CONFORMANCE.md),
and the Engine behaviours Fabric scripts rely on: optimizers that torch's LR schedulers accept,
transparent loaders, a one-process loader kept as it is, the sampler seeded by seed_everything."""
from __future__ import annotations

import csv
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from zerotrain import ConfigError, Engine, Fabric, seed_everything
from zerotrain.trainer.utilities import GLOBAL_SEED_ENV, sampler_seed


@pytest.fixture(autouse=True)
def _no_recorded_seed(monkeypatch):
    for name in (GLOBAL_SEED_ENV, "PL_SEED_WORKERS", "LT_STRATEGY", "LT_DEVICES", "LT_ACCELERATOR", "LT_PRECISION"):
        monkeypatch.setenv(name, "")  # recorded, so that what a test sets is undone after it
        monkeypatch.delenv(name)


def _fabric(**kwargs) -> Fabric:
    return Fabric(accelerator="cpu", devices=1, strategy="single", **kwargs)


def _data(n: int = 12) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g))


def test_lr_scheduler_accepts_the_set_up_optimizer():
    fabric = _fabric()
    model = nn.Linear(3, 1)
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
    assert isinstance(opt, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # TypeError before
    before = model.weight.detach().clone()
    x, y = _data()[:4]
    fabric.backward(nn.functional.mse_loss(model(x), y))
    grad = model.weight.grad.detach().clone()
    opt.step()
    sched.step()
    assert opt.param_groups is opt.optimizer.param_groups and opt.param_groups[0]["lr"] == 0.5
    torch.testing.assert_close(model.weight.detach(), before - 1.0 * grad)  # the step used lr 1.0
    assert opt.state_dict() == opt.optimizer.state_dict()


def test_loaders_are_transparent_and_one_process_keeps_its_sampler():
    seed_everything(3)
    fabric = _fabric()
    data = _data()
    plain = DataLoader(data, batch_size=4, shuffle=True)
    loader = fabric.setup_dataloaders(plain)
    assert loader.dataset is data and len(loader.dataset) == 12  # missing before
    assert isinstance(loader.sampler, RandomSampler)  # a DistributedSampler before: another order
    torch.manual_seed(5)
    want = [x for x, _ in plain]
    torch.manual_seed(5)
    got = [x for x, _ in loader]
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and len(got) == len(want)


def test_the_sampler_seed_is_seed_everythings(monkeypatch):
    assert sampler_seed(None) == 0
    seed_everything(42)
    assert sampler_seed(None) == 42 and sampler_seed(7) == 7
    engine = Engine(accelerator="cpu", devices=1, strategy="single")
    # this rank as one of two data-parallel ranks: the loader goes over a DistributedSampler
    monkeypatch.setattr(type(engine.strategy), "data_parallel_world_size", property(lambda s: 2))
    monkeypatch.setattr(type(engine.strategy), "data_parallel_rank", property(lambda s: 0))
    loader = engine.setup_dataloaders(DataLoader(_data(), batch_size=2, shuffle=True))
    assert type(loader.sampler).__name__ == "DistributedSampler" and loader.sampler.shuffle
    assert loader.sampler.seed == 42  # Engine(seed=0) seeded it with 0 before, whatever seed_everything said
    assert Engine(accelerator="cpu", devices=1, strategy="single", seed=7).setup_dataloaders(
        DataLoader(_data(), batch_size=2, shuffle=True)).sampler.seed == 7


def test_fabric_surface(tmp_path, monkeypatch):
    class Logger:
        def __init__(self):
            self.rows = []

        def log_metrics(self, metrics, step=None):
            self.rows.append((metrics, step))

    class Callback:
        def __init__(self):
            self.calls = []

        def on_train_epoch_end(self, **kw):
            self.calls.append(kw)

    logger, callback = Logger(), Callback()
    fabric = _fabric(loggers=logger, callbacks=[callback, object()])
    assert fabric.logger is logger and fabric.loggers == [logger] and fabric.is_global_zero
    assert Fabric.seed_everything(5) == 5 and os.environ[GLOBAL_SEED_ENV] == "5"
    fabric.log("loss", torch.tensor(0.5), step=1)
    fabric.log_dict({"a": 1, "b": torch.tensor(2.0)})
    assert logger.rows == [({"loss": 0.5}, 1), ({"a": 1, "b": 2.0}, None)]
    fabric.call("on_train_epoch_end", epoch=1)
    assert callback.calls == [{"epoch": 1}]
    moved = fabric.to_device({"x": [torch.zeros(1)]})
    assert moved["x"][0].device == fabric.device
    with fabric.rank_zero_first():
        pass
    assert fabric.launch(lambda f, k: (f is fabric, k), 3) == (True, 3)
    # setup_module then setup_optimizers, as Fabric's two-step set-up
    net = nn.Linear(3, 1)
    model = fabric.setup_module(net)
    opt = fabric.setup_optimizers(torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = _data()[:4]
    fabric.backward(nn.functional.mse_loss(model(x), y))
    opt.step()
    fabric.save(str(tmp_path / "ckpt"), {"model": model, "optimizer": opt, "note": "hi"})
    # a partial load: only the model, the rest comes back
    rest = fabric.load(str(tmp_path / "ckpt"), {"model": model})
    assert rest["note"] == "hi"


def test_fabric_reads_fabric_runs_variables(monkeypatch):
    monkeypatch.setenv("LT_STRATEGY", "single")
    monkeypatch.setenv("LT_ACCELERATOR", "cpu")
    monkeypatch.setenv("LT_DEVICES", "1")
    monkeypatch.setenv("LT_PRECISION", "bf16-mixed")
    fabric = Fabric()
    assert fabric.strategy.name == "single" and fabric.devices == 1
    assert type(fabric.precision_plugin).__name__ == "BF16Mixed"
    with pytest.raises(ConfigError, match="plugins="):
        Fabric(plugins=["x"])
    with pytest.raises(ConfigError, match="setup_optimizers: no module"):
        _fabric().setup_optimizers(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))


def test_fabric_run_variables_win_over_the_code_as_fabrics(monkeypatch):
    """DCGAN's ``Fabric(accelerator="auto", devices=1)`` run by torchrun with ``LT_DEVICES=2``: the
    variable wins (Fabric's rule); under ``fabric run`` (``LT_CLI_USED=1``) the conflict is an
    error, as Fabric's; compared with the installed lightning where it is there."""
    monkeypatch.setenv("LT_ACCELERATOR", "cpu")
    monkeypatch.setenv("LT_STRATEGY", "auto")
    monkeypatch.setenv("LT_DEVICES", "1")
    monkeypatch.delenv("LT_CLI_USED", raising=False)
    fabric = Fabric(accelerator="auto", devices=3, strategy="ddp")  # every argument overridden
    assert (fabric.accelerator, fabric.devices, fabric.strategy.name) == ("cpu", 1, "single")
    monkeypatch.setenv("LT_CLI_USED", "1")
    assert Fabric(accelerator="cpu", devices=1).devices == 1  # equal to the variable: no conflict
    with pytest.raises(ValueError, match="devices=3 in the code conflicts with --devices=1"):
        Fabric(devices=3)
    lightning = pytest.importorskip("lightning.fabric")
    with pytest.raises(ValueError, match="conflicts"):
        lightning.Fabric(devices=3)
    monkeypatch.setenv("LT_CLI_USED", "0")
    assert lightning.Fabric(accelerator="auto", devices=3, strategy="ddp").world_size == 1


def test_clip_gradients_takes_fabrics_keywords():
    fabric = _fabric()
    net = nn.Linear(3, 1)
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    fabric.clip_gradients(model, opt, max_norm=0.5)
    assert opt.clip_at == 0.5
    fabric.clip_gradients(model, opt, clip_val=0.25)  # by value: tests/unit/test_fabric_clipping.py
    assert (opt.clip_at, opt.clip_by) == (0.25, "value")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_gpu_accelerator_without_cuda_is_refused_not_run_on_cpu():
    # Fabric refuses accelerator="gpu" where no GPU exists; running on the CPU instead would hide it
    with pytest.raises(ConfigError, match="cuda"):
        Fabric(accelerator="gpu", devices=1)


def test_fabric_loggers_under_fabrics_path_and_the_modules_logger(tmp_path, monkeypatch):
    """examples/fabric/reinforcement_learning: ``from lightning.fabric.loggers import
    TensorBoardLogger`` (``root_dir=``), and its LightningModule calls ``self.logger.log_metrics``
    after ``fabric.setup``: the module's logger is the Fabric's, as under Fabric."""
    from zerotrain import TrainModule
    from zerotrain.fabric.loggers import CSVLogger, TensorBoardLogger

    theirs = pytest.importorskip("lightning.fabric.loggers")
    for ours, ref in ((TensorBoardLogger, theirs.TensorBoardLogger), (CSVLogger, theirs.CSVLogger)):
        assert ours(root_dir=tmp_path, name="run").log_dir == ref(root_dir=tmp_path, name="run").log_dir
    logger = CSVLogger(root_dir=tmp_path)

    class Agent(TrainModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(3, 1)

    agent = Agent()
    assert agent.logger is None
    fabric = _fabric(loggers=logger)
    fabric.setup(agent, torch.optim.SGD(agent.parameters(), lr=0.1))
    assert agent.logger is logger and agent.loggers == [logger]


def test_all_gather_takes_collections_and_adds_no_dimension_on_one_process(monkeypatch):
    """reinforcement_learning (--share-data) gathers a dict of tensors; kfold_cv a float. On one
    process Fabric returns them as they are (no world dimension); compared with the installed Fabric."""
    data = {"obs": torch.ones(4, 3), "r": [torch.zeros(2), 1.5], "n": 3}
    out = _fabric().all_gather(data)
    lightning = pytest.importorskip("lightning.fabric")
    ref = lightning.Fabric(accelerator="cpu", devices=1).all_gather(data)
    assert out["obs"].shape == ref["obs"].shape == (4, 3) and out["r"][0].shape == ref["r"][0].shape == (2,)
    assert out["r"][1].shape == ref["r"][1].shape == () and out["r"][1].dtype == ref["r"][1].dtype
    assert out["n"].dtype == ref["n"].dtype and isinstance(out["r"], list)
    with pytest.raises(ConfigError, match="sync_grads=True"):
        _fabric().all_gather(torch.ones(1), sync_grads=True)
