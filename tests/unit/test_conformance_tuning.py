"""Lightning's tuning callbacks and Tuner (issue 41; ``callbacks/tuning/``), compared with
pytorch-lightning on the same seeded module and data where it is installed:
StochasticWeightAveraging's averaged weights, the learning-rate finder's loss curve and suggestion,
and the batch-size scaler's result in 'power' and 'binsearch' modes."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(autouse=True)
def _lightning_env(monkeypatch):  # pytorch-lightning sets it on import
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK", "1"))
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):  # seed_everything sets them: put back afterwards
        monkeypatch.setenv(name, os.environ.get(name, "0"))


def _lib(name: str):
    if name == "pl":
        return pytest.importorskip("lightning.pytorch")
    import zerotrain

    return zerotrain


def _quiet(**kw):
    return dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                accelerator="cpu", devices=1, **kw)


# ---------------------------------------------------------------------------- SWA
def _swa_fit(name: str, bn: bool, root, **swa_kw):
    L = _lib(name)
    from importlib import import_module

    boring = import_module(f"{L.__name__}.demos.boring_classes")

    class Model(boring.BoringModel):
        def __init__(self):
            super().__init__()
            self.layer = nn.Sequential(nn.Linear(32, 32), *([nn.BatchNorm1d(32)] if bn else []), nn.ReLU(),
                                       nn.Linear(32, 2))

        def train_dataloader(self):
            return DataLoader(boring.RandomDataset(32, 64), batch_size=4)

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1)]

    L.seed_everything(0)
    model = Model()
    swa = L.callbacks.StochasticWeightAveraging(**{"swa_lrs": 0.05, "swa_epoch_start": 2, "annealing_epochs": 2,
                                                   **swa_kw})
    lrs = []
    probe = type("Probe", (L.Callback,), {"on_train_epoch_start": lambda self, t, m: lrs.append(
        t.optimizers[0].param_groups[0]["lr"])})()
    trainer = L.Trainer(max_epochs=5, callbacks=[swa, probe], limit_val_batches=0, default_root_dir=str(root),
                        **_quiet())
    trainer.fit(model)
    avg = swa._average_model
    avg = getattr(avg, "module", avg)  # ours: a torch AveragedModel around the copy
    return {"state": {k: v.clone() for k, v in model.state_dict().items()},
            "avg": {k: v.clone() for k, v in avg.state_dict().items()}, "n": int(swa.n_averaged),
            "step": trainer.global_step, "epoch": trainer.current_epoch, "max_epochs": trainer.max_epochs,
            "lrs": lrs}


def test_swa_averaged_weights_equal_lightnings(tmp_path):
    """SWALR's learning rates, the average of epochs 2-5 and the module's final weights: bit for bit."""
    pl, zt = _swa_fit("pl", False, tmp_path / "pl"), _swa_fit("zt", False, tmp_path / "zt")
    assert (zt["n"], zt["step"], zt["epoch"], zt["max_epochs"]) == (pl["n"], pl["step"], pl["epoch"],
                                                                    pl["max_epochs"]) == (4, 80, 5, 5)
    assert zt["lrs"] == pl["lrs"]
    for k, v in pl["state"].items():
        assert torch.equal(zt["state"][k], v), k
        assert torch.equal(zt["state"][k], zt["avg"][k]), k  # the module ends with the average


def test_swa_batch_norm_epoch_recomputes_statistics_as_lightning(tmp_path):
    """With batch norm: one more epoch of forwards only (max_epochs back to 5 afterwards, 81
    steps counted), whose running statistics equal Lightning's. The weights are the average
    exactly; Lightning's are one SGD step away from it (its extra epoch's last batch steps the
    optimizer on the gradients left from the last real step: a documented difference)."""
    pl, zt = _swa_fit("pl", True, tmp_path / "pl"), _swa_fit("zt", True, tmp_path / "zt")
    assert (zt["n"], zt["step"], zt["epoch"], zt["max_epochs"]) == (pl["n"], pl["step"], pl["epoch"],
                                                                    pl["max_epochs"]) == (4, 81, 6, 5)
    for k, v in pl["state"].items():
        if "running" in k or "num_batches" in k:
            assert torch.equal(zt["state"][k], v), k
        else:
            assert torch.equal(zt["state"][k], zt["avg"][k]), k
            assert torch.equal(zt["avg"][k], pl["avg"][k]), k  # the averages themselves are Lightning's


@pytest.mark.parametrize("kwargs, match", [
    ({"swa_lrs": 0.1, "swa_epoch_start": 0}, "swa_epoch_start should be a >0 integer"),
    ({"swa_lrs": 0.1, "swa_epoch_start": 1.5}, "swa_epoch_start should be a >0 integer"),
    ({"swa_lrs": -1.0}, "`swa_lrs` should a positive float"),
    ({"swa_lrs": [0.1, 1]}, "`swa_lrs` should a positive float"),
    ({"swa_lrs": 0.1, "avg_fn": 3}, "`avg_fn` should be callable"),
    ({"swa_lrs": 0.1, "device": 3}, "device is expected to be a torch.device or a str"),
])
def test_swa_bad_arguments_raise_lightnings_errors(kwargs, match):
    from zerotrain.callbacks import StochasticWeightAveraging
    from zerotrain.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException, match=match):
        StochasticWeightAveraging(**kwargs)


def test_swa_refuses_zero3_before_training(tmp_path):
    import zerotrain as Z
    from zerotrain.demos.boring_classes import BoringModel

    trainer = Z.Trainer(max_epochs=2, strategy="zero3", callbacks=[Z.callbacks.StochasticWeightAveraging(0.1)],
                        default_root_dir=str(tmp_path), **_quiet())
    with pytest.raises(Z.utilities.exceptions.MisconfigurationException, match="strategy='zero3'.*sharded"):
        trainer.fit(BoringModel())
    assert trainer.global_step == 0


def test_swa_lightning_import_path():
    from zerotrain.callbacks import StochasticWeightAveraging
    from zerotrain.callbacks.stochastic_weight_avg import StochasticWeightAveraging as ByPath

    assert ByPath is StochasticWeightAveraging
