"""The Trainer's data loaders as Lightning's own tests (trainer/test_dataloaders.py) expect them
(issue 41): ``seed_everything`` records Lightning's variables and ``workers=True`` gives a loader
Lightning's worker seeding, a loader with few workers warns as Lightning's, and
``RunningStage.dataloader_prefix``."""
from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
from torch.utils.data import DataLoader

from zerotrain import Trainer, seed_everything
from zerotrain.demos.boring_classes import BoringModel, RandomDataset
from zerotrain.trainer.states import RunningStage


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):  # recorded, so that what seed_everything sets is undone
        monkeypatch.setenv(name, "0")
        monkeypatch.delenv(name)


def _fit(loader, **kw):
    trainer = Trainer(max_steps=1, limit_val_batches=0, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, **kw)
    trainer.fit(BoringModel(), train_dataloaders=loader)
    return trainer


def test_seed_everything_records_lightnings_variables():
    pytest.importorskip("lightning_fabric")
    from lightning_fabric.utilities.seed import seed_everything as theirs

    for workers in (False, True):
        theirs(3, workers=workers, verbose=False)
        want = {k: os.environ[k] for k in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")}
        os.environ.pop("PL_GLOBAL_SEED"), os.environ.pop("PL_SEED_WORKERS")
        seed_everything(3, workers=workers)
        assert {k: os.environ[k] for k in want} == want == {"PL_GLOBAL_SEED": "3", "PL_SEED_WORKERS": str(int(workers))}


def test_workers_true_gives_a_loader_lightnings_worker_seeding():
    loader = DataLoader(RandomDataset(32, 8), batch_size=4)
    seed_everything(1, workers=False)
    _fit(loader)
    assert loader.worker_init_fn is None
    seed_everything(1, workers=True)
    trainer = _fit(loader)
    assert loader.worker_init_fn is not None and loader.worker_init_fn.keywords == {"rank": 0}
    assert trainer.train_dataloader.worker_init_fn is loader.worker_init_fn


@pytest.mark.parametrize("workers, warns", [(0, True), (2, True), (3, False)])
def test_few_workers_warn_as_lightning(workers, warns):
    import warnings

    from zerotrain.trainer.data.loaders import worker_check
    from zerotrain.utilities.warnings import PossibleUserWarning

    loader = DataLoader(RandomDataset(32, 8), batch_size=4, num_workers=workers, persistent_workers=workers > 0)
    with mock.patch("zerotrain.fabric.utilities.data._num_cpus_available", return_value=5), \
            warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        worker_check(loader, "validate", 1)
    hits = [r for r in record if "The 'val_dataloader' does not have many workers" in str(r.message)]
    assert len(hits) == warns
    assert all(issubclass(r.category, PossibleUserWarning) and "num_workers=4" in str(r.message) for r in hits)


def test_the_trainer_checks_its_loaders_workers():
    with mock.patch("zerotrain.fabric.utilities.data._num_cpus_available", return_value=5), \
            pytest.warns(UserWarning, match="The 'train_dataloader' does not have many workers"):
        _fit(DataLoader(RandomDataset(32, 8), batch_size=4))


def test_running_stage_dataloader_prefix_is_lightnings():
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.trainer.states import RunningStage as Theirs

    for stage in Theirs:
        ours = RunningStage(stage.value)
        assert ours.dataloader_prefix == stage.dataloader_prefix and ours.evaluating == stage.evaluating, stage
    assert pl is not None


@pytest.mark.parametrize("options", [{"limit_train_batches": -0.1}, {"limit_val_batches": 1.2},
                                     {"limit_test_batches": 1.2}, {"overfit_batches": -0.1},
                                     {"val_check_interval": 1.2}, {"val_check_interval": -0.1}])
def test_an_out_of_range_limit_says_lightnings_sentence(options):
    from zerotrain.utilities.exceptions import MisconfigurationException

    (name, value), = options.items()
    with pytest.raises(MisconfigurationException, match=f"You have passed invalid value {value} for {name}, it has to "
                                                        r"be in \[0.0, 1.0\] or an int. Trainer: "):
        Trainer(**options)


@pytest.mark.parametrize("value", [-1, "test"])
def test_a_bad_reload_interval_says_lightnings_sentence(value):
    with pytest.raises(ValueError, match=f"`reload_dataloaders_every_n_epochs` should be an int >= 0, got {value}"):
        Trainer(reload_dataloaders_every_n_epochs=value)


def test_test_and_predict_dataloaders_are_the_last_runs():
    model = BoringModel()
    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    assert trainer.test_dataloaders is None and trainer.predict_dataloaders is None
    trainer.test(model, dataloaders=DataLoader(RandomDataset(32, 4)), verbose=False)
    assert isinstance(trainer.test_dataloaders, DataLoader) and len(trainer.test_dataloaders.dataset) == 4
    trainer.predict(model, dataloaders=[DataLoader(RandomDataset(32, 2)), DataLoader(RandomDataset(32, 3))])
    assert [len(d.dataset) for d in trainer.predict_dataloaders] == [2, 3]


def test_an_iterable_dataset_with_a_length_warns_as_lightning():
    from torch.utils.data import IterableDataset

    class WithLen(IterableDataset):
        def __iter__(self):
            return iter(RandomDataset(32, 8))

        def __len__(self):
            return 8

    with pytest.warns(UserWarning, match="Your `IterableDataset` has `__len__` defined."):
        _fit(DataLoader(WithLen(), batch_size=4))


def test_a_negative_fast_dev_run_says_lightnings_sentence():
    with pytest.raises(ValueError, match="fast_dev_run=-1 is not a valid configuration. It should be >= 0."):
        Trainer(fast_dev_run=-1)


# ---------------------------------------------------------------- several training loaders
def _numbered(n, batch_size=2):
    import torch
    from torch.utils.data import TensorDataset

    return DataLoader(TensorDataset(torch.arange(n, dtype=torch.float32)[:, None]), batch_size=batch_size)


def _seen_batches(trainer_cls, base, source, **kw):
    """The batch structure each training_step gets (each tensor by its first value), and the run's
    ``num_training_batches`` / ``train_dataloader``, under ``trainer_cls`` with a ``base`` module."""
    import torch
    from torch.utils._pytree import tree_map

    class Recorder(base):
        def __init__(self):
            super().__init__()
            self.w, self.seen = torch.nn.Linear(1, 1), []

        def training_step(self, batch, batch_idx):
            self.seen.append((batch_idx, tree_map(lambda t: int(t[0, 0]) if torch.is_tensor(t) else t, batch)))
            return self.w(torch.ones(1, 1)).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = trainer_cls(max_epochs=1, limit_val_batches=0, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, **kw)
    model = Recorder()
    trainer.fit(model, train_dataloaders=source())
    return model.seen, trainer.num_training_batches, trainer.train_dataloader


@pytest.mark.parametrize("case", ["list", "dict", "nested", "max_size_cycle", "min_size", "max_size", "limited"])
def test_several_training_loaders_give_lightnings_combined_batches(case):
    """A list/dict of training loaders is Lightning's CombinedLoader(mode='max_size_cycle'); a
    CombinedLoader keeps its mode; training_step gets the combined batch only, limit_train_batches
    limits each loader, and trainer.train_dataloader is the collection (compared with Lightning)."""
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.utilities.combined_loader import CombinedLoader as Theirs

    from zerotrain import TrainModule
    from zerotrain.utilities.combined_loader import CombinedLoader as Ours

    def source(combined):
        def make():
            if case == "list":
                return [_numbered(6), _numbered(2)]
            if case == "nested":
                return {"a": [_numbered(6), _numbered(4)], "b": _numbered(2)}
            if case in ("dict", "limited"):
                return {"a": _numbered(2), "b": _numbered(6)}
            return combined({"a": _numbered(6), "b": _numbered(2, batch_size=1)}, mode=case)
        return make

    kw = {"limit_train_batches": 2} if case == "limited" else {}
    theirs = _seen_batches(pl.Trainer, pl.LightningModule, source(Theirs), **kw)
    ours = _seen_batches(Trainer, TrainModule, source(Ours), **kw)
    assert ours[:2] == theirs[:2]
    assert type(ours[2]) is type(theirs[2]) and len(ours[2]) == len(theirs[2])


def test_a_sequential_combined_training_loader_is_refused_as_lightning():
    from zerotrain.utilities.combined_loader import CombinedLoader

    trainer = Trainer(max_epochs=1, limit_val_batches=0, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r'`_FitLoop` does not support the `CombinedLoader\(mode="sequential"\)` mode. '
                                         r"The available modes are: \['min_size', 'max_size_cycle', 'max_size'\]"):
        trainer.fit(BoringModel(), CombinedLoader([_numbered(4), _numbered(2)], mode="sequential"))
    assert trainer.num_training_batches == 3


# ---------------------------------------------------------------- when fit requests its loaders
def _requests(trainer_cls, base, **kw):
    """Each request of fit's loaders (hook, epoch, sanity checking) and each validation's epoch."""
    import torch

    calls = []

    class Tracker(base):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(1, 1)

        def training_step(self, batch, batch_idx):
            return self.w(batch[0]).sum()

        def validation_step(self, batch, batch_idx):
            if not self.trainer.sanity_checking:
                calls.append(("validation_step", self.current_epoch))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            calls.append(("train_dataloader", self.current_epoch, self.trainer.sanity_checking))
            return _numbered(4)

        def val_dataloader(self):
            calls.append(("val_dataloader", self.current_epoch, self.trainer.sanity_checking))
            return _numbered(4)

    trainer = trainer_cls(max_epochs=6, limit_train_batches=1, limit_val_batches=1, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kw)
    trainer.fit(Tracker())
    return calls


@pytest.mark.parametrize("sanity, every_n, reload", [(2, 1, 0), (0, 3, 4), (2, 3, 4), (2, 2, 1), (0, 2, 2),
                                                     (2, 5, 2)])
def test_fit_requests_its_loaders_when_lightning_does(sanity, every_n, reload):
    """Validation loaders are requested by the sanity check first (before the training loader), else
    at training start in a validating epoch or at the first validation, and again once
    reload_dataloaders_every_n_epochs passed since the last request (a sanity check's request in an
    epoch that does not validate does not count); the training loader at epochs 0, n, 2n, ..."""
    pl = pytest.importorskip("pytorch_lightning")
    from zerotrain import TrainModule

    kw = dict(num_sanity_val_steps=sanity, check_val_every_n_epoch=every_n, reload_dataloaders_every_n_epochs=reload)
    assert _requests(Trainer, TrainModule, **kw) == _requests(pl.Trainer, pl.LightningModule, **kw)


# ---------------------------------------------------------------- loaders without a length
class _NoLen:
    """A loader whose ``__len__`` raises NotImplementedError (or, ``has_len=False``, has none)."""

    def __init__(self, n=4):
        self.loader = _numbered(2 * n)

    def __iter__(self):
        return iter(self.loader)

    def __len__(self):
        raise NotImplementedError


@pytest.mark.parametrize("fn", ["fit", "validate", "test", "predict"])
def test_a_fraction_of_a_loader_without_a_length_is_lightnings_error(fn):
    from zerotrain.utilities.exceptions import MisconfigurationException

    prefix = {"fit": "train", "validate": "val"}.get(fn, fn)
    trainer = Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, **{f"limit_{prefix}_batches": 0.5})
    model = BoringModel()
    loader = _NoLen()
    loader.loader = DataLoader(RandomDataset(32, 8), batch_size=2)
    with pytest.raises(MisconfigurationException, match=rf"IterableDataset`, `Trainer\(limit_{prefix}_batches\)` must "
                                                       rf"be `1.0` or an int. An int specifies `num_{prefix}_batches`"):
        getattr(trainer, fn)(model, loader)


def test_a_len_raising_not_implemented_is_a_loader_without_a_length():
    """As Lightning: the epoch runs until the loader ends (validation after its last batch)."""
    import torch

    from zerotrain import TrainModule

    class M(TrainModule):
        def __init__(self):
            super().__init__()
            self.w, self.val_at = torch.nn.Linear(1, 1), []

        def training_step(self, batch, batch_idx):
            return self.w(batch[0]).sum()

        def validation_step(self, batch, batch_idx):
            if not self.trainer.sanity_checking:
                self.val_at.append(self.global_step)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = M()
    trainer = Trainer(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)
    trainer.fit(model, _NoLen(3), _NoLen(2))
    assert trainer.num_training_batches == float("inf") and trainer.global_step == 6
    assert model.val_at == [3, 3, 6, 6]


# ---------------------------------------------------------------- Trainer(profiler=...)
def test_the_trainers_profiler_times_the_hooks_under_lightnings_names():
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.callbacks import Callback as TheirCallback

    from zerotrain.callbacks import Callback
    from zerotrain.profilers import SimpleProfiler

    def actions(trainer_cls, model, callback):
        trainer = trainer_cls(max_epochs=1, limit_train_batches=2, limit_val_batches=1, logger=False,
                              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                              profiler="simple", callbacks=[callback])
        assert isinstance(trainer.profiler, SimpleProfiler) == (trainer_cls is Trainer)
        trainer.fit(model)
        return set(trainer.profiler.recorded_durations)

    class Cb(Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            pass

    class TheirCb(TheirCallback):
        def on_train_epoch_end(self, trainer, pl_module):
            pass

    from pytorch_lightning.demos.boring_classes import BoringModel as TheirModel

    hooks = ("on_fit_start", "on_train_start", "on_train_epoch_start", "on_train_epoch_end", "on_train_end",
             "on_fit_end")
    want = {f"[LightningModule]{name}.{h}" for name in ("BoringModel",) for h in hooks}
    theirs = actions(pl.Trainer, TheirModel(), TheirCb())
    ours = actions(Trainer, BoringModel(), Cb())
    assert want <= theirs and want <= ours
    assert f"[Callback]{TheirCb.__qualname__}.on_train_epoch_end" in theirs  # a callback's state_key
    assert f"[Callback]{Cb.__qualname__}.on_train_epoch_end" in ours
    profiler = SimpleProfiler()
    assert Trainer(profiler=profiler).profiler is profiler


def test_an_unknown_profiler_is_refused_with_the_choices():
    from zerotrain.trainer.errors import ConfigError

    with pytest.raises(ConfigError, match="profiler='advanced'; valid: None, 'simple', 'pytorch' or a Profiler instance"):
        Trainer(profiler="advanced")


def _loader_draws(trainer_cls, model_cls) -> list:
    """Each loader hook draws from torch's global RNG when it is called: the streams they see."""
    seen = []

    class Drawing(model_cls):
        def train_dataloader(self):
            seen.append(("train", float(torch.rand(1))))
            return super().train_dataloader()

        def val_dataloader(self):
            seen.append(("val", float(torch.rand(1))))
            return super().val_dataloader()

    torch.manual_seed(0)
    trainer_cls(accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=2, limit_val_batches=1,
                logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False).fit(Drawing())
    return seen


def test_the_sanity_checks_loader_request_leaves_the_rng_as_it_was():
    """Lightning requests the validation loader inside its RNG-isolated sanity check, so the
    training loader (its random dataset, its sampler seed) sees the stream the check found."""
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.demos.boring_classes import BoringModel as Theirs

    ours = _loader_draws(Trainer, BoringModel)
    assert ours == _loader_draws(pl.Trainer, Theirs)
    assert [k for k, _ in ours] == ["val", "train"] and ours[0][1] == ours[1][1]
