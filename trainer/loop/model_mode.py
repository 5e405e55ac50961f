"""The model's train/eval mode around an evaluation, as Lightning's loops switch it: the mode of
every submodule is noted, the module's ``on_<stage>_model_eval`` hook switches it to eval (by
default ``trainer.model.eval()``), and at the end the noted modes are put back - or, where the
module overrides ``on_<stage>_model_train``, that hook runs instead. So a submodule the user froze
in eval mode stays in eval mode after a validation inside ``fit``."""
from __future__ import annotations

from typing import Any

from .signature import overridden

#: the evaluation -> (the hook before it, the hook after it; None: the modes are put back)
_HOOKS = {"validate": ("on_validation_model_eval", "on_validation_model_train"),
          "test": ("on_test_model_eval", "on_test_model_train"),
          "predict": ("on_predict_model_eval", None)}


class ModelMode:
    def __init__(self, trainer: Any, fn: str) -> None:
        self.trainer, self.fn = trainer, fn
        self.modes: dict[str, bool] = {}

    def to_eval(self) -> None:
        module = self.trainer.module
        self.modes = {name: m.training for name, m in module.named_modules()}
        self.trainer.hooks.module_hook(_HOOKS[self.fn][0], self.trainer, module)

    def restore(self) -> None:
        from ..api.module import TrainModule

        module, hook = self.trainer.module, _HOOKS[self.fn][1]
        if hook is not None and overridden(module, hook, TrainModule):
            self.trainer.hooks.module_hook(hook, self.trainer, module)
            return
        for name, m in module.named_modules():
            if name in self.modes:  # a submodule made during the evaluation keeps its mode
                m.training = self.modes[name]


def zero_grad_before_validation(trainer: Any) -> None:
    """Lightning's ``on_validation_model_zero_grad`` before a validation inside ``fit`` that falls
    between accumulations (the strategies have released the step's gradients already)."""
    trainer.hooks.module_hook("on_validation_model_zero_grad", trainer, trainer.module)


def warn_modules_in_eval(module: Any) -> None:
    """Lightning's warning when training starts with submodules in eval mode (on rank 0; the
    modes stay as the user set them)."""
    from ..utilities import PossibleUserWarning, rank_zero_warn

    in_eval = [name for name, m in module.named_modules() if not m.training]
    if in_eval:
        rank_zero_warn(f"Found {len(in_eval)} module(s) in eval mode at the start of training. This may lead to "
                       "unexpected behavior during training. If this is intentional, you can ignore this warning.",
                       category=PossibleUserWarning)
