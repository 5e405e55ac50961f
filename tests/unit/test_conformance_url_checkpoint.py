"""Checkpoints given by URL, as Lightning reads them (issue 41; Lightning's
trainer/test_trainer.py and models/test_restore.py with ``url_ckpt=True``): ``load_from_checkpoint``,
``load_checkpoint`` (Lightning's ``cloud_io._load``) and ``Trainer.fit(ckpt_path=url)`` download the
file and read it as a local one - weights-only still, so a file that needs pickled code is refused."""
from __future__ import annotations

import functools
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from zerotrain import Trainer
from zerotrain.demos.boring_classes import BoringModel
from zerotrain.trainer.errors import CheckpointError
from zerotrain.trainer.api.from_checkpoint import load_checkpoint


@pytest.fixture
def served(tmp_path):
    """``tmp_path`` over HTTP: the URL of a file name in it."""
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(tmp_path))
    with ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        yield lambda name: f"http://127.0.0.1:{server.server_address[1]}/{name}"
        server.shutdown()


def _trained(tmp_path):
    trainer = Trainer(default_root_dir=tmp_path, max_steps=2, limit_val_batches=0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model = BoringModel()
    trainer.fit(model)
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    return model


def test_load_from_checkpoint_and_load_checkpoint_read_a_url(tmp_path, served):
    model = _trained(tmp_path)
    loaded = BoringModel.load_from_checkpoint(served("model.ckpt"))
    torch.testing.assert_close(loaded.state_dict(), model.state_dict(), rtol=0, atol=0)
    raw = load_checkpoint(served("model.ckpt"))
    assert raw["global_step"] == 2
    torch.testing.assert_close(raw["state_dict"], model.state_dict(), rtol=0, atol=0)


def test_fit_resumes_from_a_url(tmp_path, served):
    _trained(tmp_path)
    trainer = Trainer(default_root_dir=tmp_path, max_steps=3, limit_val_batches=0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(BoringModel(), ckpt_path=served("model.ckpt"))
    assert trainer.global_step == 3  # 2 restored, one more trained


def test_url_reading_stays_weights_only(tmp_path, served):
    torch.save({"state_dict": {}, "code": Trainer}, tmp_path / "code.ckpt")  # a pickled class
    with pytest.raises(CheckpointError, match="weights_only=True"):
        load_checkpoint(served("code.ckpt"))
    with pytest.raises(CheckpointError, match="cannot download checkpoint"):
        load_checkpoint(served("missing.ckpt"))
