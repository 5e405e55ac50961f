"""A DeepSpeed AutoTP training script: a tiny Hugging Face Llama (GQA heads, untied head) trained
with ``"tensor_parallel": {"autotp_size": 2}`` in its config, as DeepSpeed's AutoTP training
tutorial writes it. test_deepspeed_autotp.py runs it with DeepSpeed 0.19.8 itself and again with only
its two deepspeed import lines renamed to zerotrain.deepspeed.

    python deepspeed_autotp_script.py --deepspeed_config ds.json --out result [--model qwen2]

Each data-parallel replica (the ranks of one tensor group share it, as DeepSpeed requires) draws its
own batches. Every rank saves its losses, its own parameters (its tensor-parallel shards) and the engine's
train_batch_size and gradient_accumulation_steps to ``<out>.<rank>.pt``.
"""
import argparse
import json

import torch
import transformers

import deepspeed
from deepspeed import comm as dist

STEPS, BATCH, SEQ, VOCAB = 3, 2, 16, 32
#: --model: the Hugging Face families whose GQA attention (4 heads, 2 key-value heads) AutoTP cuts
MODELS = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="llama", choices=sorted(MODELS))
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(7)
    family = MODELS[args.model]
    config = getattr(transformers, f"{family}Config")(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=False, attn_implementation="sdpa")
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=args.deepspeed_config)
    with open(args.deepspeed_config) as f:
        tp = json.load(f).get("tensor_parallel", {}).get("autotp_size", 1)
    replica = dist.get_rank() // tp  # DeepSpeed's mesh: the tensor groups are consecutive ranks
    ids = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(8 + replica))
    losses = []
    for step in range(STEPS):
        loss = engine(input_ids=ids[step], labels=ids[step]).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):  # stage 3: this rank's whole shards
        params = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    batch = torch.tensor([engine.train_batch_size(), engine.gradient_accumulation_steps()])
    torch.save({"losses": torch.tensor(losses), "params": params, "batch": batch}, f"{args.out}.{dist.get_rank()}.pt")


if __name__ == "__main__":
    main()
