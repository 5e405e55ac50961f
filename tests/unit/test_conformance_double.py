"""``precision="64-true"`` as Lightning's ``DoublePrecision`` (issue 41; Lightning's
trainer/test_trainer.py::test_predict_return_predictions_cpu[64-true-*]): the module trains in
float64, the batch's floating-point tensors are cast, tensors made in a step are float64, and
the sharded strategies refuse it before any process starts."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from zerotrain import Trainer, seed_everything
from zerotrain.demos.boring_classes import BoringModel, RandomDataset
from zerotrain.trainer.errors import ConfigError


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):  # recorded, so that what seed_everything sets is undone
        monkeypatch.setenv(name, "0")
        monkeypatch.delenv(name)


def _model(base):
    class Model(base):
        def training_step(self, batch, batch_idx):
            assert batch.dtype == torch.float64 and torch.zeros(1).dtype == torch.float64
            out = super().training_step(batch, batch_idx)
            self.seen.append(out["loss"].detach().clone())
            return out

    model = Model()
    model.seen = []
    return model


def _run(trainer_cls, base, precision):
    seed_everything(7)
    model = _model(base)
    trainer = trainer_cls(max_steps=4, precision=precision, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(model, train_dataloaders=DataLoader(RandomDataset(32, 16), batch_size=4))
    preds = trainer.predict(model, dataloaders=DataLoader(RandomDataset(32, 2)))
    return model, preds


@pytest.mark.parametrize("precision", ["64-true", "64", 64])
def test_double_trains_in_float64(precision):
    model, preds = _run(Trainer, BoringModel, precision)
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert [p.dtype for p in preds] == [torch.float64, torch.float64]
    assert torch.get_default_dtype() == torch.float32  # restored after each forward
    assert [loss.dtype for loss in model.seen] == [torch.float64] * 4


def test_double_as_lightnings():
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.demos.boring_classes import BoringModel as TheirModel

    ours, our_preds = _run(Trainer, BoringModel, "64-true")
    theirs, their_preds = _run(pl.Trainer, TheirModel, "64-true")
    # the same float64 operations in the same order: equal to float64 rounding
    torch.testing.assert_close(torch.stack(ours.seen), torch.stack(theirs.seen), rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.cat(our_preds), torch.cat(their_preds), rtol=0, atol=1e-12)


@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_sharded_strategies_refuse_double(strategy):
    with pytest.raises(ConfigError, match="float64 training keeps the module whole"):
        Trainer(strategy=strategy, precision="64-true", devices=1, logger=False)
