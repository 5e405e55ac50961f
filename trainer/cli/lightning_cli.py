"""``zerotrain.cli.LightningCLI``: Lightning's command line for a TrainModule / DataModule script,
so that a ``LightningCLI`` script ports by the README's rename.

It parses (jsonargparse, the library Lightning's CLI is built on) the arguments of the Trainer,
the model and the data from their signatures, as ``--trainer.*``, ``--model.*``, ``--data.*``,
from ``--config`` files and the command line, under the subcommands ``fit``, ``validate``,
``test`` and ``predict`` (or none, with ``run=False``); everything is checked before any object
is built, so a bad value ends the program with jsonargparse's message and exit code 2 before any
process starts. Then it seeds, builds the model, the data and the Trainer (with a
``SaveConfigCallback`` that writes the config beside the run), and calls the subcommand's Trainer
method. Lightning's documented hooks (``add_arguments_to_parser``, ``before_<subcommand>`` ...,
``instantiate_classes``, ``configure_optimizers``) are methods of the same names here."""
from __future__ import annotations

import inspect
import os
import sys
import warnings
from functools import partial, update_wrapper
from pathlib import Path
from types import MethodType
from typing import Any, Callable, Union

import torch
import yaml
from jsonargparse import ActionConfigFile, Namespace, class_from_function
from torch.optim import Optimizer

from ...callbacks.base import Callback
from ..api.datamodule import DataModule
from ..checkpoint.directory import load_meta
from ..errors import CheckpointError, ConfigError, MisconfigurationException
from ..api.hparams import HPARAMS_KEY, given_hyperparameters
from ..api.module import TrainModule
from ..loop.trainer import Trainer
from ..utilities import is_overridden, seed_everything
from .parser import (ArgsType, LightningArgumentParser, LRSchedulerTypeTuple, ReduceLROnPlateau, instantiate_class,
                     keep_none, with_class_path)
from .save_config import SaveConfigCallback

#: the import path ``load_from_checkpoint`` finds in the hyperparameters of a module the CLI built
INSTANTIATOR = "zerotrain.cli.instantiate_module"
AUTOMATIC = "AUTOMATIC"


class LightningCLI:
    """Lightning's ``LightningCLI`` over zerotrain's Trainer; the arguments are Lightning's:
    ``model_class`` / ``datamodule_class`` (a class or a function returning one; None: any
    subclass, chosen with ``--model=...`` / ``--data=...``), ``save_config_callback`` and
    ``save_config_kwargs``, ``trainer_class``, ``trainer_defaults`` (Trainer argument defaults;
    its ``callbacks`` are always added), ``seed_everything_default`` (an int, True: a seed is
    chosen, False: no seeding), ``parser_kwargs`` (for every parser, or per subcommand),
    ``parser_class``, ``subclass_mode_model`` / ``subclass_mode_data``, ``args`` (instead of
    ``sys.argv``), ``run`` (False: build the objects, run nothing), ``auto_configure_optimizers``
    (``--optimizer`` / ``--lr_scheduler``) and ``load_from_checkpoint_support``."""

    def __init__(self, model_class: Any = None, datamodule_class: Any = None,
                 save_config_callback: type[SaveConfigCallback] | None = SaveConfigCallback,
                 save_config_kwargs: dict[str, Any] | None = None, trainer_class: Any = Trainer,
                 trainer_defaults: dict[str, Any] | None = None, seed_everything_default: bool | int = True,
                 parser_kwargs: dict[str, Any] | None = None,
                 parser_class: type[LightningArgumentParser] = LightningArgumentParser,
                 subclass_mode_model: bool = False, subclass_mode_data: bool = False, args: ArgsType = None,
                 run: bool = True, auto_configure_optimizers: bool = True,
                 load_from_checkpoint_support: bool = True) -> None:
        self.save_config_callback = save_config_callback
        self.save_config_kwargs = save_config_kwargs or {}
        self.trainer_class = trainer_class
        self.trainer_defaults = trainer_defaults or {}
        self.seed_everything_default = seed_everything_default
        self.parser_kwargs = parser_kwargs or {}
        self.parser_class = parser_class
        self.auto_configure_optimizers = auto_configure_optimizers
        self.model_class = model_class
        self.datamodule_class = datamodule_class
        # what the parser is given: the base classes when none was named (then any subclass goes)
        self._model_class = model_class or TrainModule
        self._datamodule_class = datamodule_class or DataModule
        self.subclass_mode_model = model_class is None or subclass_mode_model
        self.subclass_mode_data = datamodule_class is None or subclass_mode_data

        names = self.subcommands()
        main_kwargs = {k: v for k, v in self.parser_kwargs.items() if k not in names}
        sub_kwargs = {k: v for k, v in self.parser_kwargs.items() if k in names}
        self.setup_parser(run, main_kwargs, sub_kwargs)
        self.parse_arguments(self.parser, args)
        self._parse_ckpt_path()
        self.subcommand = self.config["subcommand"] if run else None
        self._set_seed()
        self._instantiators = self._module_instantiators() if load_from_checkpoint_support else []
        self.before_instantiate_classes()
        self.instantiate_classes()
        self.after_instantiate_classes()
        if self.subcommand is not None:
            self._run_subcommand(self.subcommand)

    # ------------------------------------------------------------------ the parser
    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        """A parser of ``parser_class`` with ``-c/--config``."""
        from ..version import __version__

        kwargs.setdefault("dump_header", [f"zerotrain=={__version__}"])
        parser = self.parser_class(**kwargs)
        parser.add_argument("-c", "--config", action=ActionConfigFile,
                            help="Path to a configuration file in json or yaml format.")
        return parser

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict[str, Any],
                     subparser_kwargs: dict[str, Any]) -> None:
        """``self.parser``: with one sub-parser per subcommand, or (``run=False``) the arguments themselves."""
        self.parser = self.init_parser(**main_kwargs)
        if add_subcommands:
            self._subcommand_method_arguments: dict[str, list[str]] = {}
            self._add_subcommands(self.parser, **subparser_kwargs)
        else:
            self._add_arguments(self.parser)

    def add_default_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """``--seed_everything``."""
        parser.add_argument("--seed_everything", type=Union[bool, int], default=self.seed_everything_default,
                            help="Set to an int to run seed_everything with this value before classes instantiation."
                                 "Set to True to use a random seed.")

    def add_core_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """``--trainer.*`` (with ``trainer_defaults``), ``--model.*`` and ``--data.*``."""
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        parser.set_defaults({f"trainer.{k}": v for k, v in self.trainer_defaults.items() if k != "callbacks"})
        parser.add_lightning_class_args(self._model_class, "model", subclass_mode=self.subclass_mode_model)
        # without a datamodule class the data stays optional: the module may have its own loaders
        parser.add_lightning_class_args(self._datamodule_class, "data", subclass_mode=self.subclass_mode_data,
                                        required=self.datamodule_class is not None)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Override to add arguments or argument links."""

    def _add_arguments(self, parser: LightningArgumentParser) -> None:
        self.add_default_arguments_to_parser(parser)
        self.add_core_arguments_to_parser(parser)
        self.add_arguments_to_parser(parser)
        if self.auto_configure_optimizers:  # unless the user's add_arguments_to_parser added its own
            if not parser._optimizers:
                parser.add_optimizer_args((Optimizer,))
            if not parser._lr_schedulers:
                parser.add_lr_scheduler_args(LRSchedulerTypeTuple)
        self.link_optimizers_and_lr_schedulers(parser)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """The subcommands (Trainer methods) and the arguments of each that the CLI fills itself."""
        return {"fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
                "validate": {"model", "dataloaders", "datamodule"},
                "test": {"model", "dataloaders", "datamodule"},
                "predict": {"model", "dataloaders", "datamodule"}}

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        self._subcommand_parsers: dict[str, LightningArgumentParser] = {}
        group = parser.add_subcommands()
        klass = self.trainer_class if isinstance(self.trainer_class, type) else class_from_function(self.trainer_class)
        for name, skip in self.subcommands().items():
            description = _first_line(getattr(klass, name))
            sub_kwargs = dict(kwargs.get(name, {}))
            sub_kwargs.setdefault("description", description)
            sub = self.init_parser(**sub_kwargs)
            self._add_arguments(sub)
            self._subcommand_method_arguments[name] = sub.add_method_arguments(klass, name, skip=set(skip))
            self._subcommand_parsers[name] = sub
            group.add_subcommand(name, sub, help=description)

    @staticmethod
    def link_optimizers_and_lr_schedulers(parser: LightningArgumentParser) -> None:
        """Link each optimizer / scheduler group with a ``link_to`` key to that key."""
        for key, (classes, link_to) in {**parser._optimizers, **parser._lr_schedulers}.items():
            if link_to == AUTOMATIC:
                continue
            if isinstance(classes, tuple):  # already a class_path + init_args
                parser.link_arguments(key, link_to)
            else:
                parser.link_arguments(key, link_to, compute_fn=partial(with_class_path, classes))

    def _parser(self, subcommand: str | None) -> LightningArgumentParser:
        return self.parser if subcommand is None else self._subcommand_parsers[subcommand]

    # ------------------------------------------------------------------ parsing
    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        """``self.config``: ``args`` (strings, a dict or a Namespace) parsed, else ``sys.argv``."""
        if args is not None and len(sys.argv) > 1:
            warnings.warn(f"LightningCLI's args parameter is meant for running from Python as if from the command "
                          f"line; both were given (sys.argv[1:]={sys.argv[1:]}, args={args}), and args wins",
                          UserWarning, stacklevel=3)
        if isinstance(args, (dict, Namespace)):
            self.config = parser.parse_object(args)
        else:
            self.config = parser.parse_args(args)

    def _parse_ckpt_path(self) -> None:
        """A subcommand's ``--ckpt_path`` checkpoint file: its module hyperparameters become the
        ``model`` config (what the command line gives still wins)."""
        if not self.config.get("subcommand"):
            return
        hparams = _saved_hparams(self.config[self.config.subcommand].get("ckpt_path"))
        hparams.pop("_instantiator", None)
        if not hparams:
            return
        if "_class_path" in hparams:
            hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
        try:
            self.config = self.parser.parse_object({self.config.subcommand: {"model": hparams}}, self.config)
        except SystemExit:
            sys.stderr.write("Parsing of ckpt_path hyperparameters failed!\n")
            raise

    def _set_seed(self) -> None:
        """``seed_everything`` as configured; the seed used is written back into the config."""
        section = self.config[self.subcommand] if self.subcommand else self.config
        seed = section.get("seed_everything")
        if seed is False:
            return
        section["seed_everything"] = seed_everything(None if seed is True else seed, workers=True)

    # ------------------------------------------------------------------ building
    def before_instantiate_classes(self) -> None:
        """Override to run code before the classes are built."""

    def after_instantiate_classes(self) -> None:
        """Override to run code after the classes are built."""

    def instantiate_classes(self) -> None:
        """Build the model, the data and the Trainer (``config_init``, ``model``, ``datamodule``, ``trainer``)."""
        self.config_init = self.parser.instantiate(self.config, instantiators=self._instantiators)
        self.datamodule = self._get(self.config_init, "data")
        self.model = self._get(self.config_init, "model")
        self._add_configure_optimizers_method_to_model(self.subcommand)
        self.trainer = self.instantiate_trainer()

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """A Trainer from the config updated with ``kwargs``, with the configured callbacks."""
        extra = [self._get(self.config_init, key) for key in self._parser(self.subcommand).callback_keys]
        config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        return self._instantiate_trainer(config, extra)

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        if "callbacks" in config:
            given = config["callbacks"]
            merged = [] if given is None else list(given) if isinstance(given, (list, tuple)) else [given]
            merged += callbacks
            defaults = self.trainer_defaults.get("callbacks", [])
            merged += [_built(c) for c in (defaults if isinstance(defaults, list) else [defaults])]
            if self.save_config_callback and not config.get("fast_dev_run", False):
                merged.append(self.save_config_callback(self._parser(self.subcommand),
                                                        self.config.get(str(self.subcommand), self.config),
                                                        **self.save_config_kwargs))
            config["callbacks"] = merged
        else:
            name = getattr(self.trainer_class, "__qualname__", self.trainer_class)
            warnings.warn(f"The `{name}` class does not expose the `callbacks` argument so they will not be included.",
                          UserWarning, stacklevel=3)
        try:
            return self.trainer_class(**config)
        except ConfigError as exc:  # a value of the right type the Trainer refuses: one line, exit code 2
            self._parser(self.subcommand).error(f"--trainer: {exc}")

    def _get(self, config: Namespace, key: str, default: Any = None) -> Any:
        """``config[key]``, inside the subcommand's section when there is one."""
        section = config.get(self.subcommand, config) if self.subcommand else config
        return section.get(key, default)

    # ------------------------------------------------------------------ optimizers
    @staticmethod
    def configure_optimizers(lightning_module: TrainModule, optimizer: Optimizer, lr_scheduler: Any = None) -> Any:
        """What the model's ``configure_optimizers`` returns when ``--optimizer`` is given;
        override to change it."""
        if lr_scheduler is None:
            return optimizer
        if isinstance(lr_scheduler, ReduceLROnPlateau):
            return {"optimizer": optimizer,
                    "lr_scheduler": {"scheduler": lr_scheduler, "monitor": lr_scheduler.monitor}}
        return [optimizer], [lr_scheduler]

    def _add_configure_optimizers_method_to_model(self, subcommand: str | None) -> None:
        """With one ``AUTOMATIC`` optimizer group given (and at most one scheduler group), the
        model's ``configure_optimizers`` becomes ``self.configure_optimizers`` with them built."""
        if not self.auto_configure_optimizers:
            return
        parser = self._parser(subcommand)
        optimizers = _automatic(parser._optimizers, Optimizer)
        schedulers = _automatic(parser._lr_schedulers, LRSchedulerTypeTuple)
        if not optimizers:
            return
        if len(optimizers) > 1 or len(schedulers) > 1:
            raise MisconfigurationException(
                f"`{type(self).__name__}.add_configure_optimizers_method_to_model` expects at most one optimizer and "
                f"one lr_scheduler to be 'AUTOMATIC', but found {optimizers + schedulers}: link the argument groups "
                "(link_to=...) and implement `configure_optimizers` yourself")
        optimizer_init = self._init_of(parser._optimizers, optimizers[0])
        if not optimizer_init:  # the group exists but no optimizer was given
            return
        scheduler_init = self._init_of(parser._lr_schedulers, schedulers[0]) if schedulers else None
        if is_overridden("configure_optimizers", self.model):
            warnings.warn(f"`{type(self.model).__name__}.configure_optimizers` will be overridden by "
                          f"`{type(self).__name__}.configure_optimizers`.", UserWarning, stacklevel=2)
        optimizer = instantiate_class(self.model.parameters(), optimizer_init)
        scheduler = instantiate_class(optimizer, scheduler_init) if scheduler_init else None
        fn = partial(self.configure_optimizers, optimizer=optimizer, lr_scheduler=scheduler)
        update_wrapper(fn, self.configure_optimizers)  # so that is_overridden sees an override
        self.model.configure_optimizers = MethodType(fn, self.model)

    def _init_of(self, register: dict[str, tuple[Any, str]], key: str) -> Any:
        classes = register[key][0]
        init = self._get(self.config_init, key)
        return init if isinstance(classes, tuple) else with_class_path(classes, init)

    # ------------------------------------------------------------------ running
    def _run_subcommand(self, subcommand: str) -> None:
        """``before_<subcommand>``, the subcommand (this class's method of that name, else the
        Trainer's) with its parsed arguments, ``after_<subcommand>``."""
        for hook in (f"before_{subcommand}", None, f"after_{subcommand}"):
            if hook is None:
                run = getattr(self, subcommand, getattr(self.trainer, subcommand))
                run(**self._prepare_subcommand_kwargs(subcommand))
            elif callable(getattr(self, hook, None)):
                getattr(self, hook)()

    def _prepare_subcommand_kwargs(self, subcommand: str) -> dict[str, Any]:
        allowed = self._subcommand_method_arguments[subcommand]
        kwargs = {k: v for k, v in self.config_init[subcommand].items() if k in allowed}
        kwargs["model"] = self.model
        if self.datamodule is not None:
            kwargs["datamodule"] = self.datamodule
        return kwargs

    # ------------------------------------------------------------------ load_from_checkpoint support
    def _module_instantiators(self) -> list[tuple[Callable, type, bool]]:
        """Builders of the model and the data that make their ``save_hyperparameters`` store the
        parsed config, so that ``load_from_checkpoint`` can rebuild nested / injected objects."""
        pairs = [("model", _module_type(self._model_class), self.subclass_mode_model),
                 ("data", _module_type(self._datamodule_class), self.subclass_mode_data)]
        return [(_Instantiator(self, key), cls, sub) for key, cls, sub in pairs if isinstance(cls, type)]

    def _dump_config(self) -> None:
        if hasattr(self, "config_dump"):
            return
        dumped = yaml.safe_load(self.parser.dump(self.config, skip_link_targets=False, format="yaml", **keep_none()))
        self.config_dump = dumped[self.config.subcommand] if "subcommand" in self.config else dumped


class _Instantiator:
    """Builds the ``key`` object (model or data) with the config it was parsed from as the
    hyperparameters its ``save_hyperparameters`` stores."""

    def __init__(self, cli: LightningCLI, key: str) -> None:
        self.cli = cli
        self.key = key

    def __call__(self, class_type: type, *args: Any, applied_instantiation_links: dict, **kwargs: Any) -> Any:
        self.cli._dump_config()
        hparams = dict(self.cli.config_dump.get(self.key) or {})
        if "class_path" in hparams:  # subclass mode: the arguments flat, the class under _class_path
            hparams = {"_class_path": hparams["class_path"], **(hparams.get("init_args") or {}),
                       **(hparams.get("dict_kwargs") or {})}
        prefix = f"{self.key}."
        for target, value in applied_instantiation_links.items():  # values linked at instantiation
            if target.startswith(prefix):
                _set_nested(hparams, target[len(prefix):].removeprefix("init_args."), value)
        with given_hyperparameters(hparams, INSTANTIATOR):
            return class_type(*args, **kwargs)


def instantiate_module(class_type: type, config: dict[str, Any]) -> Any:
    """``class_type`` (or the subclass ``config["_class_path"]`` names) rebuilt from the
    hyperparameters a CLI-built module saved: how ``load_from_checkpoint`` restores it."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    if "_class_path" in config:
        parser.add_subclass_arguments(class_type, "module", fail_untyped=False)
        config = {"class_path": config["_class_path"],
                  "dict_kwargs": {k: v for k, v in config.items() if k != "_class_path"}}
    else:
        parser.add_class_arguments(class_type, "module", fail_untyped=False)
    return parser.instantiate(parser.parse_object({"module": config})).module


def _built(value: Any) -> Any:
    """A callback given in ``trainer_defaults`` as ``{"class_path": ..., "init_args": ...}``, built."""
    if isinstance(value, dict) and "class_path" in value:
        return instantiate_class((), value)
    return value


def _saved_hparams(ckpt_path: Any) -> dict[str, Any]:
    """The module hyperparameters a checkpoint (a ``.ckpt`` file or a sharded directory) holds;
    ``{}`` for anything else (``"last"``, ``"best"``: the Trainer resolves those)."""
    path = Path(ckpt_path) if isinstance(ckpt_path, (str, os.PathLike)) else None
    if path is not None and path.is_file():
        return dict(torch.load(path, weights_only=True, map_location="cpu").get(HPARAMS_KEY) or {})
    if path is not None and path.is_dir():
        try:
            return dict(load_meta(path)[1].get(HPARAMS_KEY) or {})
        except CheckpointError:
            return {}
    return {}


def _automatic(register: dict[str, tuple[Any, str]], base: Any) -> list[str]:
    """The keys of ``register`` linked ``AUTOMATIC`` whose classes derive from ``base``."""
    return [key for key, (classes, link_to) in register.items()
            if link_to == AUTOMATIC and any(issubclass(c, base) for c in (classes if isinstance(classes, tuple)
                                                                          else (classes,)))]


def _first_line(fn: Any) -> str | None:
    """A method's one-line summary (its docstring's first line), for the subcommand help."""
    doc = inspect.getdoc(fn)
    return doc.strip().splitlines()[0] if doc and doc.strip() else None


def _module_type(value: Any) -> type:
    """The class a model / data argument builds: itself, or a function's return annotation."""
    if callable(value) and not isinstance(value, type):
        return inspect.signature(value).return_annotation
    return value


def _set_nested(data: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        data = data[key]
    data[last] = value
