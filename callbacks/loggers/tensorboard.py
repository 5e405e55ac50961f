"""TensorBoard logging through torch.utils.tensorboard (real event files), with Lightning's
``TensorBoardLogger`` arguments and layout: ``<save_dir>/<name>/version_<n>[/<sub_dir>]``,
hyperparameters in TensorBoard's HPARAMS tab (with ``hp_metric``) and in ``hparams.yaml``."""
from __future__ import annotations

import os
import warnings
from argparse import Namespace
from typing import Any

from ...trainer.compat.imports import package_available
from ...trainer.api.saving import save_hparams_to_yaml
from ..base import VersionedLogger, rank_zero_experiment

_TENSORBOARD_AVAILABLE = package_available("tensorboard")
_TENSORBOARDX_AVAILABLE = package_available("tensorboardX")


class TensorBoardLogger(VersionedLogger):
    """``TensorBoardLogger(save_dir, name="lightning_logs", version=None, log_graph=False,
    default_hp_metric=True, prefix="", sub_dir=None, **kwargs)``: ``kwargs`` go to the
    ``SummaryWriter``; ``log_graph`` adds the model's graph (from ``example_input_array``) at the
    start of fit; ``default_hp_metric`` logs ``hp_metric=-1`` with the hyperparameters, as
    Lightning, so that TensorBoard's HPARAMS tab lists the run."""

    NAME_HPARAMS_FILE = "hparams.yaml"
    LOGGER_JOIN_CHAR = "-"

    def __init__(self, save_dir: "str | os.PathLike", name: str | None = "lightning_logs",
                 version: int | str | None = None, log_graph: bool = False, default_hp_metric: bool = True,
                 prefix: str = "", sub_dir: "str | os.PathLike | None" = None, **kwargs: Any) -> None:
        super().__init__(os.path.expanduser(os.fspath(save_dir)), name or "", version)
        self._log_graph, self._default_hp_metric, self._prefix = log_graph, default_hp_metric, prefix
        self._sub_dir = None if sub_dir is None else os.fspath(sub_dir)
        self._kwargs = kwargs
        self._experiment = None
        self.hparams: dict[str, Any] = {}

    @property
    def log_dir(self) -> str:
        path = super().log_dir
        if self._sub_dir is not None:
            path = os.path.join(path, self._sub_dir)
        return os.path.expandvars(os.path.expanduser(path))

    @property
    def sub_dir(self) -> str | None:
        return self._sub_dir

    @property
    @rank_zero_experiment
    def experiment(self):
        """The SummaryWriter (Lightning's ``experiment``); a do-nothing stand-in off rank 0."""
        return self.writer

    @property
    def writer(self):
        if self._experiment is None:
            from torch.utils.tensorboard import SummaryWriter
            self._experiment = SummaryWriter(log_dir=self.log_dir, **self._kwargs)
        return self._experiment

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        for name, value in metrics.items():
            name = f"{self._prefix}{self.LOGGER_JOIN_CHAR}{name}" if self._prefix else name
            value = value.item() if hasattr(value, "item") else value
            try:
                if isinstance(value, dict):
                    self.writer.add_scalars(name, value, global_step=step)
                else:
                    self.writer.add_scalar(name, value, global_step=step)
            except Exception as exc:
                raise ValueError(f"\n you tried to log {value} which is currently not supported. Try a dict or a "
                                 "scalar/tensor.") from exc

    def log_hyperparams(self, params: Any = None, metrics: Any = None, step: int | None = None) -> None:
        """Keep ``params`` (a dict, Namespace or None) for ``hparams.yaml`` and write them,
        flattened (``a/b`` for nested dicts; values TensorBoard cannot show as text), to the HPARAMS
        tab with ``metrics`` (default ``{"hp_metric": -1}`` when ``default_hp_metric``)."""
        params = _as_dict(params)
        self.hparams.update(params)
        flat = {k: _shown(v) for k, v in _flatten(params).items()}
        if metrics is None and self._default_hp_metric:
            metrics = {"hp_metric": -1}
        elif metrics is not None and not isinstance(metrics, dict):
            metrics = {"hp_metric": metrics}
        if metrics:
            self.log_metrics(metrics, step)
            from torch.utils.tensorboard.summary import hparams

            writer = self.writer._get_file_writer()
            for summary in hparams(flat, metrics):
                writer.add_summary(summary, step)

    def log_graph(self, model: Any, input_array: Any = None) -> None:
        """With ``log_graph=True``: the model's graph on ``input_array`` (default its
        ``example_input_array``: a tensor or a tuple of forward's arguments)."""
        if not self._log_graph:
            return
        sample = model.example_input_array if input_array is None else input_array
        if sample is None:
            warnings.warn("Could not log computational graph to TensorBoard: The `model.example_input_array` "
                          "attribute is not set or `input_array` was not given.", stacklevel=2)
            return
        import torch

        if not isinstance(sample, (torch.Tensor, tuple)):
            warnings.warn(f"Could not log computational graph to TensorBoard: The `input_array` or "
                          f"`model.example_input_array` has type {type(sample)} which can't be traced by "
                          "TensorBoard. Make the input array a tuple representing the positional arguments to the "
                          "model's `forward()` implementation.", stacklevel=2)
            return
        device = next(model.parameters()).device if any(True for _ in model.parameters()) else None
        if device is not None:
            sample = sample.to(device) if torch.is_tensor(sample) else tuple(
                s.to(device) if torch.is_tensor(s) else s for s in sample)
        scripting = getattr(model, "_scripting", None)
        if scripting is None:
            self.experiment.add_graph(model, sample)
        else:
            with scripting():
                self.experiment.add_graph(model, sample)

    def save(self) -> None:
        """Flush the events (making the writer, and so the run's directory, as Lightning's); write
        ``hparams.yaml`` once (when the run's directory exists and has none)."""
        self.experiment.flush()
        path = os.path.join(self.log_dir, self.NAME_HPARAMS_FILE)
        if os.path.isdir(self.log_dir) and not os.path.isfile(path):
            save_hparams_to_yaml(path, self.hparams)

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (a Trainer holding this logger too): the SummaryWriter is left out and made
        again when next needed, as Lightning's."""
        return {**self.__dict__, "_experiment": None}

    def finalize(self, status: str = "success") -> None:
        if self._experiment is not None:
            self._experiment.flush()
            self._experiment.close()
        if status == "success":
            self.save()
        if self._experiment is not None:
            self._experiment.close()
            self._experiment = None


def _as_dict(params: Any) -> dict:
    if params is None:
        return {}
    if isinstance(params, Namespace):
        return vars(params)
    return dict(params)


def _flatten(params: dict, prefix: str = "") -> dict:
    """Nested dicts (and Namespaces) as ``outer/inner`` keys, in their order (mixed key types too)."""
    flat: dict = {}
    for key, value in params.items():
        name = f"{prefix}/{key}" if prefix else key
        if isinstance(value, Namespace):
            value = vars(value)
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, str(name)))
        else:
            flat[str(name)] = value
    return flat


def _shown(value: Any) -> Any:
    """What TensorBoard's hparams can hold, as Lightning passes it: numbers, strings, bools (a numpy
    scalar as its Python number) and tensors of at most one dimension; anything else as text."""
    import torch

    if hasattr(value, "item") and hasattr(value, "dtype") and getattr(value, "ndim", None) == 0 \
            and not torch.is_tensor(value):
        value = value.item()  # numpy's bool_, integer and floating scalars
    if isinstance(value, (bool, int, float, str)) or (torch.is_tensor(value) and value.ndim <= 1):
        return value
    return str(value)
