"""Names of Lightning's internal objects that Lightning's tests import at module level: its loop
and connector objects, process launchers, XLA classes, the Fabric shim of a module's trainer
(``Closure`` is zerotrain's own: what the ``optimizer_step`` hook gets).
zerotrain runs its loop inside the Trainer and has none of them; each class here exists so that
code importing it loads, and constructing one raises ``NotImplementedError`` saying so. ``_Loop``
(a base that only holds the trainer) and ``_no_grad_context`` (run a loop method under
``torch.no_grad`` or ``torch.inference_mode``) behave as Lightning's, and so does
``UnrepeatedDistributedSampler``."""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch.utils.data import DistributedSampler

from .. import imports as _imports
from ...loop.results_table import print_results


class _Loop:
    """The base of Lightning's loop objects: the trainer it runs in, and whether it is restarting."""

    def __init__(self, trainer: Any) -> None:
        self._restarting = False
        self._loaded_from_state_dict = False
        self.trainer = trainer

    @property
    def restarting(self) -> bool:
        return self._restarting

    def state_dict(self, destination: dict | None = None, prefix: str = "") -> dict:
        return {} if destination is None else destination

    def load_state_dict(self, state_dict: dict, prefix: str = "") -> None:
        self._loaded_from_state_dict = True


def _no_grad_context(loop_run: Callable) -> Callable:
    """A ``_Loop`` method run under ``torch.inference_mode()`` when the loop's ``inference_mode`` is
    true, else under ``torch.no_grad()``; a TypeError on anything but a ``_Loop`` or one without
    ``inference_mode``."""
    @functools.wraps(loop_run)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(self, _Loop):
            raise TypeError(f"`{type(self).__name__}` needs to be a Loop")
        if not hasattr(self, "inference_mode"):
            raise TypeError(f"`{type(self).__name__}.inference_mode` needs to be defined")
        context = torch.inference_mode if self.inference_mode else torch.no_grad
        with context():
            return loop_run(self, *args, **kwargs)

    return run


_LOOP = "its Trainer runs its loop itself"


def _internal(name: str, what: str, base: type = object, why: str = _LOOP) -> type:
    """A class named like Lightning's ``name`` whose construction says zerotrain has none, and why."""
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"{name}: Lightning's {what}; zerotrain has no such object ({why})")

    return type(name, (base,), {"__init__": __init__, "__module__": __name__,
                                "__doc__": f"Lightning's {what}: not provided by zerotrain (importable only)."})


_FitLoop = _internal("_FitLoop", "fit loop object", _Loop)
_TrainingEpochLoop = _internal("_TrainingEpochLoop", "training-epoch loop object", _Loop)
_EvaluationLoop = _internal("_EvaluationLoop", "evaluation loop object", _Loop)
_RICH_AVAILABLE = _imports._RICH_AVAILABLE  # Lightning's tests switch it off here to get the text table


def _print_results(results: list, stage: str) -> None:
    """Lightning's ``_EvaluationLoop._print_results``: ``validate``/``test``'s verbose table."""
    print_results(results, stage, rich=_RICH_AVAILABLE)


_EvaluationLoop._print_results = staticmethod(_print_results)
_PredictionLoop = _internal("_PredictionLoop", "prediction loop object", _Loop)
from ...optim.optimization import Closure  # noqa: E402 - zerotrain's automatic-optimization closure
_BaseProgress = _internal("_BaseProgress", "loop progress counter")
_FxValidator = _internal("_FxValidator", "check of where self.log may be called")
_ResultCollection = _internal("_ResultCollection", "collection of logged results")
_MultiProcessingLauncher = _internal("_MultiProcessingLauncher", "spawn launcher")
_SubprocessScriptLauncher = _internal("_SubprocessScriptLauncher", "script launcher")
_TrainerFabricShim = _internal("_TrainerFabricShim", "trainer stand-in for a module used with Fabric")
SingleDeviceXLAStrategy = _internal("SingleDeviceXLAStrategy", "XLA (TPU) strategy")
XLACheckpointIO = _internal("XLACheckpointIO", "XLA checkpoint IO plugin")
from ...data.predict_indices import IndexBatchSampler as _IndexBatchSamplerWrapper  # noqa: E402 - what predict runs over


class UnrepeatedDistributedSampler(DistributedSampler):
    """A DistributedSampler that pads nothing: rank ``r`` of ``n`` takes the indices ``r, r + n,
    ...`` of the (shuffled) order, so ranks may get one sample fewer and no sample is seen twice."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not hasattr(self.dataset, "__len__"):
            raise TypeError("The given dataset must implement the `__len__` method.")
        self.num_samples = len(range(self.rank, len(self.dataset), self.num_replicas))
        self.total_size = len(self.dataset)

    def __iter__(self):  # type: ignore[override]
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(len(self.dataset), generator=g).tolist()
        else:
            indices = list(range(len(self.dataset)))
        return iter(indices[self.rank:self.total_size:self.num_replicas])
