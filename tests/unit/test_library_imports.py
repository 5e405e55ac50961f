"""The library never imports ``examples/``: ``trainer/``, ``strategies/``, ``callbacks/`` and
``ops/`` must work for a user's own TrainModule without the demo GPT; the command line reaches the demo's module only through the
``_target_`` string of its ``model`` options (``zerotrain.examples.gpt_cli.cli_module``). The
modules at the root (``train.py``: ``zerotrain-train``, ``tune.py``: ``zerotrain-tune``, the
package's ``__init__``) are the library too: they build whatever ``_target_`` the config names."""
import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository root is the zerotrain package
LIBRARY = ("trainer", "strategies", "callbacks", "ops")
#: the library's modules at the repository root (``setup.py`` is the installer, not a module)
ROOT_MODULES = ("__init__", "train", "tune")
FORBIDDEN = "zerotrain.examples"


def _package_of(path: pathlib.Path) -> list[str]:
    """``trainer/zero/x.py`` -> ["zerotrain", "trainer", "zero"]: what a relative import starts from."""
    return ["zerotrain", *path.relative_to(ROOT).parent.parts]


def _imported_names(source: str, package: list[str]) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source``, a module of ``package``, relative
    ones resolved; for ``from M import a`` both ``M`` and ``M.a`` (``a`` may be a sub-module: ``from
    .. import examples``), and the first argument of ``importlib.import_module("...")`` /
    ``__import__("...")``."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names += [(node.lineno, module)] + [(node.lineno, f"{module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if func in ("import_module", "__import__"):
                names.append((node.lineno, node.args[0].value))
    return names


def _is_examples(name: str) -> bool:
    return name in (FORBIDDEN, "examples") or name.startswith((FORBIDDEN + ".", "examples."))


def _library_files() -> list[pathlib.Path]:
    return sorted([p for package in LIBRARY for p in (ROOT / package).rglob("*.py")]
                  + [ROOT / f"{name}.py" for name in ROOT_MODULES])


def test_the_library_files_are_found():
    files = _library_files()
    assert len(files) > 20 and ROOT / "trainer" / "command" / "config.py" in files, files
    assert {ROOT / "train.py", ROOT / "tune.py"} <= set(files) and all(p.is_file() for p in files), files


@pytest.mark.parametrize("path", _library_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_library_module_imports_examples(path):
    bad = [f"{path.relative_to(ROOT)}:{line}: imports {name}"
           for line, name in _imported_names(path.read_text(), _package_of(path)) if _is_examples(name)]
    assert not bad, "the library never imports examples/ (train.py brings the demo in):\n" + "\n".join(bad)


def test_the_check_sees_every_form_of_import():
    """The resolver itself, for a module of ``zerotrain.trainer``: each way of writing an import of
    the examples is caught, and names that only look like it are not."""
    forms = {"from ..examples.gpt import GPTConfig": True, "from .. import examples": True,
             "import zerotrain.examples.gpt_module": True, "from zerotrain import examples": True,
             "from zerotrain.examples import gpt": True, "importlib.import_module('zerotrain.examples.gpt')": True,
             "def build():\n    from ..examples import gpt_cli": True,  # a lazy import counts too
             "from . import examples_of_use": False, "from ..strategies import registry": False,
             "from .examples import x": False}  # zerotrain.trainer.examples is not the demo
    for source, caught in forms.items():
        names = [name for _, name in _imported_names(source, ["zerotrain", "trainer"])]
        assert any(_is_examples(n) for n in names) == caught, (source, names)


def test_importing_every_library_module_loads_no_example():
    """At import time too: this sees what the ast check cannot, an examples module reached through a
    name built at run time or through a module outside the four packages that the library imports."""
    code = ("import importlib, pkgutil, sys\n"
            "import zerotrain\n"
            f"for pkg in {LIBRARY!r}:\n"
            "    mod = importlib.import_module('zerotrain.' + pkg)\n"
            "    for info in pkgutil.walk_packages(mod.__path__, mod.__name__ + '.'):\n"
            "        importlib.import_module(info.name)\n"
            f"for name in {ROOT_MODULES[1:]!r}:\n"
            "    importlib.import_module('zerotrain.' + name)\n"
            f"print(sorted(m for m in sys.modules if m == {FORBIDDEN!r} or m.startswith({FORBIDDEN!r} + '.')))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", proc.stdout


#: the strategies' imports of trainer/ that predate the rule below (the pipeline's ConfigError)
STRATEGIES_MAY_IMPORT = {"zerotrain.trainer.errors", "zerotrain.trainer.errors.ConfigError"}


def _trainer_imports(source: str, path: pathlib.Path) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line}: imports {name}"
            for line, name in _imported_names(source, _package_of(path))
            if (name == "zerotrain.trainer" or name.startswith("zerotrain.trainer.")) and name not in STRATEGIES_MAY_IMPORT]


def test_strategies_do_not_import_the_trainer():
    """strategies/ sits below trainer/: what the Trainer decides for a strategy (Lightning's rule for
    a step method's arguments, ``Strategy.step_call``) is handed to it, not imported from trainer/,
    not even lazily inside a method."""
    bad = [b for p in sorted((ROOT / "strategies").rglob("*.py")) for b in _trainer_imports(p.read_text(), p)]
    assert not bad, "strategies/ imports trainer/:\n" + "\n".join(bad)
    lazy = "def forward(self):\n    from ..trainer.signature import step_args\n"  # the check sees this form
    assert _trainer_imports(lazy, ROOT / "strategies" / "base.py")
