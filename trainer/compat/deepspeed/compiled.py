"""``DeepSpeedEngine.compile()`` and ``is_compiled``, DeepSpeed 0.19.8's names, on zerotrain's
per-block compilation (``strategies/compile.py``).

DeepSpeed compiles the whole module (``module.compile(backend=..., **compile_kwargs)``), or with
the config's ``compile.deepcompile`` runs its own compiler passes that schedule ZeRO-3's gathers.
Here the engine's strategy compiles each block (ZeRO-3: each unit) and its gathers stay outside the
graphs, under every stage; ``schedule`` (DeepCompile's passes) is refused with the reason.
"""
from __future__ import annotations

from typing import Any

from ....strategies.compile import CompileConfig
from ...errors import ConfigError

#: ``compile_kwargs`` keys that ``torch.compile`` takes besides ``backend``
TORCH_COMPILE_KEYS = ("mode", "fullgraph", "dynamic", "options")


class CompileMethods:
    """Mixed into ``DeepSpeedEngine`` (which holds the zerotrain model wrapper as ``_model``)."""

    _is_compiled = False

    def compile(self, backend: Any = "inductor", compile_kwargs: dict | None = None, schedule: Any = None,
                compiled_autograd_enabled: bool = False) -> None:
        """Compile the model's blocks with ``backend`` and ``compile_kwargs`` (``torch.compile``'s
        ``mode``/``fullgraph``/``dynamic``/``options``; a ``backend`` key there is overridden by the
        argument, as DeepSpeed's). A second call does nothing, as DeepSpeed's."""
        if self._is_compiled:
            return
        if schedule is not None:
            raise ConfigError(f"DeepSpeedEngine.compile: schedule={schedule!r}; valid: None (DeepCompile's "
                              "passes are not run: zerotrain compiles per block, the gathers outside the graphs)")
        if compiled_autograd_enabled:
            raise ConfigError("DeepSpeedEngine.compile: compiled_autograd_enabled=True; valid: False (the "
                              "backward runs through the strategy's autograd hooks)")
        kwargs = dict(compile_kwargs or {})
        kwargs.pop("backend", None)
        unknown = sorted(set(kwargs) - set(TORCH_COMPILE_KEYS))
        if unknown:
            raise ConfigError(f"DeepSpeedEngine.compile: compile_kwargs has {unknown}; valid keys: "
                              f"{', '.join(TORCH_COMPILE_KEYS)}")
        strategy = self._model._strategy
        try:
            strategy.compile = CompileConfig(backend=backend, **kwargs)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"DeepSpeedEngine.{exc}") from None
        strategy.compile_module()
        self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        return self._is_compiled
