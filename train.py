"""``zerotrain-train`` / ``python -m zerotrain.train``: the Hydra entry point, the application that
trains the demo GPT. Its GPT-specific pieces (the ``model`` group's schema, the model-against-data
checks, building the GPTModule) come from ``examples/gpt_cli.py``: the library never imports
``examples/``, so this file is where the two meet.

Everything that can be wrong with the configuration is checked here, in the first process, before
the Trainer starts any other rank: Hydra rejects unknown options, misspelt keys and wrong types at
compose time (reported in the same one line, see below); ``Config.validate()`` range-checks every
field (see ``trainer/config.py``), the demo's checks relate the model to the data, and building
the strategy, precision and Trainer objects checks the rest. A bad value ends the command with exit code 2 and one line
``zerotrain-train: configuration error: field=value: ...; valid: ...``; what Hydra refuses at
compose time is found by composing the command line once before Hydra's main runs
(``trainer/compose_check.py``), so it reads the same.

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

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .examples import gpt_cli as app  # the demo GPT: the model group's schema, its checks, its module
from .strategies.precision import canonical_precision
from .trainer.compose_check import check_compose, describe, unknown_key
from .trainer.config import Config, build_precision, build_strategy, register_configs
from .trainer.errors import ConfigError

register_configs()
app.register_schema()
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
    """Every field of every section, then the demo's checks of the model against the data and the
    strategy. Raises ConfigError; builds nothing."""
    cfg.validate()
    app.validate(cfg)


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
    return trainer, app.build_module(cfg)


def _save_final(trainer, checkpoint) -> None:
    """``callbacks.save_last``: the state fit ended with is saved (and ``last.ckpt`` links to it)
    when the step trigger did not save it. Collective: every rank calls it."""
    if trainer.global_step > 0 and checkpoint._last_global_step_saved != trainer.global_step:
        metrics = checkpoint._monitor_candidates(trainer)
        checkpoint._save_checkpoint(trainer, checkpoint.format_checkpoint_name(metrics))
        checkpoint._save_last_checkpoint(trainer, metrics)


def run(dcfg: DictConfig) -> None:
    try:
        check_known_keys(dcfg)
        cfg: Config = OmegaConf.to_object(dcfg)  # runs the model schema's __post_init__ checks
        trainer, module = build(cfg)
    except OmegaConfBaseException as exc:  # e.g. an interpolation that cannot be resolved: one line
        _fail(str(describe(exc, sys.argv[1:])))
    except (ConfigError, ValueError) as exc:
        _fail(str(exc))
    if trainer.is_global_zero and "RANK" not in os.environ:
        print(OmegaConf.to_yaml(dcfg), file=sys.stderr)
    trainer.fit(module, ckpt_path=cfg.ckpt_path)
    if cfg.callbacks.save_last and trainer.checkpoint_callback is not None:
        _save_final(trainer, trainer.checkpoint_callback)
    if cfg.sample_tokens:
        text = module.sample(cfg.sample_prompt, max_new_tokens=cfg.sample_tokens)  # every rank: ZeRO-3 gathers
        if trainer.is_global_zero:
            print("\n----- sample -----\n" + text + "\n------------------", flush=True)
    if trainer.is_global_zero:
        m = trainer.callback_metrics
        print(f"done: {trainer.global_step} steps, train_loss {m.get('train_loss', float('nan')):.4f}, "
              f"val_loss {m.get('val_loss', float('nan')):.4f}; logs and checkpoints in {trainer.default_root_dir}",
              flush=True)


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def _hydra_main(dcfg: DictConfig) -> None:
    run(dcfg)


def main() -> None:
    try:
        sys.argv[1:] = normalize_overrides(sys.argv[1:])  # the other ranks re-run this command line
        check_compose(sys.argv[1:], "zerotrain.conf", "config")  # Hydra's compose errors, in one line
    except ConfigError as exc:
        _fail(str(exc))
    _hydra_main()


if __name__ == "__main__":
    main()
