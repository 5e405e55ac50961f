"""A DeepSpeed training script written as DeepSpeed's tutorials write them. test_deepspeed_compat.py
runs it with DeepSpeed 0.19.8 itself and again with only the three deepspeed import lines renamed
to zerotrain.deepspeed (nothing else in this file may name either library).

    python deepspeed_script.py --deepspeed_config ds.json --out result --ckpt ckpt_dir [--zero_init]
        [--plain_backward] [--checkpoint_activations]

It trains a small MLP for STEPS optimizer steps on the DeepSpeed dataloader (a pass of the data is
shorter than that, so the loader is iterated again), saves a checkpoint, trains two more steps,
loads the checkpoint and trains the same two steps again (the first STEPS with a plain
``loss.backward()`` under --plain_backward, as DeepSpeed 0.19 allows), then reads the full weights through
zero.GatheredParameters; with --zero_init the model is built under zero.Init and, after the
training, rank 0 changes one bias through GatheredParameters(modifier_rank=0) and one more step
runs. With --checkpoint_activations the hidden layer runs under deepspeed.checkpointing.checkpoint,
configured from the config's activation_checkpointing section (deepspeed.checkpointing.configure),
with dropout in the first STEPS drawn from a stream of deepspeed.checkpointing.get_cuda_rng_tracker(),
so the recomputation must see the forward's random numbers (no dropout after them: no checkpoint
holds the tracker's streams, and the steps after the load must repeat those after the save). Every
rank saves what it saw to ``<out>.<rank>.pt``.
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import deepspeed
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator

STEPS, SAMPLES = 6, 64
CHECKPOINT = False  # --checkpoint_activations


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 4)])
        self.dropout = 0.2 if CHECKPOINT else 0.0

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.layers[1](x))
        if self.dropout and self.training:
            with deepspeed.checkpointing.get_cuda_rng_tracker().fork():
                x = F.dropout(x, p=self.dropout)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.layers[0](x))
        x = deepspeed.checkpointing.checkpoint(self.hidden, x) if CHECKPOINT else self.hidden(x)
        return self.layers[2](x)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(SAMPLES, 8, generator=g)
    return TensorDataset(x, torch.sin(x[:, :4] * 3) + 0.1 * torch.randn(SAMPLES, 4, generator=g))


def train(engine, loader, steps: int, plain_backward: bool = False) -> dict:
    """``steps`` optimizer steps from a fresh pass of the loader (and further passes as needed);
    ``plain_backward``: ``loss.backward()`` instead of ``engine.backward(loss)``."""
    losses, lrs, firsts = [], [], []
    target = engine.global_steps + steps
    while engine.global_steps < target:
        for x, y in loader:
            firsts.append(float(x[0, 0]))
            x, y = x.to(engine.device), y.to(engine.device)
            loss = F.mse_loss(engine(x), y)
            if plain_backward:
                loss.backward()
            else:
                engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            losses.append(loss.item())
            if boundary:
                lrs.append(engine.get_lr()[0])
            if engine.global_steps >= target:
                break
    return {"losses": losses, "lrs": lrs, "firsts": firsts}


def full_weights(engine) -> dict:
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return {n: p.detach().clone().float().cpu() for n, p in engine.module.named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--zero_init", action="store_true")
    parser.add_argument("--plain_backward", action="store_true")
    parser.add_argument("--checkpoint_activations", action="store_true")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    get_accelerator().manual_seed_all(0)
    if args.checkpoint_activations:
        global CHECKPOINT
        CHECKPOINT = True
        deepspeed.checkpointing.configure(None, deepspeed_config=args.deepspeed_config)
        # DeepSpeed's model_parallel_cuda_manual_seed needs an mpu: the stream is added directly
        deepspeed.checkpointing.get_cuda_rng_tracker().add("model-parallel-rng", 1234)
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    if args.zero_init:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = Net()
    else:
        model = Net()
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=dataset())

    out = {"first": train(engine, loader, STEPS, args.plain_backward)}
    engine.module.dropout = 0.0
    engine.save_checkpoint(args.ckpt, client_state={"note": "saved", "at": engine.global_steps})
    out["after_save"] = train(engine, loader, 2)
    out["weights_after_save"] = full_weights(engine)
    path, client = engine.load_checkpoint(args.ckpt)
    out["client"], out["steps_after_load"] = client, engine.global_steps
    out["after_load"] = train(engine, loader, 2)
    out["weights"] = full_weights(engine)
    if args.zero_init:
        bias = engine.module.layers[0].bias
        with deepspeed.zero.GatheredParameters(bias, modifier_rank=0):
            if dist.get_rank() == 0:
                with torch.no_grad():
                    bias.add_(0.5)
        out["after_modify"] = train(engine, loader, 1)
        out["weights_modified"] = full_weights(engine)
    acc = get_accelerator()
    out["facts"] = {
        "micro": engine.train_micro_batch_size_per_gpu(), "gas": engine.gradient_accumulation_steps(),
        "train_batch": engine.train_batch_size(), "rank": engine.global_rank, "local_rank": engine.local_rank,
        "bf16": engine.bfloat16_enabled(), "fp16": engine.fp16_enabled(), "device": str(engine.device),
        "dist_rank": dist.get_rank(), "dist_world": dist.get_world_size(), "accelerator": acc.device_name(),
        "backend": acc.communication_backend_name(), "batches": len(loader), "global_steps": engine.global_steps,
        "global_samples": engine.global_samples, "skipped": engine.skipped_steps,
        "scheduler": type(scheduler).__name__, "optimizer_lr": optimizer.param_groups[0]["lr"],
        "saved_tag_file": open(f"{args.ckpt}/latest").read().strip(),
    }
    torch.save(out, f"{args.out}.{dist.get_rank()}.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
