"""DataModule: the data of a run in one object, as Lightning's ``LightningDataModule``.

The Trainer calls, in each of ``fit`` / ``validate`` / ``test`` / ``predict``, once the processes
are connected and before the model is configured:

1. ``prepare_data()`` on local rank 0 of every node (``prepare_data_per_node = False``: on global
   rank 0 only), while the other ranks wait at a barrier: download or tokenise here, once, and
   assign no state (the other ranks never run it).
2. ``setup(stage)`` on every rank, ``stage`` in ``"fit" | "validate" | "test" | "predict"``:
   split datasets and assign them to ``self`` here.
3. the ``*_dataloader()`` methods the stage needs; their loaders get the Trainer's
   DistributedSampler exactly as the module's own loaders do.

and ``teardown(stage)`` on every rank at the end of the stage.
"""
from __future__ import annotations

import inspect
import os
from functools import partial
from unittest.mock import Mock
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader, Dataset, IterableDataset

from ..errors import MisconfigurationException
from .hparams import DATAMODULE_KEYS, HyperparametersMixin

if TYPE_CHECKING:
    from ..loop.trainer import Trainer


class DataHooks:
    """The four loaders a stage asks for (TrainModule and DataModule both have them, as in
    Lightning); None means "none here". And ``prepare_data``, which the Trainer runs on the
    datamodule and on the module: once per node (``prepare_data_per_node = False``: once)."""

    #: run ``prepare_data`` on local rank 0 of every node (True) or on global rank 0 only (False,
    #: for a file system all nodes share)
    prepare_data_per_node: bool = True

    def prepare_data(self) -> None:
        """Once per node (see the class attribute), before the other ranks go on: download,
        tokenise, write to disk. Do not assign state here: the other ranks never run it."""

    def train_dataloader(self) -> Any:
        """Not implemented here: Lightning's MisconfigurationException (the Trainer asks only
        for the loaders a module or datamodule overrides)."""
        raise _not_implemented("train_dataloader")

    def val_dataloader(self) -> Any:
        raise _not_implemented("val_dataloader")

    def test_dataloader(self) -> Any:
        raise _not_implemented("test_dataloader")

    def predict_dataloader(self) -> Any:
        raise _not_implemented("predict_dataloader")

    # ---- each batch on its way to the device (``trainer/data/batch_transfer.py``)
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Change the batch before it moves to the device; returns it."""
        return batch

    def transfer_batch_to_device(self, batch: Any, device: Any, dataloader_idx: int) -> Any:
        """Move the batch to ``device``: every tensor of a (nested) list, tuple or dict; override
        for a batch of another kind."""
        from ..loop.evaluation import to_device

        return to_device(batch, device)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Change the batch once it is on the device; returns it."""
        return batch


def _not_implemented(hook: str) -> MisconfigurationException:
    return MisconfigurationException(f"`{hook}` must be implemented to be used with the Trainer")


def overrides_hook(owner: Any, hook: str) -> bool:
    """Lightning's ``is_overridden`` for a data hook of ``owner`` (a module or datamodule): its
    class's or its own attribute (``from_datasets``) is another function than the base's no-op,
    seen through ``functools.wraps``/``partial``/``Mock(wraps=...)`` wrappers; None: it gives
    nothing (Lightning's way of switching a loader off)."""
    mine = getattr(owner, hook, None) if owner is not None else None
    mine = getattr(mine, "__wrapped__", mine)
    if isinstance(mine, Mock):
        mine = mine._mock_wraps
    elif isinstance(mine, partial):
        mine = mine.func
    if mine is None:
        return False
    return getattr(mine, "__code__", None) is not getattr(DataHooks, hook).__code__


class DataModule(HyperparametersMixin, DataHooks):
    """Subclass and override what the run needs; every method here is a no-op or returns None.
    ``save_hyperparameters()`` in ``__init__`` as Lightning's (trainer/api/hparams.py): they are
    logged with the module's and stored in checkpoints as ``datamodule_hyper_parameters``."""

    #: Lightning's names of a checkpoint's datamodule hyperparameter keys
    CHECKPOINT_HYPER_PARAMS_KEY, CHECKPOINT_HYPER_PARAMS_NAME, CHECKPOINT_HYPER_PARAMS_TYPE = DATAMODULE_KEYS

    def __init__(self) -> None:
        self.trainer: Trainer | None = None

    def setup(self, stage: str) -> None:
        """On every rank, at the start of ``stage`` ("fit", "validate", "test" or "predict")."""

    def teardown(self, stage: str) -> None:
        """On every rank, at the end of ``stage``."""

    def state_dict(self) -> dict[str, Any]:
        """This datamodule's state for a checkpoint (saved under its class's qualified name, as
        Lightning's); nothing by default."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Given back what ``state_dict`` returned, when ``fit`` resumes from a checkpoint."""

    def on_exception(self, exception: BaseException) -> None:
        """Called when a stage ends in an exception (after the callbacks' ``on_exception``)."""

    def __str__(self) -> str:
        """Lightning's summary of the loaders this datamodule gives (``datamodule_info.py``)."""
        from .datamodule_info import describe_datamodule

        return describe_datamodule(self)

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: "str | os.PathLike", map_location: Any = None,
                             hparams_file: "str | os.PathLike | None" = None, weights_only: bool | None = None,
                             **overrides: Any) -> "DataModule":
        """This class rebuilt from the datamodule hyperparameters a checkpoint saved (updated with
        ``overrides``; ``hparams_file``'s instead when given), as Lightning's."""
        from .from_checkpoint import load_from_checkpoint

        return load_from_checkpoint(cls, checkpoint_path, map_location=map_location, hparams_file=hparams_file,
                                    weights_only=weights_only, **overrides)

    @classmethod
    def from_datasets(cls, train_dataset: Any = None, val_dataset: Any = None, test_dataset: Any = None,
                      predict_dataset: Any = None, batch_size: int = 1, num_workers: int = 0,
                      **datamodule_kwargs: Any) -> "DataModule":
        """Lightning's ``from_datasets``: a datamodule whose loaders wrap the given datasets (each
        a dataset or a list / dict of them) in ``DataLoader(batch_size, num_workers,
        pin_memory=True)``, the training ones shuffled (unless iterable). ``batch_size`` and
        ``num_workers`` also go to ``__init__`` where it takes them; the other keywords always do."""
        def loaders(data: Any, shuffle: bool) -> Any:
            if isinstance(data, Dataset):
                return DataLoader(data, batch_size=batch_size, num_workers=num_workers, pin_memory=True,
                                  shuffle=shuffle and not isinstance(data, IterableDataset))
            if isinstance(data, dict):
                return {key: loaders(value, shuffle) for key, value in data.items()}
            return type(data)(loaders(value, shuffle) for value in data)

        params = inspect.signature(cls.__init__).parameters
        extra = {"batch_size": batch_size, "num_workers": num_workers}
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            extra = {key: value for key, value in extra.items() if key in params}
        datamodule = cls(**datamodule_kwargs, **extra)
        for stage, data in (("train", train_dataset), ("val", val_dataset), ("test", test_dataset),
                            ("predict", predict_dataset)):
            if data is not None:
                setattr(datamodule, f"{stage}_dataloader",
                        lambda data=data, shuffle=stage == "train": loaders(data, shuffle))
        return datamodule
