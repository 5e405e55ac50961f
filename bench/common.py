"""What every system in ``gpt_bench.py`` shares: the model sizes, the weights, the data, the
optimizer, and the per-rank measurement record.

Everything here is a pure function of the command-line options and the rank, so ten systems in
ten process groups build the same initial weights, see the same micro-batches and step the same
AdamW: in fp32 their loss curves must agree to rounding (the correctness column of the table).
"""
from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from zerotrain.examples.data import ByteDataset, stdlib_corpus
from zerotrain.examples.gpt import GPT, GPTConfig


@dataclass(frozen=True)
class ModelSpec:
    """One benchmark size: the GPT's shape and the micro-batch each rank runs per step."""

    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int
    micro_batch: int
    #: False: the LM head has its own matrix (``UntiedGPT``), so a 2-stage pipeline has no tied
    #: weight to all-reduce between its first and last stage
    tied: bool = True

    def config(self) -> GPTConfig:
        return GPTConfig(vocab_size=self.vocab_size, block_size=self.block_size, n_layer=self.n_layer,
                         n_head=self.n_head, n_embd=self.n_embd)

    def num_params(self) -> int:
        """Parameters, the tied embedding/head counted once (built on the meta device: free)."""
        with torch.device("meta"):
            return sum(p.numel() for p in gpt_class(self.tied)(self.config()).parameters())


# The 21M and 118M sizes are MACHINE_FACTS.md's peer benchmarks. Their parameter counts (21.1M,
# 117.7M) need a 16384-token vocabulary (tied head): with byte tokens (256) the same shapes have
# 12.8M / 101M parameters. Byte data still fits (ids < 256); the head's matmul has the peers' size.
# gpt_118m_untied has the same 117.7M parameters as an 8192-token vocabulary with an untied head
# (wte and lm_head 8.4M each): the pipeline benchmark's model, whose two stages then share no
# weight, with 4 sequences per rank (a global batch of 8 on 2 ranks). gpt_21m_untied is issue
# 14's model A: the 21M shape with an 8192-token vocabulary and an untied head (the same 21.1M).
MODELS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=256, micro_batch=2),
    "tiny_untied": ModelSpec(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=256, micro_batch=4,
                             tied=False),
    "gpt_21m": ModelSpec(n_layer=4, n_head=8, n_embd=512, block_size=256, vocab_size=16384, micro_batch=4),
    "gpt_21m_untied": ModelSpec(n_layer=4, n_head=8, n_embd=512, block_size=256, vocab_size=8192, micro_batch=4,
                                tied=False),
    "gpt_118m": ModelSpec(n_layer=8, n_head=16, n_embd=1024, block_size=256, vocab_size=16384, micro_batch=1),
    "gpt_118m_untied": ModelSpec(n_layer=8, n_head=16, n_embd=1024, block_size=256, vocab_size=8192, micro_batch=4,
                                 tied=False),
}

# AdamW for every system: decay on matrices only, constant learning rate (no scheduler, so
# DeepSpeed's config optimizer and ours step identically), no gradient clipping.
OPTIM = dict(lr=6e-4, betas=(0.9, 0.95), eps=1e-8)
WEIGHT_DECAY = 0.1


class UntiedGPT(GPT):
    """The demo GPT with an LM head of its own (initialised like every Linear, N(0, 0.02)) instead
    of ``wte``'s matrix: ``tie_weights`` leaves the two apart."""

    def tie_weights(self) -> None:
        pass

    def flops_per_token(self) -> float:
        """``GPT.flops_per_token`` less ``wte``'s 6 x its size: untied, the token table is only
        looked up (no matmul), and the head, a matrix of the same size, is counted already."""
        return super().flops_per_token() - 6 * self.wte.weight.numel()


def gpt_class(tied: bool) -> type[GPT]:
    return GPT if tied else UntiedGPT


def build_gpt(config: GPTConfig, seed: int, tied: bool = True) -> GPT:
    """The benchmark GPT (``tied=False``: ``UntiedGPT``) with weights that depend on ``seed`` only.

    ``init_weights()`` is re-run right after seeding, so the weights are the same whatever RNG
    the constructor consumed before (eager build) or did not (a meta build materialised later).
    """
    torch.manual_seed(seed)
    model = gpt_class(tied)(config)
    torch.manual_seed(seed)
    model.init_weights()
    return model


def param_groups(model: nn.Module) -> list[dict]:
    """Weight decay on matrices (Linear, Embedding), none on vectors (LayerNorm)."""
    params = [p for p in model.parameters() if p.requires_grad]  # the tied weight once
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return [g for g in ({"params": decay, "weight_decay": WEIGHT_DECAY},
                        {"params": rest, "weight_decay": 0.0}) if g["params"]]


def make_adamw(model: nn.Module) -> tuple[torch.optim.Optimizer, str]:
    """torch's AdamW, fused when this build supports the parameters (4-6x faster on CPU than the
    default, MACHINE_FACTS.md); returns the optimizer and which implementation it is."""
    try:
        return torch.optim.AdamW(param_groups(model), fused=True, **OPTIM), "fused"
    except (RuntimeError, ValueError, TypeError):  # e.g. a tensor subclass the fused kernel lacks
        return torch.optim.AdamW(param_groups(model), foreach=True, **OPTIM), "foreach"


def make_batches(spec: ModelSpec, data: str, seed: int, steps: int, rank: int,
                 world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batch of every step: step ``s`` draws a global batch of ``world *
    micro_batch`` sequences from a generator seeded by ``(seed, s)``; rank ``r`` takes rows
    ``[r * micro_batch, (r + 1) * micro_batch)``. ``data``: ``stdlib`` (windows of the standard
    library's source, byte tokens) or ``random`` (uniform ids over the whole vocabulary)."""
    mb, t = spec.micro_batch, spec.block_size
    rows = slice(rank * mb, (rank + 1) * mb)
    dataset = ByteDataset(stdlib_corpus(2_000_000), t) if data == "stdlib" else None
    batches = []
    for s in range(steps):
        g = torch.Generator().manual_seed(seed * 1_000_003 + s)
        if dataset is not None:
            idx = torch.randint(len(dataset), (world * mb,), generator=g)[rows]
            x = torch.stack([dataset[int(i)][0] for i in idx])
            y = torch.stack([dataset[int(i)][1] for i in idx])
        else:
            tok = torch.randint(spec.vocab_size, (world * mb, t + 1), generator=g)[rows]
            x, y = tok[:, :-1].contiguous(), tok[:, 1:].contiguous()
        batches.append((x, y))
    return batches


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def faults_and_cpu() -> tuple[int, float]:
    """Minor page faults this process took so far, and its CPU time (user + system, every thread
    counted), from one ``getrusage`` call."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_minflt, use.ru_utime + use.ru_stime


def current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


@dataclass
class Record:
    """What one rank measured in one run; written as JSON for the driver.

    ``step_times[i]`` is the wall time from the end of step ``i - 1`` (for step 0: the start of
    the loop) to the end of step ``i``, ended after the optimizer step, so it holds everything a
    training step costs: data, forward, backward, communication, optimizer, hooks.
    ``rss_base`` is the peak RSS once the system's libraries are imported, before the process
    group, the model and the optimizer exist; ``rss_setup`` after model and optimizer set-up;
    ``rss_peak`` at the end. ``step_faults[i]``: the minor page faults (a page touched for the first
    time: the kernel zeroes it) this rank took in step ``i``, a cost that step times on a shared
    machine hide in their noise; ``step_cpu[i]``: the CPU seconds this rank used in step ``i``
    (all its threads: compute, communication, page faults).
    """

    system: str
    rank: int
    world: int
    threads: int = field(default_factory=torch.get_num_threads)
    optimizer: str = "?"
    rss_base: int = 0
    rss_setup: int = 0
    rss_peak: int = 0
    step_times: list[float] = field(default_factory=list)
    step_faults: list[int] = field(default_factory=list)
    step_cpu: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    #: pipeline only: each step's schedule on this stage (``compute_s``, ``comm_s``, ``wall_s``)
    schedule: list[dict] = field(default_factory=list)
    _last: float = 0.0
    _faults: int = 0
    _cpu: float = 0.0

    def baseline(self) -> None:
        self.rss_base = peak_rss_bytes()

    def setup_done(self) -> None:
        self.rss_setup = peak_rss_bytes()
        self.threads = torch.get_num_threads()

    def start(self) -> None:
        self._last = time.perf_counter()
        self._faults, self._cpu = faults_and_cpu()

    def step_end(self, loss: torch.Tensor) -> None:
        now = time.perf_counter()
        self.step_times.append(now - self._last)
        self._last = now
        self.losses.append(float(loss.detach().float()))
        faults, cpu = faults_and_cpu()
        self.step_faults.append(faults - self._faults)
        self.step_cpu.append(cpu - self._cpu)
        self._faults, self._cpu = faults, cpu

    def write(self, directory: str) -> None:
        self.rss_peak = peak_rss_bytes()
        out = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        out["rss_current"] = current_rss_bytes()
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"rank{self.rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(out, f)
        os.replace(path + ".tmp", path)  # the driver never reads a half-written file
