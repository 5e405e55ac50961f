"""``zerotrain-train`` / ``python -m zerotrain.train``: the Hydra entry point. It trains the user's
own TrainModule (and DataModule), named by ``_target_`` with its arguments as keys::

    zerotrain-train model._target_=my_pkg.MyModule model.hidden=64 data._target_=my_pkg.MyData \
                    strategy=zero3 trainer.devices=2

or a config group of the user's own (``--config-dir my_conf model=my_model``), a Hugging Face causal
LM (``model=llama_tiny``, ``trainer/command/causal_lm.py``), or the demo GPT (the default ``model=gpt_small``,
whose ``_target_`` is ``zerotrain.examples.gpt_cli.cli_module``: the library never imports
``examples/``; Hydra reaches it through that string, as it reaches the user's). Instantiation is
Hydra's (``hydra.utils.instantiate``); ``trainer/command/hydra_target.py`` rewrites the command line so a
target's keys need no ``+``, and checks them against its signature.

Everything that can be wrong with the configuration is checked here, in the first process, before
the Trainer starts any other rank: Hydra rejects unknown options, misspelt keys and wrong types of
the typed sections at compose time (reported in the same one line, see below); ``Config.validate()``
range-checks every field (see ``trainer/command/config.py``), a ``_target_``'s keys are checked against its
signature and type hints (jsonargparse, as ``LightningCLI`` does), the demo's checks relate its GPT
to the data, and building the strategy, precision, Trainer and module objects checks the rest. A bad
value ends the command with exit code 2 and one line
``zerotrain-train: configuration error: field=value: ...; valid: ...``; what Hydra refuses at
compose time is found by composing the command line once before Hydra's main runs
(``trainer/command/compose_check.py``), so it reads the same.

The composed config, resolved, is saved as ``checkpoints/config.yaml`` beside the checkpoints. Under
``--multirun`` each job is its own multi-process run, one after another, in its own folder, and a
table of the jobs (overrides, losses, step time, peak memory) ends the sweep
(``trainer/command/sweep_table.py``).

``precision=`` takes Lightning's names and aliases (16, "16", 16-mixed, bf16, bf16-mixed, bf16-true,
32, 32-true): they are mapped to the config group's option before Hydra sees the command line,
since Hydra would read ``precision=16`` as a number and refuse it as a group option.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .strategies.environment import destroy_default_group
from .strategies.precision import canonical_precision
from .trainer.command import demo_gpt as demo_gpt_cli
from .trainer.command.compose_check import check_compose, describe, unknown_key
from .trainer.command.config import Config, build_precision, build_strategy, register_configs
from .trainer.errors import ConfigError
from .trainer.command.hydra_target import build_target, check_target, is_target, target_overrides

register_configs()
demo_gpt_cli.register_schema()
#: the built-in options of the target groups that have a typed schema (Hydra checks their keys)
TYPED_OPTIONS = {"model": (*demo_gpt_cli.SIZES, *demo_gpt_cli.MOE_SIZES), "data": ("stdlib", "text")}
log = logging.getLogger("zerotrain")

_PRECISION_OVERRIDE = re.compile(r"^(\+{0,2})precision=(.*)$")


def _fail(message: str) -> None:
    print(f"zerotrain-train: configuration error: {message}", file=sys.stderr)
    sys.exit(2)


def normalize_overrides(overrides: list[str]) -> list[str]:
    """The command line with a ``precision=`` alias replaced by its config-group option (quoted,
    so Hydra reads "32" as a name, not a number). Raises ConfigError for an unknown precision."""
    out = []
    for arg in overrides:
        m = _PRECISION_OVERRIDE.match(arg)
        if m and not any(c in m.group(2) for c in "()[]{}$"):  # leave Hydra's sweep functions alone
            names = []
            for value in m.group(2).split(","):  # a --multirun sweep: precision=16,bf16
                value = value.strip()
                if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                    value = value[1:-1]
                try:
                    names.append(f"'{canonical_precision(value)}'")
                except ValueError as exc:
                    raise ConfigError(str(exc)) from None
            arg = f"{m.group(1)}precision={','.join(names)}"
        out.append(arg)
    return out


def check_known_keys(node: DictConfig, path: str = "") -> None:
    """Every key of every typed section is one of its schema's fields. Hydra's ``+key=value``
    adds a key to a typed section without complaint, and building from the schema's fields would
    then drop it (``+trainer.gradient_clip_algorithm=value`` would still clip by norm)."""
    schema = OmegaConf.get_type(node)
    fields = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    for key in node.keys():
        child = node._get_node(key)
        if fields is not None and key not in fields:
            raise unknown_key(f"{path}{key}", None, fields)
        if isinstance(child, DictConfig):
            check_known_keys(child, f"{path}{key}.")


def validate(cfg: Config) -> None:
    """Every field of every section; the keys of a ``_target_`` section against its signature; the
    demo's checks of its GPT against the data and the strategy. Raises ConfigError; builds nothing."""
    cfg.validate()
    for section in ("model", "data"):
        if is_target(getattr(cfg, section)):
            check_target(section, getattr(cfg, section))
    if isinstance(cfg.model, demo_gpt_cli.GPTConfig):
        demo_gpt_cli.validate(cfg)


def build_module(cfg: Config):
    """The TrainModule ``model._target_`` names (the demo's typed schema names one that takes the
    whole config), built right after seeding the RNGs with ``trainer.seed``: a module that draws its
    weights in ``__init__`` gets the same ones on every rank and in every job of a sweep."""
    from .trainer.utilities import seed_rngs

    if cfg.trainer.seed is not None:
        seed_rngs(cfg.trainer.seed)
    node = cfg.model if is_target(cfg.model) else {"_target_": getattr(cfg.model, "_target_", None)}
    return build_target("model", node, cli_config=cfg)


def build_datamodule(cfg: Config):
    """The DataModule ``data._target_`` names, or None (the demo's data options: the module's own)."""
    return build_target("data", cfg.data, cli_config=cfg) if is_target(cfg.data) else None


def build(cfg: Config):
    """Turn a composed config into (trainer, module). Raises ConfigError on bad values; starts nothing."""
    from .callbacks import (FlopsProfiler, LearningRateMonitor, ModelCheckpoint, ResourceMonitor, TensorBoardLogger,
                            ThroughputMonitor)
    from .trainer import Trainer

    validate(cfg)
    root = cfg.trainer.default_root_dir or HydraConfig.get().runtime.output_dir
    strategy, precision = build_strategy(cfg.strategy), build_precision(cfg.precision)
    callbacks = []
    if cfg.trainer.enable_checkpointing:
        # this CLI's layout: every checkpoint kept as step=NNNNNN.ckpt, last.ckpt a link to the newest
        callbacks.append(ModelCheckpoint(dirpath=f"{root}/checkpoints", filename="{step:06d}", save_top_k=-1,
                                         save_last="link" if cfg.callbacks.save_last else False,
                                         every_n_train_steps=cfg.callbacks.checkpoint_every_n_steps))
    if cfg.callbacks.lr_monitor and cfg.callbacks.tensorboard:  # it needs a logger, as Lightning's
        callbacks.append(LearningRateMonitor())
    if cfg.callbacks.throughput:
        callbacks.append(ThroughputMonitor())
    if cfg.callbacks.resources:
        callbacks.append(ResourceMonitor(json_path=cfg.callbacks.resources_json))
    if cfg.callbacks.flops_profile_step is not None:
        callbacks.append(FlopsProfiler(profile_step=cfg.callbacks.flops_profile_step))
    logger = TensorBoardLogger(f"{root}/tensorboard", name="", version="") if cfg.callbacks.tensorboard else False
    tkw = {k: getattr(cfg.trainer, k) for k in cfg.trainer.__dataclass_fields__ if k != "default_root_dir"}
    try:
        trainer = Trainer(**tkw, strategy=strategy, precision=precision, callbacks=callbacks, logger=logger,
                          default_root_dir=root)
    except ConfigError as exc:  # name the CLI key: "Trainer: devices=-1 ..." -> "trainer.devices=-1 ..."
        msg = str(exc)
        raise ConfigError("trainer." + msg[len("Trainer: "):] if msg.startswith("Trainer: ") else msg) from None
    return trainer, build_module(cfg)


def _save_final(trainer, checkpoint) -> None:
    """``callbacks.save_last``: the state fit ended with is saved (and ``last.ckpt`` links to it)
    when the step trigger did not save it. Collective: every rank calls it."""
    if trainer.global_step > 0 and checkpoint._last_global_step_saved != trainer.global_step:
        metrics = checkpoint._monitor_candidates(trainer)
        checkpoint._save_checkpoint(trainer, checkpoint.format_checkpoint_name(metrics))
        checkpoint._save_last_checkpoint(trainer, metrics)


def _config_saver(dcfg: DictConfig):
    """A callback that writes the composed config, resolved, as ``checkpoints/config.yaml`` when
    training starts (global rank 0; after the checkpoint folder's checks, which it would trip):
    a checkpoint's run can be reproduced from what sits beside it."""
    from .callbacks import Callback

    text = OmegaConf.to_yaml(dcfg, resolve=True)

    class SaveComposedConfig(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            checkpoint = trainer.checkpoint_callback
            if trainer.is_global_zero and checkpoint is not None and checkpoint.dirpath:
                os.makedirs(checkpoint.dirpath, exist_ok=True)
                with open(os.path.join(checkpoint.dirpath, "config.yaml"), "w") as f:
                    f.write(text)

    return SaveComposedConfig()


def run(dcfg: DictConfig) -> dict:
    """One training run; returns its numbers for a ``--multirun`` table (global rank 0's)."""
    try:
        cfg = checked_config(dcfg)
        trainer, module = build(cfg)
        datamodule = build_datamodule(cfg)
    except OmegaConfBaseException as exc:  # e.g. an interpolation that cannot be resolved: one line
        _fail(str(describe(exc, sys.argv[1:])))
    except (ConfigError, ValueError) as exc:
        _fail(str(exc))
    if trainer.is_global_zero and "RANK" not in os.environ:
        print(OmegaConf.to_yaml(dcfg), file=sys.stderr)
    trainer.callbacks.append(_config_saver(dcfg))
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        env = dict(os.environ)
        try:
            return _fit(cfg, trainer, module, datamodule)
        finally:  # the next job of the sweep launches its own ranks
            destroy_default_group()
            os.environ.clear()
            os.environ.update(env)
    return _fit(cfg, trainer, module, datamodule)


def _fit(cfg: Config, trainer, module, datamodule) -> dict:
    trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    if cfg.callbacks.save_last and trainer.checkpoint_callback is not None:
        _save_final(trainer, trainer.checkpoint_callback)
    if cfg.sample_tokens and callable(getattr(module, "sample", None)):
        text = module.sample(cfg.sample_prompt, max_new_tokens=cfg.sample_tokens)  # every rank: ZeRO-3 gathers
        if trainer.is_global_zero:
            print("\n----- sample -----\n" + text + "\n------------------", flush=True)
    m = trainer.callback_metrics
    if trainer.is_global_zero:
        print(f"done: {trainer.global_step} steps, train_loss {m.get('train_loss', float('nan')):.4f}, "
              f"val_loss {m.get('val_loss', float('nan')):.4f}; logs and checkpoints in {trainer.default_root_dir}",
              flush=True)
    return run_numbers(trainer)


def run_numbers(trainer) -> dict:
    """The run's logged losses, mean step time and peak memory (the ResourceMonitor's, if on)."""
    from .callbacks import ResourceMonitor

    out = {k: float(v) for k, v in trainer.callback_metrics.items() if k.endswith("loss") and v.numel() == 1}
    out["steps"] = trainer.global_step
    monitor = next((c for c in trainer.callbacks if isinstance(c, ResourceMonitor)), None)
    summary = getattr(monitor, "summary", None) or {}
    if summary.get("ranks"):
        out["step_ms"] = 1e3 * sum(r["step"] for r in summary["ranks"]) / len(summary["ranks"])
    if summary.get("memory"):
        out["peak_gib"] = max(summary["memory"].values()) / 2**30
    return out


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def _hydra_main(dcfg: DictConfig) -> dict:
    return run(dcfg)


def _default_targets(argv: list[str], model: Any, data: Any) -> list[str]:
    """``argv`` with ``model._target_=`` / ``data._target_=`` naming ``model`` / ``data`` (a class
    or function) where the command line picks neither an option nor a target of that group."""
    out = list(argv)
    for group, obj in (("model", model), ("data", data)):
        keys = {a.partition("=")[0].lstrip("+") for a in argv if "=" in a}
        if obj is not None and not keys & {group, f"{group}._target_"}:
            out.append(f"{group}._target_={obj.__module__}.{obj.__qualname__}")
    return out


def hydra_overrides(argv: list[str], model: Any = None, data: Any = None) -> list[str]:
    """The command line as Hydra composes it (``zerotrain-tune`` composes its trials with it too):
    ``model`` / ``data`` as default targets, ``precision=`` aliases as options, a target's keys as
    ``++`` keys (:func:`~zerotrain.trainer.command.hydra_target.target_overrides`). Raises ConfigError."""
    return target_overrides(normalize_overrides(_default_targets(argv, model, data)), TYPED_OPTIONS)


def checked_config(dcfg: DictConfig) -> Config:
    """The composed config as objects, every key and value checked (:func:`validate`); builds nothing."""
    check_known_keys(dcfg)
    cfg: Config = OmegaConf.to_object(dcfg)  # runs the model schema's __post_init__ checks
    validate(cfg)
    return cfg


def main(model: Any = None, data: Any = None) -> None:
    """The command line. From a script of the user's own, ``main(MyModule, MyData)`` makes them the
    default ``model._target_`` / ``data._target_`` (a script's classes are ``__main__.MyModule``:
    the other ranks re-run the script), with the same command line as ``zerotrain-train``::

        if __name__ == "__main__":
            zerotrain.train.main(MyModule, MyData)   # python my_script.py model.hidden=64 strategy=zero3
    """
    try:
        sys.argv[1:] = hydra_overrides(sys.argv[1:], model, data)  # the other ranks re-run this command line
        check_compose(sys.argv[1:], "zerotrain.conf", "config")  # Hydra's compose errors, in one line
    except ConfigError as exc:
        _fail(str(exc))
    _hydra_main()


if __name__ == "__main__":
    main()
