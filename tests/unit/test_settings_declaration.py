"""The Trainer's settings are declared once (``trainer/settings/declaration.py``): the Trainer's
signature, the ``trainer`` section of ``zerotrain-train`` and the Engine's shared arguments are
built from the declaration, and fail here when one of them drifts from it. The Engine and the
Trainer give ``seed`` one meaning: an int seeds every rank's global RNGs when the job is joined,
and a rank a resumed checkpoint has no RNG state for is re-seeded the same way by both."""
import dataclasses
import inspect
import os

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from zerotrain import Engine, Trainer, TrainModule
from zerotrain.callbacks import Callback
from zerotrain.trainer.command.config import CLI_DEFAULTS, TrainerConfig
from zerotrain.trainer.errors import ConfigError
from zerotrain.trainer.settings import declaration
from zerotrain.trainer.settings.declaration import ENGINE, TrainerSettings, declared
from zerotrain.trainer.utilities import seed_rngs

pytestmark = pytest.mark.timeout(120)

DECLARED = {f.name: f for f in dataclasses.fields(TrainerSettings)}


def _keyword_params(cls):
    return {n: p for n, p in inspect.signature(cls).parameters.items() if p.kind == p.KEYWORD_ONLY}


@pytest.mark.parametrize("cls, names", [(Trainer, list(DECLARED)), (Engine, list(ENGINE))])
def test_the_constructors_signatures_are_the_declarations(cls, names):
    params = _keyword_params(cls)
    assert list(params) == names
    assert {n: p.default for n, p in params.items()} == {n: DECLARED[n].default for n in names}
    assert {n: p.annotation for n, p in params.items()} == {n: DECLARED[n].type for n in names}


def test_the_engine_shares_the_devices_and_seed_settings():
    assert set(ENGINE) == {"accelerator", "devices", "num_nodes", "strategy", "precision", "seed"}


def test_the_cli_schema_is_the_declarations_cli_subset():
    fields = {f.name: f for f in dataclasses.fields(TrainerConfig)}
    assert list(fields) == [n for n, f in DECLARED.items() if f.metadata["cli"]]
    assert set(CLI_DEFAULTS) <= set(fields)  # the CLI's own defaults name settings it has
    for name, f in fields.items():
        assert f.default == CLI_DEFAULTS.get(name, DECLARED[name].default), name


def test_a_constructor_that_drifts_from_the_declaration_is_refused():
    with pytest.raises(TypeError, match="the declaration"):
        @declared("Engine", ENGINE)
        def init(self, *, accelerator, devices, num_nodes, strategy, precision, seed, extra):
            pass
    with pytest.raises(TypeError, match="the declaration"):
        @declared("Engine", ENGINE)
        def init2(self, *, accelerator, devices, num_nodes, strategy, precision):
            pass


def test_each_setting_has_one_line_of_documentation():
    for name, f in DECLARED.items():
        assert f.metadata["doc"] and "\n" not in f.metadata["doc"], name


def test_the_engine_refuses_what_the_trainer_refuses_in_its_own_name():
    for kw in ({"devices": 0}, {"num_nodes": 0}, {"accelerator": "tpu"}, {"seed": "1"}):
        with pytest.raises(ConfigError) as trainer_error:
            Trainer(**kw)
        with pytest.raises(ConfigError) as engine_error:
            Engine(**kw)
        assert str(engine_error.value) == "Engine: " + str(trainer_error.value)[len("Trainer: "):], kw


def test_the_engine_takes_lightnings_forms_as_the_trainer():
    engine = Engine(accelerator="cpu", devices="1", strategy="single")
    assert engine.devices == 1 and engine.accelerator == "cpu"
    assert Engine(accelerator="cpu", devices=[0], strategy="single").devices == 1


def test_the_cli_checks_are_the_trainers_worded_for_the_command_line():
    with pytest.raises(ConfigError, match=r"^trainer\.on_nonfinite='maybe'; valid choices: raise, skip, warn$"):
        TrainerConfig(on_nonfinite="maybe").validate()
    with pytest.raises(ConfigError, match=r"^Trainer: on_nonfinite='maybe'; valid choices: raise, skip, warn$"):
        Trainer(on_nonfinite="maybe")


# ---------------------------------------------------------------------- seed and resume
class _Module(TrainModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _DrawAtTrainStart(Callback):
    def on_train_start(self, trainer, module):
        self.drawn = torch.rand(4)


def _loader():
    return DataLoader(TensorDataset(torch.arange(32.0).reshape(8, 4)), batch_size=2)


def _trainer(root, **kw):
    return Trainer(accelerator="cpu", devices=1, strategy="single", logger=False, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(root), **kw)


def _expected(seed, iterators: int = 0):
    """Seed ``seed``'s stream, after ``iterators`` DataLoader iterators were made (each draws its
    base seed from the global RNG: Lightning's fit loop makes the first pass's before
    ``on_train_start``)."""
    seed_rngs(seed)
    for _ in range(iterators):
        torch.empty((), dtype=torch.int64).random_()
    return torch.rand(4)


def _drawn_at_train_start(root, user_seed, **kw):
    draw = _DrawAtTrainStart()
    torch.manual_seed(user_seed)
    _trainer(root, max_steps=1, callbacks=[draw], **kw).fit(_Module(), _loader())
    return draw.drawn


def _drawn_after_launch(user_seed, **kw):
    engine = Engine(accelerator="cpu", devices=1, strategy="single", **kw)
    torch.manual_seed(user_seed)
    engine.launch()
    return torch.rand(4)


def test_an_int_seed_seeds_the_rngs_under_both(tmp_path):
    """``seed=5``: whatever the user seeded before, both start from seed 5's stream."""
    trainer_drawn = _drawn_at_train_start(tmp_path, 123, seed=5)
    assert torch.equal(trainer_drawn, _drawn_at_train_start(tmp_path, 124, seed=5))
    assert torch.equal(trainer_drawn, _expected(5, iterators=1))
    assert torch.equal(_drawn_after_launch(123, seed=5), _expected(5))


def test_no_seed_seeds_nothing_under_both(tmp_path):
    """``seed=None`` (Lightning's and Fabric's way: ``seed_everything``): the user's seeding stands."""
    trainer_drawn = _drawn_at_train_start(tmp_path, 123)
    assert torch.equal(trainer_drawn, _drawn_at_train_start(tmp_path, 123))
    assert not torch.equal(trainer_drawn, _drawn_at_train_start(tmp_path, 124))
    assert torch.equal(_drawn_after_launch(123), _expected(123))
    assert not torch.equal(_drawn_after_launch(124), _expected(123))


def _checkpoint_without_rng_states(tmp_path):
    """A Trainer checkpoint after 2 steps whose job had no rank this process is (its RNG states
    are dropped: as a checkpoint of a smaller job read by a new rank of a grown one)."""
    trainer = _trainer(tmp_path / "first", seed=5, max_steps=2)
    trainer.fit(_Module(), _loader())
    path = tmp_path / "ckpt"
    trainer.save_checkpoint(str(path))
    meta_path = path / "meta.pt"
    meta = torch.load(meta_path, weights_only=True)
    meta["rng"] = []
    torch.save(meta, meta_path)
    return str(path), meta["loop"]["global_step"]


def test_a_rank_without_a_saved_rng_state_is_reseeded_alike_on_resume(tmp_path):
    path, step = _checkpoint_without_rng_states(tmp_path)
    draw = _DrawAtTrainStart()
    torch.manual_seed(123)
    _trainer(tmp_path / "second", seed=5, max_steps=3, callbacks=[draw]).fit(_Module(), _loader(), ckpt_path=path)

    engine = Engine(accelerator="cpu", devices=1, strategy="single", seed=5)
    module = _Module()
    model, optimizer = engine.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    engine.setup_dataloaders(_loader())
    torch.manual_seed(123)
    engine.load(path, {"model": model, "optimizer": optimizer})
    engine_drawn = torch.rand(4)
    assert torch.equal(engine_drawn, draw.drawn)
    assert torch.equal(draw.drawn, _expected(5 + step))  # the sampler seed, rank 0, the saved step


# ---------------------------------------------------------------------- bad values, refused when built
FLAGS = ["enable_checkpointing", "enable_progress_bar", "enable_model_summary", "deterministic",
         "use_distributed_sampler", "detect_anomaly", "barebones"]


@pytest.mark.parametrize("name", FLAGS)
def test_a_flag_given_as_a_word_is_refused_when_the_trainer_is_built(name):
    """``enable_checkpointing="no"`` was read as True (a non-empty string) and the run went on doing
    what the user switched off; now one line naming the field, the value and the choices."""
    with pytest.raises(ConfigError) as info:
        Trainer(**{name: "no"})
    msg = str(info.value)
    assert msg.startswith(f"Trainer: {name}='no'; valid: True, False") and "\n" not in msg, msg


def test_a_flag_from_the_environment_is_checked_as_an_argument(monkeypatch):
    monkeypatch.setenv("PL_TRAINER_ENABLE_CHECKPOINTING", "no")  # text, not a Python literal
    with pytest.raises(ConfigError, match=r"^Trainer: enable_checkpointing='no'; valid: True, False"):
        Trainer()
    monkeypatch.setenv("PL_TRAINER_ENABLE_CHECKPOINTING", "False")
    assert not Trainer(accelerator="cpu", devices=1, logger=False).checkpoint_callbacks


@pytest.mark.parametrize("kw", [dict(deterministic=1), dict(deterministic="warn"), dict(enable_checkpointing=0),
                                dict(enable_progress_bar=None)])
def test_what_python_and_lightning_read_as_a_flag_is_still_taken(kw):
    Trainer(accelerator="cpu", devices=1, logger=False, **kw)


@pytest.mark.parametrize("kw, names", [
    # wrong types
    (dict(max_steps="3"), "max_steps='3'"), (dict(devices=1.5), "devices=1.5"), (dict(num_nodes="1"), "num_nodes='1'"),
    (dict(collective_timeout_s="10"), "collective_timeout_s='10'"), (dict(seed=1.5), "seed=1.5"),
    (dict(inference_mode="yes"), "inference_mode='yes'"), (dict(log_every_n_steps="10"), "log_every_n_steps='10'"),
    # negative counts
    (dict(accumulate_grad_batches=0), "accumulate_grad_batches=0"), (dict(max_restarts=-1), "max_restarts=-1"),
    (dict(min_epochs=-1), "min_epochs=-1"), (dict(reload_dataloaders_every_n_epochs=-1),
                                             "reload_dataloaders_every_n_epochs=-1"),
    (dict(stall_timeout_s=-1), "stall_timeout_s=-1"), (dict(limit_val_batches=-2), "limit_val_batches=-2"),
    # unknown strings
    (dict(accelerator="tpu"), "accelerator='tpu'"), (dict(on_nonfinite="ignore"), "on_nonfinite='ignore'"),
    (dict(gradient_clip_algorithm="max"), "gradient_clip_algorithm='max'"), (dict(profiler="fancy"), "profiler='fancy'"),
    (dict(max_time="soon"), "max_time='soon'"), (dict(strategy="ddpp"), "strategy='ddpp'"),
    (dict(precision="fp7"), "precision='fp7'"),
])
def test_a_bad_value_is_one_line_naming_field_and_value_when_built(kw, names):
    with pytest.raises((ConfigError, TypeError)) as info:
        Trainer(accelerator="cpu", devices=1, **{"logger": False, **kw}) if "accelerator" not in kw and \
            "devices" not in kw else Trainer(**kw)
    msg = str(info.value)
    assert f"Trainer: {names}" in msg and "\n" not in msg and ("valid" in msg or "must be" in msg), msg
