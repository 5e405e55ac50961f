"""An unshuffled training loader on several ranks: Lightning's DistributedSampler shuffles it anyway,
and zerotrain follows Lightning while saying so (issue 41: "Follow Lightning and keep the warning").
The sampler itself is pinned in test_conformance_examples_basics.py; this pins the warning, and that
a shuffled loader or an evaluation loader gets no such warning."""
from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from zerotrain import Trainer

pytestmark = pytest.mark.timeout(60)

SAID = "the training DataLoader does not shuffle: its DistributedSampler shuffles anyway"


def _two_ranks(monkeypatch) -> Trainer:
    """A one-process Trainer that sees itself as data-parallel rank 0 of 2 (no process group)."""
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    strategy = type(trainer._strategy)
    monkeypatch.setattr(strategy, "data_parallel_world_size", property(lambda s: 2))
    monkeypatch.setattr(strategy, "data_parallel_rank", property(lambda s: 0))
    return trainer


def _warnings(caplog, trainer, stage, shuffle) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zerotrain"):
        loader = trainer._prepare_loader(DataLoader(TensorDataset(torch.arange(8)), batch_size=2, shuffle=shuffle),
                                         stage)
    assert type(loader.sampler).__name__ == "DistributedSampler"
    return [r.getMessage() for r in caplog.records if SAID in r.getMessage()]


def test_an_unshuffled_training_loader_on_several_ranks_is_shuffled_with_a_warning(monkeypatch, caplog):
    trainer = _two_ranks(monkeypatch)
    said = _warnings(caplog, trainer, "fit", shuffle=False)
    assert len(said) == 1 and "use_distributed_sampler=False" in said[0]


def test_no_such_warning_for_a_shuffled_or_an_evaluation_loader(monkeypatch, caplog):
    trainer = _two_ranks(monkeypatch)
    assert _warnings(caplog, trainer, "fit", shuffle=True) == []
    assert _warnings(caplog, trainer, "test", shuffle=False) == []
