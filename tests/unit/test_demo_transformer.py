"""zerotrain.demos.Transformer / WikiText2 against ``lightning.pytorch.demos`` (Lightning's
examples/fabric/language_model trains them): one seed gives the same initial weights (parameters
created in the same order), the same forward (dropout draws included) and gradients, and the same
tokenized data. Skipped where lightning is not installed."""
from __future__ import annotations

import importlib

import pytest
import torch
from torch.nn import functional as F

from zerotrain.demos import Transformer, WikiText2


SMALL = dict(vocab_size=50, ninp=16, nhead=2, nhid=24, nlayers=2, dropout=0.2)


def _lightning():
    return pytest.importorskip("lightning.pytorch.demos.transformer")


def _pair(**kwargs):
    theirs = _lightning()
    torch.manual_seed(7)
    ref = theirs.Transformer(**kwargs)
    after_ref = torch.get_rng_state()
    torch.manual_seed(7)
    mine = Transformer(**kwargs)
    assert torch.equal(torch.get_rng_state(), after_ref)  # as many draws: what the script draws next is the same
    return ref, mine


@pytest.mark.parametrize("kwargs", [{}, SMALL], ids=["defaults", "small"])
def test_one_seed_builds_lightnings_initial_weights(kwargs):
    ref, mine = _pair(**kwargs)
    assert [n for n, _ in mine.named_parameters()] == [n for n, _ in ref.named_parameters()]
    for (name, a), b in zip(ref.state_dict().items(), mine.state_dict().values()):
        assert torch.equal(a, b), name


def test_forward_and_gradients_are_lightnings():
    ref, mine = _pair(**SMALL)
    g = torch.Generator().manual_seed(0)
    inputs, target = torch.randint(0, 50, (4, 9), generator=g), torch.randint(0, 50, (4, 9), generator=g)
    outs = []
    for model in (ref, mine):
        torch.manual_seed(3)  # the dropout masks
        out = model(inputs, target)
        F.nll_loss(out, target.view(-1)).backward()
        model.eval()
        with torch.no_grad():
            evaluated = model(inputs, target, mask=None)
        outs.append((out.detach(), evaluated, [p.grad for p in model.parameters()]))
    (a, ea, ga), (b, eb, gb) = outs
    assert b.shape == (4 * 9, 50)
    assert torch.equal(a, b) and torch.equal(ea, eb)
    assert all(torch.equal(x, y) for x, y in zip(ga, gb))
    # the position code is the table's row at the sequence length, for every position (Lightning's)
    assert torch.equal(mine.pos_encoder.pe, ref.pos_encoder.pe)


def test_wikitext2_tokenizes_as_lightnings(tmp_path):
    theirs = _lightning()
    (tmp_path / "wikitext-2.txt").write_text("the cat sat\n\n on the mat .\nthe end\n" * 7, encoding="utf8")
    ref, mine = theirs.WikiText2(data_dir=tmp_path, block_size=5, download=False), WikiText2(tmp_path, 5)
    assert torch.equal(ref.data, mine.data)
    assert ref.dictionary.idx2word == mine.dictionary.idx2word and ref.vocab_size == mine.vocab_size == 8
    assert len(ref) == len(mine) and all(torch.equal(x, y) for i in range(len(ref)) for x, y in zip(ref[i], mine[i]))


def test_wikitext2_never_downloads_and_takes_token_ids(tmp_path):
    with pytest.raises(FileNotFoundError, match="wikitext-2.txt does not exist.*does not download"):
        WikiText2(data_dir=tmp_path)
    assert not list(tmp_path.iterdir())
    ids = torch.arange(36 * 3) % 11
    data = WikiText2.from_tokens(ids, vocab_size=20)
    assert data.vocab_size == 20 and len(data) == 36 * 3 // 35 - 1
    x, y = data[1]
    assert torch.equal(x, ids[35:70]) and torch.equal(y, ids[36:71])
    with pytest.raises(ValueError, match=r"ids range over \[0, 10\]; valid: ids in \[0, vocab_size=5\)"):
        WikiText2.from_tokens(ids, vocab_size=5)


def test_lightnings_module_path():
    module = importlib.import_module("zerotrain.demos.transformer")
    assert module.Transformer is Transformer and module.WikiText2 is WikiText2
