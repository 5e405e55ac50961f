"""Checks shared by the option dataclasses of every strategy (``ZeroConfig``, ``OffloadPolicy``,
``DDPConfig``, ``PipelineConfig``, ...): each error names the owner, the field, its value and what
is valid."""
from __future__ import annotations

from typing import Any, Mapping, TypeVar

T = TypeVar("T")


def whole_number(owner: str, name: str, value: object, least: int) -> int:
    """``value`` as an int >= ``least``; integral floats (``5e7``, natural for sizes) are accepted."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{owner}: {name}={value!r} must be an integer >= {least}")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{owner}: {name}={value!r} must be a whole number >= {least}")
    if value < least:
        raise ValueError(f"{owner}: {name}={value!r} must be >= {least}; valid: a whole number >= {least}")
    return int(value)


def check_bool(owner: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: {name}={value!r} must be True or False")


def check_choice(owner: str, name: str, value: object, choices: "tuple[str, ...] | Mapping") -> None:
    if value not in choices:
        raise ValueError(f"{owner}: {name}={value!r}; valid choices: {', '.join(choices)}")


def config_from(cls: type[T], config: T | None, options: Mapping[str, Any], owner: str) -> T:
    """A strategy's options: the dataclass given whole (``config=``) or built from keywords, not both;
    an unknown keyword is named with the valid ones."""
    if config is not None:
        if options:
            raise TypeError(f"{owner}: give the options in config= or as keywords, not both "
                            f"(got config and {sorted(options)})")
        return config
    known = cls.__dataclass_fields__  # type: ignore[attr-defined]
    for key, value in options.items():
        if key not in known:
            raise TypeError(f"{owner}: {key}={value!r} is not an option; valid: {', '.join(known)}")
    return cls(**options)


def expose_options(init: Any, *configs: type) -> None:
    """Give ``init`` (a strategy's ``__init__`` taking ``**options``) a signature listing the fields
    of its option dataclasses ``configs`` as keyword-only parameters in place of ``**options``, so
    that introspection - ``help()``, and jsonargparse in ``zerotrain.cli``
    (``--trainer.strategy=DDP --trainer.strategy.bucket_cap_mb=50``) - sees the options the
    constructor accepts. The constructor itself is unchanged (it still checks each option)."""
    import dataclasses
    import inspect
    import typing

    sig = inspect.signature(init)
    params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    names = {p.name for p in params}
    for config in configs:
        try:
            hints = typing.get_type_hints(config)
        except Exception:  # an annotation that does not resolve here: leave the fields untyped
            hints = {}
        for f in dataclasses.fields(config):
            if not f.init or f.name in names:
                continue
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else inspect.Parameter.empty)
            params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                            annotation=hints.get(f.name, inspect.Parameter.empty)))
            names.add(f.name)
    init.__signature__ = sig.replace(parameters=params)
