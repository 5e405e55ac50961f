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
