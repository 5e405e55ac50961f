"""``zerotrain.demos.Transformer`` / ``WikiText2`` (also ``zerotrain.demos.transformer``): the small
language model and word-level data set of ``lightning.pytorch.demos`` (Lightning's
``examples/fabric/language_model`` trains them), with the same constructor arguments, the same
forward and the same parameters created in the same order, so one seed gives the same initial
weights and the same numbers as Lightning's demo. Our own code; for examples and tests only.

Differences, deliberate: ``WikiText2`` never downloads (zerotrain makes no network calls): it reads
``data_dir/wikitext-2.txt`` when that file is there, or takes token ids directly
(``WikiText2.from_tokens``, e.g. random ids of WikiText-2's shapes for a test)."""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from ..api.module import TrainModule

#: the vocabulary size of WikiText-2's training text (the default of ``Transformer``)
WIKITEXT2_VOCAB = 33278


def causal_mask(size: int) -> Tensor:
    """A float ``size x size`` mask: 0 on and below the diagonal, -inf above (no look-ahead)."""
    return torch.full((size, size), float("-inf")).triu(diagonal=1)


class PositionalEncoding(nn.Module):
    """Adds a sinusoidal position code to ``x`` (batch, time, dim), then dropout. As in Lightning's
    demo, the code added is the table's row number ``time`` (the sequence length), the same row at
    every position, broadcast; the table (``max_len`` rows) is built on the input's device at the
    first call and kept as a plain attribute (not a buffer, not a parameter)."""

    def __init__(self, dim: int, dropout: float = 0.1, max_len: int = 5000) -> None:
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        self.dim, self.max_len = dim, max_len
        self.pe: Tensor | None = None

    def table(self, device: torch.device) -> Tensor:
        """The ``(1, max_len, dim)`` table: sin in the even columns, cos in the odd ones."""
        position = torch.arange(self.max_len, dtype=torch.float, device=device)[:, None]
        rate = torch.exp(torch.arange(0, self.dim, 2, device=device).float() * (-math.log(10000.0) / self.dim))
        out = torch.zeros(self.max_len, self.dim, device=device)
        out[:, 0::2] = torch.sin(position * rate)
        out[:, 1::2] = torch.cos(position * rate)
        return out[None]

    def forward(self, x: Tensor) -> Tensor:
        if self.pe is None:
            self.pe = self.table(x.device)
        return self.dropout(x + self.pe[:, x.size(1)])


class Transformer(nn.Module):
    """Encoder-decoder ``nn.Transformer`` language model: ``forward(inputs, target, mask=None)``
    embeds both token-id tensors (batch, time), scaled by sqrt(ninp) and position-coded, runs the
    transformer with a causal target mask (``mask`` when given) and returns log-probabilities of
    shape (batch * time, vocab_size), ready for ``F.nll_loss(out, target.view(-1))``.

    Submodules (and so parameters and their random draws) in Lightning's order: ``pos_encoder``,
    ``embedding``, ``transformer`` (batch_first), ``decoder``."""

    def __init__(self, vocab_size: int = WIKITEXT2_VOCAB, ninp: int = 200, nhead: int = 2, nhid: int = 200,
                 nlayers: int = 2, dropout: float = 0.2) -> None:
        super().__init__()
        self.pos_encoder = PositionalEncoding(ninp, dropout)
        self.embedding = nn.Embedding(vocab_size, ninp)
        self.transformer = nn.Transformer(d_model=ninp, nhead=nhead, num_encoder_layers=nlayers,
                                          num_decoder_layers=nlayers, dim_feedforward=nhid, dropout=dropout,
                                          batch_first=True)
        self.decoder = nn.Linear(ninp, vocab_size)
        self.ninp, self.vocab_size = ninp, vocab_size
        self.src_mask: Tensor | None = None  # the causal mask of the last source length (kept, as Lightning's)

    @staticmethod
    def generate_square_subsequent_mask(size: int) -> Tensor:
        return causal_mask(size)

    def _embed(self, tokens: Tensor) -> Tensor:
        return self.pos_encoder(self.embedding(tokens) * math.sqrt(self.ninp))

    def forward(self, inputs: Tensor, target: Tensor, mask: Tensor | None = None) -> Tensor:
        length = inputs.shape[1]
        if self.src_mask is None or self.src_mask.size(0) != length:
            self.src_mask = causal_mask(length).to(inputs.device)
        if mask is None:
            mask = causal_mask(length).to(inputs.device)
        hidden = self.transformer(self._embed(inputs), self._embed(target), tgt_mask=mask)
        return F.log_softmax(self.decoder(hidden), dim=-1).view(-1, self.vocab_size)


class Dictionary:
    """Words <-> ids, in order of first appearance."""

    def __init__(self) -> None:
        self.word2idx: dict[str, int] = {}
        self.idx2word: list[str] = []

    def add_word(self, word: str) -> int:
        if word not in self.word2idx:
            self.word2idx[word] = len(self.idx2word)
            self.idx2word.append(word)
        return self.word2idx[word]

    def __len__(self) -> int:
        return len(self.idx2word)


def tokenize(path: Path | str) -> tuple[Tensor, Dictionary]:
    """The file's words, each line followed by ``<eos>``, as one int64 tensor of ids (ids given in
    order of first appearance), and the dictionary."""
    dictionary, ids = Dictionary(), []
    with open(path, encoding="utf8") as f:
        for line in f:
            ids.extend(dictionary.add_word(w) for w in [*line.split(), "<eos>"])
    return torch.tensor(ids, dtype=torch.int64), dictionary


class WikiText2(Dataset):
    """Blocks of ``block_size`` consecutive token ids: sample ``i`` is ``(ids[i*b : i*b+b],
    ids[i*b+1 : i*b+b+1])`` (the target is the input shifted by one); ``len`` is
    ``len(ids) // block_size - 1``; ``vocab_size`` is the dictionary's size.

    Reads ``data_dir/wikitext-2.txt`` (PyTorch examples' ``word_language_model`` WikiText-2
    ``train.txt``). It does not download: with the file missing, ``download=True`` (the default,
    as Lightning's) or not, it is a clear error naming the path. ``WikiText2.from_tokens`` builds
    it from ids instead."""

    def __init__(self, data_dir: Path | str = Path("./data"), block_size: int = 35, download: bool = True) -> None:
        super().__init__()
        self.path = Path(data_dir) / "wikitext-2.txt"
        if not os.path.exists(self.path):
            raise FileNotFoundError(
                f"WikiText2: {self.path} does not exist (download={download!r}: zerotrain does not download); "
                "valid: put WikiText-2's train.txt there, or build the data set from token ids with "
                "WikiText2.from_tokens(ids, vocab_size)")
        self.data, self.dictionary = tokenize(self.path)
        self.block_size = block_size

    @classmethod
    def from_tokens(cls, tokens: Tensor, vocab_size: int | None = None, block_size: int = 35) -> "WikiText2":
        """The data set over the 1-d int64 ``tokens`` (e.g. random ids of WikiText-2's shapes); its
        dictionary names id ``k`` ``"<k>"`` for ``k < vocab_size`` (default: the largest id + 1)."""
        tokens = torch.as_tensor(tokens, dtype=torch.int64).flatten()
        size = int(tokens.max()) + 1 if vocab_size is None else vocab_size
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= size):
            raise ValueError(f"WikiText2.from_tokens: ids range over [{int(tokens.min())}, {int(tokens.max())}]; "
                             f"valid: ids in [0, vocab_size={size})")
        self = cls.__new__(cls)
        Dataset.__init__(self)
        self.path, self.data, self.block_size = None, tokens, block_size
        self.dictionary = Dictionary()
        for k in range(size):
            self.dictionary.add_word(f"<{k}>")
        return self

    @property
    def vocab_size(self) -> int:
        return len(self.dictionary)

    def __len__(self) -> int:
        return len(self.data) // self.block_size - 1

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = index * self.block_size
        return self.data[start:start + self.block_size], self.data[start + 1:start + self.block_size + 1]


class LightningTransformer(TrainModule):
    """``Transformer`` as a TrainModule: NLL loss of the next token, SGD(lr=0.1), WikiText2 loader."""

    def __init__(self, vocab_size: int = WIKITEXT2_VOCAB) -> None:
        super().__init__()
        self.model = Transformer(vocab_size=vocab_size)

    def forward(self, inputs: Tensor, target: Tensor) -> Tensor:
        return self.model(inputs, target)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, target = batch
        return F.nll_loss(self(inputs, target), target.view(-1))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.model.parameters(), lr=0.1)

    def prepare_data(self) -> None:
        WikiText2(download=True)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(WikiText2())


__all__ = ["Dictionary", "LightningTransformer", "PositionalEncoding", "Transformer", "WikiText2", "tokenize"]
