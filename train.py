"""``zerotrain-train`` / ``python -m zerotrain.train``: the Hydra entry point.

Everything that can be wrong with the configuration is checked here, in the first process, before
the Trainer starts any other rank: Hydra rejects unknown options, misspelt keys and wrong types at
compose time, and building the strategy, precision and Trainer objects checks the values.
"""
from __future__ import annotations

import logging
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from .trainer.config import (Config, build_precision, build_strategy, register_configs, validate_data,
                             validate_optimizer)
from .trainer.errors import ConfigError

register_configs()
log = logging.getLogger("zerotrain")


def build(cfg: Config):
    """Turn a composed config into (trainer, module, config). Raises ConfigError on bad values."""
    from .callbacks import LearningRateMonitor, ModelCheckpoint, TensorBoardLogger, ThroughputMonitor
    from .examples.gpt_module import GPTModule
    from .trainer import Trainer

    validate_data(cfg.data)
    validate_optimizer(cfg.optimizer)
    root = cfg.trainer.default_root_dir or HydraConfig.get().runtime.output_dir
    callbacks = []
    if cfg.trainer.enable_checkpointing:
        callbacks.append(ModelCheckpoint(dirpath=f"{root}/checkpoints", save_last=cfg.callbacks.save_last,
                                         every_n_train_steps=cfg.callbacks.checkpoint_every_n_steps))
    if cfg.callbacks.lr_monitor:
        callbacks.append(LearningRateMonitor())
    if cfg.callbacks.throughput:
        callbacks.append(ThroughputMonitor())
    logger = TensorBoardLogger(f"{root}/tensorboard", version="") if cfg.callbacks.tensorboard else False
    tkw = {k: getattr(cfg.trainer, k) for k in cfg.trainer.__dataclass_fields__ if k != "default_root_dir"}
    try:
        module = GPTModule(config=cfg.model, lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay,
                           betas=tuple(cfg.optimizer.betas), warmup_steps=min(cfg.optimizer.warmup_steps,
                                                                              cfg.trainer.max_steps),
                           max_steps=cfg.trainer.max_steps, min_lr_ratio=cfg.optimizer.min_lr_ratio,
                           batch_size=cfg.data.batch_size, data_path=cfg.data.path, max_bytes=cfg.data.max_bytes,
                           val_fraction=cfg.data.val_fraction, num_workers=cfg.data.num_workers)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    trainer = Trainer(**tkw, strategy=build_strategy(cfg.strategy), precision=build_precision(cfg.precision),
                      callbacks=callbacks, logger=logger, default_root_dir=root)
    return trainer, module


def run(dcfg: DictConfig) -> None:
    try:
        cfg: Config = OmegaConf.to_object(dcfg)  # runs the dataclasses' __post_init__ checks
        trainer, module = build(cfg)
    except (ConfigError, ValueError) as exc:
        print(f"zerotrain-train: configuration error: {exc}", file=sys.stderr)
        sys.exit(2)
    if trainer.is_global_zero and "RANK" not in __import__("os").environ:
        print(OmegaConf.to_yaml(dcfg), file=sys.stderr)
    trainer.fit(module, ckpt_path=cfg.ckpt_path)
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
    _hydra_main()


if __name__ == "__main__":
    main()
