"""Lightning's stages and DataModule on 2 real processes, under ddp, zero2 and zero3 (whose forward
gathers parameters collectively, so every rank runs the evaluation loop together), and the
training sample order per rank and epoch against pytorch-lightning 2.6's own ddp run."""
from __future__ import annotations

import logging
import os
import time

import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Sampler, SequentialSampler, TensorDataset

from harness import run_ranks
from tolerance import assert_no_worse_than_peer, backward_as_ranks, mean_rtol, peer_bound
from toy import build_net, global_batches, make_data

N, BS = 64, 4  # 64 samples / (4 x 2 ranks): no padding, every batch full
QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False)


def _indexed(n: int = N) -> TensorDataset:
    x, y = make_data(n).tensors
    return TensorDataset(torch.arange(n), x, y)


def _stage_module(build_late: bool):
    from zerotrain import TrainModule

    class StageNet(TrainModule):
        """The net built in ``__init__`` (eager) or in ``configure_model`` (partitioned under zero3),
        after each rank seeded differently: every rank must still start from one model."""

        def __init__(self) -> None:
            super().__init__()
            if not build_late:
                self.net = build_net()

        def configure_model(self) -> None:
            if build_late and not hasattr(self, "net"):
                self.net = build_net()

        def _loss(self, batch):
            _, x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def training_step(self, batch, batch_idx):
            return self._loss(batch)

        # sync_dist: the mean over both ranks' batches (without it each rank keeps its own, as Lightning)
        def validation_step(self, batch, batch_idx):
            self.log("val_mse", self._loss(batch), sync_dist=True)

        def test_step(self, batch, batch_idx):
            self.log("test_mse", self._loss(batch), sync_dist=True)

        def predict_step(self, batch, batch_idx, dataloader_idx=0):
            return batch[0], self.net(batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return StageNet()


def _datamodule(marker: str):
    from zerotrain import DataModule

    class Data(DataModule):
        def prepare_data(self):  # slow on purpose: the other rank must wait at the barrier
            with open(marker, "a") as f:
                f.write(f"{self.trainer.global_rank}\n")
            time.sleep(0.5)
            os.replace(marker, marker + ".done")

        def setup(self, stage):
            assert os.path.exists(marker + ".done"), "setup ran before prepare_data finished"
            self.ds = _indexed()

        def train_dataloader(self):
            return DataLoader(self.ds, batch_size=BS)

        def test_dataloader(self):
            return DataLoader(self.ds, batch_size=BS)

        def predict_dataloader(self):
            return DataLoader(self.ds, batch_size=BS)

    return Data()


class _Said(logging.Handler):
    """The zerotrain logger's warnings on this rank (the differences Lightning users are told)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _stages_case(strategy: str, build_late: bool, root: str):
    from zerotrain import ModelSummary, Trainer

    rank = int(os.environ["RANK"])
    torch.manual_seed(100 + rank)  # the user seeded each rank differently; the Trainer must not re-seed
    said = _Said()
    logging.getLogger("zerotrain").addHandler(said)
    module = _stage_module(build_late)
    trainer = Trainer(strategy=strategy, devices=2, accelerator="cpu", max_steps=3, **QUIET,
                      default_root_dir=root)
    dm = _datamodule(os.path.join(root, "prepared"))
    trainer.fit(module, datamodule=dm)  # its training loader does not shuffle: said on rank 0
    weights = trainer.full_state_dict()  # rank 0 only
    test = trainer.test(module, verbose=False)  # the attached datamodule's loader
    val = trainer.validate(module, DataLoader(_indexed(), batch_size=BS), verbose=False)
    preds = trainer.predict(module)
    odd = trainer.predict(module, DataLoader(_indexed(N - 1), batch_size=BS))  # one sample repeated, said
    ds = _indexed()
    own = trainer.predict(module, DataLoader(ds, batch_sampler=BatchSampler(SequentialSampler(ds), 16, False)))
    summary = next(c for c in trainer.callbacks if isinstance(c, ModelSummary))
    return {"weights": weights, "test": test, "val": val,
            "pred_index": torch.cat([p[0] for p in preds]), "pred": torch.cat([p[1] for p in preds]),
            "odd_index": torch.cat([p[0] for p in odd]), "own_index": torch.cat([p[0] for p in own]),
            "bytes_per_rank": summary.bytes_per_rank, "said": said.lines}


def _reference(as_ranks: int = 0) -> dict:
    """Rank 0's model (seeded 100), 3 plain SGD steps on the global batches of 2 x 4 samples.
    ``as_ranks=k``: the peer, each gradient summed as torch DDP sums it on k ranks."""
    torch.manual_seed(100)
    net = build_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    _, x, y = _indexed().tensors
    # the loader does not shuffle, yet Lightning's training DistributedSampler does (seed 0, epoch 0)
    for idx in global_batches(N, 2, BS)[:3]:
        opt.zero_grad()
        if as_ranks:  # each rank's own share, summed as torch DDP sums it
            backward_as_ranks(net.parameters(), [(x[idx], y[idx])],
                              lambda b: nn.functional.mse_loss(net(b[0]), b[1]), as_ranks)
        else:
            nn.functional.mse_loss(net(x[idx]), y[idx]).backward()
        opt.step()
    with torch.no_grad():
        mse = float(nn.functional.mse_loss(net(x), y))
        return {"net": net, "mse": mse, "pred": net(x)}


#: ddp, zero2 and zero3 (built late) by default; zero1 and offload are `slow` (the suite's time)
@pytest.mark.parametrize("strategy,build_late", [
    ("ddp", False), ("zero3", True), ("zero2", False),
    pytest.param("zero1", False, marks=pytest.mark.slow), pytest.param("offload_cpu", False, marks=pytest.mark.slow)])
def test_stages_on_two_ranks(tmp_path, strategy, build_late):
    out = run_ranks("test_stages:_stages_case", 2, tmp_path, timeout=180, strategy=strategy,
                    build_late=build_late, root=str(tmp_path))
    ref, peer = _reference(), _reference(as_ranks=2)
    assert (tmp_path / "prepared.done").read_text() == "0\n"  # prepare_data: local rank 0 only, once
    got = out[0]["weights"]
    # tolerance: no worse than torch DDP's order of the same sums (tolerance.PEER_FACTOR x its error + 4 ulps)
    assert_no_worse_than_peer({k.removeprefix("net."): v for k, v in got.items() if k.startswith("net.")},
                              ref["net"].state_dict(), peer["net"].state_dict())  # rank 0's initial weights, trained
    # tolerance: as the weights, + 2 mean_rtol(N x 3) for two orders of the same mean of squares
    mse_bound = peer_bound(abs(peer["mse"] - ref["mse"]) / ref["mse"], floor=2 * mean_rtol(N * 3))
    for r in range(2):
        assert [list(d) for d in out[r]["test"]] == [["test_mse"]]
        # tolerance: mse_bound (above): no worse than torch DDP's order (PEER_FACTOR x) + 2 mean_rtol(N x 3)
        assert out[r]["test"][0]["test_mse"] == pytest.approx(ref["mse"], rel=mse_bound)
        assert out[r]["val"][0]["val_mse"] == pytest.approx(ref["mse"], rel=mse_bound)
        index = out[r]["pred_index"]  # each rank predicts its own share, in order
        assert torch.equal(index, torch.arange(r, N, 2))
        # tolerance: no worse than torch DDP's order (the predictions of the weights above)
        assert_no_worse_than_peer(out[r]["pred"], ref["pred"][index], peer["pred"][index], f"rank {r} pred")
        # 63 samples: rank 1's share is padded with sample 0; an own batch_sampler is every rank's whole
        assert torch.equal(out[r]["odd_index"], torch.tensor(list(range(r, N - 1, 2)) + [0] * r))
        assert torch.equal(out[r]["own_index"], torch.arange(N))
    said = "\n".join(out[0]["said"])
    assert "the training DataLoader does not shuffle: its DistributedSampler shuffles anyway" in said
    assert "predict: 63 samples on 2 ranks: the DistributedSampler repeats 1 sample(s)" in said
    assert "the predict DataLoader has its own batch_sampler (BatchSampler): zerotrain keeps it" in said
    assert not out[1]["said"]  # said once, by global rank 0
    # ModelSummary: the bytes each rank holds; zero3 partitions the parameters over the 2 ranks
    full = sum(p.numel() for p in ref["net"].parameters()) * 4
    held = out[0]["bytes_per_rank"]["params"]
    if strategy == "zero3":
        assert full / 2 <= held < 0.55 * full, (held, full)
    else:  # whole on every rank (a flat buffer may pad it to its alignment)
        assert full <= held <= full + 64, (held, full)


# ---------------------------------------------------------------------------- sample order vs Lightning
EPOCHS = 3


def _order_dataset() -> TensorDataset:
    return TensorDataset(torch.arange(N).float().unsqueeze(1), torch.zeros(N, 1))


class EpochStrided(Sampler):
    """A sampler of the user's own: 31 of the N indices (an odd count: rank 1's share is padded),
    every third from the epoch on, so its order changes only if ``set_epoch`` reaches it."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return 31

    def __iter__(self):
        return iter([(self.epoch + 3 * i) % N for i in range(31)])


def _custom_loaders() -> tuple[DataLoader, DataLoader]:
    """Training and validation loaders over their own samplers (Lightning wraps both; the training
    one with its positions shuffled, the validation one not)."""
    return (DataLoader(_order_dataset(), batch_size=BS, sampler=EpochStrided()),
            DataLoader(_order_dataset(), batch_size=BS, sampler=EpochStrided()))


def _record(base):
    """The module both libraries fit: each batch's sample ids, with the epoch (and "val")."""

    class Net(base):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(1, 1)
            self.seen = []

        def training_step(self, batch, batch_idx):
            self.seen.append((self.current_epoch, batch[0].view(-1).long().tolist()))
            return nn.functional.mse_loss(self.lin(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            self.seen.append(("val", self.current_epoch, batch[0].view(-1).long().tolist()))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    return Net()


def _zerotrain_order(root: str):
    from zerotrain import Callback, Trainer, TrainModule, seed_everything

    class Epochs(Callback):
        ended: list = []

        def on_train_epoch_end(self, trainer, module):
            self.ended.append(trainer.current_epoch)

    seed_everything(42)  # the user's seed: the sampler's seed too, as Lightning's PL_GLOBAL_SEED
    module, epochs = _record(TrainModule), Epochs()
    Trainer(strategy="ddp", devices=2, accelerator="cpu", max_epochs=EPOCHS, callbacks=[epochs], **QUIET,
            default_root_dir=root).fit(module, DataLoader(_order_dataset(), batch_size=BS, shuffle=True))
    custom = _record(TrainModule)  # samplers of the user's own, in a second fit of the same processes
    Trainer(strategy="ddp", devices=2, accelerator="cpu", max_epochs=2, num_sanity_val_steps=0, **QUIET,
            default_root_dir=root).fit(custom, *_custom_loaders())
    return {"seen": module.seen, "ended": epochs.ended, "custom": custom.seen}


def _lightning_order(root: str):
    import pytorch_lightning as pl

    class Epochs(pl.Callback):
        ended: list = []

        def on_train_epoch_end(self, trainer, module):
            self.ended.append(trainer.current_epoch)

    quiet = dict(accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_checkpointing=False,
                 enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    pl.seed_everything(42)
    module, epochs = _record(pl.LightningModule), Epochs()
    pl.Trainer(max_epochs=EPOCHS, callbacks=[epochs], **quiet).fit(
        module, DataLoader(_order_dataset(), batch_size=BS, shuffle=True))
    custom = _record(pl.LightningModule)
    pl.Trainer(max_epochs=2, num_sanity_val_steps=0, **quiet).fit(custom, *_custom_loaders())
    return {"seen": module.seen, "ended": epochs.ended, "custom": custom.seen}


def test_training_sample_order_matches_lightning(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # importing Lightning sets it: undone after
    pytest.importorskip("pytorch_lightning")
    theirs = run_ranks("test_stages:_lightning_order", 2, tmp_path / "pl", timeout=240, root=str(tmp_path / "pl"),
                       env={"ZT_TEST_HARD_EXIT": "1"})
    ours = run_ranks("test_stages:_zerotrain_order", 2, tmp_path / "zt", timeout=180, root=str(tmp_path / "zt"))
    for r in range(2):
        assert len(ours[r]["seen"]) == EPOCHS * N // (2 * BS)
        assert ours[r]["seen"] == theirs[r]["seen"], f"rank {r}: per-epoch sample order differs"
        assert ours[r]["ended"] == theirs[r]["ended"] == list(range(EPOCHS))
        # a sampler of the user's own: each rank Lightning's share of it, in Lightning's order,
        # training and validation, each epoch (16 per rank: 31 indices padded to 32)
        assert ours[r]["custom"] == theirs[r]["custom"], f"rank {r}: the custom sampler's order differs"
        assert len(ours[r]["custom"]) == 2 * (4 + 4)
    assert ours[0]["seen"] != ours[1]["seen"]  # each rank its own share
    first, second = ([i for e, b in ours[0]["seen"] if e == k for i in b] for k in (0, 1))
    assert first != second  # reshuffled each epoch (set_epoch)
    def ids(kind: tuple) -> set[int]:
        return {i for r in range(2) for rec in ours[r]["custom"] if tuple(rec[:-1]) == kind for i in rec[-1]}

    assert ids((0,)) == set(EpochStrided())  # the sampler's indices, split over the ranks
    assert ids(("val", 1)) == {(1 + 3 * i) % N for i in range(31)}  # set_epoch(1) reached it in validation
