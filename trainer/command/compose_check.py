"""The command line's overrides composed before Hydra's ``main`` runs, so that what Hydra refuses at
compose time (an unknown group option, a misspelt key, a wrongly typed value, an override it cannot
parse) ends the command like every other bad value: a :class:`ConfigError` of one line naming the
key, the value and the valid choices (``train.py`` prints it and exits with code 2). Hydra's own
report of these is several lines and exit code 1.

Only the failure path costs more than one extra compose (~0.1 s); ``--multirun`` sweeps are checked
one value at a time.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from typing import Any, Iterable, Optional, Sequence

from ..errors import ConfigError

_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def unknown_key(full_key: str, value: Optional[str], valid: Iterable[str]) -> ConfigError:
    """``section.key[=value]: no such key in section; did you mean ...?; valid keys: ...``: the
    closest valid keys first (difflib), then all of them."""
    valid = sorted(valid)
    section, _, key = full_key.rpartition(".")
    close = difflib.get_close_matches(key, valid, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(f'{section}.{c}' if section else c for c in close)}?" if close else ""
    shown = full_key if value is None else f"{full_key}={value}"
    return ConfigError(f"{shown}: no such key in {section or 'the top level'}{hint}; valid keys: {', '.join(valid)}")


def _expected(schema: Any, key: str) -> Optional[str]:
    """What the schema's field ``key`` takes, in words ("an integer or null"), or None."""
    if not dataclasses.is_dataclass(schema) or key not in {f.name for f in dataclasses.fields(schema)}:
        return None
    try:
        tp = typing.get_type_hints(schema).get(key)
    except Exception:  # an annotation that cannot be resolved: fall back on OmegaConf's words
        return None
    args = typing.get_args(tp)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), None) if optional else tp
    if base not in _TYPE_NAMES:
        return None
    return _TYPE_NAMES[base] + (" or null" if optional else "")


def _first_line(text: str) -> str:
    return " ".join(str(text).strip().splitlines()[0].split()) if str(text).strip() else ""


def _override_value(overrides: Sequence[str], full_key: str) -> Optional[str]:
    for arg in overrides:
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+~") == full_key:
            return value
    return None


def describe(exc: BaseException, overrides: Sequence[str]) -> ConfigError:
    """One line for a compose-time error of Hydra or OmegaConf: key, value, why, valid choices."""
    from hydra.errors import MissingConfigException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    cause = exc.__cause__ if exc.__cause__ is not None else exc
    full_key = getattr(cause, "full_key", None)
    schema = getattr(cause, "object_type", None)
    value = _override_value(overrides, full_key) if full_key else None
    if isinstance(exc, MissingConfigException) and getattr(exc, "options", None) is not None:
        group, _, option = (exc.missing_cfg_file or "").rpartition("/")
        shown = f"{group}={option}" if group else f"config={option}"
        return ConfigError(f"{shown}: no such option; valid: {', '.join(sorted(exc.options))}")
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and full_key and dataclasses.is_dataclass(schema):
        return unknown_key(full_key, value, (f.name for f in dataclasses.fields(schema)))
    if isinstance(cause, ValidationError) and full_key:
        key = getattr(cause, "key", None) or full_key.rpartition(".")[2]
        expected = _expected(schema, key)
        if expected is None:
            return ConfigError(f"{full_key}={value}: {_first_line(cause)}; valid: see zerotrain-train --help")
        default = {f.name: f.default for f in dataclasses.fields(schema)}.get(key)
        shown = str(default).lower() if isinstance(default, bool) else default  # YAML's true/false
        example = f", e.g. {shown} (the default)" if isinstance(default, (int, float, str)) else ""
        return ConfigError(f"{full_key}={value}: is not {expected}; valid: {expected}{example}")
    where = (full_key if value is None else f"{full_key}={value}") + ": " if full_key else ""
    return ConfigError(f"{where}{_first_line(cause) or type(cause).__name__}; valid: see zerotrain-train --help")


def _candidates(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The override lists to compose: the command line, or under ``--multirun`` for a sweep
    (``a=1,2 b=x,y``) each value of each swept key with the other keys at their first value.
    Raises ConfigError naming an override that cannot be parsed."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep, RangeSweep
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    parsed = []
    for arg in overrides:  # one at a time, to name the one that cannot be parsed
        try:
            parsed.append(parser.parse_override(arg))
        except HydraException as exc:
            raise ConfigError(f"{arg}: cannot be parsed ({_first_line(exc)}); valid: key=value, +key=value (add), "
                              "~key (delete), quoted where the value holds ,[]{}()= or spaces") from None
    if not multirun:
        return [overrides]
    first: list[Optional[str]] = []
    sweeps: list[tuple[int, str]] = []
    for i, o in enumerate(parsed):
        if o.is_sweep_override() and isinstance(o.value(), (ChoiceSweep, RangeSweep)):
            values = list(o.sweep_string_iterator())
            if not values:
                first.append(None)
                continue
            first.append(f"{o.get_key_element()}={values[0]}")
            sweeps.extend((i, f"{o.get_key_element()}={v}") for v in values[1:])
        else:
            first.append(None if o.is_sweep_override() else overrides[i])  # glob/interval: Hydra's to expand
    out = [[a for a in first if a is not None]]
    for i, arg in sweeps:
        out.append([a for a in (arg if j == i else b for j, b in enumerate(first)) if a is not None])
    return out


def check_compose(argv: Sequence[str], config_module: str, config_name: str) -> None:
    """Compose ``config_name`` with the overrides on ``argv`` (Hydra's own command line) as Hydra's
    main will; raise ConfigError with one line for what it refuses. ``--config-dir`` (a directory
    ``zerotrain-tune`` wrote) joins the search path; where the command composes nothing, replaces
    the config path or names a directory that does not exist, Hydra's main does the reporting."""
    from hydra import compose, initialize_config_module
    from hydra._internal.utils import get_args_parser

    args, _ = get_args_parser().parse_known_args(list(argv))
    if args.shell_completion or args.config_path or (args.config_dir and not os.path.isdir(args.config_dir)):
        return
    name = args.config_name or config_name
    extra = []
    if args.config_dir and not any(o.lstrip("+").startswith("hydra.searchpath=") for o in args.overrides):
        extra = [f"hydra.searchpath=[file://{os.path.abspath(args.config_dir)}]"]
    for overrides in _candidates(list(args.overrides), args.multirun):
        overrides = overrides + extra
        with initialize_config_module(config_module=config_module, version_base="1.3"):
            try:
                compose(config_name=name, overrides=overrides)
            except Exception as exc:  # Hydra's and OmegaConf's compose-time errors; anything else: Hydra reports it
                from hydra.errors import HydraException
                from omegaconf.errors import OmegaConfBaseException

                if isinstance(exc, (HydraException, OmegaConfBaseException)):
                    raise describe(exc, overrides) from None
                raise
