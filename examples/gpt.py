"""A small GPT-style causal language model in plain PyTorch, the demo model for zerotrain.

Byte-level by default (``vocab_size=256``), so it needs no tokenizer. The layout is the usual
pre-LayerNorm decoder: token + position embeddings, ``blocks`` (one :class:`Block` per layer), a
final LayerNorm and an ``lm_head`` whose weight *is* ``wte.weight``.

Two things matter for the sharded strategies:

* ``GPT.blocks`` is an ``nn.ModuleList`` of :class:`Block`; each Block is the unit that ZeRO-3 /
  FSDP-style strategies gather and free together.
* :meth:`GPT.pipeline_layers` lists the same modules as a sequence of layers (``wte``, the
  positions, each block, ``ln_f``, ``lm_head``), each with its name here, for the pipeline
  strategy: ``PipelineModule.from_modules`` cuts them into stages, ties ``lm_head`` to ``wte``
  across the first and last stage (they share one Parameter) and checkpoints them under these
  names, so a pipeline checkpoint is this model's. :meth:`GPT.pipeline_cut` gives the same
  layers with stage bounds that balance compute instead, splitting a block into its attention and
  MLP halves where a bound falls inside it (``model.pipeline_cut=compute`` on the command line).
* :meth:`GPT.init_weights` re-initialises every parameter and buffer in place, in a fixed order,
  so a model built on the meta device and materialised with ``to_empty(device=...)`` gets real
  weights, identical to an eager build when the global RNG is seeded the same way right before
  each ``init_weights()`` call. ``to_empty`` unties ``lm_head.weight`` from ``wte.weight``;
  ``init_weights`` ties them again, so call it before gathering parameters to shard.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..strategies.moe import GateConfig, MoE, Routes
from ..strategies.moe.experts import Experts
from ..strategies.moe.groups import ep_size_of
from ..trainer.command.demo_gpt import GPTConfig, GPTMoEConfig  # noqa: F401  (the command line's schema: in the library)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)  # residual projection
        self.resid_dropout = nn.Dropout(config.dropout)
        #: None: causal SDPA here; else ``attention(q, k, v)`` on (B, T, n_head, head_dim) tensors,
        #: e.g. Ulysses over a sequence group (:meth:`GPT.use_attention`)
        self.attention = None
        #: the attention dropout's random numbers under tensor parallelism: each tensor rank holds
        #: other heads, so it draws a stream of its own (set by the tensor-parallel cut:
        #: zerotrain.strategies.parallel.tensor_sequence.TensorRNG); None: the default generator
        self.tensor_rng = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        C = x.shape[-1]
        qkv = self.c_attn(x)
        B, T = qkv.shape[:2]  # the whole sequence, also where x is a sequence shard (tp_plan_sequence_parallel)
        # the heads are counted from c_attn's output: all n_head of them, or this rank's under a
        # tensor-parallel plan (GPT.tp_plan cuts c_attn's q, k and v by heads)
        q, k, v = (t.view(B, T, -1, C // self.n_head) for t in qkv.chunk(3, dim=2))
        if self.attention is not None:
            y = self.attention(q, k, v)
        else:  # (B, T, n_head, head_dim) -> (B, n_head, T, head_dim) for SDPA, and back
            p = self.dropout if self.training else 0.0
            with self.tensor_rng(x.device) if self.tensor_rng is not None and p > 0 else contextlib.nullcontext():
                y = F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=p, is_causal=True,
                ).transpose(1, 2)
        y = y.contiguous().view(B, T, -1)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)  # residual projection
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class MoEMLP(nn.Module):
    """A block's MLP as a mixture of experts (:class:`GPTMoEConfig`): ``moe``, the library's
    ``MoE`` with ``num_experts`` copies of :class:`MLP` spread over ``ep_size`` ranks. ``forward``
    returns the output only; the last forward's aux loss, expert counts (tokens routed to each
    expert before any were dropped) and dropped routes stay on the module for the loss and the logs."""

    def __init__(self, config: GPTMoEConfig) -> None:
        super().__init__()
        gate = GateConfig(k=config.k, capacity_factor=config.capacity_factor,
                          eval_capacity_factor=config.capacity_factor, min_capacity=config.min_capacity,
                          drop_tokens=config.drop_tokens)
        self.moe = MoE(config.n_embd, MLP(config), num_experts=config.num_experts, ep_size=config.ep_size, gate=gate)
        self.moe.layer.gate.register_forward_hook(self._count_dropped)
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None
        self.dropped: torch.Tensor | None = None

    def _count_dropped(self, gate: nn.Module, inputs: tuple, routes: Routes) -> None:
        self.dropped = (routes.indices < 0).sum().detach()  # routes (token, expert) past the capacity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, self.l_aux, self.exp_counts = self.moe(x)
        return out


class Block(nn.Module):
    """One pre-LN decoder layer: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``; ``mlp`` is an
    :class:`MoEMLP` in the blocks a :class:`GPTMoEConfig` makes MoE blocks (``index``: this block's)."""

    def __init__(self, config: GPTConfig, index: int = 0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        moe = isinstance(config, GPTMoEConfig) and config.is_moe_block(index)
        self.mlp = MoEMLP(config) if moe else MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class BlockHalf(nn.Module):
    """``x + sub(norm(x))``: the attention half (``ln_1``, ``attn``) or the MLP half (``ln_2``,
    ``mlp``) of a :class:`Block`, holding the block's own modules under the block's names, so that
    a pipeline stage boundary can fall inside a block, computing the same operations in the same
    order, while the checkpoint keeps the block's keys (``blocks.4.attn.c_attn.weight``)."""

    PARTS = {"attn": ("ln_1", "attn"), "mlp": ("ln_2", "mlp")}

    def __init__(self, block: Block, half: str) -> None:
        super().__init__()
        if half not in self.PARTS:
            raise ValueError(f"BlockHalf: half={half!r}; valid: {', '.join(self.PARTS)}")
        self.half = half
        for name in self.PARTS[half]:
            self.add_module(name, getattr(block, name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm, sub = self.PARTS[self.half]
        return x + getattr(self, sub)(getattr(self, norm)(x))


class AddPositions(nn.Module):
    """The pipeline's second layer: ``drop(x + wpe(arange(T)))`` on the token embeddings ``x``,
    with ``wpe``'s Parameter registered as ``weight`` so that its checkpoint name is ``wpe.weight``."""

    def __init__(self, wpe: nn.Embedding, drop: nn.Dropout) -> None:
        super().__init__()
        self.weight = wpe.weight
        self.drop = drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.size(1)
        if T > self.weight.size(0):
            raise ValueError(f"sequence length {T} exceeds GPTConfig.block_size={self.weight.size(0)}; "
                             f"crop the input or build the model with a larger block_size")
        return self.drop(x + F.embedding(torch.arange(T, device=x.device), self.weight))


@torch.no_grad()
def _init_experts(experts: Experts, std: float, resid_std: float) -> None:
    """Every expert of the layer drawn in turn, expert by expert (each Linear's weight ~ N(0, std),
    ``c_proj``'s ~ N(0, resid_std), biases zero), and this rank's own kept: the first
    ``num_local`` at ep_size=1, so the same seed gives each expert the same weights whatever the
    ep_size (rank r of an expert-parallel group holds experts ``r * num_local ...``)."""
    local = experts.local
    param = next(iter(local[0].parameters()))
    ep = ep_size_of(param.group_name)
    rank = torch.distributed.get_rank() if ep > 1 and torch.distributed.is_initialized() else 0
    first = (rank % ep) * experts.num_local
    template = [(n, m) for n, m in local[0].named_modules() if isinstance(m, nn.Linear)]
    for j in range(ep * experts.num_local):
        for name, linear in template:
            drawn = torch.empty_like(linear.weight).normal_(0.0, resid_std if name.endswith("c_proj") else std)
            if first <= j < first + experts.num_local:
                mine = local[j - first].get_submodule(name)
                mine.weight.copy_(drawn)
                if mine.bias is not None:
                    mine.bias.zero_()


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy :meth:`GPT.forward` computes, from logits (B, T, V) and targets (B, T)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class GPT(nn.Module):
    """A GPT-style causal LM. ``forward(idx, targets=None)`` returns ``(logits, loss)``."""

    #: Megatron's tensor-parallel plan, in Hugging Face's vocabulary (for
    #: ``zerotrain.strategies.parallel.parallelize_tensor``): q/k/v cut by heads (one fused
    #: projection of 3 blocks), the attention's and the MLP's second projections by rows, the
    #: embedding and the tied LM head by vocabulary; the logits stay vocabulary-sharded, for
    #: ``vocab_parallel_cross_entropy``
    tp_plan = {"wte": "embedding_rowwise", "blocks.*.attn.c_attn": ("packed_colwise", 3),
               "blocks.*.attn.c_proj": "rowwise", "blocks.*.mlp.c_fc": "colwise", "blocks.*.mlp.c_proj": "rowwise",
               "lm_head": "colwise"}
    #: the same with the sequence-parallel variant (Korthikanti et al., 2022): the residual stream,
    #: the norms and the dropouts cut along the sequence over the tensor group (``drop`` cuts the
    #: replicated embeddings + positions), each column-parallel input gathered along the sequence and
    #: each row-parallel output reduce-scattered along it; the model's plan where
    #: ``GPTConfig.tp_sequence_parallel`` (strategies/README.md, tensor parallelism)
    tp_plan_sequence_parallel = {
        "wte": "embedding_rowwise", "drop": "sequence_shard", "blocks.*.ln_1": "sequence_parallel",
        "blocks.*.attn.c_attn": ("colwise_sp", 3), "blocks.*.attn.c_proj": "rowwise_sp",
        "blocks.*.attn.resid_dropout": "sequence_parallel", "blocks.*.ln_2": "sequence_parallel",
        "blocks.*.mlp.c_fc": "colwise_sp", "blocks.*.mlp.c_proj": "rowwise_sp", "blocks.*.mlp.dropout": "sequence_parallel",
        "ln_f": "sequence_parallel", "lm_head": "colwise_sp"}

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = config if config is not None else GPTConfig()
        c = self.config
        if getattr(c, "tp_sequence_parallel", False):
            self.tp_plan = dict(self.tp_plan_sequence_parallel)
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.block_size, c.n_embd)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c, i) for i in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.tie_weights()
        self.init_weights()

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the very Parameter ``wte.weight`` (one Parameter, two modules).

        ``to_empty()`` from the meta device gives each module a *new* Parameter and so unties them;
        :meth:`init_weights` calls this first to restore the tie."""
        if self.lm_head.weight is not self.wte.weight:
            self.lm_head.weight = self.wte.weight

    # ---- initialisation
    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re-)initialise every parameter and buffer in place, in ``named_modules()`` order.

        Linear and Embedding weights ~ N(0, 0.02); the two residual projections of each block
        (``attn.c_proj``, ``mlp.c_proj``) ~ N(0, 0.02 / sqrt(2 * n_layer)) so the residual stream
        does not grow with depth; biases zero; LayerNorm weight one. The tied ``lm_head.weight`` is
        initialised once, as ``wte.weight``.

        Draws come from the global RNG of the parameters' device. To get the same weights from an
        eager build and from a meta-device build materialised with ``to_empty(device=...)``, call
        ``torch.manual_seed(s)`` immediately before each ``init_weights()`` call (module
        construction itself consumes RNG in an eager build but not on the meta device).
        It first re-ties ``lm_head.weight`` to ``wte.weight`` (see :meth:`tie_weights`), so a
        strategy that materialises a meta model should call it before collecting parameters.
        """
        self.tie_weights()
        std = 0.02
        resid_std = std / math.sqrt(2 * self.config.n_layer)
        done: set[int] = set()  # ids of tensors already initialised (tied weights appear twice)

        for name, module in self.named_modules():
            if isinstance(module, Experts):  # a rank's share of the experts, as drawn for all of them
                _init_experts(module, std, resid_std)
                done.update(id(t) for t in module.parameters())
            own = [t for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))
                   if id(t) not in done]
            if not own:
                continue
            if isinstance(module, nn.Linear):
                if id(module.weight) not in done:
                    is_resid = name.endswith("c_proj")
                    nn.init.normal_(module.weight, mean=0.0, std=resid_std if is_resid else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            else:
                # A new layer type must say how it is initialised: after to_empty() its memory is garbage.
                raise TypeError(
                    f"GPT.init_weights does not know how to initialise {name!r} "
                    f"({type(module).__name__}); add a branch for it"
                )
            done.update(id(t) for t in own)

    # ---- mixture of experts
    def moe_layers(self) -> list[MoEMLP]:
        """The blocks' MoE MLPs (none for a dense GPT)."""
        return [block.mlp for block in self.blocks if isinstance(block.mlp, MoEMLP)]

    def moe_stats(self) -> dict[str, torch.Tensor]:
        """The last forward's MoE numbers on this rank, summed over the MoE layers: ``moe/aux_loss``
        (the load-balancing losses, before ``aux_loss_coef``), ``moe/tokens_dropped`` (routes past an
        expert's capacity: tokens at k=1) and the load histogram ``moe/load/expert_<j>`` (tokens
        routed to expert j before dropping). Empty for a dense GPT or before a forward."""
        layers = [m for m in self.moe_layers() if m.l_aux is not None]
        if not layers:
            return {}
        out = {"moe/aux_loss": sum(m.l_aux.detach().float() for m in layers),
               "moe/tokens_dropped": sum(m.dropped.float() for m in layers)}
        load = sum(m.exp_counts.float() for m in layers)
        out.update({f"moe/load/expert_{j}": load[j] for j in range(load.numel())})
        return out

    # ---- forward
    def use_attention(self, attention) -> None:
        """Every block attends through ``attention(q, k, v)`` on (B, T, n_head, head_dim) tensors
        (None: causal SDPA again); with ``zerotrain.strategies.parallel.ulysses_attention`` over a
        sequence group, each rank runs its sequence shard with ``positions`` of its own."""
        for block in self.blocks:
            block.attn.attention = attention

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``idx``: (B, T) int64 token ids with T <= block_size. Returns logits (B, T, vocab_size)
        and the mean cross-entropy against ``targets`` (B, T), or None without targets. ``positions``
        (T,): the tokens' positions, ``arange(T)`` by default (a sequence shard's own otherwise)."""
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device) if positions is None else positions
        last = T if positions is None else int(positions.max()) + 1
        if last > self.config.block_size:
            raise ValueError(
                f"sequence length {last} exceeds GPTConfig.block_size={self.config.block_size}; "
                f"crop the input or build the model with a larger block_size"
            )
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            if logits.size(-1) != self.config.vocab_size:
                raise ValueError(f"GPT.forward: the logits hold {logits.size(-1)} of {self.config.vocab_size} classes "
                                 f"(a vocabulary-parallel lm_head); compute the loss with "
                                 f"vocab_parallel_cross_entropy(logits, targets, group)")
            loss = lm_loss(logits, targets)
            moe = self.moe_layers()
            if moe:  # the experts' load-balancing loss, weighted
                loss = loss + self.config.aux_loss_coef * sum(m.l_aux for m in moe)
        return logits, loss

    def pipeline_layers(self) -> list[tuple[str, nn.Module]]:
        """This model as a sequence of ``(name, layer)``, the name being the layer's path here:
        applied in order to ``idx`` they compute :meth:`forward`'s logits with these very modules
        (``lm_head`` still shares ``wte``'s Parameter), for ``PipelineModule.from_modules``."""
        return [("wte", self.wte), ("wpe", AddPositions(self.wpe, self.drop)),
                *((f"blocks.{i}", block) for i, block in enumerate(self.blocks)),
                ("ln_f", self.ln_f), ("lm_head", self.lm_head)]

    def pipeline_cut(self, num_stages: int) -> tuple[list[tuple[str, nn.Module]], list[int]]:
        """:meth:`pipeline_layers` and stage bounds that balance the stages' compute, for
        ``PipelineModule.from_modules(layers, num_stages, partition_method=bounds)``.

        The cost of each layer is its forward multiply-adds per token (a backward costs about
        twice its forward, so the proportions hold): attention ``4 d^2 + T d``, MLP ``8 d^2``, the
        LM head ``d V`` (plus ``V`` for the loss), every other layer ``d``. Bounds are chosen with
        each block as its two :class:`BlockHalf` halves; a block a bound falls inside stays as its
        halves (both under the block's name, so checkpoint keys are unchanged), every other block
        is whole. Why: cut by parameters between blocks, the last stage also runs the head and
        the loss (a fifth of a stage for 8 blocks of d=1024 at vocab 8192) and sets the pace,
        while the first stage's embedding, counted as parameters, costs almost nothing."""
        from ..strategies.pipeline.partition import partition_balanced

        c = self.config
        d, t, vocab = c.n_embd, c.block_size, c.vocab_size
        pieces: list[tuple[str, nn.Module]] = []
        cost: list[int] = []
        whole: list[tuple[str, nn.Module] | None] = []  # the block a half belongs to, else None
        for name, layer in self.pipeline_layers():
            if isinstance(layer, Block):
                pieces += [(name, BlockHalf(layer, "attn")), (name, BlockHalf(layer, "mlp"))]
                cost += [4 * d * d + t * d, 8 * d * d]
                whole += [(name, layer)] * 2
            else:
                pieces.append((name, layer))
                cost.append(d * vocab + vocab if name == "lm_head" else d)
                whole.append(None)
        starts = set(partition_balanced(cost, num_stages)[1:-1])  # a stage starts at pieces[b]
        layers: list[tuple[str, nn.Module]] = []
        bounds, i = [0], 0
        while i < len(pieces):
            keep_whole = whole[i] is not None and i + 1 not in starts and whole[i + 1] is whole[i]
            layers.append(whole[i] if keep_whole else pieces[i])
            i += 2 if keep_whole else 1
            if i in starts:
                bounds.append(len(layers))
        return layers, bounds + [len(layers)]

    # ---- accounting
    def num_params(self, non_embedding: bool = False) -> int:
        """Number of parameters, each tied parameter counted once. ``non_embedding=True`` leaves out
        the position table ``wpe``; the token table stays in because, tied to ``lm_head``, it is
        used as a weight matrix in the output projection."""
        n = sum(p.numel() for p in self.parameters())  # parameters() deduplicates the tied weight
        if non_embedding:
            n -= self.wpe.weight.numel()
        return n

    def flops_per_token(self) -> float:
        """Training FLOPs (forward + backward) per token at full context, the PaLM / nanoGPT
        estimate ``6 N + 12 L H Q T`` (N non-embedding parameters, L layers, H heads, Q head size,
        T = block_size). ``6 N``: 2 N for the forward matmuls, 4 N for the backward; the second
        term is attention's score and value products."""
        c = self.config
        N = self.num_params(non_embedding=True)
        L, H, Q, T = c.n_layer, c.n_head, c.n_embd // c.n_head, c.block_size
        return float(6 * N + 12 * L * H * Q * T)

    # ---- sampling
    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` (B, T) and return (B, T + new).
        The context fed to the model is cropped to the last ``block_size`` tokens. Put the model
        in ``eval()`` first if it uses dropout."""
        if idx.dim() != 2 or idx.size(1) == 0:
            raise ValueError(f"generate needs idx of shape (B, T) with T >= 1, got {tuple(idx.shape)}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        if top_k is not None and top_k <= 0:
            raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size:]
            logits, _ = self(context)
            logits = logits[:, -1, :].float() / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            next_idx = torch.multinomial(probs, num_samples=1)
            idx = torch.cat((idx, next_idx), dim=1)
        return idx
