"""The library's import structure, read statically with ast (nothing is imported):

* no import circle among the modules of ``fm_parallel/`` and ``kernels/<language>/``
  (= ``fm_parallel.kernels.<language>``),
  counting imports inside functions too (a lazy import still ties two modules), but not those under
  ``if TYPE_CHECKING:`` (annotations only);
* no script under ``launch/`` takes a private name (``_x``) from ``fm_parallel``;
* nothing in the tree imports a top-level ``kernels`` (our folder is only ``fm_parallel.kernels``), and
  the folder has no ``__init__.py`` (so it never shadows PyPI's ``kernels``); one folder per kernel
  language in it;
* the FA4 version is written once (``pyproject.toml``; ``fm_parallel.kernels.fa4.pin`` reads it);
* no trainer module but ``objectives.py`` compares an objective's name (an objective is one class);
* the deprecated ``fm_parallel.launchers`` view is gone;
* no script under ``launch/`` edits ``sys.path`` (benchmarks run as ``python -m launch.bench.<name>``);
* a backend's derived data is never stored on a ``FlashMask`` (each backend has its own store).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"fm_parallel": ROOT / "fm_parallel", "fm_parallel.kernels.triton": ROOT / "kernels" / "triton",
            "fm_parallel.kernels.fa4": ROOT / "kernels" / "fa4"}
SKIP_DIRS = {".git", "build", "venv", ".venv", "node_modules"}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if pkg == "fm_parallel" and parts[:1] == ("kernels",) and parts[1:2] in (("triton",), ("fa4",)):
                continue  # an installed copy of kernels/<language>, if one exists
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((pkg, *parts))] = path
    return out


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node, skipping the bodies of ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _imports(node)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    anchor = package[: len(package) - node.level + 1]
    return ".".join(anchor + ([node.module] if node.module else []))


def _graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports: line of the first such import}."""
    mods = _modules()

    def owner(name: str) -> str | None:  # the most specific of our modules that `name` loads
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for module, path in mods.items():
        edges = graph.setdefault(module, {})
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = _absolute(node, module, path.name == "__init__.py")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for target in filter(None, map(owner, targets)):
                if target != module:
                    edges.setdefault(target, node.lineno)
    return graph


def _python_files():
    for path in sorted(ROOT.rglob("*.py")):
        if not SKIP_DIRS.intersection(path.relative_to(ROOT).parts[:-1]) and "egg-info" not in str(path):
            yield path


def _cycles(graph: dict[str, dict[str, int]]) -> set[tuple[str, ...]]:
    """Every circle a depth-first walk closes (each once, rotated to start at its smallest module)."""
    found, done = set(), set()

    def walk(node, stack, on_stack):
        for nxt in graph.get(node, {}):
            if nxt in on_stack:
                cycle = stack[stack.index(nxt):]
                i = cycle.index(min(cycle))
                found.add(tuple(cycle[i:] + cycle[:i]))
            elif nxt not in done:
                stack.append(nxt), on_stack.add(nxt)
                walk(nxt, stack, on_stack)
                stack.pop(), on_stack.discard(nxt)
        done.add(node)

    for start in sorted(graph):
        if start not in done:
            walk(start, [start], {start})
    return found


def test_the_cycle_finder_finds_circles():
    assert _cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == {("a", "b", "c")}
    assert _cycles({"a": {"b": 1}, "b": {}, "c": {"b": 1}}) == set()


def has_edge(graph, a, b) -> bool:
    return b in graph.get(a, {})


def test_the_graph_sees_lazy_and_relative_imports():
    graph = _graph()
    assert has_edge(graph, "fm_parallel.kernels.fa4.sparsity", "fm_parallel.kernels.plan")  # across folders
    relative = ast.parse("from .plan import x").body[0]
    assert _absolute(relative, "fm_parallel.kernels.fa4.sparsity", False) == "fm_parallel.kernels.fa4.plan"
    assert _absolute(relative, "fm_parallel.kernels", True) == "fm_parallel.kernels.plan"
    assert has_edge(graph, "fm_parallel.kernels.plan", "fm_parallel.kernels.triton.plan")  # inside a function
    assert has_edge(graph, "fm_parallel.masks.flashmask", "fm_parallel.masks.blocks")  # lazy, in block_summary
    assert not has_edge(graph, "fm_parallel.masks.blocks", "fm_parallel.masks.flashmask")  # TYPE_CHECKING only


def test_no_import_circles_in_the_library():
    graph = _graph()
    cycles = []
    for cycle in map(list, _cycles(graph)):
        hops = [f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:] + cycle[:1])]
        cycles.append(" -> ".join(hops + [cycle[0]]))
    assert not cycles, "import circles:\n" + "\n".join(sorted(cycles))


def test_launch_scripts_use_public_names_of_the_library_only():
    found = []
    for path in sorted((ROOT / "launch").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        library_modules = set()  # local names bound to fm_parallel modules: `plan._classes` counts too
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "fm_parallel" and not node.level:
                for alias in node.names:
                    if alias.name.startswith("_"):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} from {node.module} import {alias.name}")
                    library_modules.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "fm_parallel":
                        if any(part.startswith("_") and not part.startswith("__") for part in alias.name.split(".")):
                            found.append(f"{path.relative_to(ROOT)}:{node.lineno} import {alias.name}")
                        library_modules.add(alias.asname or alias.name.split(".")[0])
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id in library_modules):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value.id}.{node.attr}")
    assert not found, "private library names used under launch/ (use or add a public name):\n" + "\n".join(found)


def test_nothing_imports_a_top_level_kernels():
    found = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] == "kernels"]
    assert not found, "top-level `kernels` imports (use fm_parallel.kernels):\n" + "\n".join(found)


def test_the_kernels_folder_is_one_package_per_language_and_never_a_package_itself():
    folder = ROOT / "kernels"
    assert not (folder / "__init__.py").exists(), "kernels/__init__.py would make a top-level `kernels` package"
    entries = sorted(p.name for p in folder.iterdir() if p.name != "__pycache__")
    assert entries == ["fa4", "triton"], f"kernels/ holds one folder per kernel language, found {entries}"
    assert all((folder / lang / "__init__.py").is_file() for lang in entries)


def test_the_fa4_version_is_written_once():
    import re

    pin = re.compile(r"\b4\.0\.0b\d+")
    found = [f"{path.relative_to(ROOT)}" for path in _python_files() if pin.search(path.read_text())
             and path.name != "test_cute.py"]  # the fake other version that test installs
    assert not found, "FA4 versions written outside pyproject.toml (read fm_parallel.kernels.fa4.pin):\n" + "\n".join(found)


def _objective_name_tests(tree: ast.AST) -> list[int]:
    """Lines comparing something called ``objective`` (a name or an attribute) with a string."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = any(getattr(n, "id", getattr(n, "attr", None)) == "objective" for n in sides)
            strings = any(isinstance(n, ast.Constant) and isinstance(n.value, str) for n in sides) or any(
                isinstance(n, (ast.Tuple, ast.List, ast.Set)) and any(isinstance(e, ast.Constant) for e in n.elts)
                for n in sides)
            if named and strings:
                lines.append(node.lineno)
    return lines


def test_the_objective_name_finder_finds_a_branch():
    assert _objective_name_tests(ast.parse('if cfg.data.objective == "dpo":\n    pass\n')) == [1]
    assert _objective_name_tests(ast.parse('x = objective in ("sft", "dpo")\n')) == [1]
    assert _objective_name_tests(ast.parse("x = OBJECTIVES[cfg.data.objective](cfg)\n")) == []


def test_only_objectives_py_branches_on_the_objective():
    """Adding an objective is one class in trainer/objectives.py: no other library module asks which
    objective runs (data checks are ``Objective.validate``, losses ``Objective.loss``)."""
    found = [f"{path.relative_to(ROOT)}:{line}" for name, path in _modules().items()
             if name != "fm_parallel.trainer.objectives"
             for line in _objective_name_tests(ast.parse(path.read_text(), str(path)))]
    assert not found, "objective branches outside trainer/objectives.py:\n" + "\n".join(found)


def test_the_deprecated_launchers_view_is_gone():
    assert not (ROOT / "fm_parallel" / "launchers.py").exists()
    assert "fm_parallel.launchers" not in _modules()


def _recursive_closures(tree: ast.AST) -> list[tuple[str, str, int]]:
    """(outer, inner, line) for nested functions that call themselves and that the outer function
    does not ``del`` (a ``finally: del inner`` breaks the closure's reference cycle)."""
    found = []
    for outer in ast.walk(tree):
        if not isinstance(outer, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        deleted = {t.id for n in ast.walk(outer) if isinstance(n, ast.Delete) for t in n.targets if isinstance(t, ast.Name)}
        for inner in ast.walk(outer):
            if inner is outer or not isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            calls = {n.func.id for n in ast.walk(inner) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
            if inner.name in calls and inner.name not in deleted:
                found.append((outer.name, inner.name, inner.lineno))
    return found


def test_the_recursive_closure_finder_finds_one():
    src = "def f(x):\n    def g(y):\n        return g(y - 1) if y else x\n    return g(3)\n"
    assert _recursive_closures(ast.parse(src)) == [("f", "g", 2)]
    assert _recursive_closures(ast.parse(src.replace("    return g(3)", "    try:\n        return g(3)\n"
                                                         "    finally:\n        del g"))) == []


def test_no_recursive_closure_holds_tensors_past_its_call():
    """A nested function that calls itself is in a reference cycle with its closure, which keeps what
    the closure sees (a call's tensors) alive until the cyclic GC runs: on the H200 that held every
    layer's FA4 tensors at once (kernels/fa4/launches.py, 20.7 vs 6.4 GiB). Module-level helpers, or
    ``del`` the inner function in a ``finally``."""
    found = [f"{path.relative_to(ROOT)}:{line} {outer}.{inner}" for path in _modules().values()
             for outer, inner, line in _recursive_closures(ast.parse(path.read_text(), str(path)))]
    assert not found, "recursive closures (reference cycles holding their closure):\n" + "\n".join(found)


def test_a_backends_derived_data_is_never_stored_on_the_mask():
    """Only the masks layer writes ``FlashMask.cached`` / ``_cache``; backends keep their own store
    (``fm_parallel.derived.derived_for_mask``)."""
    found = []
    for path in _python_files():
        rel = path.relative_to(ROOT)
        if rel.parts[:2] == ("fm_parallel", "masks") or rel.parts[0] == "tests":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in ("cached", "_cache") and not (
                    isinstance(node.value, ast.Name) and node.value.id == "self"):
                found.append(f"{rel}:{node.lineno} .{node.attr}")
    assert not found, "data derived outside the masks layer stored on a FlashMask:\n" + "\n".join(found)


def test_no_script_under_launch_edits_sys_path():
    """Benchmarks run as modules from the project root (``python -m launch.bench.<name>``); an example
    imports its siblings from its own folder, which Python puts on ``sys.path`` when it runs."""
    found = []
    for path in sorted((ROOT / "launch").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                    and node.value.id == "sys"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, "sys.path used under launch/ (run the script as a module instead):\n" + "\n".join(found)
