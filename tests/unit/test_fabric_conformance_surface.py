"""Fabric's user-visible surface found by running Lightning Fabric's own tests renamed
(bench/CONFORMANCE.md, "Fabric's own tests"): setup_module alone gives a set-up model, wrapped
objects and non-loaders are refused with Fabric's error types, callbacks get only the keyword
arguments they take, Fabric's setup/step callback hooks, metric tensors logged as numbers, and
all_reduce with Fabric's signature on collections. Where lightning is installed, its Fabric runs
the same calls on one process for comparison."""
from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from zerotrain.fabric import Fabric

pytestmark = pytest.mark.timeout(120)


def _model_and_sgd(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_setup_module_alone_gives_a_set_up_model_and_setup_optimizers_steps_it():
    fabric = Fabric(accelerator="cpu", devices=1)
    model, opt = _model_and_sgd()
    ref, ref_opt = _model_and_sgd()
    wrapped = fabric.setup_module(model, move_to_device=True)
    assert wrapped.module is model and wrapped.device == torch.device("cpu")
    optimizer = fabric.setup_optimizers(opt)
    assert optimizer.optimizer is opt
    x = torch.randn(4, 3)
    fabric.backward(wrapped(x).square().sum())
    optimizer.step()
    ref(x).square().sum().backward()
    ref_opt.step()
    for mine, theirs in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def test_setup_of_the_model_alone_then_setup_optimizers_of_an_optimizer_built_after_it():
    """Fabric's FSDP / ModelParallel order (Lightning's examples/fabric/tensor_parallel):
    ``setup(model)``, the optimizer built on the set-up model's parameters, then
    ``setup_optimizers(optimizer)``; each of two models set up so finds its own optimizer. Before,
    ``setup_optimizers`` said no module was set up."""
    fabric = Fabric(accelerator="cpu", devices=1)
    (a, _), (b, _) = _model_and_sgd(0), _model_and_sgd(1)
    (ref_a, ref_opt_a), (ref_b, ref_opt_b) = _model_and_sgd(0), _model_and_sgd(1)
    wrapped_a, wrapped_b = fabric.setup(a), fabric.setup(b)
    opt_b = fabric.setup_optimizers(torch.optim.SGD(wrapped_b.parameters(), lr=0.1))
    opt_a = fabric.setup_optimizers(torch.optim.SGD(wrapped_a.parameters(), lr=0.1))
    x = torch.randn(4, 3)
    for wrapped, opt, ref, ref_opt in ((wrapped_a, opt_a, ref_a, ref_opt_a), (wrapped_b, opt_b, ref_b, ref_opt_b)):
        fabric.backward(wrapped(x).square().sum())
        opt.step()
        ref(x).square().sum().backward()
        ref_opt.step()
        for mine, theirs in zip(wrapped.parameters(), ref.parameters()):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    with pytest.raises(ValueError, match="no module set up"):  # an optimizer of no set-up model
        fabric.setup_optimizers(torch.optim.SGD(nn.Linear(3, 2).parameters(), lr=0.1))


def test_objects_setup_returned_are_refused_with_fabrics_errors():
    fabric = Fabric(accelerator="cpu", devices=1)
    model, opt = _model_and_sgd()
    wrapped, wrapped_opt = fabric.setup(model, opt)
    with pytest.raises(ValueError, match="A model should be passed only once to the `setup` method"):
        fabric.setup(wrapped, torch.optim.SGD(model.parameters(), lr=0.1))
    other = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="An optimizer should be passed only once to the `setup` method"):
        fabric.setup(other, wrapped_opt)
    loader = fabric.setup_dataloaders(DataLoader(range(4)))
    with pytest.raises(ValueError, match="A dataloader should be passed only once"):
        fabric.setup_dataloaders(loader)
    with pytest.raises(ValueError, match="requires at least one dataloader"):
        fabric.setup_dataloaders()
    with pytest.raises(TypeError, match="Only PyTorch DataLoader are currently supported"):
        fabric.setup_dataloaders(range(2))


def test_call_passes_each_callback_only_the_keyword_arguments_it_takes():
    class Limited:
        def on_epoch(self, epoch):
            self.got = {"epoch": epoch}

    class Open:
        def on_epoch(self, epoch, **kwargs):
            self.got = {"epoch": epoch, **kwargs}

    class NoArgs:
        def on_epoch(self):
            self.got = {}

    class NotCallable:
        on_epoch = 3

    callbacks = [Limited(), Open(), NoArgs(), NotCallable()]
    fabric = Fabric(accelerator="cpu", devices=1, callbacks=callbacks)
    with pytest.warns(UserWarning, match="Skipping the callback `NotCallable.on_epoch`"):
        fabric.call("on_epoch", epoch=2, loss=0.5)
    assert [c.got for c in callbacks[:3]] == [{"epoch": 2}, {"epoch": 2, "loss": 0.5}, {}]


def test_setup_and_optimizer_step_call_fabrics_hooks():
    seen = []

    class Hooks:
        def on_after_setup(self, fabric, module):
            seen.append(("setup", fabric, module))

        def on_after_optimizer_step(self, strategy, optimizer):
            seen.append(("step", strategy, optimizer))

    fabric = Fabric(accelerator="cpu", devices=1, callbacks=[Hooks()])
    model, opt = _model_and_sgd()
    wrapped, optimizer = fabric.setup(model, opt)
    fabric.backward(wrapped(torch.randn(2, 3)).sum())
    optimizer.step()
    assert seen == [("setup", fabric, wrapped), ("step", fabric.strategy, opt)]


def test_log_dict_turns_one_element_tensors_into_numbers_and_refuses_others():
    rows = []

    class Logger:
        def log_metrics(self, metrics, step=None):
            rows.append((metrics, step))

    fabric = Fabric(accelerator="cpu", devices=1, loggers=[Logger()])
    fabric.log("a", torch.tensor([2.0]))
    fabric.log_dict({"b": torch.tensor(3), "c": {"d": torch.tensor([1.5])}}, step=4)
    assert rows == [({"a": 2.0}, None), ({"b": 3, "c": {"d": 1.5}}, 4)]
    assert all(not torch.is_tensor(v) for v in (rows[0][0]["a"], rows[1][0]["b"], rows[1][0]["c"]["d"]))
    with pytest.raises(ValueError, match="cannot be converted to a scalar"):
        fabric.log("e", torch.tensor([1.0, 2.0]))


def _fabric_calls(fabric) -> list:
    data = {"t": torch.tensor([1.0, 3.0]), "n": [2, 0.5, True], "s": "text"}
    out = [fabric.all_reduce(data), fabric.all_reduce(data["t"], reduce_op="sum"), fabric.node_rank]
    fabric.barrier("named")
    return out


def test_all_reduce_takes_fabrics_signature_and_collections_as_fabric():
    mine = _fabric_calls(Fabric(accelerator="cpu", devices=1))
    assert mine[0]["s"] == "text" and mine[2] == 0
    torch.testing.assert_close(mine[1], torch.tensor([1.0, 3.0]))
    assert [v.dtype for v in mine[0]["n"]] == [torch.int32, torch.float32, torch.uint8]
    lightning = pytest.importorskip("lightning.fabric")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = _fabric_calls(lightning.Fabric(accelerator="cpu", devices=1))
    assert type(mine[0]) is type(theirs[0]) and mine[0].keys() == theirs[0].keys() and mine[2] == theirs[2]
    for a, b in zip([mine[0]["t"], *mine[0]["n"], mine[1]], [theirs[0]["t"], *theirs[0]["n"], theirs[1]]):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_launch_refuses_what_is_not_a_function_of_the_fabric():
    fabric = Fabric(accelerator="cpu", devices=1)

    def no_args():
        pass

    with pytest.raises(TypeError, match="needs to take at least one argument"):
        fabric.launch(no_args)
    with pytest.raises(TypeError, match="needs to be a callable"):
        fabric.launch(None)  # fabric.launch(train(fabric)): the result, not the function
    assert fabric.launch(lambda f, x: (f, x), 3) == (fabric, 3)


def test_seed_everything_seeds_the_workers_of_the_loaders_fabric_sets_up(monkeypatch):
    from zerotrain.fabric.utilities.seed import pl_worker_init_function

    monkeypatch.setenv("PL_GLOBAL_SEED", "0")  # restored after the test (seed_everything writes both)
    monkeypatch.setenv("PL_SEED_WORKERS", "0")
    assert Fabric.seed_everything(3) == 3
    loader = Fabric(accelerator="cpu", devices=1).setup_dataloaders(DataLoader(range(4)))
    assert loader.worker_init_fn.func is pl_worker_init_function and loader.worker_init_fn.keywords == {"rank": 0}
    assert os.environ["PL_SEED_WORKERS"] == "1"


def test_load_of_a_plain_file_and_load_raw(tmp_path):
    torch.manual_seed(0)
    saved = nn.Linear(3, 2)
    torch.save({"model": saved.state_dict(), "step": 7}, tmp_path / "ckpt.pt")
    torch.save(saved.state_dict(), tmp_path / "raw.pt")
    fabric = Fabric(accelerator="cpu", devices=1)
    assert fabric.load(tmp_path / "ckpt.pt")["step"] == 7  # no state: the whole dict
    state = {"model": nn.Linear(3, 2)}
    assert fabric.load(tmp_path / "ckpt.pt", state, weights_only=False) == {"step": 7}
    torch.testing.assert_close(state["model"].weight, saved.weight, rtol=0, atol=0)
    model, opt = _model_and_sgd(1)
    wrapped, _ = fabric.setup(model, opt)
    fabric.load_raw(tmp_path / "raw.pt", wrapped)
    torch.testing.assert_close(model.weight, saved.weight, rtol=0, atol=0)
