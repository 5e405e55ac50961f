"""A second ``fit`` on the same Trainer, on 2 processes, under each strategy: raising
``max_steps`` and fitting again trains exactly as the same steps in one fit (same sums in the same
order: compared exactly). Under zero1/zero2 the first fit's teardown had released the
gradient-reduction hooks, so the second fit stepped on zero gradients under zero2 (zero1 still reduced them, at the
flush, without overlap).
One process: tests/unit/test_zero_refit.py."""
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from harness import run_ranks
from zerotrain import Trainer, TrainModule


class Net(TrainModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        return DataLoader(TensorDataset(torch.randn(40, 6, generator=g), torch.randn(40, 1, generator=g)), batch_size=4)


STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "offload"]


def _fit(strategy: str, splits: tuple[int, ...]) -> dict:
    t = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=splits[0], logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model = Net()
    for steps in splits:
        t.fit_loop.max_steps = steps
        t.fit(model)
    full = t.full_state_dict()  # a collective: rank 0 gets the weights
    return {"losses": torch.stack(model.losses), "full": {k: v.clone() for k, v in full.items()},
            "step": t.global_step}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_second_fit_trains_as_one_fit_on_two_ranks(tmp_path, strategy):
    one = run_ranks("test_refit_ranks:_fit", 2, tmp_path / "one", timeout=180, strategy=strategy, splits=(6,))
    two = run_ranks("test_refit_ranks:_fit", 2, tmp_path / "two", timeout=180, strategy=strategy, splits=(3, 6))
    for rank in (0, 1):
        assert two[rank]["step"] == 6
        assert torch.equal(two[rank]["losses"], one[rank]["losses"]), rank
    assert one[0]["full"]
    for k, v in one[0]["full"].items():
        assert torch.equal(two[0]["full"][k], v), k
