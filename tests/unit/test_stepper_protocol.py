"""The ZeRO strategy's optimizer part is a typed seam (issue 43): ``Stepper`` lists every method the
stage calls, and both steppers implement exactly those, with call shapes the stage can use."""
from __future__ import annotations

import inspect

import pytest

from zerotrain.strategies.offload import OffloadPolicy
from zerotrain.strategies.offload.stepper import OffloadStepper
from zerotrain.strategies.zero import ShardedStepper, ZeroStage2
from zerotrain.strategies.zero.stepper import Stepper

STEPPERS = [ShardedStepper, OffloadStepper]


def _protocol_methods() -> dict[str, inspect.Signature]:
    return {n: inspect.signature(f) for n, f in vars(Stepper).items()
            if inspect.isfunction(f) and not n.startswith("_")}


def test_the_protocol_names_the_stage_calls():
    assert len(_protocol_methods()) >= 20, sorted(_protocol_methods())


@pytest.mark.parametrize("cls", STEPPERS, ids=lambda c: c.__name__)
def test_each_stepper_has_exactly_the_protocol_methods(cls):
    public = {n for n, f in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")}
    assert public == set(_protocol_methods()), (public ^ set(_protocol_methods()))


@pytest.mark.parametrize("cls", STEPPERS, ids=lambda c: c.__name__)
def test_each_stepper_accepts_the_protocol_call_shapes(cls):
    """Every call the stage makes as the protocol declares it (positional) binds to the stepper's
    method: with all the protocol's parameters, and with only its required ones."""
    for name, sig in _protocol_methods().items():
        params = [p for p in sig.parameters.values() if p.name != "self"]
        required = [p for p in params if p.default is inspect.Parameter.empty]
        mine = inspect.signature(getattr(cls, name))
        for given in (params, required):
            mine.bind(None, *[object()] * len(given))


def test_instances_satisfy_the_protocol_and_the_strategy_holds_one():
    offload = OffloadStepper(OffloadPolicy())
    assert isinstance(ShardedStepper(), Stepper) and isinstance(offload, Stepper)
    assert isinstance(ZeroStage2().stepper, Stepper)
    assert ZeroStage2(stepper=offload).stepper is offload
