"""On 2 processes: load_from_checkpoint of a ddp / zero2 / zero3 / offload / pipeline checkpoint, in
one process, gives the trained weights and predictions; self.all_gather has the shape and values
of Lightning's own gather (run in the same process group); self.print writes on rank 0 only."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from harness import run_ranks_once
from tolerance import EPS32, gamma
from zerotrain import ModelCheckpoint, Trainer, TrainModule
from zerotrain.trainer.checkpoint.consolidate import consolidate

STRATEGIES = ("ddp", "zero2", "zero3", "offload_cpu")
_CACHE: dict = {}


def _data(n: int = 48) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(n, 5, generator=g), torch.randn(n, 2, generator=g))


class Regressor(TrainModule):
    def __init__(self, hidden: int = 9, lr: float = 0.05, depth: int = 2):
        super().__init__()
        self.save_hyperparameters()
        self.gathered: dict = {}

    def configure_model(self):  # built here: zero3 partitions it as it is built
        layers, width = [], 5
        for _ in range(self.hparams.depth):
            layers += [nn.Linear(width, self.hparams.hidden), nn.Tanh()]
            width = self.hparams.hidden
        self.net = nn.Sequential(*layers, nn.Linear(width, 2))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        if batch_idx == 0 and not self.gathered:
            self._gather_like_lightning()
            self.print(f"PRINTED-BY-RANK-{self.global_rank}")
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self):
        return DataLoader(_data(), batch_size=4)

    def _gather_like_lightning(self):
        """Ours next to Lightning's own gather function in this process group."""
        from lightning_fabric.utilities.distributed import _all_gather_ddp_if_available as theirs

        r = self.global_rank
        data = {"t": torch.tensor([r, r + 10.0]), "n": r, "nested": (torch.ones(2, 3) * r, [torch.tensor(r * 1.5)])}
        ours = self.all_gather(data)
        ref = {"t": theirs(data["t"]), "n": theirs(torch.tensor(r)),
               "nested": (theirs(data["nested"][0]), [theirs(data["nested"][1][0])])}
        leaf = torch.full((3,), float(r + 1), requires_grad=True)
        ours_g = self.all_gather(leaf * 2, sync_grads=True)
        ours_g.pow(2).sum().backward()
        ours_grad, leaf.grad = leaf.grad.clone(), None
        theirs_g = theirs(leaf * 2, sync_grads=True)
        theirs_g.pow(2).sum().backward()
        self.gathered = {"ours": ours, "ref": ref, "sync": [ours_g.detach(), theirs_g.detach()],
                         "grads": [ours_grad, leaf.grad.clone()]}


class WithExtra(Regressor):
    def configure_model(self):
        super().configure_model()
        self.extra = nn.Linear(1, 1)


def _fit_and_predict(strategy: str, root: str) -> dict:
    torch.manual_seed(0)
    module = Regressor(hidden=11)
    trainer = Trainer(strategy=strategy, devices=2, max_steps=5, logger=False, enable_progress_bar=False,
                      enable_model_summary=False,
                      callbacks=[ModelCheckpoint(dirpath=os.path.join(root, "ck"), save_last=True)])
    trainer.fit(module)
    full = trainer.full_state_dict()
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(9))
    preds = trainer.predict(module, DataLoader(TensorDataset(x), batch_size=2))  # rank r: samples r, r+2, ...
    if trainer.is_global_zero:
        consolidate(os.path.join(root, "ck"), os.path.join(root, "model.safetensors"))
    trainer.strategy.barrier()
    return {"full": full, "x": x, "preds": torch.cat(preds), "gathered": module.gathered}


def _run(strategy, tmp_path_factory):
    """One spawn per strategy, shared by the tests below: (its output folder, every rank's result)."""
    root = _CACHE.setdefault(("root", strategy), tmp_path_factory.mktemp(f"conv_{strategy}"))
    out = run_ranks_once(_CACHE, strategy, "test_module_conveniences:_fit_and_predict", 2, tmp_path_factory,
                         timeout=180, strategy=strategy, root=str(root))
    return root, out


def _forward_bound(net: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """Twice the forward error of fp32 evaluations of ``net`` (Linear and Tanh layers) at ``x``: a Linear
    of fan-in k adds gamma(k + 1) x (|W||h| + |b|) and carries the input's error through |W|; Tanh (1-Lipschitz)
    carries it and adds its own 1 ulp (<= eps |tanh|). Two evaluations differ by at most twice that."""
    h, err = x.double(), torch.zeros_like(x, dtype=torch.float64)
    for layer in net:
        if isinstance(layer, nn.Linear):
            w, b = layer.weight.detach().double(), layer.bias.detach().double()
            err = err @ w.abs().T + gamma(w.shape[1] + 1) * (h.abs() @ w.abs().T + b.abs())
            h = h @ w.T + b
        else:
            assert isinstance(layer, nn.Tanh), layer
            h = torch.tanh(h)
            err = err + EPS32 * h.abs()
    return 2 * err


@pytest.mark.parametrize("strategy", [s if s in ("ddp", "zero3") else pytest.param(s, marks=pytest.mark.slow)
                                      for s in STRATEGIES])
def test_load_from_checkpoint_of_two_ranks_gives_the_trained_module(strategy, tmp_path_factory):
    root, out = _run(strategy, tmp_path_factory)
    full = out[0]["full"]
    for path in (root / "ck", root / "model.safetensors"):
        loaded = Regressor.load_from_checkpoint(str(path))
        assert loaded.hparams.hidden == 11
        state = loaded.state_dict()
        assert state.keys() == full.keys()
        for k, v in full.items():
            assert torch.equal(state[k], v), (path, k)
        reference = Regressor(hidden=11)
        reference.configure_model()
        reference.load_state_dict(full)
        with torch.no_grad():
            assert torch.equal(loaded(out[0]["x"]), reference(out[0]["x"]))
            for r in range(2):  # each rank predicted every other sample, 2 at a time, with the sharded model
                mine = out[0]["x"][r::2]
                preds = torch.cat([loaded(mine[i:i + 2]) for i in range(0, len(mine), 2)])
                # tolerance: another process's kernels: both within a forward-error bound of the exact MLP
                diff = (preds.double() - out[r]["preds"].double()).abs()
                assert bool((diff <= _forward_bound(loaded.net, mine)).all()), diff.max()


@pytest.mark.parametrize("strategy", ["zero3"])
def test_load_from_checkpoint_overrides(strategy, tmp_path_factory):
    root, _ = _run(strategy, tmp_path_factory)
    loaded = Regressor.load_from_checkpoint(str(root / "ck"), lr=0.5, map_location="cpu")
    assert loaded.hparams.lr == 0.5 and loaded.hparams.hidden == 11
    with pytest.raises(RuntimeError, match="size mismatch"):
        Regressor.load_from_checkpoint(str(root / "ck"), hidden=4)
    with pytest.raises(RuntimeError, match="Missing key"):
        WithExtra.load_from_checkpoint(str(root / "ck"))
    loose = WithExtra.load_from_checkpoint(str(root / "ck"), strict=False)
    assert torch.equal(loose.net[0].weight, loaded.net[0].weight)


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_all_gather_matches_lightnings(strategy, tmp_path_factory):
    _, out = _run(strategy, tmp_path_factory)
    for r in range(2):
        g = out[r]["gathered"]
        ours, ref = g["ours"], g["ref"]
        assert ours["t"].shape == (2, 2) and torch.equal(ours["t"], ref["t"])
        assert torch.equal(ours["t"], torch.tensor([[0.0, 10.0], [1.0, 11.0]]))
        assert torch.equal(ours["n"], ref["n"]) and torch.equal(ours["n"], torch.tensor([0, 1]))
        assert isinstance(ours["nested"], tuple) and ours["nested"][0].shape == (2, 2, 3)
        assert torch.equal(ours["nested"][0], ref["nested"][0])
        assert torch.equal(ours["nested"][1][0], ref["nested"][1][0])
        assert torch.equal(g["sync"][0], g["sync"][1])
        assert torch.equal(g["grads"][0], g["grads"][1])  # sync_grads: the same gradient as Lightning's


@pytest.mark.parametrize("strategy", ["ddp"])
def test_print_only_on_rank_zero(strategy, tmp_path_factory):
    root, _ = _run(strategy, tmp_path_factory)
    logs = sorted(p for p in root.parent.glob("w2_*/rank_*.log"))
    text = {p.name: p.read_text() for p in logs}
    assert any("PRINTED-BY-RANK-0" in t for n, t in text.items() if n == "rank_0.log")
    assert not any("PRINTED-BY-RANK-1" in t for t in text.values())


# ---------------------------------------------------------------------------- a pipeline checkpoint

def _mlp(hidden: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 2))


class PipeRegressor(TrainModule):
    def __init__(self, hidden: int = 9):
        super().__init__()
        from zerotrain.strategies.pipeline import PipelineModule

        self.save_hyperparameters()
        self.pipe = PipelineModule.from_sequential(_mlp(hidden), 2, loss_fn=nn.functional.mse_loss)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class PlainRegressor(TrainModule):
    """The same layers in one process: a pipeline module holds only its stage's layers, so its
    checkpoint loads into a plain class, whose on_load_checkpoint maps the names."""

    def __init__(self, hidden: int = 9):
        super().__init__()
        self.save_hyperparameters()
        self.net = _mlp(hidden)

    def on_load_checkpoint(self, checkpoint):
        state = checkpoint["state_dict"]
        for key in list(state):
            state["net." + key[len("pipe."):]] = state.pop(key)


def _fit_pipeline(root: str) -> dict:
    from zerotrain.strategies import PipelineStrategy

    module = PipeRegressor(hidden=7)
    trainer = Trainer(strategy=PipelineStrategy(stages=2, micro_batches=2), devices=2, max_steps=3, logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[ModelCheckpoint(dirpath=os.path.join(root, "ck"), save_last=True)])
    trainer.fit(module, DataLoader(_data(), batch_size=4))
    return {"full": trainer.full_state_dict()}


def test_load_from_a_pipeline_checkpoint_into_a_plain_module(tmp_path):
    from harness import run_ranks

    out = run_ranks("test_module_conveniences:_fit_pipeline", 2, tmp_path, timeout=180, root=str(tmp_path))
    full = out[0]["full"]
    loaded = PlainRegressor.load_from_checkpoint(str(tmp_path / "ck"))
    assert loaded.hparams.hidden == 7
    state = loaded.state_dict()
    assert sorted(state) == sorted("net." + k[len("pipe."):] for k in full)
    for k, v in full.items():
        assert torch.equal(state["net." + k[len("pipe."):]], v), k
    assert not torch.equal(state["net.0.weight"], _mlp(7)[0].weight)  # trained
