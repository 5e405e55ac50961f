"""Lightning's stages on one process: ``validate`` / ``test`` / ``predict`` with their results as
Lightning returns them, ``ckpt_path`` special values, the DataModule's calls in order, and the
Lightning semantics the issue names (``current_epoch`` in ``on_train_epoch_end``, no re-seeding)."""
from __future__ import annotations

import logging

import pytest
import torch
from tolerance import mean_rtol
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zerotrain import Callback, DataModule, ModelCheckpoint, Trainer, TrainModule
from zerotrain.trainer.errors import ConfigError


def _data(n: int = 32, seed: int = 7) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))


class Net(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)

    def forward(self, x):
        return self.net(x)

    def _loss(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_mse", self._loss(batch))

    def test_step(self, batch, batch_idx, dataloader_idx=0):
        self.log("test_mse", self._loss(batch))

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Data(DataModule):
    def __init__(self, calls: list) -> None:
        super().__init__()
        self.calls = calls

    def prepare_data(self):
        self.calls.append("prepare_data")

    def setup(self, stage):
        self.calls.append(f"setup:{stage}")
        self.ds = _data()

    def teardown(self, stage):
        self.calls.append(f"teardown:{stage}")

    def train_dataloader(self):
        return DataLoader(self.ds, batch_size=8)

    def val_dataloader(self):
        return DataLoader(self.ds, batch_size=8)

    def test_dataloader(self):
        return DataLoader(self.ds, batch_size=8)

    def predict_dataloader(self):
        return DataLoader(self.ds, batch_size=8)


def _trainer(tmp_path, **kw) -> Trainer:
    kw.setdefault("enable_checkpointing", False)
    return Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                   default_root_dir=str(tmp_path), **kw)


def _mse(model: nn.Module, ds: TensorDataset) -> float:
    with torch.no_grad():
        x, y = ds.tensors
        return float(nn.functional.mse_loss(model(x), y))


def test_datamodule_calls_and_stage_results(tmp_path):
    calls: list[str] = []
    model, dm = Net(), Data(calls)
    trainer = _trainer(tmp_path, max_epochs=2)
    trainer.fit(model, dm)  # positional, as Lightning
    assert trainer.datamodule is dm and dm.trainer is trainer
    assert calls == ["prepare_data", "setup:fit", "teardown:fit"]
    want = _mse(model, _data())  # batches of equal size: the mean of the batch means
    val = trainer.validate(model)  # no datamodule: the attached one, as Lightning
    test = trainer.test(model, datamodule=dm)
    assert calls[3:] == ["prepare_data", "setup:validate", "teardown:validate",
                         "prepare_data", "setup:test", "teardown:test"]
    # tolerance: two orders and groupings of one mean of 32 squared errors (>= 0, so mean|terms| is the mean): the
    # batch means weighted by batch size, 3 roundings more: 2 mean_rtol(32, ops=3) relative
    assert list(val[0]) == ["val_mse"] and val[0]["val_mse"] == pytest.approx(want, rel=2 * mean_rtol(32, ops=3))
    assert len(test) == 1 and test[0]["test_mse"] == pytest.approx(want, rel=2 * mean_rtol(32, ops=3))
    preds = trainer.predict(model)
    assert len(preds) == 4 and torch.allclose(torch.cat(preds), model(_data().tensors[0]).detach())
    assert trainer.predict(model, return_predictions=False) is None


def test_several_loaders_limits_and_names(tmp_path):
    model = Net()
    trainer = _trainer(tmp_path, max_steps=1, limit_test_batches=2, limit_predict_batches=3)
    trainer.fit(model, DataLoader(_data(), batch_size=8))
    loaders = [DataLoader(_data(seed=1), batch_size=8), DataLoader(_data(seed=2), batch_size=4)]
    out = trainer.test(model, loaders)
    assert [list(d) for d in out] == [["test_mse/dataloader_idx_0"], ["test_mse/dataloader_idx_1"]]
    first = _data(seed=1)[:16]  # limit_test_batches=2: two batches of 8
    # tolerance: as above, a mean of 16 squared errors in two batches: 2 mean_rtol(16, ops=3) relative
    assert out[0]["test_mse/dataloader_idx_0"] == pytest.approx(_mse(model, TensorDataset(*first)),
                                                               rel=2 * mean_rtol(16, ops=3))
    preds = trainer.predict(model, loaders)
    assert [len(p) for p in preds] == [3, 3]


def test_stage_refusals(tmp_path):
    class NoTest(Net):
        test_step = TrainModule.test_step

    class LogsInPredict(Net):
        def predict_step(self, batch, batch_idx, dataloader_idx=0):
            self.log("x", 1.0)

    loader = DataLoader(_data(), batch_size=8)
    with pytest.raises(ConfigError, match=r"No `test_step\(\)` method defined to run `Trainer.test`"):  # Lightning's
        _trainer(tmp_path).test(NoTest(), loader)
    with pytest.raises(ConfigError, match="predict_step"):
        _trainer(tmp_path).predict(LogsInPredict(), loader)
    with pytest.raises(ConfigError, match="both given"):
        _trainer(tmp_path).test(Net(), loader, datamodule=Data([]))
    with pytest.raises(ConfigError, match="no data"):
        _trainer(tmp_path).test(Net())
    with pytest.raises(TypeError, match="no model yet"):  # Lightning: a TypeError
        _trainer(tmp_path).test(dataloaders=loader)
    trainer = _trainer(tmp_path, max_steps=1)
    trainer.fit(Net(), loader)
    with pytest.raises(ConfigError, match="one module per Trainer"):
        trainer.test(Net(), loader)
    with pytest.raises(ValueError, match="is set but `ModelCheckpoint` is not configured"):
        trainer.test(dataloaders=loader)  # no model, no ckpt_path: "best", as Lightning


@pytest.mark.parametrize("stage, metric", [("test", "test_mse"), ("validate", "val_mse")])
@pytest.mark.parametrize("ckpt", ["last", "latest", "best", "dir"])
def test_ckpt_path_loads_the_saved_weights(tmp_path, ckpt, stage, metric):
    model = Net()
    cb = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=2, save_last=True)
    trainer = _trainer(tmp_path, max_steps=4, callbacks=[cb], enable_checkpointing=True)
    trainer.fit(model, DataLoader(_data(), batch_size=8))
    loader = DataLoader(_data(seed=3), batch_size=8)
    run = getattr(trainer, stage)
    want = run(model, loader)[0][metric]
    with torch.no_grad():
        model.net.weight.add_(1.0)  # the checkpoint must bring the trained weights back
    assert run(model, loader)[0][metric] != pytest.approx(want)
    path = {"dir": cb.last_path}.get(ckpt, ckpt)
    # tolerance: exact: the checkpoint's weights are the ones evaluated first, with the same ops in the same order
    assert run(model, loader, ckpt_path=path)[0][metric] == want
    assert trainer.global_step == 4  # evaluation loads the weights only, not the loop


def test_current_epoch_in_on_train_epoch_end_matches_lightning(tmp_path, monkeypatch):
    pl = pytest.importorskip("pytorch_lightning")

    class Record(Callback):
        def __init__(self):
            self.seen = []

        def on_train_epoch_end(self, trainer, module):
            self.seen.append(trainer.current_epoch)

    class PLRecord(pl.Callback):
        def __init__(self):
            self.seen = []

        def on_train_epoch_end(self, trainer, module):
            self.seen.append(trainer.current_epoch)

    class PLNet(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    ours, theirs = Record(), PLRecord()
    _trainer(tmp_path, max_epochs=3, callbacks=[ours]).fit(Net(), DataLoader(_data(), batch_size=8))
    pl.Trainer(accelerator="cpu", devices=1, max_epochs=3, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, callbacks=[theirs],
               default_root_dir=str(tmp_path / "pl")).fit(PLNet(), DataLoader(_data(), batch_size=8))
    assert ours.seen == theirs.seen == [0, 1, 2]


def test_trainer_does_not_reseed_unless_asked(tmp_path):
    loader = DataLoader(_data(), batch_size=8)
    for seed in (None, 5):
        torch.manual_seed(123)
        model = Net()  # seeds 0 itself, then draws
        expected = torch.get_rng_state() if seed is None else torch.manual_seed(5).get_state()
        probe = {}

        class Probe(Callback):
            def on_fit_start(self, trainer, module):
                probe["state"] = torch.get_rng_state()

        _trainer(tmp_path, max_steps=1, seed=seed, callbacks=[Probe()]).fit(model, loader)
        assert torch.equal(probe["state"], expected), seed
    with pytest.raises(ConfigError, match="seed="):
        _trainer(tmp_path, seed="0")


def test_a_step_that_logs_nothing_logs_nothing_as_lightning(tmp_path):
    """A returned loss is not logged (Lightning's rule; only the pipeline logs its loss)."""
    class Quiet(Net):
        def training_step(self, batch, batch_idx):
            return self._loss(batch)

        def validation_step(self, batch, batch_idx):
            return self._loss(batch)

    trainer, model = _trainer(tmp_path, max_epochs=2), Quiet()
    trainer.fit(model, DataLoader(_data(), batch_size=8), DataLoader(_data(), batch_size=8))
    assert trainer.callback_metrics == {} and trainer.logged_metrics == {}
    assert trainer.validate(model, DataLoader(_data(), batch_size=8)) == [{}]


def test_the_pipeline_tests_its_loss_and_refuses_to_predict(tmp_path):
    """README: the pipeline runs its own schedule, so ``test`` reports its loss and ``predict``
    raises (one stage on one process: the same Trainer path as more)."""
    from zerotrain.strategies.pipeline import PipelineModule, PipelineStrategy

    class Piped(TrainModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.pipe = PipelineModule.from_sequential(nn.Sequential(nn.Linear(4, 1)), 1,
                                                       loss_fn=nn.functional.mse_loss)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = Piped()
    trainer = _trainer(tmp_path, max_steps=2, strategy=PipelineStrategy(stages=1, micro_batches=2))
    trainer.fit(model, DataLoader(_data(), batch_size=8))
    loader = DataLoader(_data(seed=3), batch_size=8)
    out = trainer.test(model, loader)
    x, y = _data(seed=3).tensors
    with torch.no_grad():
        want = float(nn.functional.mse_loss(model.pipe(x), y))  # one stage: the whole model
    # tolerance: a mean of 32 squared errors in batches of 8, micro-batches of 4: each part's mean, its share
    # (a division, a product) and the batch's weight (a product, a division): 2 mean_rtol(32, ops=5) relative
    assert list(out[0]) == ["test_loss"] and out[0]["test_loss"] == pytest.approx(want, rel=2 * mean_rtol(32, ops=5))
    with pytest.raises(ConfigError, match="Trainer.predict: strategy=.* runs its own schedule and returns only the "
                                          "loss; valid: predict under single, ddp or zero1/2/3"):
        trainer.predict(model, loader)


def test_a_callbacks_state_and_extra_entries_round_trip_through_a_checkpoint(tmp_path):
    """Lightning's callback persistence: ``state_dict`` saved under the callback's ``state_key``
    and given back to ``load_state_dict`` on resume, and what ``on_save_checkpoint`` adds to the
    checkpoint seen again by ``on_load_checkpoint``."""

    class Counter(Callback):
        def __init__(self):
            self.batches, self.loaded, self.extra = 0, None, None

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.batches += 1

        def state_dict(self):
            return {"batches": self.batches, "history": [1.5, 2.5]}

        def load_state_dict(self, state):
            self.loaded = dict(state)
            self.batches = state["batches"]

        def on_save_checkpoint(self, trainer, module, checkpoint):
            checkpoint["counter_extra"] = {"at_step": trainer.global_step}

        def on_load_checkpoint(self, trainer, module, checkpoint):
            self.extra = checkpoint.get("counter_extra")

    loader = DataLoader(_data(), batch_size=8)
    first = Counter()
    ck = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=3, save_last=False)
    _trainer(tmp_path, max_steps=3, callbacks=[first, ck], enable_checkpointing=True).fit(Net(), loader)
    resumed = Counter()
    _trainer(tmp_path, max_steps=5, callbacks=[resumed]).fit(Net(), loader, ckpt_path=ck.last_path)
    assert resumed.loaded == {"batches": 3, "history": [1.5, 2.5]} and resumed.extra == {"at_step": 3}
    assert resumed.batches == 5  # counted on from the saved state
