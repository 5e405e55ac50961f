"""A second ``fit`` on the same Trainer (Lightning's way to train on: raise ``max_steps`` and fit
again; what a tuner's ``lr_find`` then ``fit`` does) trains as the same steps run in one fit. The
first fit's teardown releases the ZeRO-1/2 gradient-reduction hooks; without putting them back the
second fit stepped on zero gradients. Exact comparison: the same computation in the same order
(one process here; 2 processes: tests/distributed/test_refit_ranks.py)."""
import pytest
import torch

from test_refit_ranks import Net  # the same model on 2 processes (tests/distributed is on the path)
from zerotrain import Trainer

STRATEGIES = ["single", "zero1", "zero2", "zero3", "offload"]


def trainer(strategy: str, steps: int, **kw) -> Trainer:
    return Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kw)


def weights(t: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in t.full_state_dict().items()}


def assert_same_run(got: tuple[Trainer, Net], want: tuple[Trainer, Net]) -> None:
    """The same losses and final weights, exactly."""
    assert torch.equal(torch.stack(got[1].losses), torch.stack(want[1].losses))
    mine = weights(got[0])
    for k, v in weights(want[0]).items():
        assert torch.equal(mine[k], v), k


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_second_fit_trains_as_one_fit(strategy):
    one, m1 = trainer(strategy, 6), Net()
    one.fit(m1)
    two, m2 = trainer(strategy, 3), Net()
    two.fit(m2)
    two.fit_loop.max_steps = 6  # Lightning: raise the limit, fit again
    two.fit(m2)
    assert two.global_step == 6
    assert_same_run((two, m2), (one, m1))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fit_after_a_tuner_fit_trains(strategy):
    """``lr_find`` runs a fit (and tears it down), restores the model, then the user fits: that
    fit must equal a fit on a fresh Trainer."""
    from zerotrain.tuner import Tuner
    ref, m1 = trainer(strategy, 4), Net()
    ref.fit(m1)
    t, m2 = trainer(strategy, 4), Net()
    Tuner(t).lr_find(m2, num_training=5, update_attr=False)
    m2.losses.clear()
    t.fit(m2)
    assert_same_run((t, m2), (ref, m1))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("second", ["zero3", "single"])
def test_new_trainer_refuses_a_module_partitioned_by_zero3(second):
    """After a zero3 fit the module's parameters are NaN placeholders (the values live in that
    strategy's shards); a new Trainer given the module would train on NaN, so its set-up refuses
    it, naming what to do. The first Trainer still fits on."""
    first, m = trainer("zero3", 2), Net()
    first.fit(m)
    import gc
    with pytest.raises(ValueError, match=r"partitioned by the zero3 strategy of an earlier.*fit again on that Trainer"):
        trainer(second, 4).fit(m)
    gc.collect()  # the refusal holds while the placeholders do, whatever is collected
    with pytest.raises(ValueError, match="partitioned by the zero3 strategy"):
        trainer(second, 4).fit(m)
    first.fit_loop.max_steps = 4
    first.fit(m)
    assert first.global_step == 4


@pytest.mark.timeout(120)
def test_new_trainer_continues_from_a_zero2_fit():
    """ZeRO-1/2 leave the module's parameters whole: a new Trainer continues from the trained weights."""
    first, m = trainer("zero2", 3), Net()
    first.fit(m)
    trained = weights(first)
    second = trainer("zero2", 1)
    second.fit(m)
    assert len(m.losses) == 4
    ref = Net()
    ref.load_state_dict(trained)
    assert torch.equal(ref.training_step(next(iter(ref.train_dataloader())), 0), m.losses[3])
