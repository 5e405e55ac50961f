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
    tqdm = pytest.importorskip("tqdm")
    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)  # Lightning's lr-finder bar: no monitor thread left


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


# ---------------------------------------------------------------------------- lr_find
def _regression_model(L, opt: str = "sgd", batch_size: int = 16):
    from importlib import import_module

    boring = import_module(f"{L.__name__}.demos.boring_classes")

    class Model(boring.BoringModel):
        def __init__(self):
            super().__init__()
            self.lr, self.batch_size, self.steps_seen = 0.1, batch_size, 0

        def training_step(self, batch, batch_idx):
            self.steps_seen += 1
            out = self.layer(batch)
            return nn.functional.mse_loss(out, batch[:, :2] * 3)

        def train_dataloader(self):
            return DataLoader(boring.RandomDataset(32, 1024), batch_size=self.batch_size)

        def val_dataloader(self):
            return DataLoader(boring.RandomDataset(32, 16), batch_size=16)

        def configure_optimizers(self):
            kind = torch.optim.Adam if opt == "adam" else torch.optim.SGD
            return kind(self.parameters(), lr=self.lr)

    return Model


def _lr_find(name: str, root, mode: str, opt: str = "sgd", threshold=4.0, strategy: str | None = None):
    """Tuner.lr_find on a seeded regression model, then fit: the search and what it left behind."""
    L = _lib(name)
    from importlib import import_module

    Tuner = import_module(f"{L.__name__}.tuner").Tuner
    L.seed_everything(0)
    model = _regression_model(L, opt)()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = L.Trainer(max_epochs=1, default_root_dir=str(root), **_quiet(**({"strategy": strategy} if strategy else {})))
    result = Tuner(trainer).lr_find(model, num_training=50, mode=mode, early_stop_threshold=threshold)
    restored = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    searched, step_after_search = model.steps_seen, trainer.global_step
    trainer.fit(model)
    return {"lr": result.results["lr"], "loss": result.results["loss"], "suggestion": result.suggestion(),
            "attr": model.lr, "restored": restored, "searched": searched, "step_after_search": step_after_search,
            "step": trainer.global_step, "state": {k: v.clone() for k, v in model.state_dict().items()},
            "left": sorted(os.listdir(root))}


@pytest.mark.parametrize("mode", ["exponential", "linear"])
def test_lr_find_curve_and_suggestion_equal_lightnings(tmp_path, mode):
    """The same learning rates and smoothed losses (bit for bit), the same suggestion set on
    ``model.lr``; afterwards the weights are the initial ones, the search's checkpoint is gone,
    and the fit that follows trains from step 0 with the suggested rate to Lightning's weights."""
    pl, zt = _lr_find("pl", tmp_path / "pl", mode), _lr_find("zt", tmp_path / "zt", mode)
    assert len(zt["loss"]) == 50
    for key in ("lr", "loss", "suggestion", "attr", "searched", "step_after_search", "step"):
        assert zt[key] == pl[key], key
    assert zt["attr"] == zt["suggestion"] and zt["restored"] and pl["restored"]
    assert zt["left"] == pl["left"] == []
    for k, v in pl["state"].items():
        assert torch.equal(zt["state"][k], v), k


def test_lr_find_stops_early_on_divergence_as_lightning(tmp_path):
    """Up to 10 (linear to 1.0 on a step of 64 rates diverges): the early stop at the same step."""
    def run(name):
        L = _lib(name)
        from importlib import import_module

        L.seed_everything(0)
        model = _regression_model(L)()
        trainer = L.Trainer(max_epochs=1, default_root_dir=str(tmp_path / name), **_quiet())
        tuner = import_module(f"{L.__name__}.tuner").Tuner(trainer)
        res = tuner.lr_find(model, num_training=60, max_lr=50.0, mode="linear", update_attr=False)
        return res.results, model.lr

    (pl, pl_lr), (zt, zt_lr) = run("pl"), run("zt")
    assert zt == pl and len(zt["loss"]) < 60
    assert zt_lr == pl_lr == 0.1  # update_attr=False


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_lr_find_under_data_parallel_strategies_on_one_process(tmp_path, strategy):
    """The search runs through the strategy's own step: the same curve and suggestion as
    single-device Lightning (Adam), its checkpoint removed. (Under zero3 the module's own tensors
    are shards after a fit, so the restored weights are not compared here.)"""
    pl, zt = _lr_find("pl", tmp_path / "pl", "exponential", opt="adam"), _lr_find(
        "zt", tmp_path / "zt", "exponential", opt="adam", strategy=strategy)
    assert zt["loss"] == pl["loss"] and zt["suggestion"] == pl["suggestion"] and zt["left"] == []
    assert zt["restored"] or strategy == "zero3"


def test_lr_finder_callback_runs_in_the_fit(tmp_path):
    """``LearningRateFinder`` in the callbacks: the search in on_fit_start, then the whole fit
    trains with the suggestion (Lightning's numbers)."""
    def run(name):
        L = _lib(name)
        L.seed_everything(0)
        model = _regression_model(L)()
        finder = L.callbacks.LearningRateFinder(num_training_steps=30)
        trainer = L.Trainer(max_epochs=1, callbacks=[finder], default_root_dir=str(tmp_path / name), **_quiet())
        trainer.fit(model)
        return finder.optimal_lr.results, model.lr, trainer.global_step, {k: v.clone() for k, v in
                                                                         model.state_dict().items()}

    pl, zt = run("pl"), run("zt")
    assert zt[:3] == pl[:3]
    for k, v in pl[3].items():
        assert torch.equal(zt[3][k], v), k


def test_lr_find_refusals():
    import zerotrain as Z
    from zerotrain.tuner import Tuner

    with pytest.raises(ValueError, match="`mode` should be either of"):
        Z.callbacks.LearningRateFinder(mode="cubic")
    trainer = Z.Trainer(callbacks=[Z.callbacks.LearningRateFinder()], **_quiet())
    with pytest.raises(ValueError, match="already configured with a `LearningRateFinder`"):
        Tuner(trainer).lr_find(_regression_model(Z)())
    with pytest.raises(Z.utilities.exceptions.MisconfigurationException, match="method='fit' is the only"):
        Tuner(Z.Trainer(**_quiet())).lr_find(_regression_model(Z)(), method="test")


# ---------------------------------------------------------------------------- scale_batch_size
def _scale(name: str, root, mode: str, max_trials: int, limit: int = 50, init_val: int = 2, dm: bool = False):
    """Tuner.scale_batch_size where a batch larger than ``limit`` 'runs out of memory' (the
    error CUDA raises): the size found, the sizes tried, what was restored."""
    L = _lib(name)
    from importlib import import_module

    Tuner = import_module(f"{L.__name__}.tuner").Tuner
    tried: list[int] = []

    class Model(_regression_model(L)):
        def training_step(self, batch, batch_idx):
            if batch_idx == 0:
                tried.append(len(batch))
            if len(batch) > limit:
                raise RuntimeError("CUDA error: out of memory")
            return super().training_step(batch, batch_idx)

    L.seed_everything(0)
    model = Model()
    model.batch_size = 4
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = L.Trainer(max_epochs=1, default_root_dir=str(root), **_quiet())
    found = Tuner(trainer).scale_batch_size(model, mode=mode, max_trials=max_trials, init_val=init_val,
                                            steps_per_trial=2)
    restored = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    return {"found": found, "attr": model.batch_size, "tried": tried, "restored": restored,
            "step": trainer.global_step, "left": sorted(os.listdir(root))}


@pytest.mark.parametrize("mode, max_trials", [("power", 25), ("power", 3), ("binsearch", 25), ("binsearch", 4)])
def test_scale_batch_size_equals_lightnings(tmp_path, mode, max_trials):
    """The same sizes tried (power: doubling until the 'out of memory', binsearch: then bisecting,
    with the 5 % margin off), the same result set on ``model.batch_size``, the initial weights
    back, no step counted and the checkpoint removed."""
    pl, zt = _scale("pl", tmp_path / "pl", mode, max_trials), _scale("zt", tmp_path / "zt", mode, max_trials)
    # a documented difference: Lightning's first trial still runs the loader of the module's own
    # batch size (4; it requests the loader again only after a trial), ours runs init_val (2)
    assert pl["tried"][0] == 4 and zt["tried"][0] == 2
    assert {**zt, "tried": zt["tried"][1:]} == {**pl, "tried": pl["tried"][1:]}
    assert zt["restored"] and zt["step"] == 0 and zt["left"] == []
    assert zt["found"] == zt["attr"]


def test_scale_batch_size_stops_at_the_dataset_length(tmp_path):
    pl, zt = _scale("pl", tmp_path / "pl", "power", 25, limit=10 ** 6), _scale("zt", tmp_path / "zt", "power", 25,
                                                                                 limit=10 ** 6)
    assert zt["tried"][1:] == pl["tried"][1:] and zt["found"] == pl["found"] == 1024


def test_scale_batch_size_refusals(tmp_path):
    import zerotrain as Z
    from zerotrain.tuner import Tuner

    with pytest.raises(ValueError, match="`mode` should be either of"):
        Z.callbacks.BatchSizeFinder(mode="triple")
    model = _regression_model(Z)()
    with pytest.raises(Z.utilities.exceptions.MisconfigurationException, match="dataloaders passed directly"):
        Tuner(Z.Trainer(default_root_dir=str(tmp_path), **_quiet())).scale_batch_size(
            model, train_dataloaders=model.train_dataloader())
    with pytest.raises(NotImplementedError, match="method='fit'"):
        Tuner(Z.Trainer(**_quiet())).scale_batch_size(model, method="validate")
    del model.batch_size
    with pytest.raises(Z.utilities.exceptions.MisconfigurationException, match="Field batch_size not found"):
        Tuner(Z.Trainer(default_root_dir=str(tmp_path), **_quiet())).scale_batch_size(model)


# ---------------------------------------------------------------------------- found by Lightning's own tests
def test_swa_copy_leaves_the_trainer_out(tmp_path):
    """The average is a copy of the module made without the Trainer (Lightning: no loaders or
    datamodule deep-copied)."""
    import zerotrain as Z
    from zerotrain.demos.boring_classes import BoringModel

    seen = {}

    class Probe(Z.callbacks.StochasticWeightAveraging):
        def setup(self, trainer, pl_module, stage):
            super().setup(trainer, pl_module, stage)
            seen["copy_trainer"] = self._average_model._trainer
            seen["module_trainer"] = pl_module.trainer

    trainer = Z.Trainer(fast_dev_run=True, callbacks=[Probe(swa_lrs=0.01)], default_root_dir=str(tmp_path), **_quiet())
    trainer.fit(BoringModel())
    assert seen == {"copy_trainer": None, "module_trainer": trainer}


def test_swa_resumes_after_swalr_took_over_a_lambda_scheduler(tmp_path):
    """A checkpoint saved after SWA began holds SWALR's scheduler state: resuming with a LambdaLR
    configured loads it into SWALR, not into the LambdaLR (which raised KeyError 'lr_lambdas')."""
    import zerotrain as Z
    from zerotrain.demos.boring_classes import BoringModel

    class Model(BoringModel):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.1)}

    def trainer(epochs):
        return Z.Trainer(max_epochs=epochs, limit_train_batches=2, limit_val_batches=0, default_root_dir=str(tmp_path),
                         callbacks=[Z.callbacks.StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2)],
                         **_quiet())

    first = trainer(3)
    first.fit(Model())
    first.save_checkpoint(str(tmp_path / "swa.ckpt"))
    second = trainer(4)
    second.fit(Model(), ckpt_path=str(tmp_path / "swa.ckpt"))
    swa = second.callbacks[0]
    assert type(second.lr_scheduler_configs[0].scheduler).__name__ == "SWALR" and int(swa.n_averaged) == 3


def test_single_file_checkpoint_with_a_frozen_matrix_loads_back(tmp_path):
    """A frozen 2-D parameter is an extra of the ``.ckpt`` layout: read back whole in its shape
    (was flat: a size mismatch), here through the lr finder's restore with BackboneFinetuning."""
    import zerotrain as Z
    from zerotrain.demos.boring_classes import BoringModel
    from zerotrain.tuner import Tuner

    class Model(BoringModel):
        def __init__(self):
            super().__init__()
            self.backbone = nn.Sequential(nn.Linear(32, 16), nn.ReLU())
            self.layer = nn.Linear(16, 2)
            self.learning_rate = 1e-3

        def forward(self, x):
            return self.layer(self.backbone(x))

        def configure_optimizers(self):
            return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=self.learning_rate)

    model = Model()
    trainer = Z.Trainer(max_epochs=2, callbacks=[Z.callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=1)],
                        default_root_dir=str(tmp_path), **_quiet())
    before = model.backbone[0].weight.clone()
    assert Tuner(trainer).lr_find(model, num_training=5).results["lr"]
    assert torch.equal(model.backbone[0].weight, before)


def test_lr_find_inside_a_running_epoch_as_lightning(tmp_path):
    """A LearningRateFinder run again in on_train_epoch_start (Lightning's fine-tuning recipe): the
    search's max_steps is the global step plus its steps, ``fit_loop.restarting`` stays False and
    the fit goes on to Lightning's step count. (Not its weights: Lightning's running epoch then
    iterates the loader requested after the search, ours the one the epoch started with.)"""
    def run(name):
        L = _lib(name)
        expected = []

        class Model(_regression_model(L)):
            def on_train_batch_start(self, batch, batch_idx):
                expected.append(self.trainer.fit_loop.max_steps)

        class Finder(L.callbacks.LearningRateFinder):
            def on_fit_start(self, trainer, pl_module):
                pass

            def on_train_epoch_start(self, trainer, pl_module):
                if trainer.current_epoch in (0, 1):
                    self.lr_find(trainer, pl_module)
                    assert not trainer.fit_loop.restarting and not trainer.fit_loop.epoch_loop.restarting

        L.seed_everything(0)
        model = Model()
        trainer = L.Trainer(max_epochs=3, limit_train_batches=10, limit_val_batches=0, num_sanity_val_steps=0,
                            callbacks=[Finder(early_stop_threshold=None, num_training_steps=5)],
                            default_root_dir=str(tmp_path / name), **_quiet())
        trainer.fit(model)
        return trainer.global_step, expected

    pl, zt = run("pl"), run("zt")
    assert zt[:2] == pl[:2] and zt[0] == 30


def test_scale_batch_size_leaves_both_loaders_at_the_size_found(tmp_path):
    """As Lightning's: the training and validation loaders are requested again at the size found."""
    def run(name):
        L = _lib(name)
        from importlib import import_module

        L.seed_everything(0)
        model = _regression_model(L)()
        model.batch_size = 16

        def val_dataloader():
            return DataLoader(import_module(f"{L.__name__}.demos.boring_classes").RandomDataset(32, 64),
                              batch_size=model.batch_size)

        model.val_dataloader = val_dataloader
        trainer = L.Trainer(max_epochs=1, default_root_dir=str(tmp_path / name), **_quiet())
        found = import_module(f"{L.__name__}.tuner").Tuner(trainer).scale_batch_size(model, max_trials=2,
                                                                                   steps_per_trial=2, init_val=8)
        return found, trainer.train_dataloader.batch_size, trainer.val_dataloaders.batch_size

    assert run("zt") == run("pl") == (16, 16, 16)


def test_scale_batch_size_refuses_a_trainer_of_several_processes_before_it_starts():
    import zerotrain as Z
    from zerotrain.tuner import Tuner

    trainer = Z.Trainer(devices=2, strategy="ddp", accelerator="cpu", logger=False)
    with pytest.raises(ValueError, match="not supported with distributed strategies"):
        Tuner(trainer).scale_batch_size(_regression_model(Z)())
    with pytest.raises(Z.utilities.exceptions.MisconfigurationException, match="not supported with distributed"):
        Z.callbacks.BatchSizeFinder().setup(trainer, _regression_model(Z)())
