"""16-mixed on 2 ranks: an injected inf skips the step everywhere and drives the scale exactly."""
import torch

from harness import run_ranks
from toy import ToyModule
from zerotrain import Callback, Trainer
from zerotrain.strategies.precision import DynamicLossScaler, FP16Mixed


class Recorder(Callback):
    def __init__(self):
        self.rows = []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self._before = torch.cat([p.detach().flatten().clone() for p in module.parameters()])

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        after = torch.cat([p.detach().flatten() for p in module.parameters()])
        self.rows.append({"step": trainer.global_step, "scale": trainer.precision_plugin.loss_scale,
                          "lr": trainer.optimizer.param_groups[0]["lr"],
                          "changed": bool(not torch.equal(after, self._before))})


def _run(strategy, devices):
    rec = Recorder()
    scaler = DynamicLossScaler(init_scale=1024, growth_interval=3, hysteresis=2)
    trainer = Trainer(strategy=strategy, devices=devices, precision=FP16Mixed(scaler), max_steps=8,
                      callbacks=[rec], logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(ToyModule(inject_inf_steps=(2, 3)))
    return {"rows": rec.rows, "skipped": trainer.state.skipped_steps}


def test_fp16_overflow_skips_on_every_rank_and_scale_sequence_is_exact(tmp_path):
    out = run_ranks("test_fp16:_run", 2, tmp_path, timeout=120, strategy="ddp", devices=2)
    for rank_out in out:
        rows = rank_out["rows"]
        assert [r["scale"] for r in rows] == [1024, 1024, 1024, 512, 512, 512, 1024, 1024]
        assert [r["changed"] for r in rows] == [True, True, False, False, True, True, True, True]
        lrs = [r["lr"] for r in rows]
        assert lrs[1] == lrs[2] == lrs[3]  # the scheduler did not step on skipped steps
        assert lrs[4] < lrs[3]
        assert rank_out["skipped"] == 2
