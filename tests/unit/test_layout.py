"""The library's layout rules (issue 43), checked on the source: no import circle, no file over 500
lines, no folder with more than 15 modules, no reach into another package's private names."""
from __future__ import annotations

import ast
import collections
import pathlib

import pytest

import zerotrain

ROOT = pathlib.Path(zerotrain.__file__).parent
#: the library: what ``import zerotrain`` can load (tests/, bench/ and examples/ are not part of it)
FOLDERS = ("trainer", "strategies", "callbacks", "conf", "ops", "csrc")
MAX_LINES = 500
MAX_MODULES = 15


def _modules() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of the library."""
    files = [p for p in ROOT.glob("*.py") if p.name != "setup.py"]
    for folder in FOLDERS:
        files += (ROOT / folder).rglob("*.py")
    out = {}
    for path in files:
        parts = ["zerotrain", *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()
TREES = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}


def _package(module: str) -> str:
    """The package a module's relative imports resolve against."""
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def _module_level_imports(tree: ast.Module):
    """Import statements that run when the module is imported: not inside a function, not under
    ``if TYPE_CHECKING``."""
    def visit(body):
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                yield from visit(node.body)
                yield from visit(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                    yield from visit(block)
            elif isinstance(node, (ast.With, ast.ClassDef)):
                yield from visit(node.body)
    yield from visit(tree.body)


def _imported(module: str, node: ast.ImportFrom | ast.Import):
    """(target module, imported name or None) for each name an import statement binds, targets
    inside the library only."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name in MODULES:
                yield alias.name, None
        return
    if node.level:
        base = _package(module).split(".")
        base = base[:len(base) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if source not in MODULES:
        return
    for alias in node.names:
        full = f"{source}.{alias.name}"
        yield (full, None) if full in MODULES else (source, alias.name)


def _graph() -> dict[str, set[str]]:
    edges = collections.defaultdict(set)
    for module, tree in TREES.items():
        for node in _module_level_imports(tree):
            for target, _ in _imported(module, node):
                edges[module].add(target)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]
    for start in MODULES:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter[0]; counter[0] += 1
        stack.append(start); on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]; counter[0] += 1
                    stack.append(child); on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop(); on_stack.discard(member); component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_import_circle():
    assert not _cycles(_graph()), "modules that import each other when loaded"


def test_the_circle_check_sees_a_circle():
    edges = _graph()
    edges["zerotrain.trainer.errors"].add("zerotrain.trainer.loop.trainer")  # trainer imports errors
    assert any("zerotrain.trainer.errors" in c for c in _cycles(edges))


def test_no_file_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_no_folder_with_more_than_15_modules():
    per_folder = collections.Counter(str(p.parent.relative_to(ROOT)) for p in MODULES.values())
    crowded = {folder: n for folder, n in per_folder.items() if n > MAX_MODULES}
    assert not crowded, f"folders with more than {MAX_MODULES} modules directly in them: {crowded}"


def test_every_folder_says_what_lives_there():
    bare = [str(p.relative_to(ROOT)) for name, p in MODULES.items()
            if p.name == "__init__.py" and not ast.get_docstring(TREES[name])]
    assert not bare, f"packages without a docstring: {bare}"


def _inside(package: str, owner: str) -> bool:
    """``owner``'s private names are ``package``'s own: the same package or one of its sub-packages."""
    return owner == package or owner.startswith(package + ".") or package.startswith(owner + ".")


def _private_reaches() -> list[str]:
    found = []
    for module, tree in TREES.items():
        here = _package(module)
        aliases = {}  # a local name bound to another library module
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for (target, name), alias in zip(_imported(module, node), node.names):
                owner = _package(target)
                if name is None:
                    aliases[alias.asname or alias.name.rpartition(".")[2]] = owner
                elif name.startswith("_") and not name.startswith("__") and not _inside(here, owner):
                    found.append(f"{module}: from {target} import {name}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                    and str(node.args[1].value).startswith("_") and not str(node.args[1].value).startswith("__")
                    and ast.unparse(node.args[0]).endswith("trainer")
                    and not here.startswith("zerotrain.trainer.loop")):
                found.append(f"{module}: {ast.unparse(node)}")  # the same reach, spelt as a string
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            owner = aliases.get(node.value.id) if isinstance(node.value, ast.Name) else None
            if owner is not None and not _inside(here, owner):
                found.append(f"{module}: {node.value.id}.{node.attr}")
            # the Trainer's private state is the loop's: nothing else reads it
            if ast.unparse(node.value).endswith("trainer") and not here.startswith("zerotrain.trainer.loop"):
                found.append(f"{module}: {ast.unparse(node)}")
    return found


def test_no_reach_into_another_packages_private_names():
    assert not _private_reaches()


@pytest.mark.parametrize("name", ["zerotrain.trainer", "zerotrain.strategies", "zerotrain.callbacks"])
def test_the_scan_covers_each_part(name):
    assert any(m.startswith(name + ".") for m in MODULES)


def _declared_imports() -> dict[str, list[str]]:
    """Package -> the library packages its ``May import:`` line names (``zerotrain.`` prefixed)."""
    out = {}
    for name, tree in TREES.items():
        doc = ast.get_docstring(tree) or "" if MODULES[name].name == "__init__.py" else ""
        for line in doc.splitlines():
            if line.startswith("May import:"):
                names = [n.strip().rstrip(".") for n in line[len("May import:"):].split(",")]
                out[name] = [f"zerotrain.{n}" for n in names if n and n != "nothing"]
    return out


def _undeclared_imports(edges) -> list[str]:
    declared = _declared_imports()
    found = []
    for module, targets in edges.items():
        rooms = [p for p in declared if module == p or module.startswith(p + ".")]
        if not rooms:
            continue
        room = max(rooms, key=len)  # the closest package that declares its imports
        for target in targets:
            allowed = [room, *declared[room]]
            if target != "zerotrain" and not any(target == a or target.startswith(a + ".") for a in allowed):
                found.append(f"{module} imports {target} (May import of {room}: {declared[room]})")
    return found


def test_each_package_imports_only_what_its_docstring_declares():
    """A package whose ``__init__`` docstring has a ``May import:`` line loads only those parts of the
    library (and itself), so the map in trainer/README.md stays true."""
    assert len(_declared_imports()) >= 10
    assert not _undeclared_imports(_graph())


def test_an_undeclared_import_is_seen():
    edges = _graph()
    edges["zerotrain.trainer.launch.job"].add("zerotrain.trainer.loop.trainer")
    assert _undeclared_imports(edges)
