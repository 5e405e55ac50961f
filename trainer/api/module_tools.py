"""What a TrainModule does outside training, as Lightning's ``LightningModule``: ``freeze`` /
``unfreeze`` and export to ONNX (``to_onnx``) or TorchScript (``to_torchscript``)."""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch

from ..compat.imports import package_available


class ModuleTools:
    """Mixed into TrainModule (an ``nn.Module`` with ``example_input_array`` and ``device``)."""

    #: set while TorchScript inspects the module, whose attribute scan reads ``trainer``
    _jit_is_scripting = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """TorchScript compiles no property of the class (``trainer``, ``device``, ``hparams`` ...)."""
        super().__init_subclass__(**kwargs)
        cls.__jit_unused_properties__ = sorted(
            {name for klass in cls.__mro__ for name, value in vars(klass).items() if isinstance(value, property)})

    @contextlib.contextmanager
    def _scripting(self) -> Iterator[None]:
        modules = [m for m in self.modules() if isinstance(m, ModuleTools)]
        for m in modules:
            m._jit_is_scripting = True
        try:
            yield
        finally:
            for m in modules:
                m._jit_is_scripting = False

    def freeze(self) -> Any:
        """No parameter requires a gradient, and the module is in eval mode; returns it."""
        for param in self.parameters():
            param.requires_grad = False
        return self.eval()

    def unfreeze(self) -> Any:
        """Every parameter requires a gradient, and the module is in train mode; returns it."""
        for param in self.parameters():
            param.requires_grad = True
        return self.train()

    def _export_input(self, given: Any, what: str) -> Any:
        """``given`` else ``example_input_array``, on the module's device."""
        sample = self.example_input_array if given is None else given
        if sample is None:
            raise ValueError(f"Could not export to {what} since neither `input_sample` nor "
                             "`model.example_input_array` attribute is set.")
        from ..loop.evaluation import to_device

        return to_device(sample, self.device)

    def to_onnx(self, file_path: "str | os.PathLike | Any" = None, input_sample: Any = None, **kwargs: Any) -> Any:
        """``torch.onnx.export(self, input_sample, file_path, **kwargs)`` (needs the ``onnx``
        package; ``dynamo=True`` also ``onnxscript``); ``input_sample`` defaults to
        ``example_input_array``. The train/eval mode is put back after."""
        if not package_available("onnx"):
            raise ModuleNotFoundError(f"`{type(self).__name__}.to_onnx()` requires `onnx` to be installed "
                                      "(pip install onnx).")
        if kwargs.get("dynamo", False) and not package_available("onnxscript"):
            raise ModuleNotFoundError(f"`{type(self).__name__}.to_onnx(dynamo=True)` requires `onnxscript` "
                                      "to be installed (pip install onnxscript).")
        was_training = self.training
        sample = self._export_input(input_sample, "ONNX")
        try:
            return torch.onnx.export(self, sample, os.fspath(file_path) if isinstance(file_path, os.PathLike)
                                     else file_path, **kwargs)
        finally:
            self.train(was_training)

    @torch.no_grad()
    def to_torchscript(self, file_path: "str | os.PathLike | None" = None, method: str | None = "script",
                       example_inputs: Any = None, **kwargs: Any) -> Any:
        """The module (in eval mode) as a ``ScriptModule``: ``method="script"`` compiles it,
        ``"trace"`` traces it on ``example_inputs`` (default ``example_input_array``); saved to
        ``file_path`` when given. The train/eval mode is put back after."""
        if method not in ("script", "trace"):
            raise ValueError(f"The 'method' parameter only supports 'script' or 'trace', but value given was: {method}")
        if method == "trace" and example_inputs is None and self.example_input_array is None:
            raise ValueError("Choosing method=`trace` requires either `example_inputs` or "
                             "`model.example_input_array` to be defined.")
        was_training = self.training
        try:
            with self._scripting():
                if method == "script":
                    scripted = torch.jit.script(self.eval(), **kwargs)
                else:
                    sample = self._export_input(example_inputs, "TorchScript")
                    scripted = torch.jit.trace(func=self.eval(), example_inputs=sample, **kwargs)
        finally:
            self.train(was_training)
        if file_path is not None:
            torch.jit.save(scripted, os.fspath(file_path))
        return scripted
