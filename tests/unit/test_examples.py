"""The demo model, data and TrainModule in examples/: no process group, tiny configs."""
from __future__ import annotations

import math

import pytest
import torch

from zerotrain.examples.data import (
    ByteDataset,
    decode,
    encode,
    load_text,
    split_train_val,
    stdlib_corpus,
)
from zerotrain.examples.gpt import GPT, GPTConfig
from zerotrain.examples.gpt_module import GPTModule, warmup_cosine

TINY = dict(block_size=16, n_layer=2, n_head=2, n_embd=32)


def tiny_config(**overrides) -> GPTConfig:
    return GPTConfig(**{**TINY, **overrides})


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        torch.testing.assert_close(sa[name], sb[name], rtol=0, atol=0, msg=name)


# ---------------------------------------------------------------- config
@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"n_embd": 30, "n_head": 4}, "n_embd=30"),
        ({"n_layer": 0}, "n_layer"),
        ({"vocab_size": -1}, "vocab_size"),
        ({"block_size": 0}, "block_size"),
        ({"dropout": 1.0}, "dropout"),
    ],
)
def test_config_rejects_bad_values(overrides, field):
    with pytest.raises(ValueError, match=field):
        GPTConfig(**overrides)


# ---------------------------------------------------------------- model
def test_lm_head_is_tied_to_token_embedding():
    model = GPT(tiny_config())
    assert model.lm_head.weight is model.wte.weight
    assert model.lm_head.weight.data_ptr() == model.wte.weight.data_ptr()
    # The tie is counted once.
    assert len(list(model.parameters())) == len({id(p) for _, p in model.named_parameters()})


def test_same_seed_gives_identical_models():
    torch.manual_seed(123)
    a = GPT(tiny_config())
    torch.manual_seed(123)
    b = GPT(tiny_config())
    assert_same_weights(a, b)
    torch.manual_seed(124)
    c = GPT(tiny_config())
    assert not torch.equal(a.wte.weight, c.wte.weight)


def test_meta_build_then_to_empty_matches_eager_build():
    cfg = tiny_config(bias=True)
    eager = GPT(cfg)
    torch.manual_seed(7)
    eager.init_weights()

    with torch.device("meta"):
        lazy = GPT(cfg)
    assert lazy.wte.weight.is_meta
    lazy.to_empty(device="cpu")
    torch.manual_seed(7)
    lazy.init_weights()

    assert lazy.lm_head.weight is lazy.wte.weight  # to_empty unties; init_weights re-ties
    assert_same_weights(eager, lazy)


def test_init_weights_values():
    cfg = tiny_config(n_layer=8, n_embd=64, bias=True)
    torch.manual_seed(0)
    model = GPT(cfg)
    block = model.blocks[0]
    assert torch.equal(block.ln_1.weight, torch.ones_like(block.ln_1.weight))
    assert torch.equal(block.attn.c_attn.bias, torch.zeros_like(block.attn.c_attn.bias))
    assert block.attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.1)
    resid_std = 0.02 / math.sqrt(2 * cfg.n_layer)
    assert block.mlp.c_proj.weight.std().item() == pytest.approx(resid_std, rel=0.1)


def test_forward_shapes_and_initial_loss():
    torch.manual_seed(0)
    cfg = tiny_config()
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (3, cfg.block_size))
    logits, loss = model(idx)
    assert logits.shape == (3, cfg.block_size, cfg.vocab_size)
    assert loss is None
    logits, loss = model(idx[:, :5], idx[:, 1:6])
    assert logits.shape == (3, 5, cfg.vocab_size)
    assert loss.dim() == 0
    assert loss.item() == pytest.approx(math.log(cfg.vocab_size), abs=0.2)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, cfg.block_size + 1, dtype=torch.long))


def test_plain_training_reduces_loss_on_a_fixed_batch():
    torch.manual_seed(0)
    cfg = tiny_config()
    model = GPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size))
    y = torch.roll(x, -1, dims=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses


def test_generate_length_and_context_cropping():
    torch.manual_seed(0)
    cfg = tiny_config()
    model = GPT(cfg).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, 3))
    out = model.generate(idx, max_new_tokens=cfg.block_size + 5, top_k=5)  # runs past block_size
    assert out.shape == (2, 3 + cfg.block_size + 5)
    assert torch.equal(out[:, :3], idx)
    assert int(out.min()) >= 0 and int(out.max()) < cfg.vocab_size
    with pytest.raises(ValueError, match="temperature"):
        model.generate(idx, 1, temperature=0.0)


def test_num_params_and_flops():
    cfg = tiny_config()
    model = GPT(cfg)
    C, L, V, T = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.block_size
    # ln_1 (weight only, bias=False), attn qkv + proj, ln_2, mlp fc + proj
    per_block = C + 3 * C * C + C * C + C + 4 * C * C + 4 * C * C
    expected = V * C + T * C + L * per_block + C  # tied lm_head adds nothing
    assert model.num_params() == expected
    assert model.num_params(non_embedding=True) == expected - T * C
    H, Q = cfg.n_head, C // cfg.n_head
    assert model.flops_per_token() == 6 * (expected - T * C) + 12 * L * H * Q * T


# ---------------------------------------------------------------- data
def test_byte_dataset_chunks():
    data = bytes(range(23))  # block_size 4 -> chunks of 5 -> 4 full chunks, 3 bytes dropped
    ds = ByteDataset(data, block_size=4)
    assert len(ds) == 4
    x, y = ds[1]
    assert x.dtype == torch.int64 and y.dtype == torch.int64
    assert x.tolist() == [5, 6, 7, 8] and y.tolist() == [6, 7, 8, 9]
    x, y = ds[-1]
    assert x.tolist() == [15, 16, 17, 18] and y.tolist() == [16, 17, 18, 19]
    with pytest.raises(IndexError):
        ds[4]
    # Exactly one chunk works; one byte less does not.
    assert len(ByteDataset(bytes(5), block_size=4)) == 1
    with pytest.raises(ValueError, match="fewer than one chunk"):
        ByteDataset(bytes(4), block_size=4)
    # A tensor works as well as bytes.
    ds_t = ByteDataset(torch.arange(23), block_size=4)
    assert torch.equal(ds_t[2][0], ds[2][0])


def test_split_train_val_holds_out_the_tail():
    data = bytes(range(100))
    train, val = split_train_val(data, 0.1)
    assert train == data[:90] and val == data[90:]
    train, val = split_train_val(data, 0.0)
    assert train == data and val == b""
    with pytest.raises(ValueError, match="val_fraction"):
        split_train_val(data, 1.0)


def test_encode_decode_round_trip():
    text = "héllo\nworld"
    tokens = encode(text)
    assert tokens.dtype == torch.int64 and len(tokens) == len(text.encode("utf-8"))
    assert decode(tokens) == text
    assert decode(torch.tensor([0xFF, 104])) == "\ufffdh"
    assert decode(encode("")) == ""


def test_stdlib_corpus_is_deterministic_and_bounded():
    a = stdlib_corpus(max_bytes=50_000)
    b = stdlib_corpus(max_bytes=50_000)
    assert len(a) == 50_000
    assert a == b
    assert stdlib_corpus(max_bytes=1_000) == a[:1_000]
    assert b"def " in a or b"import " in a
    with pytest.raises(ValueError, match="max_bytes"):
        stdlib_corpus(max_bytes=0)


def test_load_text(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_bytes(b"abcdefgh")
    assert load_text(str(path), max_bytes=5) == b"abcde"
    assert load_text(None, max_bytes=2_000) == stdlib_corpus(2_000)
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        load_text(str(missing))
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load_text(str(empty))


# ---------------------------------------------------------------- GPTModule
def make_module(tmp_path, **kwargs) -> GPTModule:
    path = tmp_path / "corpus.txt"
    path.write_bytes(stdlib_corpus(20_000))
    defaults = dict(config=tiny_config(), batch_size=4, data_path=str(path), max_bytes=20_000)
    return GPTModule(**{**defaults, **kwargs})


def test_module_builds_model_lazily_and_steps(tmp_path):
    module = make_module(tmp_path)
    assert module.model is None
    module.configure_model()
    model = module.model
    module.configure_model()  # idempotent
    assert module.model is model

    batch = next(iter(module.train_dataloader()))
    x, y = batch
    assert x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    loss = module.training_step(batch, 0)
    assert loss.requires_grad and loss.dim() == 0
    loss.backward()

    val = module.val_dataloader()
    assert len(val.dataset) == 2_000 // 17
    assert module.validation_step(next(iter(val)), 0).dim() == 0
    assert make_module(tmp_path, val_fraction=0.0).val_dataloader() is None


def test_module_meta_configure_model(tmp_path):
    module = make_module(tmp_path)
    with torch.device("meta"):
        module.configure_model()
    assert module.model.wte.weight.is_meta
    module.model.to_empty(device="cpu")
    module.model.init_weights()
    assert module.model.lm_head.weight is module.model.wte.weight


def test_configure_optimizers_groups_and_schedule(tmp_path):
    module = make_module(tmp_path, config=tiny_config(bias=True), lr=1e-3, weight_decay=0.1,
                         warmup_steps=10, max_steps=50, min_lr_ratio=0.1)
    with pytest.raises(RuntimeError, match="configure_model"):
        module.configure_optimizers()
    module.configure_model()
    out = module.configure_optimizers()
    opt, sched = out["optimizer"], out["lr_scheduler"]["scheduler"]
    assert out["lr_scheduler"]["interval"] == "step"

    seen = [p for g in opt.param_groups for p in g["params"]]
    assert len(seen) == len({id(p) for p in seen})  # no parameter twice (tied weight once)
    assert {id(p) for p in seen} == {id(p) for p in module.parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            assert group["weight_decay"] == (0.1 if p.dim() >= 2 else 0.0)

    lrs = []
    for _ in range(60):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(1e-3 / 11)
    assert lrs[10] == pytest.approx(1e-3)
    assert max(lrs) == pytest.approx(1e-3)
    assert lrs[50] == pytest.approx(1e-4)
    assert lrs[59] == pytest.approx(1e-4)
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:11]))  # warmup rises
    assert all(a >= b for a, b in zip(lrs[10:50], lrs[11:51]))  # cosine falls


def test_warmup_cosine_without_warmup():
    assert warmup_cosine(0, 0, 10, 0.1) == pytest.approx(1.0)
    assert warmup_cosine(5, 0, 10, 0.1) == pytest.approx(0.55)
    assert warmup_cosine(10, 0, 10, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(3, 3, 3, 0.2) == pytest.approx(0.2)


def test_module_accounting_and_sample(tmp_path):
    module = make_module(tmp_path)
    assert module.tokens_per_sample() == 16
    flops = module.flops_per_sample()  # works before the model is built
    module.configure_model()
    assert flops == module.model.flops_per_token() * 16
    module.model.train()
    torch.manual_seed(0)
    text = module.sample("def ", max_new_tokens=10)
    assert text.startswith("def ")
    assert len(text) > 4  # 10 bytes decode to at least 3 characters
    assert module.model.training  # mode restored


def test_module_rejects_bad_arguments():
    with pytest.raises(ValueError, match="warmup_steps"):
        GPTModule(warmup_steps=300, max_steps=200)
    with pytest.raises(ValueError, match="lr"):
        GPTModule(lr=0.0)
