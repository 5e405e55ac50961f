"""``torch.compile`` from each face, one process (``strategies/compile.py``, ``trainer/loop/compiled.py``,
``trainer/compat/deepspeed/compiled.py``): ``Trainer(compile=...)``, Lightning's
``trainer.fit(torch.compile(model))``, Fabric's ``fabric.setup(torch.compile(model))`` and
DeepSpeed's ``engine.compile()``. The ``eager`` backend: dynamo captures the graphs (counted,
breaks and guards as under inductor) and runs their ops as captured, so the losses equal eager
PyTorch's exactly. The numerics of generated code: tests/distributed/test_compile.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import zerotrain.deepspeed as deepspeed
from zerotrain import ConfigError, Fabric, Trainer, TrainModule
from zerotrain.strategies.compile import CompileConfig, repeated_blocks

from deepspeed_unit_common import _own_group_and_checkpointing  # noqa: F401 - autouse fixture

QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, num_sanity_val_steps=0)
STEPS = 3


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + F.gelu(self.fc(self.ln(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(24, 4, generator=g), torch.randn(24, 1, generator=g))


class Module(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net()
        self.losses: list[float] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss = F.mse_loss(self(batch[0]), batch[1])
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return DataLoader(data(), batch_size=4)


def eager_losses() -> list[float]:
    net, out = Net(), []
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for x, y in list(DataLoader(data(), batch_size=4))[:STEPS]:
        loss = F.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(float(loss.detach()))
    return out


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_repeated_blocks_are_the_module_lists_entries():
    net = Net()
    assert repeated_blocks(net) == list(net.blocks)
    assert repeated_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == []  # one module with parameters


@pytest.mark.parametrize("value, match", [
    ("yes", "compile='yes'; valid: True, False, None or a dict"),
    ({"mode": "fast"}, "mode='fast'; valid choices: None, default, reduce-overhead"),
    ({"backend": "nonesuch"}, "backend='nonesuch'; valid choices: "),
    ({"regonal": False}, r"unknown key\(s\) \['regonal'\]; valid keys: backend, dynamic, fullgraph, mode"),
    ({"fullgraph": 1}, "fullgraph=1 must be True or False"),
])
def test_bad_compile_option_is_refused_before_anything_starts(value, match):
    with pytest.raises(ConfigError, match=match):
        Trainer(compile=value, **QUIET)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["single", "ddp", "zero2", "zero3"])
def test_trainer_compile_per_block_equals_eager(strategy):
    module = Module()
    trainer = Trainer(strategy=strategy, devices=1, max_steps=STEPS, compile={"backend": "eager"}, **QUIET)
    trainer.fit(module)
    s = trainer.strategy
    assert s.compiled.names == ["net.blocks.0", "net.blocks.1"]
    assert s.compile.stats.graphs == 1  # one graph for both blocks, no recompilation
    assert module.losses == eager_losses()


@pytest.mark.timeout(300)
def test_lightning_fit_of_a_compiled_module():
    """Lightning's ``trainer.fit(torch.compile(model))``: the user's module is trained (and is
    the Trainer's), its blocks compiled with the user's own dynamo context."""
    module = Module()
    compiled = torch.compile(module, backend="eager")
    trainer = Trainer(strategy="zero3", devices=1, max_steps=STEPS, **QUIET)
    trainer.fit(compiled)
    assert trainer.lightning_module is module
    assert trainer.strategy.compile.context is compiled.dynamo_ctx
    assert trainer.strategy.compiled.names == ["net.blocks.0", "net.blocks.1"]
    assert module.losses == eager_losses()
    with pytest.raises(ConfigError, match="compiled .*and compile=.* was given too"):
        Trainer(max_steps=1, compile=True, **QUIET).fit(torch.compile(Module(), backend="eager"))


@pytest.mark.timeout(300)
def test_fabric_setup_of_a_compiled_module():
    fabric = Fabric(accelerator="cpu", devices=1, strategy="zero2")
    net = Net()
    compiled = torch.compile(net, backend="eager")
    model, opt = fabric.setup(compiled, torch.optim.Adam(net.parameters(), lr=1e-2))
    assert model.module is net and fabric.strategy.compiled.names == ["blocks.0", "blocks.1"]
    losses = []
    for x, y in list(DataLoader(data(), batch_size=4))[:STEPS]:
        loss = F.mse_loss(model(x), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert losses == eager_losses()


def _engine_losses(stage: int, compiled: bool) -> tuple[list[float], object]:
    net = Net()
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage}})
    if compiled:
        assert not engine.is_compiled
        with pytest.raises(ConfigError, match=r"compile_kwargs has \['fullgrap'\]; valid keys: mode, fullgraph"):
            engine.compile(backend="eager", compile_kwargs={"fullgrap": True})
        engine.compile(backend="eager", compile_kwargs={"backend": "inductor"})  # the argument wins, as DeepSpeed's
        assert engine.is_compiled and engine.zerotrain_engine.strategy.compiled.names == ["blocks.0", "blocks.1"]
    losses = []
    for x, y in list(DataLoader(data(), batch_size=4))[:STEPS]:
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    engine.destroy()
    return losses, engine


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed_engine_compile(stage):
    """DeepSpeed's ``engine.compile()``: the same losses as the same engine uncompiled."""
    losses, engine = _engine_losses(stage, compiled=True)
    assert losses == _engine_losses(stage, compiled=False)[0]
    assert engine.zerotrain_engine.strategy.compile.stats.graphs == 1


class Wide(TrainModule):
    """Blocks whose LayerNorms hold ZeRO-3's root-unit (small) parameters: their modules carry
    scope hooks inside each compiled block."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 64), nn.Sequential(*(Block(64) for _ in range(3))), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


@pytest.mark.timeout(300)
def test_zero3_blocks_share_one_graph_without_inner_scope_hooks():
    """Under zero3 the scope hooks of modules inside a compiled block are removed (the block's own
    scope hook enters the scope): dynamo traced them and guarded on their hook ids, one graph per block."""
    trainer = Trainer(strategy="zero3", devices=1, max_steps=2, compile={"backend": "eager"}, **QUIET)
    trainer.fit(Wide(), train_dataloaders=list(DataLoader(data(), batch_size=4)))
    assert trainer.strategy.compiled.names == ["net.1.0", "net.1.1", "net.1.2"]
    assert trainer.strategy.compile.stats.graphs == 1


@pytest.mark.timeout(180)
def test_command_line_compile_reaches_the_trainer(tmp_path):
    """``zerotrain-train trainer.compile=...``: a TrainerConfig field given to the Trainer, so a bad
    value is the Trainer's one-line error, rc 2, before any rank starts."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "zerotrain.train", "trainer.compile=maybe", f"hydra.run.dir={tmp_path}"],
                          capture_output=True, text=True, timeout=150, cwd=tmp_path)
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "zerotrain-train: configuration error: trainer.compile='maybe'; valid: True, False, None or a dict "
        "of backend/mode/fullgraph/dynamic/options/regional")


def test_a_strategy_given_with_compile_keeps_it():
    """The strategy option: ``strategy.compile`` set on the instance given to the Trainer stays."""
    from zerotrain.strategies import strategy_from_name
    strategy = strategy_from_name("zero2")
    strategy.compile = CompileConfig(backend="eager")
    assert Trainer(strategy=strategy, **QUIET).strategy.compile is strategy.compile


@pytest.mark.timeout(300)
def test_regional_false_compiles_the_whole_model_even_without_a_forward():
    """``regional=False``: the module's forward, or (a TrainModule without one) each child with parameters."""
    trainer = Trainer(strategy="zero2", devices=1, max_steps=2, compile={"backend": "eager", "regional": False},
                      **QUIET)
    trainer.fit(Wide(), train_dataloaders=list(DataLoader(data(), batch_size=4)))
    assert trainer.strategy.compiled.names == ["net"] and trainer.strategy.compile.stats.graphs == 1
