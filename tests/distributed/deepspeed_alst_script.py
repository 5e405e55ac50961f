"""An ALST training script (Ulysses sequence parallelism for a Hugging Face model), used as
DeepSpeed's ALST tutorial and tests use it: ``UlyssesSPAttentionHF.register_with_transformers``
returns the ``mpu``, ``deepspeed.initialize(..., mpu=mpu)``, ``UlyssesSPDataLoaderAdapter`` gives
each rank its shard, the shards' losses are combined over the sequence group weighted by their
good tokens (differentiably), then ``engine.backward`` / ``engine.step``. A tiny Llama (GQA 4/2,
untied head), sp = 2. test_deepspeed_alst.py runs it under DeepSpeed 0.19.8 and with its deepspeed
imports renamed to zerotrain.deepspeed.

    python deepspeed_alst_script.py --deepspeed_config ds.json --out result [--sgd] [--loss-backward]

Every rank saves its losses and the whole parameters (gathered at ZeRO-3) to ``<out>.<rank>.pt``.
"""
import argparse

import torch
import torch.distributed.nn.functional as dist_nn
from torch.utils.data import DataLoader, DistributedSampler
from transformers import LlamaConfig, LlamaForCausalLM

import deepspeed
from deepspeed import comm as dist
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

STEPS, SEQ, VOCAB, SP = 4, 16, 32, 2


class Samples(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(100 + i)
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        labels = ids.clone()
        labels[: i % 3] = -100  # a few ignored tokens, unevenly over the shards
        return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(SEQ)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--sgd", action="store_true", help="a client torch SGD (its update shows the gradients' scale)")
    parser.add_argument("--loss-backward", action="store_true", help="loss.backward() rather than engine.backward")
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(7)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False)
    model = LlamaForCausalLM(config)
    mpu = UlyssesSPAttentionHF.register_with_transformers(model_name_or_path=model, core_attn_implementation="sdpa",
                                                          sequence_parallel_size=SP, micro_batch_size=1,
                                                          seq_length=SEQ, seq_length_is_variable=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5) if args.sgd else None
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=optimizer,
                                           config=args.deepspeed_config, mpu=mpu)
    sp_group = mpu.get_sequence_parallel_group()
    sp_size, sp_rank = mpu.get_sequence_parallel_world_size(), mpu.get_sequence_parallel_rank()
    dp_size = dist.get_world_size() // sp_size
    dp_rank = dist.get_rank() // sp_size
    # each rank of a sequence group draws its own samples (the adapter gathers them over the group)
    loader = DataLoader(Samples(), batch_size=1,
                        sampler=DistributedSampler(Samples(), dist.get_world_size(), dist.get_rank(), shuffle=False))
    loader = UlyssesSPDataLoaderAdapter(loader, sp_rank=sp_rank, sp_group=sp_group, sp_world_size=sp_size,
                                        device=engine.device)
    losses = []
    for step, batch in zip(range(STEPS), loader):
        out = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        shift_labels = batch["shift_labels"]
        loss = engine.module.loss_function(logits=out.logits, labels=None, shift_labels=shift_labels,
                                           vocab_size=engine.module.config.vocab_size)
        # the shards' losses weighted by their good tokens, differentiably, over the sequence group
        losses_per_rank = dist_nn.all_gather(loss, group=sp_group)
        good = (shift_labels != -100).sum()
        good_per_rank = dist_nn.all_gather(good, group=sp_group)
        loss = sum(losses_per_rank[r] * good_per_rank[r] for r in range(sp_size)) / sum(good_per_rank)
        if args.loss_backward:
            loss.backward()
        else:
            engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        params = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    torch.save({"losses": torch.tensor(losses), "params": params, "dp": (dp_size, dp_rank)},
               f"{args.out}.{dist.get_rank()}.pt")


if __name__ == "__main__":
    main()
