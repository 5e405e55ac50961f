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


#: the library's code that may run a backward or a step: strategies/, trainer/ and callbacks/,
#: searched whole (files move between sub-folders; call sites are named by class and function)
ROOT = STRATEGIES.parent
STEP_CODE = sorted(p for top in ("strategies", "trainer", "callbacks") for p in (ROOT / top).rglob("*.py"))


def _sites():
    """Every call ``<x>.<name>(...)`` and every read of ``<x>.backward`` that is not called, in
    STEP_CODE: ``(kind, name, "Class.function:<x>")``, kind "call" or "ref"."""
    for path in STEP_CODE:
        tree = ast.parse(path.read_text())
        called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}

        def visit(node, scope):
            for child in ast.iter_child_nodes(node):
                inner = scope
                if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    inner = f"{scope}.{child.name}" if scope else child.name
                if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute):
                    yield "call", child.func.attr, f"{inner}:{ast.unparse(child.func.value)}"
                elif (isinstance(child, ast.Attribute) and child.attr == "backward" and id(child) not in called
                      and ast.unparse(child.value).endswith(("Tensor", "autograd"))):
                    yield "ref", "backward", f"{inner}:{ast.unparse(child.value)}"
                yield from visit(child, inner)

        yield from visit(tree, "")


def _where(name: str, kind: str = "call") -> list[str]:
    return sorted(site for k, n, site in _sites() if k == kind and n == name)


#: calls of a method named ``backward`` that dispatch to the library's own ``backward`` methods (a
#: strategy's, an engine's, a precision plugin's, the module's hook), not to autograd
DISPATCH = {
    "Strategy.run_schedule:self", "Strategy.manual_backward:self", "Strategy.backward:self.precision",
    "Precision.backward_loss:self", "StageExecutor._backward:self.precision", "Engine.backward:s",
    "DeepSpeedEngine.backward:self._zt", "backward_across:models[0][0].precision",
    "TrainerSetup._module_backward:self.module", "_Builder.backward_pass:self", "interleaved_1f1b:b",
}


def test_the_step_sequence_is_written_once():
    """Across strategies/, trainer/ and callbacks/: the loss is scaled in one place (the precision
    plugin's ``pre_backward``, run by its ``backward_loss``, which both the base strategy and the
    pipeline's last stage call), autograd runs in one place (the plugin's ``backward``), and
    unscale -> clip -> inner step are sequenced once, in the base strategy. A backward the user
    runs goes through ``Strategy.user_backward``: nothing outside strategies/ calls a strategy's
    private ``_before_backward``/``_after_backward``."""
    assert [s.split(":")[0] for s in _where("scale_loss")] == ["Precision.pre_backward"], _where("scale_loss")
    for name in ("pre_backward", "post_backward"):  # the plugin's (stage 3's runtime has its own)
        plugin = [s for s in _where(name) if s.startswith("Precision.") or s.endswith("precision")]
        assert plugin == ["Precision.backward_loss:self"], (name, plugin)
    autograd = [s for s in _where("backward") if s not in DISPATCH] + _where("backward", "ref")
    # a single loss through Tensor.backward (as Lightning's plugins call it; by reference, since the
    # module's ``backward`` hook the Trainer lends may run instead), a stage's outputs with their
    # incoming gradients through torch.autograd.backward: both in the plugin. TrainModule.backward is
    # that hook (Lightning's ``LightningModule.backward``): its default body is what the plugin runs.
    assert sorted(autograd) == ["Precision.backward:torch.Tensor", "Precision.backward:torch.autograd",
                                "TrainModule.backward:loss"], autograd
    for name in ("unscale_and_check", "clip_grad_norm_", "_inner_step"):
        assert [s.split(":")[0] for s in _where(name)] == ["Strategy.optimizer_step"], (name, _where(name))
    private = [s for s in _where("_before_backward") + _where("_after_backward")
               if not s.startswith("Strategy.")]
    assert not private, f"use Strategy.user_backward / begin_user_backward instead: {private}"


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
