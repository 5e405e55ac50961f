"""``zerotrain-train`` for the user's own TrainModule and DataModule: the ``model`` and ``data``
sections name what to build with Hydra's ``_target_`` and pass the other keys as its arguments::

    zerotrain-train model._target_=my_pkg.MyModule model.hidden=64 \\
                    data._target_=my_pkg.MyData data.batch_size=8 strategy=zero3 trainer.devices=2

* :func:`target_overrides` rewrites such a command line for Hydra before it composes: a
  ``model._target_=`` with no ``model=`` option selects the empty option ``model=target``
  (``conf/model/target.yaml``), and in a section that is not one of the typed built-in options
  (the demo GPT's sizes, the demo's data), ``model.hidden=64`` becomes ``++model.hidden=64``: the
  keys are the target's arguments, which no schema lists, so each is set or added (Hydra alone
  refuses a key the composed section does not hold yet). An unknown key is then the target's to
  refuse, below.
* :func:`check_target` checks the keys against the target's signature and type hints before
  anything is built or any rank starts, with jsonargparse, as ``LightningCLI`` checks its
  ``--model.*`` arguments: a wrongly typed value, a missing required argument and an unknown key
  each end the command with one line naming the key, the value and what is expected (exit code 2).
  A nested section with its own ``_target_`` (``model.model.config._target_=...``) is checked too.
* :func:`build_target` instantiates through ``hydra.utils.instantiate``. A target with a
  ``cli_config`` parameter (the demo GPT's ``zerotrain.examples.gpt_cli.cli_module``) is called with
  the whole composed config instead of the section's keys.
"""
from __future__ import annotations

import inspect
import re
from typing import Any, Iterable, Mapping, Sequence

from .compose_check import _override_value, unknown_key
from ..errors import ConfigError

#: the sections whose ``_target_`` names a user object, and each one's option with no keys
GROUPS = ("model", "data")
EMPTY_OPTION = "target"
#: Hydra's own keys in a ``_target_`` section, not arguments of the target
_HYDRA_KEYS = ("_target_", "_recursive_", "_convert_", "_partial_", "_args_")


def target_overrides(overrides: Sequence[str], typed: Mapping[str, Iterable[str]]) -> list[str]:
    """The command line for Hydra: ``typed`` maps each group of :data:`GROUPS` to its built-in
    options that have a schema (the first is the default). See the module's docstring."""
    out = list(overrides)
    for group in GROUPS:
        options = list(typed.get(group, ()))
        choice = _override_value(out, group)  # the group's option on the command line
        sets_target = any(a.partition("=")[0].lstrip("+") == f"{group}._target_" for a in out)
        if choice is None and sets_target:
            out.append(f"{group}={EMPTY_OPTION}")
            choice = EMPTY_OPTION
        if choice is None or choice in options:
            continue  # a typed section: Hydra checks its keys and types while composing
        for i, arg in enumerate(out):
            key = arg.partition("=")[0]
            if "=" in arg and key.lstrip("+").startswith(f"{group}.") and not key.startswith("~"):
                out[i] = "++" + arg.lstrip("+")
    return out


def _locate(section: str, target: Any) -> Any:
    from hydra.utils import _locate as locate

    if not isinstance(target, str) or not target:
        raise ConfigError(f"{section}._target_={target!r}: is not a dotted name; valid: an importable class or "
                          "function, e.g. my_pkg.models.MyModule (its package on PYTHONPATH)")
    try:
        return locate(target)
    except Exception as exc:  # ImportError, AttributeError: Hydra's words, one line
        why = " ".join(str(exc).split())
        raise ConfigError(f"{section}._target_={target!r}: cannot be imported ({why}); valid: an importable "
                          "class or function, e.g. my_pkg.models.MyModule (its package on PYTHONPATH)") from None


def takes_cli_config(obj: Any) -> bool:
    """A target called with the whole composed config (``cli_config=``), not its section's keys."""
    try:
        return "cli_config" in inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return False


def _signature_text(obj: Any, key: str) -> str:
    try:
        param = inspect.signature(obj).parameters[key]
    except (TypeError, ValueError, KeyError):
        return key
    return str(param).replace("'", "")


def _arguments(node: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in node.items() if k not in _HYDRA_KEYS}


def _parser_for(obj: Any, section: str, skip: set[str]):
    """A jsonargparse parser of ``obj``'s arguments under ``section``, or None where jsonargparse is
    missing or cannot read the signature (then only unknown and missing keys are checked)."""
    try:
        from jsonargparse import ArgumentParser
    except ImportError:
        return None
    parser = ArgumentParser(exit_on_error=False)
    try:
        if inspect.isclass(obj):
            parser.add_class_arguments(obj, section, fail_untyped=False, sub_configs=True, skip=skip)
        else:
            parser.add_function_arguments(obj, section, fail_untyped=False, sub_configs=True, skip=skip)
    except Exception:
        return None
    return parser


def _plain_check(obj: Any, section: str, args: Mapping[str, Any]) -> None:
    """Unknown and missing keys from ``inspect.signature`` alone."""
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key, value in args.items():
        if key not in named:
            raise _unknown(obj, section, key, value, named)
    for name in named:
        if params[name].default is inspect.Parameter.empty and name not in args:
            raise _missing(obj, section, name)


def _unknown(obj: Any, section: str, key: str, value: Any, named: Iterable[str]) -> ConfigError:
    err = unknown_key(f"{section}.{key}", value, named)
    return ConfigError(str(err).replace(f"no such key in {section}", f"{_name(obj)} takes no argument {key!r}", 1))


def _missing(obj: Any, section: str, key: str) -> ConfigError:
    return ConfigError(f"{section}.{key}: missing, a required argument of {_name(obj)}; valid: "
                       f"{section}.{key}=<value> ({_signature_text(obj, key)})")


def _name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def check_target(section: str, node: Mapping[str, Any]) -> None:
    """Raise :class:`ConfigError` (one line) where ``node``'s keys do not fit its ``_target_``'s
    signature: an import that fails, an unknown key, a missing required argument, a value of the
    wrong type. Nested sections with a ``_target_`` are checked the same way. Builds nothing."""
    obj = _locate(section, node.get("_target_"))
    if takes_cli_config(obj):
        return
    args = _arguments(node)
    for key, value in args.items():
        if isinstance(value, Mapping) and "_target_" in value:
            check_target(f"{section}.{key}", value)
    plain = {k: v for k, v in args.items() if not (isinstance(v, Mapping) and "_target_" in v)}
    _plain_check(obj, section, args)
    parser = _parser_for(obj, section, set(args) - set(plain))  # nested targets: checked above
    if parser is None:
        return
    known = {a.dest.partition(".")[2] for a in parser._actions if a.dest.startswith(section + ".")}
    try:
        parser.parse_object({section: {k: v for k, v in plain.items() if k in known}},
                            defaults=True)
    except Exception as exc:  # jsonargparse's ArgumentError: several lines -> one
        raise _describe(obj, section, args, str(exc)) from None


def _describe(obj: Any, section: str, args: Mapping[str, Any], text: str) -> ConfigError:
    lines = [" ".join(line.split()) for line in text.strip().splitlines() if line.strip()]
    m = re.search(r'Parser key "([^"]+)"', text)
    if m:
        key = m.group(1).partition(".")[2].split(".")[0]
        why = next((line for line in lines[1:] if line), lines[0] if lines else "invalid")
        return ConfigError(f"{section}.{key}={args.get(key)!r}: {why}; valid: {_signature_text(obj, key)}, "
                           f"as {_name(obj)} takes it")
    m = re.search(r"required: (\S+)", text)
    if m:
        return _missing(obj, section, m.group(1).rstrip(",").partition(".")[2])
    m = re.search(r"does not accept option '([^']+)'", text)
    if m:
        key = m.group(1)
        return _unknown(obj, section, key, args.get(key), inspect.signature(obj).parameters)
    return ConfigError(f"{section}: {' '.join(lines) or 'invalid'}; valid: the arguments of {_name(obj)}")


def build_target(section: str, node: Mapping[str, Any], cli_config: Any = None) -> Any:
    """``hydra.utils.instantiate`` of the section (nested targets first, as Hydra does; plain dicts
    and lists for the target's arguments), or the target called with ``cli_config`` where it takes
    one. A ValueError or TypeError of the user's constructor becomes a one-line ConfigError."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    obj = _locate(section, node.get("_target_"))
    try:
        if takes_cli_config(obj):
            return obj(cli_config=cli_config)
        return instantiate(dict(node), _convert_="all")
    except ConfigError:
        raise
    except (InstantiationException, ValueError, TypeError) as exc:
        cause = exc.__cause__ if isinstance(exc, InstantiationException) and exc.__cause__ else exc
        why = " ".join(str(cause).split())
        raise ConfigError(f"{section}._target_={node.get('_target_')!r}: {type(cause).__name__}: {why}; valid: "
                          f"the arguments {_name(obj)} accepts") from None


def is_target(node: Any) -> bool:
    """A section that names its own ``_target_`` (a dict after ``OmegaConf.to_object``)."""
    return isinstance(node, Mapping) and "_target_" in node
