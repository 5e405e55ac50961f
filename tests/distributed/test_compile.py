"""``torch.compile`` under the strategies (``strategies/compile.py``), fp32, 2 real gloo processes.

Each case trains the tiny demo GPT with ``Trainer(compile=...)`` (one compiled region per block)
and is compared with plain eager single-process PyTorch over the same global batches.

# tolerance: no worse than the peer: torch DDP on 2 ranks with the whole DDP module compiled by
# the same backend (what a torch user runs), against the same eager reference
(``tolerance.assert_no_worse_than_peer``, losses and final weights). Compiled graphs are counted:
none is compiled after the first step (no recompilation in steady state).

The ``aot_eager`` cases trace and partition the graphs as inductor does, without generating code
(zero3 and offload in the default suite; the other strategies ``slow``); the inductor cases
generate C++ (minutes on 2 busy cores: ``slow``). Without a working
``torch.compile`` (no C++ compiler for inductor), they skip with the reason.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from harness import init_dist, run_ranks_once
from toy import trainer_batches
from tolerance import assert_no_worse_than_peer, shard
from zerotrain import Callback, Trainer, TrainModule
from zerotrain.examples.gpt import GPT, GPTConfig

STEPS, BS, N, LR = 4, 4, 64, 3e-3
CFG = GPTConfig(vocab_size=37, block_size=12, n_layer=2, n_head=2, n_embd=16)
CASES = ("ddp", "zero1", "zero2", "zero3", "offload", "deepspeed_stage_3_offload")
#: the default suite's spawn (about a minute): the sharded stage and offload; the rest is ``slow``
QUICK = ("zero3", "offload")
QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, num_sanity_val_steps=0)


def tokens(n: int = N, length: int = 12, seed: int = 5) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, CFG.vocab_size, (n, length + 1), generator=g)
    return TensorDataset(x[:, :-1].contiguous(), x[:, 1:].contiguous())


class LM(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = GPT(CFG)

    def training_step(self, batch, batch_idx):
        return self.model(*batch)[1]

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=LR)

    def train_dataloader(self):
        return DataLoader(tokens(), batch_size=BS)


class Record(Callback):
    """Each step's loss (the mean over ranks) and the graphs compiled so far."""

    def __init__(self) -> None:
        self.losses, self.graphs = [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(trainer.strategy.reduce(loss.detach(), "mean")))
        self.graphs.append(trainer.strategy.compile.stats.graphs)


# ---------------------------------------------------------------------------- ranks
def _zerotrain(backend: str, cases: list[str]) -> dict:
    out = {}
    world = int(os.environ["WORLD_SIZE"])
    for case in cases:
        torch._dynamo.reset()  # each case compiles its own graphs (dynamo caches them per function)
        rec = Record()
        trainer = Trainer(strategy=case, devices=world, max_steps=STEPS, seed=0, callbacks=[rec],
                          compile={"backend": backend}, **QUIET)
        trainer.fit(LM())
        out[case] = {"losses": rec.losses, "graphs": rec.graphs, "regions": trainer.strategy.compiled.names,
                     "params": trainer.full_state_dict()}
    return out


def _torch_ddp(backend: str) -> dict:
    """The peer: plain torch DDP, the whole DDP module compiled (DDPOptimizer splits it at the buckets)."""
    rank, world = init_dist()
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(CFG)
    ddp = nn.parallel.DistributedDataParallel(model)
    compiled = torch.compile(ddp, backend=backend)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    data, batches, losses = tokens().tensors, trainer_batches(N, world, BS), []
    for _ in range(STEPS):
        idx = next(batches)
        x, y = shard(tuple(t[idx] for t in data), rank, world)
        loss = compiled(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        torch.distributed.all_reduce(t)
        losses.append(float(t) / world)
    return {"losses": losses, "params": {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}}


def _ranks(backend: str, cases: list[str]) -> dict:
    return {"zerotrain": _zerotrain(backend, cases), "ddp": _torch_ddp(backend)}


def reference() -> dict:
    """Plain eager PyTorch, one process, over the same global batches."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    data, batches, losses = tokens().tensors, trainer_batches(N, 2, BS), []
    for _ in range(STEPS):
        idx = next(batches)
        loss = model(*(t[idx] for t in data))[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "params": {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}}


PROBE = """
import torch
f = torch.compile(lambda x: torch.nn.functional.gelu(x) * 2, backend={backend!r})
x = torch.linspace(-1, 1, 8)
assert torch.allclose(f(x), torch.nn.functional.gelu(x) * 2)
"""


@functools.lru_cache(maxsize=None)
def compile_problem(backend: str) -> str | None:
    """Why ``torch.compile(backend=...)`` cannot run here (None when it can), tried in a process
    of its own (the compiler's worker threads stay out of pytest's)."""
    try:
        proc = subprocess.run([sys.executable, "-c", PROBE.format(backend=backend)], capture_output=True,
                              text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired:
        return f"torch.compile(backend={backend!r}) did not finish a tiny function in 600 s here"
    if proc.returncode:
        return f"torch.compile(backend={backend!r}) does not work here: {proc.stderr.strip()[-300:]}"
    return None


_CACHE: dict = {}


def _results(backend: str, cases: tuple[str, ...], tmp_path_factory) -> tuple[dict, dict, dict]:
    problem = compile_problem(backend)
    if problem:
        pytest.skip(problem)
    ranks = run_ranks_once(_CACHE, (backend, cases), "test_compile:_ranks", 2, tmp_path_factory,
                           timeout=900 if backend == "inductor" else 300, backend=backend, cases=list(cases))
    return ranks[0]["zerotrain"], ranks[0]["ddp"], reference()


def _check(backend: str, case: str, tmp_path_factory, cases: tuple[str, ...] = CASES) -> None:
    got, peer, want = _results(backend, cases, tmp_path_factory)
    run = got[case]
    loss = lambda d: torch.tensor(d["losses"], dtype=torch.float64)  # noqa: E731
    assert_no_worse_than_peer(loss(run), loss(want), loss(peer), what=f"{case} losses ")
    assert_no_worse_than_peer(run["params"], want["params"], peer["params"], what=f"{case} ")
    assert run["graphs"][0] > 0, run["graphs"]  # the blocks were compiled ...
    assert run["graphs"][-1] == run["graphs"][0], run["graphs"]  # ... in the first step only
    assert run["regions"] == ["model.blocks.0", "model.blocks.1"], run["regions"]  # per block


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", QUICK)
def test_compiled_aot_eager_equals_eager(case, tmp_path_factory):
    _check("aot_eager", case, tmp_path_factory, QUICK)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", [c for c in CASES if c not in QUICK])
def test_compiled_aot_eager_equals_eager_other_strategies(case, tmp_path_factory):
    _check("aot_eager", case, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("case", CASES)
def test_compiled_inductor_equals_eager(case, tmp_path_factory):
    _check("inductor", case, tmp_path_factory)


def _pipeline(compile_: dict | None) -> dict:
    from zerotrain.examples.gpt import lm_loss
    from zerotrain.strategies.pipeline import PipelineModule, PipelineStrategy
    import dataclasses

    class PipeLM(LM):
        def configure_model(self) -> None:
            if self.model is None:
                self.model = GPT(dataclasses.replace(CFG, n_layer=4))

        def to_pipeline(self, num_stages: int):
            if not isinstance(self.model, PipelineModule):
                self.model = PipelineModule.from_modules(self.model.pipeline_layers(), num_stages, loss_fn=lm_loss)
            return self.model

    out = {}
    for key, c in (("eager", None), ("compiled", compile_)):
        torch._dynamo.reset()
        rec = Record() if c else None
        trainer = Trainer(strategy=PipelineStrategy(stages=2, micro_batches=2), devices=2, max_steps=STEPS, seed=0,
                          callbacks=[rec] if rec else [], compile=c, **QUIET)
        trainer.fit(PipeLM())
        out[key] = trainer.full_state_dict()
        if rec:
            out["graphs"], out["regions"] = rec.graphs, trainer.strategy.compiled.names
    return out


@pytest.mark.timeout(600)
def test_pipeline_stages_compile_their_own_blocks(tmp_path):
    """The pipeline: each stage compiles the blocks it holds (its layers beside the embedding and
    head); with the ``eager`` backend (the captured graphs' ops as eager runs them) the weights
    equal the eager pipeline's exactly."""
    from harness import run_ranks
    ranks = run_ranks("test_compile:_pipeline", 2, tmp_path, timeout=300, compile_={"backend": "eager"})
    assert [r["regions"] for r in ranks] == [["model.2", "model.3"], ["model.4", "model.5"]]
    for r in ranks:
        assert r["graphs"][0] == r["graphs"][-1] == 1
        for k, v in r["eager"].items():
            assert torch.equal(r["compiled"][k], v), k
