"""A Hugging Face causal language model as a TrainModule, and text data for it: what
``zerotrain-train model=llama_tiny data=lm_text`` trains (``conf/model/llama_tiny.yaml``)::

    zerotrain-train model=llama_tiny data=lm_text strategy=zero3 trainer.devices=2 \\
        model.model.config.num_hidden_layers=4 data.path=/path/to/any.txt

``CausalLMModule(model=...)`` takes what builds the network: a callable that returns it (Hydra's
``_partial_: true`` of ``transformers.AutoModelForCausalLM.from_config`` with a ``transformers``
config, as the YAML does), called in ``configure_model()`` so that under zero3 the model is built
partitioned (``strategies/zero/stage3/materialize.py``), or an ``nn.Module`` already built. Its loss is the
next-token cross-entropy; validation logs ``val_loss`` and ``val_ppl`` (the perplexity); ``sample``
greedily continues a prompt through ``transformers``' ``generate``, on every rank (under zero3 each
forward gathers the parameters, so every rank runs the same number of steps).

``TextData`` reads a text file (or, with no path, the Python standard library's source) as
tokens of a tokenizer saved locally (``tokenizer=/path``, ``AutoTokenizer.from_pretrained`` with
``local_files_only``) or as bytes (vocabulary 256, the default model's). transformers is the
``hf`` extra; it is imported only when these are used.
"""
from __future__ import annotations

import glob
import os
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from ..api.datamodule import DataModule
from ..api.module import TrainModule


def _tokenizer(path: Optional[str]):
    if path is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def encode(text: str, tokenizer: Any = None) -> list[int]:
    return list(text.encode("utf-8")) if tokenizer is None else tokenizer.encode(text, add_special_tokens=False)


def decode(ids: list[int], tokenizer: Any = None) -> str:
    return bytes(ids).decode("utf-8", errors="replace") if tokenizer is None else tokenizer.decode(ids)


class CausalLMModule(TrainModule):
    """A causal LM (``model``: a callable building it, or the module) trained on next-token
    cross-entropy with AdamW."""

    def __init__(self, model: Union[Callable[[], nn.Module], nn.Module, Any], lr: float = 3e-3,
                 weight_decay: float = 0.0, tokenizer: Optional[str] = None) -> None:
        super().__init__()
        if not (callable(model) or isinstance(model, nn.Module)):
            raise ValueError(f"CausalLMModule: model={model!r}; valid: a callable that builds the model, or the "
                             "model (e.g. transformers.AutoModelForCausalLM.from_config with _partial_: true)")
        if not lr > 0:
            raise ValueError(f"CausalLMModule: lr={lr!r}; valid: a number > 0")
        self.save_hyperparameters(ignore=["model"])
        self.net: Optional[nn.Module] = model if isinstance(model, nn.Module) else None
        self._build = None if isinstance(model, nn.Module) else model
        self.tokenizer_path = tokenizer

    def configure_model(self) -> None:
        if self.net is None:  # idempotent: a strategy may call it after the user did
            self.net = self._build()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=ids).logits

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_ppl", torch.exp(loss.detach()), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)

    @torch.no_grad()
    def sample(self, prompt: str, max_new_tokens: int = 50) -> str:
        """``prompt`` and ``max_new_tokens`` greedy tokens after it. Every rank calls it."""
        tok = _tokenizer(self.tokenizer_path)
        ids = torch.tensor([encode(prompt, tok)], device=self.device)
        was_training = self.net.training
        self.net.eval()
        try:
            out = self.net.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                    min_new_tokens=max_new_tokens, do_sample=False,
                                    pad_token_id=getattr(tok, "pad_token_id", None) or 0)
        finally:
            self.net.train(was_training)
        return decode(out[0].tolist(), tok)


class _Chunks(Dataset):
    def __init__(self, ids: torch.Tensor, block_size: int) -> None:
        self.ids, self.block = ids, block_size

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.block

    def __getitem__(self, i: int):
        chunk = self.ids[i * self.block:(i + 1) * self.block + 1]
        return chunk[:-1], chunk[1:]


def _stdlib_text(max_bytes: int) -> str:
    out, size = [], 0
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            out.append(f.read())
        size += len(out[-1])
        if size >= max_bytes:
            break
    return "".join(out)


class TextData(DataModule):
    """A text file (``path``; None: the standard library's source) cut into ``block_size``-token
    sequences; the last ``val_fraction`` of them is the validation set."""

    def __init__(self, path: Optional[str] = None, block_size: int = 64, batch_size: int = 8,
                 max_bytes: int = 200_000, val_fraction: float = 0.1, tokenizer: Optional[str] = None) -> None:
        super().__init__()
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"TextData: path={path!r} is not a file; valid: a text file, or null "
                             "(the standard library)")
        if block_size < 1 or batch_size < 1 or max_bytes < 1 or not 0 <= val_fraction < 1:
            raise ValueError("TextData: block_size, batch_size and max_bytes must be >= 1 and val_fraction in [0, 1); "
                             f"got {block_size}, {batch_size}, {max_bytes}, {val_fraction}")
        self.path, self.block_size, self.batch_size = path, block_size, batch_size
        self.max_bytes, self.val_fraction, self.tokenizer = max_bytes, val_fraction, tokenizer

    def setup(self, stage: Optional[str] = None) -> None:
        if getattr(self, "_train", None) is not None:
            return
        if self.path is None:
            text = _stdlib_text(self.max_bytes)[: self.max_bytes]
        else:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                text = f.read(self.max_bytes)
        ids = torch.tensor(encode(text, _tokenizer(self.tokenizer)), dtype=torch.long)
        n = (len(ids) - 1) // self.block_size
        n_val = int(n * self.val_fraction)
        cut = (n - n_val) * self.block_size
        self._train = _Chunks(ids[: cut + 1], self.block_size)
        self._val = _Chunks(ids[cut:], self.block_size) if n_val else None

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._train, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self):
        return DataLoader(self._val, batch_size=self.batch_size) if self._val is not None else []
