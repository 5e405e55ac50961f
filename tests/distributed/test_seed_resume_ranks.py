"""The Trainer and the Engine resume alike on a grown job: a checkpoint of one rank read by two, the
rank it has an RNG state for restores it and the new rank is re-seeded from the sampler seed, its
rank and the saved step, by both (``checkpoint/protocol.restore_or_reseed``)."""
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from harness import run_ranks
from zerotrain import Engine, Trainer, TrainModule
from zerotrain.callbacks import Callback
from zerotrain.trainer.utilities import seed_rngs

pytestmark = pytest.mark.timeout(300)


class Module(TrainModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Draw(Callback):
    def on_train_start(self, trainer, module):
        self.drawn = torch.rand(4)


def loader():
    return DataLoader(TensorDataset(torch.arange(32.0).reshape(8, 4)), batch_size=2)


def _trainer(root, devices, strategy, **kw):
    return Trainer(accelerator="cpu", devices=devices, strategy=strategy, seed=5, logger=False,
                   enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                   default_root_dir=root, **kw)


def trainer_resumes(path, root):
    draw = Draw()
    _trainer(root, 2, "ddp", max_steps=3, callbacks=[draw]).fit(Module(), loader(), ckpt_path=path)
    return draw.drawn


def engine_resumes(path):
    engine = Engine(accelerator="cpu", devices=2, strategy="ddp", seed=5)
    module = Module()
    model, optimizer = engine.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    engine.setup_dataloaders(loader())
    engine.load(path, {"model": model, "optimizer": optimizer})
    return torch.rand(4)


def test_a_grown_jobs_new_rank_is_reseeded_alike(tmp_path):
    trainer = _trainer(str(tmp_path / "first"), 1, "single", max_steps=2)
    trainer.fit(Module(), loader())
    path = str(tmp_path / "ckpt")
    trainer.save_checkpoint(path)
    by_trainer = run_ranks("test_seed_resume_ranks:trainer_resumes", 2, tmp_path / "t", path=path,
                           root=str(tmp_path / "second"))
    by_engine = run_ranks("test_seed_resume_ranks:engine_resumes", 2, tmp_path / "e", path=path)
    for rank in range(2):
        assert torch.equal(by_trainer[rank], by_engine[rank]), rank
    seed_rngs(5 + 1_000_003 * 1 + 2)  # rank 1: the sampler seed, its rank, the saved step
    assert torch.equal(by_engine[1], torch.rand(4))
    assert not torch.equal(by_engine[0], by_engine[1])
