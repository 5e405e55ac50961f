"""Lightning code runs unchanged through the loop: step outputs, hook signatures, several
validation loaders, switched-off steps, the module's optimizer_step hook, Lightning's Trainer
arguments and attributes (issue 41). Compared with pytorch_lightning where it helps."""
from __future__ import annotations

import math
import types

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import zerotrain
from zerotrain import Trainer, TrainModule
from zerotrain.trainer.loop import properties
from zerotrain.trainer.errors import ConfigError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def lightning_env(monkeypatch):
    """pytorch_lightning and seed_everything set these; they are put back after the test."""
    for key in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS", "PYTORCH_NVML_BASED_CUDA_CHECK", "ZEROTRAIN_GLOBAL_SEED"):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)


def _data(n: int = 16, batch: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g)),
                      batch_size=batch)


def _trainer(tmp_path, **kw) -> Trainer:
    kw.setdefault("max_epochs", 1)
    return Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, default_root_dir=str(tmp_path), **kw)


class Net(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.calls: list = []

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("output", ["dict", "tensor", "none"])
def test_evaluation_steps_may_return_anything(tmp_path, output):
    class M(Net):
        def validation_step(self, batch, batch_idx):
            y = self.layer(batch[0])
            return {"dict": {"preds": y}, "tensor": y.sum(), "none": None}[output]

        test_step = validation_step

    t = _trainer(tmp_path)
    m = M()
    t.fit(m, _data(), _data())
    t.validate(m, _data(), verbose=False)
    t.test(m, _data(), verbose=False)


def test_training_step_returning_none_skips_the_batch(tmp_path):
    class M(Net):
        def training_step(self, batch, batch_idx):
            return None if batch_idx % 2 else super().training_step(batch, batch_idx)

    m = M()
    before = m.layer.weight.detach().clone()
    t = _trainer(tmp_path)
    t.fit(m, _data())
    assert t.global_step == 4  # counted, as Lightning's
    assert not torch.equal(before, m.layer.weight)


def test_training_step_dict_without_loss_is_refused(tmp_path):
    class M(Net):
        def training_step(self, batch, batch_idx):
            return {"out": self.layer(batch[0]).sum()}

    with pytest.raises(ConfigError, match="'loss' key"):
        _trainer(tmp_path).fit(M(), _data())


def test_steps_without_batch_idx(tmp_path):
    class M(Net):
        def training_step(self, batch):
            self.calls.append("train")
            return super().training_step(batch, None)

        def validation_step(self, batch):
            self.calls.append("val")

        def test_step(self, batch):
            self.calls.append("test")

        def predict_step(self, batch):
            return self.layer(batch[0])

    m = M()
    t = _trainer(tmp_path, num_sanity_val_steps=0)
    t.fit(m, _data(), _data())
    t.test(m, _data(), verbose=False)
    assert len(t.predict(m, _data())) == 4
    assert m.calls.count("train") == 4 and m.calls.count("val") == 4 and m.calls.count("test") == 4


def test_several_validation_loaders_in_fit(tmp_path):
    class M(Net):
        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            assert torch.is_tensor(batch[0])
            self.calls.append(dataloader_idx)

    for loaders in ([_data(), _data(8)], {"a": _data(), "b": _data(8)}):
        m = M()
        _trainer(tmp_path, num_sanity_val_steps=0).fit(m, _data(), loaders)
        assert m.calls == [0] * 4 + [1] * 2


def test_several_loaders_need_dataloader_idx_as_lightning(tmp_path):
    class M(Net):
        def validation_step(self, batch, batch_idx):
            pass

    with pytest.raises(RuntimeError, match="no `dataloader_idx`"):
        _trainer(tmp_path).fit(M(), _data(), [_data(), _data()])


def test_validation_step_none_switches_validation_off(tmp_path):
    class M(Net):
        validation_step = None

    t = _trainer(tmp_path)
    t.fit(M(), _data(), _data())
    assert t.global_step == 4


def test_module_optimizer_step_override_is_called(tmp_path):
    """A learning-rate warm-up written in optimizer_step (Lightning's documented pattern) acts."""
    class M(Net):
        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
            self.calls.append((epoch, batch_idx))
            for group in optimizer.param_groups:
                group["lr"] = 0.0  # a warm-up from zero: nothing moves
            optimizer.step(closure=optimizer_closure)

        def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
            self.calls.append("zero")
            optimizer.zero_grad()

    m = M()
    before = m.layer.weight.detach().clone()
    _trainer(tmp_path, accumulate_grad_batches=2).fit(m, _data())
    assert m.calls == ["zero", (0, 1), "zero", (0, 3)]
    assert torch.equal(before, m.layer.weight)


def test_optimizer_step_override_that_does_not_step(tmp_path):
    class M(Net):
        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
            pass

    m = M()
    before = m.layer.weight.detach().clone()
    t = _trainer(tmp_path)
    t.fit(m, _data())
    assert t.global_step == 4 and torch.equal(before, m.layer.weight)


def test_keyboard_interrupt_ends_fit_cleanly(tmp_path):
    seen = []

    class CB(zerotrain.Callback):
        def on_exception(self, trainer, module, exception):
            seen.append(type(exception))

    class M(Net):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1:
                raise KeyboardInterrupt
            return super().training_step(batch, batch_idx)

    t = _trainer(tmp_path, callbacks=[CB()])
    with pytest.raises(SystemExit):
        t.fit(M(), _data())
    assert t.interrupted and seen == [KeyboardInterrupt]
    assert t.state.fn == "fit"


def test_on_exception_in_validate(tmp_path):
    seen = []

    class CB(zerotrain.Callback):
        def on_exception(self, trainer, module, exception):
            seen.append(str(exception))

    class M(Net):
        def validation_step(self, batch, batch_idx):
            raise ValueError("boom")

    t = _trainer(tmp_path, callbacks=[CB()])
    with pytest.raises(ValueError):
        t.validate(M(), _data(), verbose=False)
    assert seen == ["boom"] and t.interrupted


def test_trainer_attributes(tmp_path):
    from zerotrain.callbacks.checkpoint import ModelCheckpoint
    from zerotrain.callbacks.early_stopping import EarlyStopping

    seen = {}

    class M(Net):
        def configure_optimizers(self):
            seen["steps"] = self.trainer.estimated_stepping_batches
            seen["fn"] = self.trainer.state.fn
            return super().configure_optimizers()

    ck, es = ModelCheckpoint(dirpath=str(tmp_path / "ck")), EarlyStopping(monitor="val_loss", strict=False)
    t = Trainer(accelerator="cpu", devices="1", logger=False, enable_progress_bar=False, max_epochs=3,
                limit_train_batches=3, accumulate_grad_batches=2, callbacks=[ck, es], default_root_dir=str(tmp_path))
    assert t.checkpoint_callback is ck and t.checkpoint_callbacks == [ck]
    assert t.early_stopping_callback is es and t.early_stopping_callbacks == [es]
    assert t.device_ids == [0] and not t.interrupted and not t.received_sigterm
    m = M()
    t.fit(m, _data())
    assert seen == {"steps": math.ceil(3 / 2) * 3, "fn": "fit"}
    assert t.lightning_module is m and t.model is not None and t.state.finished
    m2 = Net()
    m2.trainer = t
    assert m2.trainer is t
    t.logger = None
    assert t.logger is None and t.loggers == []


def test_estimated_stepping_batches_matches_lightning(tmp_path, lightning_env):
    """Read inside configure_optimizers (where OneCycleLR is built), as under Lightning."""
    pl = pytest.importorskip("pytorch_lightning")
    cases = [dict(max_epochs=2), dict(max_epochs=3, accumulate_grad_batches=3), dict(max_steps=5),
             dict(max_epochs=-1, max_steps=4), dict(max_epochs=4, max_steps=3, limit_train_batches=2)]

    def build(base):
        class M(base):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(3, 1)

            def training_step(self, batch, batch_idx):
                return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

            def train_dataloader(self):
                return _data(20)

            def configure_optimizers(self):
                self.estimate = self.trainer.estimated_stepping_batches
                return torch.optim.SGD(self.parameters(), lr=0.1)
        return M

    for kw in cases:
        ours, theirs = build(TrainModule)(), build(pl.LightningModule)()
        _trainer(tmp_path, **{"max_epochs": None, **kw}).fit(ours)
        pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, **kw).fit(theirs)
        assert ours.estimate == theirs.estimate, kw


def test_new_trainer_arguments(tmp_path):
    grad_mode = {}

    class M(Net):
        def validation_step(self, batch, batch_idx):
            grad_mode.setdefault(self.trainer.inference_mode, torch.is_inference_mode_enabled())

    for mode in (True, False):
        _trainer(tmp_path, inference_mode=mode, num_sanity_val_steps=0).fit(M(), _data(), _data())
    assert grad_mode == {True: True, False: False}
    kept = torch.backends.cudnn.benchmark
    try:
        assert _trainer(tmp_path, benchmark=True).benchmark and torch.backends.cudnn.benchmark
        _trainer(tmp_path, deterministic=True)
        assert torch.backends.cudnn.benchmark is False
    finally:
        torch.backends.cudnn.benchmark = kept
    with pytest.raises(ConfigError, match="profiler"):
        _trainer(tmp_path, profiler="advanced")  # "simple" and a Profiler are taken (test_conformance_dataloaders)
    from zerotrain.profilers import PassThroughProfiler
    assert isinstance(_trainer(tmp_path, profiler=None).profiler, PassThroughProfiler)  # Lightning's: records nothing


def test_barebones_as_lightning(tmp_path):
    t = Trainer(accelerator="cpu", devices=1, barebones=True, default_root_dir=str(tmp_path), max_epochs=1)
    assert t.loggers == [] and t.checkpoint_callback is None and t.log_every_n_steps == 0
    assert t.num_sanity_val_steps == 0
    with pytest.raises(ValueError, match="barebones=True, enable_checkpointing=True"):
        Trainer(accelerator="cpu", barebones=True, enable_checkpointing=True)
    with pytest.raises(ValueError, match="barebones=True, logger=True"):
        Trainer(accelerator="cpu", barebones=True, logger=True)


def test_reload_dataloaders_every_n_epochs(tmp_path):
    class M(Net):
        def train_dataloader(self):
            self.calls.append(self.trainer.current_epoch)
            return _data()

    m = M()
    _trainer(tmp_path, max_epochs=5, reload_dataloaders_every_n_epochs=2).fit(m)
    assert m.calls == [0, 2, 4]


def test_epoch_and_step_limits_as_lightning(tmp_path):
    m = Net()
    t = _trainer(tmp_path, max_epochs=0)
    t.fit(m, _data())
    assert t.global_step == 0
    t = _trainer(tmp_path, max_epochs=None, max_steps=0)
    t.fit(Net(), _data())
    assert t.global_step == 0 and t.max_epochs == -1
    t = _trainer(tmp_path, max_epochs=-1, max_steps=6)
    t.fit(Net(), _data())
    assert t.global_step == 6
    seen = []

    class Stop(Net):
        def on_train_start(self):
            seen.append(self.trainer.max_epochs)
            self.trainer.should_stop = True

    t = _trainer(tmp_path, max_epochs=None)
    assert t.max_epochs is None  # decided at fit, as Lightning
    t.fit(Stop(), _data())
    assert seen == [1000]
    home = Trainer(accelerator="cpu", default_root_dir="~/zt-issue41-probe", logger=False, enable_checkpointing=False)
    assert not home.default_root_dir.startswith("~") and "~" not in home.default_root_dir


def test_configure_optimizers_none_trains_without_an_optimizer(tmp_path):
    class M(Net):
        def configure_optimizers(self):
            return None

    m = M()
    before = m.layer.weight.detach().clone()
    with pytest.warns(UserWarning, match="returned `None`"):
        _trainer(tmp_path).fit(m, _data())
    assert torch.equal(before, m.layer.weight)


def test_dropout_losses_match_lightning_one_process(tmp_path, lightning_env):
    """Same seed, same module with dropout, unshuffled loader, a validation loader: the same
    per-step losses (the sanity check leaves the RNG streams as they were, as Lightning's)."""
    pl = pytest.importorskip("pytorch_lightning")

    def build(base):
        class M(base):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
                self.losses = []

            def training_step(self, batch, batch_idx):
                loss = torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
                self.losses.append(loss.item())
                return loss

            def validation_step(self, batch, batch_idx):
                self.log("v", torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1]))

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)
        return M

    pl.seed_everything(7)
    theirs = build(pl.LightningModule)()
    pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False).fit(theirs, _data(), _data(8))
    zerotrain.seed_everything(7)
    ours = build(TrainModule)()
    _trainer(tmp_path, max_epochs=2).fit(ours, _data(), _data(8))
    # tolerance: exact: one process, Lightning's ops in Lightning's order (bit-equal under ATEN_CPU_CAPABILITY default, avx2, avx512)
    assert ours.losses == theirs.losses


@pytest.mark.parametrize("interval", ["00:00:00:03", {"seconds": 3}])
def test_time_based_val_check_interval_as_lightning(tmp_path, monkeypatch, lightning_env, interval):
    """Lightning 2.6: validate once the interval passed since the last validation, checked after
    each step (no end-of-epoch validation besides). A fake clock advances 1 s per training step."""
    pl = pytest.importorskip("pytorch_lightning")
    import time

    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])

    def build(base):
        class M(base):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(3, 1)
                self.validated_at = []

            def training_step(self, batch, batch_idx):
                clock[0] += 1.0
                return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

            def validation_step(self, batch, batch_idx):
                if batch_idx == 0:
                    self.validated_at.append(self.trainer.global_step)

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)
        return M

    theirs, ours = build(pl.LightningModule)(), build(TrainModule)()
    pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
               val_check_interval=interval).fit(theirs, _data(28), _data(8))
    _trainer(tmp_path, max_epochs=2, num_sanity_val_steps=0, val_check_interval=interval).fit(ours, _data(28),
                                                                                               _data(8))
    assert theirs.validated_at and ours.validated_at == theirs.validated_at


def test_train_batch_end_outputs_as_lightning(tmp_path, lightning_env):
    """outputs: the loss detached and divided by accumulate_grad_batches, the other keys kept, {}
    for a skipped step - what pytorch_lightning hands on_train_batch_end."""
    pl = pytest.importorskip("pytorch_lightning")

    def build(base):
        class M(base):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(3, 1)
                self.seen = []

            def training_step(self, batch, batch_idx):
                if batch_idx == 3:
                    return None
                loss = torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
                return loss if batch_idx == 0 else {"loss": loss, "extra": batch_idx}

            def on_train_batch_end(self, outputs, batch, batch_idx):
                self.seen.append({k: (v.requires_grad, round(float(v), 5)) if torch.is_tensor(v) else v
                                  for k, v in outputs.items()})

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)
        return M

    torch.manual_seed(0)
    theirs = build(pl.LightningModule)()
    torch.manual_seed(0)
    ours = build(TrainModule)()
    pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2).fit(theirs, _data())
    _trainer(tmp_path, accumulate_grad_batches=2).fit(ours, _data())
    assert ours.seen == theirs.seen and ours.seen[-1] == {}


@pytest.mark.timeout(30)
def test_an_on_exception_that_raises_still_ends_the_ranks_rank_0_started():
    """A callback's on_exception raising inside fit: the ranks our launcher started are still
    ended (else they sit in their next collective until the group's timeout)."""
    killed = []

    def hooks(name, *args):
        raise ValueError("on_exception failed")

    trainer = types.SimpleNamespace(state=types.SimpleNamespace(status=None), hooks=hooks, is_global_zero=True,
                                    _launcher=types.SimpleNamespace(kill=lambda **kw: killed.append(kw),
                                                                    unwatch=lambda: killed.append("unwatch")))
    with pytest.raises(ValueError, match="on_exception failed"):
        properties.TrainerProperties._interrupted(trainer, RuntimeError("Connection reset by peer"), None, in_fit=True)
    assert killed == [{"in_fit": True, "peer_lost": True}, "unwatch"]
