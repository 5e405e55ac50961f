"""Structural rules of strategies/ (issue 11), checked on the source so a regression fails here:
composition, not inheritance; small constructors; the step written once."""
from __future__ import annotations

import ast
import pathlib

import zerotrain

STRATEGIES = pathlib.Path(zerotrain.__file__).parent / "strategies"
FILES = sorted(STRATEGIES.rglob("*.py"))


def _classes():
    for path in FILES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                yield path, node


def test_no_class_has_more_than_one_base():
    multiple = [f"{p.relative_to(STRATEGIES)}:{c.name}" for p, c in _classes()
                if len([b for b in c.bases if not (isinstance(b, ast.Name) and b.id in ("Protocol", "Generic"))]) > 1]
    assert not multiple, f"multiple inheritance in strategies/: {multiple}"


def test_no_constructor_takes_more_than_twelve_parameters():
    big = []
    for p, c in _classes():
        for fn in c.body:
            if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
                a = fn.args
                n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) - 1  # without self
                if n > 12:
                    big.append(f"{p.relative_to(STRATEGIES)}:{c.name} ({n})")
    assert not big, f"constructors with more than 12 parameters: {big}"


def _calls(*names: str) -> dict[str, list[str]]:
    """Where each attribute call ``x.<name>(...)`` appears: name -> ["file:caller", ...]."""
    out: dict[str, list[str]] = {n: [] for n in names}
    for path in FILES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in out:
                out[node.func.attr].append(f"{path.relative_to(STRATEGIES)}:{ast.unparse(node.func.value)}")
    return out


def _references(dotted: str) -> list[str]:
    """Where ``<x>.<dotted>`` is read without being called: ["file:x", ...]."""
    owner, attr = dotted.rsplit(".", 1)
    out = []
    for path in FILES:
        tree = ast.parse(path.read_text())
        called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr == attr and id(node) not in called
                    and ast.unparse(node.value).endswith(owner)):
                out.append(f"{path.relative_to(STRATEGIES)}:{ast.unparse(node.value)}")
    return out


def test_the_step_sequence_is_written_once():
    """The loss is scaled in one place (the precision plugin's pre_backward), autograd runs in one
    place (the plugin's backward: the base strategy and the pipeline's per-micro-batch backward call
    it), and unscale -> clip -> inner step are sequenced once, in the base strategy."""
    calls = _calls("scale_loss", "backward", "unscale_and_check", "clip_grad_norm_", "_inner_step")
    assert calls["scale_loss"] == ["precision/base.py:self"], calls["scale_loss"]
    autograd = [c for c in calls["backward"] if not c.endswith(("self.precision", ":self", "schedule.py:b"))]
    # a single loss through Tensor.backward (as Lightning's plugins call it; by reference, since the
    # module's ``backward`` hook the Trainer lends may run instead), a stage's outputs with their incoming
    # gradients through torch.autograd.backward: both in the plugin, nowhere else
    assert sorted(autograd + _references("Tensor.backward")) == [
        "precision/base.py:torch.Tensor", "precision/base.py:torch.autograd"], autograd
    for name in ("unscale_and_check", "clip_grad_norm_", "_inner_step"):
        assert [c.split(":")[0] for c in calls[name]] == ["base.py"], (name, calls[name])


def test_no_file_of_strategies_over_500_lines():
    big = {str(p.relative_to(STRATEGIES)): n for p in FILES if (n := len(p.read_text().splitlines())) > 500}
    assert not big, f"split these by responsibility: {big}"


def test_no_folder_of_strategies_holds_more_than_15_modules():
    crowded = {str(d.relative_to(STRATEGIES.parent)): n for d in [STRATEGIES, *STRATEGIES.rglob("*")]
               if d.is_dir() and (n := len(list(d.glob("*.py")))) > 15}
    assert not crowded, f"split these into sub-packages: {crowded}"


def _option_defaults() -> dict[str, object]:
    """Every option dataclass field's default (numbers and strings but 0 and 1, which a pure
    function may take as its neutral value, e.g. ``virtual_stages=1``): field name -> default."""
    import dataclasses

    from zerotrain.strategies.ddp import DDPConfig
    from zerotrain.strategies.offload.config import OffloadPolicy
    from zerotrain.strategies.pipeline.config import PipelineConfig
    from zerotrain.strategies.zero.config import BucketConfig, Stage3Config, ZeroConfig

    out = {}
    for cls in (ZeroConfig, BucketConfig, Stage3Config, OffloadPolicy, PipelineConfig, DDPConfig):
        for f in dataclasses.fields(cls):
            if (isinstance(f.default, (int, float, str)) and not isinstance(f.default, bool)
                    and f.default not in (0, 1)):
                out[f.name] = f.default
    return out


def test_option_defaults_are_written_once():
    """An option's default lives in its dataclass only: no other module of strategies/ writes the
    same value again as a keyword default, an UPPER_CASE constant or an argparse default of the
    option's name (it reads the dataclass instead)."""
    defaults = _option_defaults()
    config_modules = {"zero/config.py", "offload/config.py", "pipeline/config.py", "ddp.py"}
    repeated = []
    for path in FILES:
        rel = str(path.relative_to(STRATEGIES))
        if rel in config_modules:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            pairs = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                pos = a.posonlyargs + a.args
                pairs += list(zip((x.arg for x in pos[len(pos) - len(a.defaults):]), a.defaults))
                pairs += [(x.arg, d) for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                pairs.append((node.targets[0].id.lower(), node.value))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "add_argument" and node.args and isinstance(node.args[0], ast.Constant)):
                pairs += [(str(node.args[0].value).lstrip("-").replace("-", "_"), k.value)
                          for k in node.keywords if k.arg == "default"]
            for name, value in pairs:
                if (name in defaults and isinstance(value, ast.Constant) and not isinstance(value.value, bool)
                        and value.value == defaults[name]):
                    repeated.append(f"{rel}:{node.lineno} {name}={value.value!r}")
    assert not repeated, f"read these from the option dataclasses instead: {repeated}"
