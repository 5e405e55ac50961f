"""Routing: which expert (and which slot of it) each token visits, with DeepSpeed-MoE's semantics.

A gate scores every token against every expert (``wg``, a bias-free linear layer in fp32) and
returns ``Routes``: for each of the ``k`` routes of each token, the expert (``-1``: dropped), the
slot in that expert's buffer and the combine weight, plus the buffer ``capacity``, the
load-balancing loss ``l_aux`` and ``exp_counts`` (tokens per expert before any were dropped).

Capacity per expert is ``max(ceil(tokens / experts * factor * k), min_capacity)`` (k = 1 or 2 here;
``eval_capacity_factor`` while not training); ``drop_tokens=False`` sizes it to the busiest expert
instead, the maximum taken over the expert-parallel group so every rank's buffers agree.
Top-1 keeps, per expert, the ``capacity`` tokens a ``torch.topk`` over its assignments picks; with
``use_rts`` those assignments are first multiplied by uniform draws (random token selection), so
the kept tokens are a random subset rather than the lowest-numbered. Top-2 keeps tokens in order
(first routes before second routes) and renormalizes the two weights to sum to one. The noise:
``noisy_gate_policy='Jitter'`` multiplies the gate's input by U(0.99, 1.01) while training,
``'RSample'`` picks the top-1 expert from logits plus Gumbel noise while training, and top-2 picks its
second expert from Gumbel-perturbed logits when ``second_expert_sampling`` (in training and eval,
as DeepSpeed does). Draws come from ``torch.distributions`` in DeepSpeed's order, so the same seed
gives the same routes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributions as D
import torch.distributions.gumbel  # noqa: F401  (D.Gumbel)
import torch.nn.functional as F

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")


@dataclass
class Routes:
    """``indices``, ``locations``, ``weights``: [k, tokens]; ``capacity``: slots per expert."""
    indices: torch.Tensor
    locations: torch.Tensor
    weights: torch.Tensor
    capacity: int
    l_aux: torch.Tensor
    exp_counts: torch.Tensor


def _uniform(shape, low: float, high: float, device) -> torch.Tensor:
    return D.Uniform(torch.tensor(low, device=device), torch.tensor(high, device=device)).rsample(shape)


def _gumbel(shape, device) -> torch.Tensor:
    return D.Gumbel(torch.tensor(0.0, device=device), torch.tensor(1.0, device=device)).rsample(shape)


def capacity_of(tokens: int, experts: int, factor: float, min_capacity: int) -> int:
    """Slots per expert when tokens may be dropped."""
    return max(int(math.ceil(tokens / experts * factor)), int(min_capacity))


def _busiest(counts: torch.Tensor, group) -> int:
    """No-drop capacity: the most tokens any expert got, maximum over the expert-parallel group."""
    most = counts.max().clone()
    if group is not None and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX, group=group)
    return int(most)


def top1(logits: torch.Tensor, factor: float, min_capacity: int, used_token: Optional[torch.Tensor] = None,
         noisy: Optional[str] = None, drop_tokens: bool = True, use_rts: bool = True, group=None) -> Routes:
    tokens, experts = logits.shape
    noisy_logits = logits + _gumbel(logits.shape, logits.device) if noisy == "RSample" else None
    probs = F.softmax(logits, dim=1)
    choice = torch.argmax(noisy_logits if noisy_logits is not None else probs, dim=1)
    mask = F.one_hot(choice, num_classes=experts)
    if used_token is not None:
        mask = mask * used_token.reshape(-1, 1).to(mask.dtype)
    exp_counts = mask.sum(dim=0).detach()
    if drop_tokens:
        capacity = capacity_of(tokens, experts, factor, min_capacity)
    else:
        capacity = min(_busiest(exp_counts, group), tokens)
    l_aux = torch.sum(probs.mean(dim=0) * mask.float().mean(dim=0)) * experts
    ranked = mask * _uniform(mask.shape, 0.0, 1.0, logits.device) if use_rts else mask
    if tokens < min_capacity:
        raise ValueError(f"tokens={tokens} < min_capacity={min_capacity}; valid: min_capacity <= tokens per rank")
    keep = torch.topk(ranked, k=min(capacity, tokens), dim=0)[1]
    mask = mask * torch.zeros_like(mask).scatter_(0, keep, 1)
    kept = mask.sum(dim=1)
    indices = torch.where(kept > 0, choice, torch.full_like(choice, -1))
    locations = ((torch.cumsum(mask, dim=0) - 1) * mask).sum(dim=1)
    weights = (probs * mask).sum(dim=1)
    return Routes(indices[None], locations[None], weights[None], capacity, l_aux, exp_counts)


def top2(logits: torch.Tensor, factor: float, min_capacity: int, drop_tokens: bool = True, group=None,
         second_expert_sampling: bool = True) -> Routes:
    tokens, experts = logits.shape
    probs = F.softmax(logits, dim=1)
    first = torch.argmax(probs, dim=1)
    mask1 = F.one_hot(first, num_classes=experts)
    if second_expert_sampling:
        logits = logits + _gumbel(logits.shape, logits.device)
    second = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(second, num_classes=experts)
    loc1 = torch.cumsum(mask1, dim=0) - 1
    loc2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)  # second routes queue behind all firsts
    l_aux = torch.mean(probs.mean(dim=0) * mask1.float().mean(dim=0)) * experts * experts
    exp_counts = (mask1 + mask2).sum(dim=0).detach()
    if drop_tokens:
        capacity = capacity_of(tokens, experts, factor * 2, min_capacity)
        mask1 = mask1 * (loc1 < capacity)
        mask2 = mask2 * (loc2 < capacity)
    else:
        capacity = _busiest(exp_counts, group)
    w1 = (probs * mask1.float()).sum(dim=1)
    w2 = (probs * mask2.float()).sum(dim=1)
    total = torch.clamp(w1 + w2, min=torch.finfo(w1.dtype).eps)
    idx = torch.stack([torch.where(mask1.any(dim=1), first, -1), torch.where(mask2.any(dim=1), second, -1)])
    locs = torch.stack([(loc1 * mask1).sum(dim=1), (loc2 * mask2).sum(dim=1)])
    return Routes(idx, locs, torch.stack([w1 / total, w2 / total]), capacity, l_aux, exp_counts)


@dataclass(frozen=True)
class GateConfig:
    """The gate's options, DeepSpeed-MoE's names and ``MoE``'s defaults (``top2_2nd_expert_sampling``:
    the second expert of top-2 from Gumbel-perturbed logits)."""

    k: int = 1
    capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    min_capacity: int = 4
    noisy_gate_policy: Optional[str] = None
    drop_tokens: bool = True
    use_rts: bool = True
    top2_2nd_expert_sampling: bool = True

    def __post_init__(self) -> None:
        if self.k not in (1, 2):
            raise ValueError(f"k={self.k!r}; valid: 1, 2")
        if self.noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"noisy_gate_policy={self.noisy_gate_policy!r}; valid: None, 'Jitter', 'RSample'")


class TopKGate(torch.nn.Module):
    """The gate: ``wg`` scores tokens, ``top1``/``top2`` route them."""

    def __init__(self, model_dim: int, num_experts: int, config: GateConfig = GateConfig(), ep_group=None) -> None:
        super().__init__()
        self.wg = torch.nn.Linear(model_dim, num_experts, bias=False)
        self.k, self.ep_group = config.k, ep_group
        self.capacity_factor, self.eval_capacity_factor = config.capacity_factor, config.eval_capacity_factor
        self.min_capacity, self.noisy_gate_policy = config.min_capacity, config.noisy_gate_policy
        self.drop_tokens, self.use_rts = config.drop_tokens, config.use_rts
        self.top2_2nd_expert_sampling = config.top2_2nd_expert_sampling

    def forward(self, tokens: torch.Tensor, used_token: Optional[torch.Tensor] = None) -> Routes:
        x = tokens.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = x * _uniform(x.shape, 0.99, 1.01, x.device)
        logits = F.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            noisy = self.noisy_gate_policy if self.training else None
            return top1(logits, factor, self.min_capacity, used_token, noisy, self.drop_tokens, self.use_rts,
                        self.ep_group)
        return top2(logits, factor, self.min_capacity, self.drop_tokens, self.ep_group,
                    self.top2_2nd_expert_sampling)
