"""ZeRO-3 on real gloo processes, through the real Trainer, against plain single-process PyTorch.

Three spawns (2, 3 and 4 ranks) each run several sub-cases; the tests below read their results.
Every run builds its model in ``configure_model()`` (so partitioned construction is exercised
throughout); the references build the same model eagerly with the same seed.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from harness import load_checkpoint, run_ranks_once, save_checkpoint
from toy import ToyModule, trainer_batches
from toy import reference as toy_reference
from tolerance import assert_no_worse_than_peer, backward_as_ranks
from zerotrain import Callback, Trainer, TrainModule
from zerotrain.examples.gpt import GPT, GPTConfig
from zerotrain.strategies.memory import count_bytes
from zerotrain.strategies.zero import ZeroStage3

STEPS, CLIP = 20, 0.5
CFG = GPTConfig(vocab_size=37, block_size=12, n_layer=3, n_head=2, n_embd=16)
QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False)


# ---------------------------------------------------------------------------- models
def tokens(n: int = 480, length: int = 13, vocab: int = 37, seed: int = 5) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(vocab, (n, length), generator=g)
    return TensorDataset(x[:, :-1], x[:, 1:])


def two_groups(module: nn.Module, lr: float = 3e-3):
    decay = [p for p in module.parameters() if p.dim() >= 2]
    rest = [p for p in module.parameters() if p.dim() < 2]
    # eps 1e-6, not 1e-8: GPT-2's key bias has an exactly-zero true gradient (softmax ignores a
    # per-query shift), and with a tiny eps Adam turns its rounding noise into full-size steps of
    # random sign, which no change of summation order (sharded or not) reproduces
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0, "lr": lr / 2}], lr=lr, eps=1e-6)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))


class LM(TrainModule):
    """A causal LM built in ``configure_model()``: the demo GPT (tied embedding / LM head), or
    with ``hf=True`` a Hugging Face GPT-2 from a tiny config (random init, no download)."""

    def __init__(self, hf: bool = False, n: int = 480, bs: int = 4) -> None:
        super().__init__()
        self.hf, self.n, self.bs, self.model = hf, n, bs, None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = build_lm(self.hf)

    def forward_loss(self, x, y):
        if self.hf:
            return self.model(input_ids=x, labels=x).loss
        return self.model(x, y)[1]

    def training_step(self, batch, batch_idx):
        return self.forward_loss(*batch)

    def configure_optimizers(self):
        opt, sched = two_groups(self)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(tokens(self.n), batch_size=self.bs)


def build_lm(hf: bool) -> nn.Module:
    if not hf:
        return GPT(CFG)
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=37, n_positions=12, n_embd=16, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                      bos_token_id=0, eos_token_id=0))


class Quirky(TrainModule):
    """The hard cases in one model: an embedding tied to the head, a unit called twice in one
    forward, a unit that runs on even steps only, a unit whose weight is used only outside its
    forward (a penalty in the loss), and a no_grad forward in the middle of the training step."""

    V, D = 23, 10

    def __init__(self, accum: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(self.V, self.D)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(self.D, self.D), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(self.D, self.V, bias=False)
        self.head.weight = self.emb.weight
        self.accum, self.calls = accum, 0

    def forward(self, idx):
        h = self.blocks[1](self.blocks[1](self.blocks[0](self.emb(idx))))  # blocks[1] twice
        if (self.calls // self.accum) % 2 == 0:  # the same decision on every rank
            h = self.blocks[2](h)
        return self.head(h)

    def training_step(self, batch, batch_idx):
        idx, tgt = batch
        with torch.no_grad():  # e.g. a sample in the middle of training: gathers and frees at once
            self.blocks[0](self.emb(idx[:1]))
        logits = self(idx)
        self.calls += 1
        penalty = 1e-2 * self.blocks[3][0].weight.pow(2).sum()  # used outside its unit's forward
        return nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten()) + penalty

    def validation_step(self, batch, batch_idx):
        idx, tgt = batch
        loss = nn.functional.cross_entropy(self(idx).flatten(0, 1), tgt.flatten())
        self.log("val_loss", loss)  # as Lightning, a returned loss is not logged (235b533)
        return loss

    def configure_optimizers(self):
        opt, sched = two_groups(self, lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(tokens(480, 7, self.V, seed=9), batch_size=4)

    def val_dataloader(self):
        return DataLoader(tokens(48, 7, self.V, seed=10), batch_size=4)


# ---------------------------------------------------------------------------- references
def reference(module: nn.Module, step_fn, world: int, accum: int, data, bs: int = 4,
              zero_missing: bool = False, as_ranks: bool = False) -> dict[str, torch.Tensor]:
    """Plain single-process PyTorch over the Trainer's global batches (``bs`` per rank; on several
    ranks its DistributedSampler shuffles, seed 0, as Lightning's). ``zero_missing``: a parameter that got no gradient steps on zeros (ZeRO keeps a
    gradient for every element, where PyTorch would skip the parameter). ``as_ranks``: the peer,
    each step's gradient summed as torch DDP sums it on ``world`` ranks (``backward_as_ranks``)."""
    cfg = module.configure_optimizers()
    opt, sched = cfg["optimizer"], cfg["lr_scheduler"]["scheduler"]
    batches = trainer_batches(len(data), world, bs)
    for _ in range(STEPS):
        micro = [tuple(t[idx] for t in data.tensors) for idx in (next(batches) for _ in range(accum))]
        if as_ranks:
            backward_as_ranks(module.parameters(), micro, step_fn, world)
        else:
            for batch in micro:
                (step_fn(batch) / accum).backward()
        if zero_missing:
            for p in module.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        sched.step()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def lm_reference(world: int, accum: int, hf: bool = False, as_ranks: bool = False) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)  # fit() below asks the Trainer to seed 0 before configure_model
    lm = LM(hf)
    lm.model = build_lm(hf)
    return reference(lm, lambda b: lm.forward_loss(*b), world, accum, tokens(), as_ranks=as_ranks)


def quirky_reference(world: int, accum: int, as_ranks: bool = False) -> dict[str, torch.Tensor]:
    q = Quirky(accum)
    calls = iter(range(10**9))

    def step(batch):
        if as_ranks:  # each rank counts its own micro-batches: s * accum + m before this one
            i = next(calls)
            q.calls = i // (accum * world) * accum + i % accum
        return q.training_step(batch, 0)
    return reference(q, step, world, accum, tokens(480, 7, Quirky.V, seed=9), zero_missing=True,
                     as_ranks=as_ranks)


# ---------------------------------------------------------------------------- sub-cases
def fit(module, strategy, accum: int = 2, steps: int = STEPS, **kw) -> Trainer:
    kw.setdefault("seed", 0)  # the references build after seeding 0; the Trainer seeds only when asked
    trainer = Trainer(strategy=strategy, devices=int(os.environ["WORLD_SIZE"]), max_steps=steps,
                      accumulate_grad_batches=accum, gradient_clip_val=CLIP, **QUIET, **kw)
    trainer.fit(module)
    return trainer


def _equivalence(world: int, rank: int) -> dict:
    out = {}
    mode = "reduce_scatter" if world == 3 else "all_reduce"
    toy = ToyModule(n=384)  # a multiple of bs x world x accum for 2, 3 and 4 ranks
    trainer = fit(toy, ZeroStage3(unit_modules=["Linear"], prefetch_bucket_size=500, reduce_mode=mode))
    out["toy"] = {k.removeprefix("net."): v for k, v in trainer.full_state_dict().items()}
    # max_reuse_distance=0: every block is freed after its forward (the events below say so)
    for name, kw in (("lm", {}), ("lm_ckpt", {"activation_checkpointing": True, "max_reuse_distance": 0})):
        if name == "lm_ckpt" and world != 2:
            continue
        trace = Trace()
        trainer = fit(LM(), ZeroStage3(prefetch_bucket_size=3200, reduce_mode=mode, **kw), callbacks=[trace])
        out[name] = trainer.full_state_dict()
        out[f"{name}_events"] = trace.events
    return out


class PoolUse(Callback):
    """The pooled elements each reduction of one step's two micro-batches takes, beside what
    each unit's flat gradient and partition need."""

    def __init__(self) -> None:
        self.taken: dict[int, list[int]] = {0: [], 1: []}
        self.sizes: set[tuple[int, int]] = set()

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        pool = trainer.strategy.runtime.pool
        if batch_idx in (4, 5):  # the third optimizer step's micro-batches
            self.sizes = {(u.layout.padded_numel, u.hi - u.lo) for u in trainer.strategy.units}
            plain = type(pool).acquire

            def acquire(numel: int):
                self.taken[batch_idx - 4].append(numel)
                return plain(pool, numel)
            pool.acquire = acquire
        else:
            pool.__dict__.pop("acquire", None)


def _hf(world: int, rank: int) -> dict:
    lm = LM(hf=True)
    use = PoolUse()
    trainer = fit(lm, ZeroStage3(prefetch_bucket_size=2000), callbacks=[use])
    units = [u.name for u in trainer.strategy.units]
    return {"params": trainer.full_state_dict(), "units": units, "taken": use.taken, "sizes": use.sizes,
            "mode": trainer.strategy.runtime.options.reduce_mode}


def _quirky(world: int, rank: int) -> dict:
    q = Quirky(accum=2)
    trainer = fit(q, ZeroStage3(prefetch_bucket_size=120), val_check_interval=5, limit_val_batches=2)
    s = trainer.strategy
    held = [u.name for u in s.units if u.gathered and not u.persistent]
    return {"params": trainer.full_state_dict(), "val_loss": trainer.callback_metrics.get("val_loss"),
            "gathered_after": held}


class Trace(Callback):
    """Records the runtime's events and peak gathered elements during the third optimizer step
    (the order was recorded in the first)."""

    events: list | None = None
    peak = 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        rt = trainer.strategy.runtime
        if trainer.global_step == 2 and self.events is None and rt.trace is None:
            rt.trace, rt.peak_live = [], 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        rt = trainer.strategy.runtime
        if trainer.global_step == 3 and self.events is None and rt.trace is not None:
            self.events, self.peak, rt.trace = rt.trace, rt.peak_live, None


BLOCK, ROOT_UNIT = 3104, 800  # elements of one block, and of the root (wte, wpe, ln_f)
MAX_LIVE = ROOT_UNIT + 2 * BLOCK


def _prefetch_and_memory(world: int, rank: int) -> dict:
    out = {}
    for name, kw in (("fwd", {"max_reuse_distance": 0}), ("keep", {"reshard_after_forward": False}),
                     ("reuse", {"max_reuse_distance": BLOCK, "max_live_parameters": 10 * MAX_LIVE}),
                     ("auto", {"max_live_parameters": 10 * MAX_LIVE})):
        trace = Trace()
        lm = LM()
        s = ZeroStage3(prefetch_bucket_size=BLOCK, **{"max_live_parameters": MAX_LIVE, **kw})
        trainer = fit(lm, s, accum=1, steps=4, callbacks=[trace])
        out[name] = {"events": trace.events, "peak": trace.peak, "units": [u.numel for u in s.units],
                     "params": trainer.full_state_dict(), "distance": s.runtime.options.max_reuse_distance,
                     "source": s.reuse_source}
    lm = LM()  # bf16-mixed with bf16 gradient partitions: 2 + 2 + 4 + 8 bytes per element
    s = ZeroStage3(reduce_dtype="bf16", param_persistence_threshold=16)
    fit(lm, s, accum=1, steps=1, precision="bf16-mixed")
    out["bytes"] = count_bytes(s)
    out["sharded"] = [(u.layout.numel, u.layout.padded_numel) for u in s.units if not u.persistent]
    out["persistent"] = [(u.layout.numel, u.layout.padded_numel) for u in s.units if u.persistent]
    return out


class MemoryReader:
    """The ``ShardReader`` protocol over every rank's ``param_shards()`` held in memory."""

    def __init__(self, per_rank: list, extras: dict, groups: list) -> None:
        self.shards: dict[str, list] = {}
        for shards in per_rank:
            for name, sh in shards.items():
                self.shards.setdefault(name, []).append(sh)
        self._extras, self.groups = extras, groups

    def names(self):
        return list(self.shards)

    def kinds(self, name):
        return sorted({k for sh in self.shards[name] for k in sh.tensors})

    def read(self, name, kind, start, end, out=None):
        out = torch.empty(end - start) if out is None else out
        for sh in self.shards[name]:
            a, b = max(start, sh.start), min(end, sh.end)
            if a < b and kind in sh.tensors:
                out[a - start:b - start].copy_(sh.tensors[kind][a - sh.start:b - sh.start])
        return out

    def scalars(self, name):
        return next((sh.scalars for sh in self.shards[name] if sh.scalars), {})

    def extra(self, name):
        return self._extras[name]

    def param_groups(self, current):
        return [{**g, "params": c["params"]} for g, c in zip(self.groups, current)]


def _setup(module, world, seed=0, **kw):
    """The Trainer's set-up order, driven by hand (to stop and resume in the middle)."""
    from zerotrain.strategies.environment import detect
    from zerotrain.strategies.precision import Precision
    s = ZeroStage3(prefetch_bucket_size=3200, **kw)
    s.connect(detect(world), torch.device("cpu"), Precision())
    s.setup_environment()
    torch.manual_seed(seed)
    s.configure_model(module)
    s.setup_module(module)
    cfg = module.configure_optimizers()
    s.setup_optimizer(cfg["optimizer"])
    return s, cfg["lr_scheduler"]["scheduler"]


def _steps(s, sched, batches):
    for b in batches:
        s.backward(s.training_step(b, 0))
        s.optimizer_step(CLIP)
        sched.step()


def _checkpoint(world: int, rank: int) -> dict:
    data = tokens()
    batches = list(DataLoader(data, batch_size=4, sampler=torch.utils.data.DistributedSampler(
        data, world, rank, shuffle=False)))[:STEPS]
    s, sched = _setup(LM(), world)
    _steps(s, sched, batches[:10])
    ck = save_checkpoint(s, Path.cwd() / "ck", sched)  # the spawn's shared tmp_path
    shards = [None] * world
    dist.all_gather_object(shards, s.param_shards())
    extras, groups = s.extra_state(), [dict(g, params=[]) for g in s.optimizer.state_dict()["param_groups"]]
    extras = s.broadcast(extras)
    _steps(s, sched, batches[10:])
    out = {"uninterrupted": s.full_state_dict(),
           "ranges": {k: (v.start, v.end) for k, v in shards[rank].items()}}
    for name in ("files", "param_shards"):
        s2, sched2 = _setup(LM(), world, seed=1)  # other weights: all must come from the checkpoint
        if name == "files":  # the Trainer's sequence: checkpoint_io + CheckpointReader
            load_checkpoint(s2, ck, sched2)
        else:  # the same shards, read from memory
            s2.load_param_shards(MemoryReader(shards, extras, groups))
            sched2.load_state_dict(torch.load(ck / "meta.pt", weights_only=True)["scheduler"])
        _steps(s2, sched2, batches[10:])
        out[name] = s2.full_state_dict()
    return out


def _demo(world: int, rank: int) -> dict:
    """The demo's end: validation during fit, then ``GPTModule.sample()`` on every rank."""
    from zerotrain.examples.gpt_module import GPTModule
    cfg = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16)  # bytes
    module = GPTModule(cfg, warmup_steps=1, max_steps=4, batch_size=4, max_bytes=20_000)
    fit(module, ZeroStage3(), accum=1, steps=4, val_check_interval=2, limit_val_batches=2)
    text = module.sample("def ", max_new_tokens=12)
    return {"text": text, "val_loss": module.trainer.callback_metrics.get("val_loss")}


def _construction(world: int, rank: int) -> dict:
    """Built partitioned in configure_model() vs built eagerly with the same seed."""
    out = {}
    for hf in ((False, True) if world == 2 else (False,)):
        s, _ = _setup(LM(hf), world)
        after = torch.rand(4)  # the global RNG must be where an eager build leaves it
        out[f"hf={hf}"] = {"full": s.full_state_dict(), "rng_after": after}
        s.remove_hooks()
    return out


def _worker(cases: list[str]) -> dict:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    fns = {"equivalence": _equivalence, "hf": _hf, "quirky": _quirky, "prefetch": _prefetch_and_memory,
           "checkpoint": _checkpoint, "construction": _construction,
           "demo": _demo}
    return {c: fns[c](world, rank) for c in cases}


# ---------------------------------------------------------------------------- tests
CASES = {2: ["construction", "equivalence", "hf", "quirky", "prefetch", "checkpoint", "demo"],
         3: ["construction", "equivalence"], 4: ["equivalence"]}
_SPAWNED: dict[int, object] = {}


def spawned(world: int, tmp_path_factory) -> list[dict]:
    """One spawn per world size, shared by the tests below (a failure is re-raised in each)."""
    return run_ranks_once(_SPAWNED, world, "test_zero3:_worker", world, tmp_path_factory, timeout=240, cases=CASES[world])


#: 4 processes as `slow`: 2 and 3 run by default (the suite's time on 2 cores)
@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_matches_single_process_pytorch(world, tmp_path_factory):
    ranks = [r["equivalence"] for r in spawned(world, tmp_path_factory)]
    got = ranks[0]
    assert all(r["toy"] == {} and r["lm"] == {} for r in ranks[1:])  # full_state_dict: rank 0 only
    toy = {k: toy_reference(STEPS, world, accum=2, clip=CLIP, n=384, as_ranks=k)["params"]
           for k in (0, world)}
    # tolerance: no worse than torch DDP's order of the same sums (tolerance.PEER_FACTOR x its error + 4 ulps)
    assert_no_worse_than_peer(got["toy"], toy[0], toy[world], "toy ")
    ref, peer = lm_reference(world, accum=2), lm_reference(world, accum=2, as_ranks=True)
    # tolerance: no worse than torch DDP's order of the same sums (tolerance.PEER_FACTOR x its error + 4 ulps)
    assert_no_worse_than_peer(got["lm"], ref, peer, "lm ")
    assert got["lm"]["model.lm_head.weight"] is got["lm"]["model.wte.weight"]  # tied: one tensor
    if world == 2:  # activation checkpointing: each block is freed after forward, and gathered
        # tolerance: as "lm" (no worse than torch DDP's order), and again in backward before its recomputation
        assert_no_worse_than_peer(got["lm_ckpt"], ref, peer, "lm_ckpt ")
        ev = got["lm_ckpt_events"]
        for k in (1, 2, 3):
            assert ev.index(("free", k)) < ev.index(("backward", k)) < ev.index(("recompute", k)), ev
        assert not any(e == "recompute" for e, _ in got["lm_events"])


@pytest.mark.parametrize("world", [2, 3])
def test_partitioned_construction_equals_eager_build(world, tmp_path_factory):
    res = spawned(world, tmp_path_factory)[0]["construction"]
    for key, case in res.items():
        torch.manual_seed(0)
        eager = build_lm(key == "hf=True")
        after = torch.rand(4)
        want = {f"model.{k}": v for k, v in eager.state_dict().items()}
        assert list(case["full"]) == list(want), key
        for k, v in want.items():  # tolerance: exact: the same initialisers on the same RNG stream
            assert torch.equal(case["full"][k], v), f"{key}: {k} differs from the eager build"
        assert torch.equal(case["rng_after"], after), f"{key}: construction consumed other random numbers"


def test_hugging_face_gpt2_matches_single_process(tmp_path_factory):
    res = spawned(2, tmp_path_factory)[0]["hf"]
    assert res["units"][1:3] == ["model.transformer.h.0", "model.transformer.h.1"]
    # tolerance: no worse than torch DDP's order of the same sums (tolerance.PEER_FACTOR x its error + 4 ulps)
    assert_no_worse_than_peer(res["params"], lm_reference(2, accum=2, hf=True),
                              lm_reference(2, accum=2, hf=True, as_ranks=True))
    # gloo's reduce-scatter ("auto"): while a unit's gradient partition is zeros (the first
    # micro-batch), its all-to-all lands in the partition itself; once it holds a sum (the
    # second) the piece lands in the pool. A block's flat gradient is its own gathered buffer
    # (its backward is done with the values): the pool gives a block nothing in the first
    # micro-batch and only the piece in the second. The root, reduced after backward, takes its
    # flat gradient from the pool, and the piece after it in the second micro-batch
    assert res["mode"] == "reduce_scatter"
    flats, withpiece = {n for n, _ in res["sizes"]}, {n + part for n, part in res["sizes"]}
    pieces = {part for _, part in res["sizes"]}
    assert res["taken"][0] and set(res["taken"][0]) <= flats, res
    assert len(res["taken"][0]) == 1, res  # the root only
    assert set(res["taken"][1]) <= pieces | withpiece and len(res["taken"][1]) == 3, res
    assert sum(t in withpiece for t in res["taken"][1]) == 1, res  # the root's flat and piece


def test_hard_cases_match_single_process(tmp_path_factory):
    """Tied head, a unit called twice, a unit skipped every other step, a weight used outside
    its unit, a no_grad forward inside the step, and the Trainer's validation loop."""
    ranks = [r["quirky"] for r in spawned(2, tmp_path_factory)]
    res = ranks[0]
    # tolerance: no worse than torch DDP's order of the same sums (tolerance.PEER_FACTOR x its error + 4 ulps)
    assert_no_worse_than_peer(res["params"], quirky_reference(2, accum=2), quirky_reference(2, accum=2, as_ranks=True))
    assert res["val_loss"] is not None and res["val_loss"] == res["val_loss"]
    assert all(r["gathered_after"] == [] for r in ranks)  # nothing stays gathered between steps


def test_demo_validates_and_samples_on_every_rank(tmp_path_factory):
    ranks = [r["demo"] for r in spawned(2, tmp_path_factory)]
    for res in ranks:
        assert res["text"].startswith("def ") and len(res["text"].encode("utf-8", "replace")) >= 4
        assert res["val_loss"] is not None and res["val_loss"] < 10
    assert ranks[0]["text"] == ranks[1]["text"]  # same seed, same weights: the same sample


def _between(events, start, stop, wanted):
    i, j = events.index(start), events.index(stop)
    return wanted in events[i:j]


def test_next_unit_is_gathered_while_the_current_one_computes(tmp_path_factory):
    res = spawned(2, tmp_path_factory)[0]["prefetch"]
    ev = res["fwd"]["events"]
    # units: 0 root, 1..3 the blocks. In step 3 each block's forward launches the next block's
    # all-gather before it finishes, and each block's backward the previous block's
    for k in (1, 2):
        assert _between(ev, ("forward", k), ("forward_done", k), ("prefetch", k + 1)), ev
    for k in (3, 2):
        assert _between(ev, ("backward", k), ("backward_done", k), ("prefetch", k - 1)), ev
    # even the first block (at the start of the step) and the last (at the start of backward)
    # were prefetched: no block was gathered on demand
    assert not [e for e in ev if e[0] == "gather" and e[1] > 0], ev


def test_gathered_elements_stay_within_max_live_plus_one_bucket(tmp_path_factory):
    res = spawned(2, tmp_path_factory)[0]["prefetch"]
    assert res["fwd"]["units"] == [ROOT_UNIT, BLOCK, BLOCK, BLOCK]
    assert ROOT_UNIT + BLOCK < res["fwd"]["peak"] <= MAX_LIVE + BLOCK  # one prefetch bucket = BLOCK
    # units kept gathered from forward to backward would reach the root and all 3 blocks; the
    # budget frees idle ones (least recently used first) before gathering more
    keep = res["keep"]
    assert keep["peak"] <= MAX_LIVE < ROOT_UNIT + 3 * BLOCK, keep["peak"]
    assert ("free", 1) in keep["events"][:keep["events"].index(("backward", 1))]


def test_reuse_distance_keeps_the_last_blocks_gathered_for_their_backward(tmp_path_factory):
    """``max_reuse_distance=BLOCK``: block 3's backward follows its forward with nothing gathered
    between (distance 0), block 2's after block 3 (BLOCK), block 1's after two blocks (2 BLOCK).
    So in step 3 blocks 2 and 3 stay gathered from forward to backward and are not gathered
    again, block 1 is freed and gathered again as usual; the parameters equal the run that frees
    every block (the same values gathered)."""
    res = spawned(2, tmp_path_factory)[0]["prefetch"]
    ev = res["reuse"]["events"]
    start = ev.index(("backward", 3))
    for k in (2, 3):
        span = ev[ev.index(("forward", k)):ev.index(("backward", k))]
        assert ("free", k) not in span, ev
        assert not [e for e in ev[start:] if e[1] == k and e[0] in ("gather", "prefetch")], ev
    assert ("free", 1) in ev[ev.index(("forward_done", 1)):start], ev
    assert [e for e in ev[start:] if e[1] == 1 and e[0] in ("gather", "prefetch")], ev
    fwd = res["fwd"]["events"]  # without it every block is freed after its forward
    assert all(("free", k) in fwd[fwd.index(("forward_done", k)):fwd.index(("backward", k))] for k in (1, 2, 3)), fwd
    assert list(res["reuse"]["params"]) == list(res["fwd"]["params"])
    for key, value in res["fwd"]["params"].items():  # tolerance: exact: the same values gathered, same order
        assert torch.equal(res["reuse"]["params"][key], value), key


def test_default_reuse_budget_from_memory_keeps_every_block_and_is_the_same_on_every_rank(tmp_path_factory):
    """``max_reuse_distance="auto"`` (the default): a toy model is far inside a quarter of any
    test machine's free memory, so every block stays gathered from its forward to its backward
    (within ``max_live_parameters``) and is gathered once per step; every rank resolved the same
    budget (the least over ranks) and the parameters equal the run that frees every block."""
    ranks = [r["prefetch"] for r in spawned(2, tmp_path_factory)]
    auto = ranks[0]["auto"]
    assert auto["source"].startswith("auto: ") and auto["distance"] >= 3 * BLOCK, auto["source"]
    assert ranks[1]["auto"]["distance"] == auto["distance"]
    ev = auto["events"]
    for k in (1, 2, 3):
        assert ("free", k) not in ev[ev.index(("forward", k)):ev.index(("backward", k))], ev
        assert len([e for e in ev if e[1] == k and e[0] in ("gather", "prefetch")]) == 1, ev
    for key, value in ranks[0]["fwd"]["params"].items():  # tolerance: exact: same values, same order
        assert torch.equal(auto["params"][key], value), key


def test_memory_between_steps_is_16_psi_over_n(tmp_path_factory):
    from zerotrain.strategies.zero.estimate import estimate_model_states
    for res in (r["prefetch"] for r in spawned(2, tmp_path_factory)):
        got = res["bytes"]
        shard = sum(p for _, p in res["sharded"]) // 2  # padded / world
        pers_numel, pers_padded = res["persistent"][0]
        assert got["params"] == 2 * shard + 2 * pers_padded  # bf16 shards; small params whole
        assert got["master"] == 4 * (shard + pers_padded // 2)
        assert got["grads"] == 2 * (shard + pers_padded // 2)  # bf16 gradient partitions
        psi = sum(n for n, _ in res["sharded"]) + pers_numel
        est = estimate_model_states(psi, 2, "bf16-mixed")["zero3"]
        assert est.total == 16 * -(-psi // 2)
        pad = sum(p - n for n, p in res["sharded"] + res["persistent"])
        held = got["total"] - got["comm_buffers"]
        slack = 16 * pad + 2 * pers_numel + 64 * 2 * len(res["sharded"] + res["persistent"])
        assert abs(held - est.total) <= slack, (got, est)


def test_checkpoint_round_trips_resume_exactly(tmp_path_factory):
    ranks = [r["checkpoint"] for r in spawned(2, tmp_path_factory)]
    res = ranks[0]
    for name in ("files", "param_shards"):
        assert list(res[name]) == list(res["uninterrupted"])
        for k, v in res["uninterrupted"].items():  # tolerance: exact: a resume restores every bit
            assert torch.equal(res[name][k], v), f"{name}: {k}"
    # each rank saved its own element ranges; together they tile every trainable parameter
    for k, v in res["uninterrupted"].items():
        if k == "model.lm_head.weight":  # tied: saved once, under its first name
            continue
        cuts = sorted(r["ranges"][k] for r in ranks if k in r["ranges"])
        assert cuts[0][0] == 0 and cuts[-1][1] == v.numel(), (k, cuts)
        assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:])), (k, cuts)
