"""``zerotrain.cli.LightningCLI`` (issue 44): a script written in Lightning's style (a module, a
datamodule, ``LightningCLI(Model, Data)``) ported by the README's rename gives Lightning's
numbers - ``fit`` then ``test`` from a ``--config`` YAML file, compared loss by loss with
pytorch-lightning's LightningCLI on the same script when it is installed - and ``--print_config``
prints the config; a bad argument ends with jsonargparse's error and exit code 2 before any
Trainer (or process) exists."""
from __future__ import annotations

import importlib.util
import io
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch
import yaml

SCRIPT = '''
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI


class Regression(LightningModule):
    def __init__(self, hidden: int = 8, lr: float = 0.1):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
        self.losses = {"train": [], "test": []}

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses["train"].append(loss.item())
        return loss

    def test_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses["test"].append(loss.item())
        self.log("test_loss", loss)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class Data(LightningDataModule):
    def __init__(self, batch_size: int = 4, n: int = 32):
        super().__init__()
        self.batch_size = batch_size
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, 4, generator=g)
        self.data = TensorDataset(x, x.sum(1, keepdim=True).sin())

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)


def main(args=None, run=True):
    return LightningCLI(Regression, Data, args=args, run=run)
'''


def _rename(text: str) -> str:
    """The README's rule (bench/conformance.py RENAMES), on this script."""
    return (text.replace("lightning.pytorch", "zerotrain").replace("LightningDataModule", "DataModule")
            .replace("LightningModule", "TrainModule"))


def _script(tmp_path: Path, library: str):
    """The script as a module, for ``zerotrain`` or ``pytorch_lightning``."""
    text = _rename(SCRIPT) if library == "zerotrain" else SCRIPT.replace("lightning.pytorch", library)
    path = tmp_path / f"cli_script_{library}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # jsonargparse resolves the classes' import paths
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["cli_script.py"])
    for key in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):  # set by seed_everything: restored after the test
        monkeypatch.setenv(key, "0")
        monkeypatch.delenv(key)
    yield lambda library="zerotrain": _script(tmp_path, library)
    for name in [n for n in sys.modules if n.startswith("cli_script_")]:
        del sys.modules[name]


def _config(tmp_path: Path, root: str) -> Path:
    path = tmp_path / f"{root}.yaml"
    path.write_text(yaml.safe_dump({
        "seed_everything": 7,
        "model": {"hidden": 6, "lr": 0.05},
        "data": {"batch_size": 4},
        "trainer": {"accelerator": "cpu", "devices": 1, "max_epochs": 2, "logger": False, "enable_progress_bar": False,
                    "enable_model_summary": False, "default_root_dir": str(tmp_path / root)},
    }))
    return path


def _fit_then_test(tmp_path: Path, module, root: str) -> dict[str, list[float]]:
    config = _config(tmp_path, root)
    fit = module.main(["fit", f"--config={config}"])
    ckpt = sorted((tmp_path / root).rglob("*.ckpt"))[-1]
    test = module.main(["test", f"--config={config}", f"--ckpt_path={ckpt}",
                        f"--trainer.default_root_dir={tmp_path / root / 'test'}"])
    return {"train": fit.model.losses["train"], "test": test.model.losses["test"],
            "saved": yaml.safe_load((tmp_path / root / "config.yaml").read_text())}


def test_fit_then_test_from_a_config_file_gives_lightnings_losses(script, tmp_path):
    ours = _fit_then_test(tmp_path, script("zerotrain"), "zt")
    assert len(ours["train"]) == 16 and len(ours["test"]) == 8  # 2 epochs x 8 batches, then the test set
    assert ours["saved"]["model"] == {"hidden": 6, "lr": 0.05} and ours["saved"]["seed_everything"] == 7
    pytest.importorskip("pytorch_lightning")
    theirs = _fit_then_test(tmp_path, script("pytorch_lightning"), "pl")
    # the same seed, data order and fp32 ops on one CPU process: the same numbers
    assert ours["train"] == pytest.approx(theirs["train"], rel=1e-6, abs=1e-7)
    assert ours["test"] == pytest.approx(theirs["test"], rel=1e-6, abs=1e-7)
    assert ours["saved"]["model"] == theirs["saved"]["model"] and ours["saved"]["data"] == theirs["saved"]["data"]


def test_print_config_prints_the_parsed_config_and_exits(script, tmp_path):
    module = script()
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        module.main(["fit", "--model.hidden=5", "--trainer.max_epochs=3", "--print_config"])
    assert exit_info.value.code == 0
    from zerotrain import __version__

    assert out.getvalue().startswith(f"# zerotrain=={__version__}")
    printed = yaml.safe_load(out.getvalue())
    assert printed["model"] == {"hidden": 5, "lr": 0.1}
    assert printed["trainer"]["max_epochs"] == 3 and printed["ckpt_path"] is None
    assert not list(tmp_path.rglob("config.yaml"))  # nothing ran


@pytest.mark.parametrize("argument", ["--model.hidden=abc", "--trainer.max_epochs=many", "--no_such_key=1",
                                      "--trainer.strategy=nonsense"])
def test_a_bad_argument_exits_with_code_2_before_any_trainer(script, argument, monkeypatch):
    module = script()
    import zerotrain

    built = []
    monkeypatch.setattr(zerotrain.Trainer, "fit", lambda *a, **k: built.append("fit"))
    err = io.StringIO()
    with redirect_stderr(err), pytest.raises(SystemExit) as exit_info:
        module.main(["fit", "--trainer.devices=1", "--trainer.accelerator=cpu", argument])
    assert exit_info.value.code == 2
    assert argument.split("=")[0].lstrip("-").split(".")[-1] in err.getvalue()
    assert not built
