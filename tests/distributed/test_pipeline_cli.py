"""The demo GPT as a pipeline through ``zerotrain-train`` (each run a subprocess of
``python -m zerotrain.train``, rank 0 launching the others), fp32, against a plain single-process
loop over the same global batch of 8 sequences: the GPT ``configure_model`` builds under the
Trainer's seed, AdamW with the demo's warmup + cosine schedule, clipping at 1.0, batch ``k`` being
sequences ``8k .. 8k+7`` of the DistributedSampler's epoch-0 permutation (with R replicas each
takes every R-th of them: the same 8).

* 2 stages, 4 stages (with activation checkpointing), 2 stages x 2 replicas, 2 stages with ZeRO-1
  (``strategy.zero_stage=1``; on 2 x 2, the optimizer state partitioned over the replicas) and
  interleaved 1F1B (``strategy.virtual_stages=2``): every logged loss and every final parameter
  no worse than the plain loop summed as 2 replicas x 2 micro-batches (tolerance.py); the final checkpoint, consolidated by
  ``zerotrain-consolidate``, loads into the plain GPT with ``strict=True``;
* the compute-balanced cut (``model.pipeline_cut=compute``, 3 blocks: the bound inside block 1)
  under ZB-H1, in the default suite: the same, the split block's halves saved by their stages;
* resharding: the 2-stage run's step-2 checkpoint resumes as 4 stages, as zero2 on 2 ranks, as
  single and as ddp on 2, and a zero2 run's as 2 stages; each run's steps 3-4 equal the
  uninterrupted plain loop.

The 4-process runs take longest on 2 cores: the 4-stage run stays in the default suite, the 2 x 2
grids (plain and ZeRO-1; ZeRO-1 runs by default on 2 stages x 1 replica) and the resume into 4
stages are ``slow``, and so is the resume as ddp (single loads the same replicated way).
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tolerance import assert_no_worse_than_peer, backward_per_rank, mean_rtol

STEPS, GLOBAL_BATCH, SAVE_EVERY = 4, 8, 2
COMMON = ["model=gpt_tiny", "precision=32", "data.max_bytes=60000", "data.val_fraction=0", "trainer.seed=0",
          f"trainer.max_steps={STEPS}", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
          f"callbacks.checkpoint_every_n_steps={SAVE_EVERY}", "callbacks.lr_monitor=false",
          "callbacks.throughput=false", "sample_tokens=0"]
TIMEOUT_SCALE = float(os.environ.get("ZEROTRAIN_TEST_TIMEOUT_SCALE", "1"))

_RUNS: dict = {}


def _cli(root: Path, name: str, devices: int, replicas: int, *overrides: str, timeout: float = 150) -> Path:
    """One ``zerotrain-train`` run in ``root/name`` (cached by name: runs feed each other);
    each data-parallel replica reads GLOBAL_BATCH / replicas sequences a step."""
    if name in _RUNS:
        return _RUNS[name]
    run_dir = root / name
    args = [sys.executable, "-m", "zerotrain.train", *COMMON, f"trainer.devices={devices}",
            f"data.batch_size={GLOBAL_BATCH // replicas}", *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout * TIMEOUT_SCALE, cwd=root)
    assert proc.returncode == 0, f"{name}: {' '.join(args[3:])}\n{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
    (run_dir / "stdout.txt").write_text(proc.stdout)
    _RUNS[name] = run_dir
    return run_dir


def _root(tmp_path_factory) -> Path:
    if "root" not in _RUNS:
        _RUNS["root"] = tmp_path_factory.mktemp("pipeline-cli")
    return _RUNS["root"]


def _checkpoint(run_dir: Path, step: int) -> str:
    return f"ckpt_path='{run_dir / 'checkpoints' / f'step={step:06d}.ckpt'}'"


# ---------------------------------------------------------------------------- the plain loop
def _reference(model: tuple[str, ...] = (), peer: bool = False) -> dict:
    """The plain single-process loop (cached; ``model``: extra ``model.*`` overrides): losses of
    steps 1..STEPS, the loss of rank 0's half of each batch (what a 2-rank data-parallel run logs:
    its rank 0's loss, as Lightning) and the final parameters. ``peer``: the same steps with each
    gradient and loss summed as 2 replicas of 2 micro-batches sum them (tolerance.backward_per_rank),
    an order as valid as the plain loop's."""
    if ("reference", model, peer) in _RUNS:
        return _RUNS[("reference", model, peer)]
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf
    from torch.utils.data import DistributedSampler

    from zerotrain.examples import gpt_cli
    from zerotrain.train import normalize_overrides, validate
    from zerotrain.trainer.utilities import seed_rngs

    overrides = normalize_overrides([o for o in COMMON if not o.startswith("callbacks.")]
                                    + [f"data.batch_size={GLOBAL_BATCH}", "trainer.devices=1", *model])
    with initialize_config_module(config_module="zerotrain.conf", version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="config", overrides=overrides))
    validate(cfg)
    module = gpt_cli.build_module(cfg)
    seed_rngs(cfg.trainer.seed)
    module.configure_model()
    gpt, configured = module.model, module.configure_optimizers()
    opt, sched = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    data = module.train_dataloader().dataset
    order = list(DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=cfg.trainer.seed))
    losses, halves = [], []
    for step in range(STEPS):
        x, y = map(torch.stack, zip(*[data[i] for i in order[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH]]))
        if peer:
            micro = [[(x[r::2][m::2], y[r::2][m::2]) for m in range(2)] for r in range(2)]
            with torch.no_grad():
                parts = [[gpt(*b)[1] for b in rank] for rank in micro]
            halves.append(float((parts[0][0] + parts[0][1]) / 2))
            loss = ((parts[0][0] + parts[0][1]) / 2 + (parts[1][0] + parts[1][1]) / 2) / 2
            backward_per_rank(list(gpt.parameters()), micro, lambda b: gpt(*b)[1])
        else:
            with torch.no_grad():
                halves.append(float(gpt(x[0::2], y[0::2])[1]))  # rank 0 of 2 takes every other sequence
            _, loss = gpt(x, y)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(gpt.parameters(), cfg.trainer.gradient_clip_val)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(float(loss.detach()))
    _RUNS[("reference", model, peer)] = {"losses": {1: losses, 2: halves},
                                         "params": {"model." + k: v.detach().clone() for k, v in gpt.state_dict().items()}}
    return _RUNS[("reference", model, peer)]


# ---------------------------------------------------------------------------- reading a run
def _logged_losses(run_dir: Path) -> dict[int, float]:
    """``train_loss`` from TensorBoard by the step it led to (1-based; logged at the 0-based
    index of its batch, as Lightning does)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    for file in sorted(glob.glob(str(run_dir / "tensorboard" / "**" / "events*"), recursive=True)):
        acc = EventAccumulator(file)
        acc.Reload()
        if "train_loss" in acc.Tags()["scalars"]:
            out.update({e.step + 1: e.value for e in acc.Scalars("train_loss")})
    return out


def _final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    """The step-STEPS checkpoint through ``zerotrain-consolidate`` (the installed command's module)."""
    out = run_dir / "consolidated.pt"
    if not out.exists():
        ckpt = run_dir / "checkpoints" / f"step={STEPS:06d}.ckpt"
        proc = subprocess.run([sys.executable, "-m", "zerotrain.trainer.checkpoint.consolidate", str(ckpt), str(out)],
                              capture_output=True, text=True, timeout=60 * TIMEOUT_SCALE)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=True)


def _check_continues_exactly(run_dir: Path, first_step: int = 1, logs_rank0_of: int = 1,
                             model: tuple[str, ...] = ()) -> None:
    """Every loss logged from ``first_step`` on and every final parameter equal the plain loop's
    (no worse than the peer order, ``_reference(peer=True)``). ``logs_rank0_of=2``: a
    data-parallel run on 2 ranks, which logs its rank 0's loss (the pipeline logs the mean over
    its replicas: the whole batch's)."""
    ref, peer = _reference(model), _reference(model, peer=True)
    got = _logged_losses(run_dir)
    steps = range(first_step, STEPS + 1)
    assert sorted(got) == list(steps), (sorted(got), first_step)
    losses = {k: torch.tensor([run["losses"][logs_rank0_of][s - 1] for s in steps]) for k, run in (("ref", ref), ("peer", peer))}
    tokens = GLOBAL_BATCH // logs_rank0_of * 64  # sequences x gpt_tiny's block_size
    # tolerance: no worse than 2 replicas x 2 micro-batches' order (PEER_FACTOR x), + 2 mean_rtol(tokens) for a first step's two orders of one mean
    assert_no_worse_than_peer(torch.tensor([got[s] for s in steps]), losses["ref"], losses["peer"], "losses",
                              floor=2 * mean_rtol(tokens, ops=3))
    params = _final_params(run_dir)
    assert sorted(params) == sorted(ref["params"])  # the plain GPTModule's state dict, tied head included
    # tolerance: no worse than the plain loop summed as 2 replicas x 2 micro-batches (PEER_FACTOR x its error + 4 ulps)
    assert_no_worse_than_peer(params, ref["params"], peer["params"])


def _plain_gpt_loads(params: dict[str, torch.Tensor]) -> None:
    from zerotrain.examples.gpt import GPT, GPTConfig
    from zerotrain.examples.gpt_cli import SIZES

    gpt = GPT(GPTConfig(**SIZES["gpt_tiny"]))
    gpt.load_state_dict({k.removeprefix("model."): v for k, v in params.items()}, strict=True)


# ---------------------------------------------------------------------------- runs
def _two_stages(tmp_path_factory) -> Path:
    return _cli(_root(tmp_path_factory), "pipe2", 2, 1, "strategy=pipeline", "strategy.stages=2",
                "sample_tokens=8")


def _zero2(tmp_path_factory) -> Path:
    return _cli(_root(tmp_path_factory), "zero2", 2, 2, "strategy=zero2")


@pytest.mark.slow  # moved out of the default suite for its 15-minute budget (16.2 min on an AVX2 EPYC)
def test_two_stages_from_the_cli_match_a_plain_loop(tmp_path_factory):
    run_dir = _two_stages(tmp_path_factory)
    _check_continues_exactly(run_dir)
    stdout = (run_dir / "stdout.txt").read_text()
    assert stdout.count("----- sample -----") == 1 and "done: 4 steps" in stdout, stdout[-2000:]
    meta = torch.load(run_dir / "checkpoints" / "step=000004.ckpt" / "meta.pt", weights_only=True)
    # the per-parameter layout of the plain GPT: the tied head saved once, by stage 0, as wte
    assert meta["strategy"] == "pipeline" and meta["world_size"] == 2
    assert meta["aliases"] == {"model.lm_head.weight": "model.wte.weight"}
    assert [r[0] for r in meta["params"]["model.wte.weight"]["ranges"]] == [0]
    assert [r[0] for r in meta["params"]["model.ln_f.weight"]["ranges"]] == [1]
    _plain_gpt_loads(_final_params(run_dir))


@pytest.mark.slow
def test_four_stages_with_activation_checkpointing_match_a_plain_loop(tmp_path_factory):
    run_dir = _cli(_root(tmp_path_factory), "pipe4", 4, 1, "strategy=pipeline", "strategy.stages=4",
                   "strategy.activation_checkpointing=true", timeout=240)
    _check_continues_exactly(run_dir)


@pytest.mark.slow
def test_two_stages_by_two_replicas_match_a_plain_loop(tmp_path_factory):
    run_dir = _cli(_root(tmp_path_factory), "pipe2x2", 4, 2, "strategy=pipeline", "strategy.stages=2",
                   "strategy.micro_batches=2", timeout=240)
    _check_continues_exactly(run_dir)


@pytest.mark.slow
def test_two_stages_with_zero1_match_a_plain_loop(tmp_path_factory):
    """ZeRO-1 over each stage's data-parallel group of one: the flat buffers, fp32 masters and the
    global norm over partitions (the tied wte/lm_head counted once, on stage 0) in the CLI path."""
    run_dir = _cli(_root(tmp_path_factory), "pipe2-zero1", 2, 1, "strategy=pipeline", "strategy.stages=2",
                   "strategy.zero_stage=1")
    _check_continues_exactly(run_dir)


@pytest.mark.slow
def test_two_stages_by_two_replicas_with_zero1_match_a_plain_loop(tmp_path_factory):
    """ZeRO-1 partitioning each stage's optimizer state over its 2 replicas."""
    run_dir = _cli(_root(tmp_path_factory), "pipe2x2-zero1", 4, 2, "strategy=pipeline", "strategy.stages=2",
                   "strategy.micro_batches=2", "strategy.zero_stage=1", timeout=240)
    _check_continues_exactly(run_dir)
    meta = torch.load(run_dir / "checkpoints" / f"step={STEPS:06d}.ckpt" / "meta.pt", weights_only=True)
    writers = {r[0] for entry in meta["params"].values() for r in entry["ranges"]}
    assert writers == {0, 1, 2, 3}, writers  # replica 1 (ranks 2, 3) saved its own partitions


@pytest.mark.slow
def test_interleaved_two_stages_match_a_plain_loop(tmp_path_factory):
    """Interleaved 1F1B: 2 chunks per stage, the stages in a ring (the tied head on stage 1's
    second chunk, wte on stage 0's first)."""
    run_dir = _cli(_root(tmp_path_factory), "pipe2-v2", 2, 1, "strategy=pipeline", "strategy.stages=2",
                   "strategy.virtual_stages=2")
    _check_continues_exactly(run_dir)


@pytest.mark.slow
def test_zero_bubble_two_stages_from_the_cli_match_a_plain_loop(tmp_path_factory):
    """ZB-H1 (``strategy.schedule=zb_h1``): the linear weights' gradients, the tied head's too,
    computed after the inputs' and accumulated later; the same losses and parameters."""
    run_dir = _cli(_root(tmp_path_factory), "pipe2-zb", 2, 1, "strategy=pipeline", "strategy.stages=2",
                   "strategy.schedule=zb_h1")
    _check_continues_exactly(run_dir)


@pytest.mark.slow  # moved out of the default suite for its 15-minute budget
def test_compute_balanced_cut_from_the_cli_splits_a_block_and_matches_a_plain_loop(tmp_path_factory):
    """``model.pipeline_cut=compute`` with 3 blocks: the stage bound falls inside block 1 (its
    attention half on stage 0, its MLP half with the head on stage 1), under ZB-H1; the same
    losses and parameters, and the checkpoint is the plain GPT's, the split block's halves
    written by the stage that holds each."""
    model = ("model.n_layer=3", "model.pipeline_cut=compute")
    run_dir = _cli(_root(tmp_path_factory), "pipe2-compute-zb", 2, 1, "strategy=pipeline", "strategy.stages=2",
                   "strategy.schedule=zb_h1", *model)
    _check_continues_exactly(run_dir, model=model)
    meta = torch.load(run_dir / "checkpoints" / f"step={STEPS:06d}.ckpt" / "meta.pt", weights_only=True)
    writer = {key: [r[0] for r in meta["params"][key]["ranges"]] for key in
              ("model.blocks.1.ln_1.weight", "model.blocks.1.attn.c_attn.weight", "model.blocks.1.ln_2.weight",
               "model.blocks.1.mlp.c_fc.weight")}
    assert list(writer.values()) == [[0], [0], [1], [1]], writer


@pytest.mark.parametrize("name,devices,replicas,overrides", [
    pytest.param("zero2", 2, 2, ["strategy=zero2"], marks=pytest.mark.slow),
    pytest.param("single", 1, 1, ["strategy=single"], marks=pytest.mark.slow),
    pytest.param("ddp", 2, 2, ["strategy=ddp"], marks=pytest.mark.slow),
], ids=["zero2-on-2", "single", "ddp-on-2"])
def test_two_stage_checkpoint_resumes_elsewhere(tmp_path_factory, name, devices, replicas, overrides):
    source = _two_stages(tmp_path_factory)
    run_dir = _cli(_root(tmp_path_factory), f"pipe2-to-{name}", devices, replicas, *overrides,
                   _checkpoint(source, SAVE_EVERY))
    _check_continues_exactly(run_dir, first_step=SAVE_EVERY + 1, logs_rank0_of=replicas)


@pytest.mark.slow
def test_two_stage_checkpoint_resumes_as_four_stages(tmp_path_factory):
    source = _two_stages(tmp_path_factory)
    run_dir = _cli(_root(tmp_path_factory), "pipe2-to-pipe4", 4, 1, "strategy=pipeline", "strategy.stages=4",
                   _checkpoint(source, SAVE_EVERY), timeout=240)
    _check_continues_exactly(run_dir, first_step=SAVE_EVERY + 1)


@pytest.mark.slow
def test_zero2_checkpoint_resumes_as_two_stages(tmp_path_factory):
    source = _zero2(tmp_path_factory)
    _check_continues_exactly(source, logs_rank0_of=2)  # zero2 itself is the plain loop
    run_dir = _cli(_root(tmp_path_factory), "zero2-to-pipe2", 2, 1, "strategy=pipeline", "strategy.stages=2",
                   _checkpoint(source, SAVE_EVERY))
    _check_continues_exactly(run_dir, first_step=SAVE_EVERY + 1)
