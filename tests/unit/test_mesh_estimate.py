"""The mesh estimate (issue 45; strategies/memory/mesh.py, ``zerotrain-estimate --tensor-parallel
--sequence-parallel --stages``): the demo GPT's split by its tensor plan, per-rank model states on a
data x sequence x tensor x pipeline mesh, the activations autograd saves (exact in fp32 against
``SavedActivations``), one-line refusals with rc 2, and the ResourceMonitor's mesh line. The
multi-process checks (tp=2, dp=2 x tp=2 under ZeRO-1/2/3, sp=2) are in
tests/distributed/test_mesh_estimate.py."""
from __future__ import annotations

import pytest
import torch

from zerotrain.examples.gpt import GPT, GPTConfig
from zerotrain.strategies.memory.mesh import (ParamSplit, gpt_activation_bytes, gpt_param_split,
                                              mesh_model_states)
from zerotrain.strategies.memory.saved import SavedActivations
from zerotrain.strategies.parallel.tensor_plan import plan_split
from zerotrain.strategies.zero.estimate import gpt_num_params, main

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("bias", [False, True])
def test_gpt_split_is_the_plans_split_of_the_real_model(bias):
    cfg = GPTConfig(vocab_size=48, block_size=24, n_layer=3, n_head=4, n_embd=16, bias=bias)
    split = gpt_param_split(3, 16, 48, 24, bias=bias)
    assert (split.sharded, split.replicated) == plan_split(GPT(cfg))
    assert split.total == gpt_num_params(3, 16, 48, 24, bias=bias) == sum(p.numel() for p in GPT(cfg).parameters())


def test_mesh_states_divide_by_the_axes():
    split = ParamSplit(sharded=1000, replicated=24)
    whole = mesh_model_states(split, precision="32")
    tp2 = mesh_model_states(split, tensor=2, precision="32")
    assert whole["ddp"].params == 4 * 1024 and tp2["ddp"].params == 4 * (500 + 24)  # only the cut part halves
    # ZeRO partitions over data x sequence (the replicas): 2 x 2 = 4 ranks
    dp_sp = mesh_model_states(split, data=2, sequence=2, tensor=2, precision="32")
    assert dp_sp["zero3"].params == 4 * 524 // 4 and dp_sp["zero1"].optimizer == 8 * 524 // 4
    assert mesh_model_states(split, stages=2, precision="32")["ddp"].params == 4 * 512
    with pytest.raises(ValueError, match="tensor=0"):
        mesh_model_states(split, tensor=0)


@pytest.mark.parametrize("shape", [dict(batch=2, seq=16, n_layer=1, n_embd=16, n_head=4, vocab_size=32),
                                   dict(batch=3, seq=8, n_layer=2, n_embd=32, n_head=8, vocab_size=40)])
def test_activation_term_is_what_autograd_saves(shape):
    """fp32, one process: the formula equals the distinct storages saved for backward, exactly."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=shape["vocab_size"], block_size=32, n_layer=shape["n_layer"],
                          n_head=shape["n_head"], n_embd=shape["n_embd"]))
    ids, targets = torch.randint(0, shape["vocab_size"], (2, shape["batch"], shape["seq"]))
    with SavedActivations(model) as saved:
        model(ids, targets)
    assert saved.bytes == gpt_activation_bytes(**shape)
    # the sequence axis divides the tokens; the Ulysses exchange adds one C per token and layer
    half = gpt_activation_bytes(**shape, sequence=2)
    assert half < saved.bytes / 2 * 1.1


def test_command_prints_the_mesh_table(capsys):
    assert main(["--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--vocab-size", "64", "--block-size", "32",
                 "--world-size", "4", "--tensor-parallel", "2", "--precision", "32"]) == 0
    out = capsys.readouterr().out
    rows = {r.split()[2]: r.split() for r in out.splitlines() if r.split()[:2] == ["4", "2x1x2x1"]}
    assert list(rows) == ["ddp", "zero1", "zero2", "zero3"]
    split = gpt_param_split(2, 64, 64, 32)
    want = mesh_model_states(split, data=2, tensor=2, precision="32")["zero3"].params
    assert " ".join(rows["zero3"][3:5]) == f"{want / 1024:.2f} KiB"


@pytest.mark.parametrize("argv,field", [
    (["--tensor-parallel", "3"], "--tensor-parallel=3"),
    (["--world-size", "6", "--tensor-parallel", "4"], "--world-size=6"),
    (["--sequence-parallel", "0"], "--sequence-parallel='0'"),
    (["--sequence-parallel", "8"], "--sequence-parallel=8"),
    (["--stages", "2", "--sequence-parallel", "2"], "--sequence-parallel=2"),
    (["--tensor-parallel", "2", "--seq-len", "64"], "--seq-len=64"),
    (["--tp-sequence-parallel"], "--tp-sequence-parallel"),
])
def test_bad_mesh_input_is_refused_in_one_line(capsys, argv, field):
    base = ["--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--vocab-size", "64", "--block-size", "32",
            "--world-size", "8"]
    with pytest.raises(SystemExit) as exc:
        main(base + argv)
    err = capsys.readouterr()
    assert exc.value.code == 2 and err.out == ""
    assert len(err.err.strip().splitlines()) == 1 and field in err.err and "valid" in err.err


def test_the_sequence_parallel_variant_cuts_every_layer_activation_by_the_tensor_axis():
    """tp=2 with norms on sequence shards and column-parallel layers keeping their input's chunk:
    the per-layer 4C + 4 and the final norm's 2C + 2, whole under plain tp, halve too."""
    shape = dict(batch=2, seq=16, n_layer=3, n_embd=16, n_head=4, vocab_size=32, tensor=2, loss=False)
    plain, variant = gpt_activation_bytes(**shape), gpt_activation_bytes(**shape, tensor_sequence=True)
    assert plain - variant == 2 * 16 * 4 * (3 * (4 * 16 + 4) + (2 * 16 + 2)) // 2
    assert gpt_activation_bytes(**{**shape, "tensor": 1}, tensor_sequence=True) == gpt_activation_bytes(
        **{**shape, "tensor": 1})


def test_num_params_needs_the_cut_count_for_a_tensor_axis(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--num-params", "1e6", "--world-size", "2", "--tensor-parallel", "2"])
    assert exc.value.code == 2 and "--sharded-params" in capsys.readouterr().err
    assert main(["--num-params", "1e6", "--sharded-params", "8e5", "--world-size", "2", "--tensor-parallel", "2"]) == 0
    assert "800,000 cut by the tensor plan" in capsys.readouterr().out


def test_resource_monitor_reports_the_mesh_and_the_parameter_estimate(capsys):
    from torch.utils.data import DataLoader, TensorDataset

    from zerotrain import Trainer, TrainModule
    from zerotrain.callbacks import ResourceMonitor

    class Module(TrainModule):
        def __init__(self):
            super().__init__()
            self.gpt = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=8))

        def training_step(self, batch, batch_idx):
            return self.gpt(batch[0], batch[0])[1]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randint(0, 32, (4, 8))), batch_size=2)

    monitor = ResourceMonitor(warmup_steps=0)
    Trainer(max_steps=2, callbacks=[monitor], logger=False, enable_checkpointing=False, enable_progress_bar=False,
            precision="32").fit(Module())
    want = 4 * gpt_param_split(1, 8, 32, 16, bias=False).total
    assert monitor.mesh == {"mesh": {"data": 1, "sequence": 1, "tensor": 1, "stages": 1},
                            "params_measured": want, "params_estimate": want}
    assert monitor.summary["mesh"] == monitor.mesh["mesh"]
    assert "mesh data=1 x sequence=1 x tensor=1 x stages=1; parameter MiB per rank" in capsys.readouterr().out
