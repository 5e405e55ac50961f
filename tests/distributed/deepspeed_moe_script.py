"""A DeepSpeed-MoE training script as DeepSpeed's tutorials write one: ``deepspeed.moe.layer.MoE``
with ``ep_size=2``, the optimizer over ``split_params_into_different_moe_groups_for_optimizer``'s
groups, ``deepspeed.initialize``, forward/backward/step. test_deepspeed_moe_script.py runs it with
DeepSpeed 0.19.8 and again with the deepspeed import lines renamed to zerotrain.deepspeed.

    python deepspeed_moe_script.py --deepspeed_config ds.json --out result --k 1 [--rts] [--noisy Jitter]

The experts start distinct (each filled from a generator seeded by its global index), each rank
draws its own batches and seeds its gate's random draws (RTS, the second expert's sampling) per
step alike on both libraries (also the Jitter noise's draws). Every rank saves its losses and final weights to ``<out>.<rank>.pt``.
"""
import argparse

import torch
import torch.nn.functional as F
from torch import nn

import deepspeed
from deepspeed import comm as dist
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

STEPS, EXPERTS, EP = 4, 4, 2


class Net(nn.Module):
    def __init__(self, k: int, rts: bool, noisy: str = None) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        expert = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.moe = MoE(8, expert, num_experts=EXPERTS, ep_size=EP, k=k, capacity_factor=1.0, min_capacity=1,
                       use_rts=rts, noisy_gate_policy=noisy)
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        h, l_aux, _ = self.moe(self.inp(x))
        return self.out(h), l_aux


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed_config")
    parser.add_argument("--out")
    parser.add_argument("--k", type=int, default=1)
    parser.add_argument("--rts", action="store_true")
    parser.add_argument("--noisy", default=None)  # noisy_gate_policy: Jitter, RSample
    parser.add_argument("--sgd", action="store_true")  # SGD: the update shows the gradients' scale
    args = parser.parse_args()
    deepspeed.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = Net(args.k, args.rts, args.noisy)
    local = EXPERTS // EP
    with torch.no_grad():
        for j, expert in enumerate(net.moe.deepspeed_moe.experts.deepspeed_experts):
            g = torch.Generator().manual_seed(1000 + (rank % EP) * local + j)
            for p in expert.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(net.parameters()),
                                                                   "name": "parameters"})
    optimizer = torch.optim.SGD(groups, lr=0.1) if args.sgd else torch.optim.AdamW(groups, lr=0.01)
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=optimizer, config=args.deepspeed_config)
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(12, 8, generator=g), torch.randint(0, 4, (12,), generator=g)
        torch.manual_seed(7 + 10 * step + rank)
        logits, l_aux = engine(x)
        loss = F.cross_entropy(logits, y) + 0.01 * l_aux
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    weights = {n: p.detach().clone() for n, p in net.named_parameters()}
    torch.save({"losses": losses, "weights": weights}, f"{args.out}.{rank}.pt")


if __name__ == "__main__":
    main()
