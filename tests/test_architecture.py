"""Package architecture, read from the source (ast), like SpecForge's own architecture test.

* SpecForge is imported only by the adapter, `pr_specforge/_specforge.py`, and only the adapter
  touches SpecForge's private API: no other module imports a private name from it, or reads or
  calls a private member (`self._x`, `obj._x`) that a SpecForge class the adapter exposes defines
  (the names are read from those classes, so a SpecForge upgrade updates the list).
* No file over 600 lines and no function over 80 lines in `pr_specforge/`.
* `print` and `raise SystemExit` only in CLI entry points (a `main` function, or a `cli.py`
  module); library functions raise exceptions and log.
* Light modules (recipe errors, recipe loading, the CLI, the stages) import without torch or SpecForge,
  and importing the adapter patches nothing in SpecForge.
* No import circle among the package's modules: the graph is read from every `import` and `from ... import`
  (module level and inside functions, absolute and relative, `from pkg import submodule` as an edge to the
  submodule; `if TYPE_CHECKING:` blocks never run and are left out), and a cycle fails naming its modules.
* No `.py` file in `benchmarks/` over 600 lines either.
* The serving plugin (`sglang_plugin/`, and `serving/batched_tree.py`, whose round it runs) never brings host values
  to a device with a waiting copy: no `torch.tensor(..., device=...)` / `torch.as_tensor(..., device=...)`, and no
  `torch.tensor(...).to(...)` without `non_blocking=True`; `serving.host_reads.to_device` is the way (a waiting
  copy holds the draft's launches until the GPU has caught up, which undoes SGLang's overlap schedule).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

PACKAGE = Path(__file__).resolve().parents[1] / "pr_specforge"
BENCHMARKS = PACKAGE.parent / "benchmarks"
ADAPTER = PACKAGE / "_specforge.py"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80


def _modules() -> Iterator[Tuple[Path, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def _rel(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


def _enclosing_functions(tree: ast.Module):
    """`node -> name of the innermost function holding it` ('<module>' at top level)."""
    owner = {}

    def visit(node, name):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else name
            owner[child] = name
            visit(child, inner)

    visit(tree, "<module>")
    return owner


def _is_cli_entry(path: Path, function: str) -> bool:
    return path.name == "cli.py" or function in ("main", "<module>")


def test_specforge_is_imported_only_by_the_adapter():
    offenders: List[str] = []
    for path, tree in _modules():
        if path == ADAPTER:
            continue
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            offenders += [f"{_rel(path)}:{node.lineno} imports {n}" for n in names if n.split(".")[0] == "specforge"]
    assert not offenders, "SpecForge is imported outside pr_specforge/_specforge.py:\n" + "\n".join(offenders)


def test_no_file_over_600_lines_and_no_function_over_80():
    long_files, long_functions = [], []
    for path, tree in _modules():
        lines = len(path.read_text().splitlines())
        if lines > MAX_FILE_LINES:
            long_files.append(f"{_rel(path)}: {lines} lines")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{_rel(path)}:{node.lineno} {node.name}: {length} lines")
    assert not long_files, long_files
    assert not long_functions, long_functions


def test_no_benchmark_file_over_600_lines():
    files = sorted(BENCHMARKS.rglob("*.py"))
    assert len(files) >= 8, files  # the studies are read (a moved folder must not pass by finding nothing)
    long_files = [f"{p.relative_to(PACKAGE.parent)}: {n} lines" for p in files
                  if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert not long_files, long_files


def _module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _executed_imports(tree: ast.AST) -> Iterator[ast.stmt]:
    """Every import statement of a module, at any depth, but those under `if TYPE_CHECKING:` (never run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for child in node.orelse:
                yield from _executed_imports(ast.Module(body=[child], type_ignores=[]))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _executed_imports(node)


def import_graph(package: Path) -> Dict[str, Dict[str, int]]:
    """`module -> {module it imports: line}` among the modules of `package` (a directory): each import names the
    most specific module of the package it loads (`from a.b import c` is `a.b.c` when that is a module, else `a.b`;
    `import a.b.c` is `a.b.c`; a relative import is resolved against the importing module's package)."""
    paths = {_module_name(p, package): p for p in sorted(package.rglob("*.py"))}
    graph: Dict[str, Dict[str, int]] = {}
    for name, path in paths.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = graph.setdefault(name, {})
        for node in _executed_imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = here.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            for target in targets:
                while target and target not in paths:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.setdefault(target, node.lineno)
    return graph


def import_cycles(graph: Dict[str, Dict[str, int]]) -> List[List[str]]:
    """One cycle per strongly connected group of modules (Tarjan's algorithm, iterative), each as the path
    `[a, b, ..., a]` a shortest walk from its first module back to it takes."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack = set()
    groups: List[List[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    cycles = []
    for group in groups:
        start, members = group[0], set(group)
        came_from = {start: None}
        frontier = [start]
        while frontier and start not in [c for f in frontier for c in graph[f]]:
            nxt = []
            for f in frontier:
                for c in sorted(graph[f]):
                    if c in members and c not in came_from:
                        came_from[c] = f
                        nxt.append(c)
            frontier = nxt
        last = next(f for f in frontier if start in graph[f])
        path = [last]
        while came_from[path[-1]] is not None:
            path.append(came_from[path[-1]])
        cycles.append(path[::-1] + [start])  # start -> ... -> last -> start
    return cycles


def _cycle_text(graph: Dict[str, Dict[str, int]], cycle: List[str]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_the_package_and_the_study_code_have_no_import_cycle():
    graph = import_graph(PACKAGE)
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100, "the import graph came out nearly empty"
    assert "pr_specforge._specforge" in graph["pr_specforge.training.registration"]  # `from pr_specforge import _specforge`
    study = import_graph(BENCHMARKS / "study")  # the studies' shared code and the regime study's rooms
    assert "study.regime_settings" in study["study.regime_stages"]  # `from .regime_settings import ...`
    cycles = [(graph, c) for c in import_cycles(graph)] + [(study, c) for c in import_cycles(study)]
    assert not cycles, "import cycles (move what both sides need into a module both import):\n" + "\n".join(
        _cycle_text(g, c) for g, c in cycles)


def test_the_cycle_check_finds_a_deliberate_cycle_at_any_depth_and_of_any_import_form(tmp_path):
    """A package with the import forms the check must read: a cycle through a function-level relative import and a
    `from pkg import submodule`, a longer one through `import a.b`, and a TYPE_CHECKING import that is no edge."""
    pkg = tmp_path / "demo"
    files = {
        "__init__.py": "",
        "errors.py": "class Boom(Exception):\n    pass\n",
        "train.py": "from demo.backends.checkpoint import save\nfrom demo.errors import Boom\n",
        "backends/__init__.py": "",
        "backends/checkpoint.py": "def save():\n    from ..train import run\n    return run\n",
        "a.py": "import demo.b\n",
        "b.py": "from demo import c\n",
        "c.py": "def f():\n    import demo.a\n",
        "typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from demo import leaf\nimport demo.errors\n",
        "leaf.py": "from demo import typed\n",
    }
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    graph = import_graph(pkg)
    assert graph["demo.backends.checkpoint"] == {"demo.train": 2} and graph["demo.b"] == {"demo.c": 1}
    assert graph["demo.typed"] == {"demo.errors": 4}  # the TYPE_CHECKING import is not an edge
    cycles = import_cycles(graph)
    assert sorted(cycles) == [["demo.a", "demo.b", "demo.c", "demo.a"],
                              ["demo.backends.checkpoint", "demo.train", "demo.backends.checkpoint"]], cycles
    assert _cycle_text(graph, cycles[0]).startswith("demo.a (line 1) -> demo.b (line 1) -> demo.c (line 2) -> demo.a")
    # moving the exception out breaks the first circle, as in the package (training/errors.py)
    (pkg / "backends/checkpoint.py").write_text("def save():\n    from ..errors import Boom\n    return Boom\n")
    (pkg / "c.py").write_text("def f():\n    import demo.errors\n")
    assert import_cycles(import_graph(pkg)) == []


def test_print_and_system_exit_only_in_cli_entry_points():
    offenders = []
    for path, tree in _modules():
        owner = _enclosing_functions(tree)
        for node in ast.walk(tree):
            what = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                what = "print"
            elif isinstance(node, ast.Raise) and node.exc is not None and "SystemExit" in ast.unparse(node.exc):
                what = "raise SystemExit"
            if what and not _is_cli_entry(path, owner.get(node, "<module>")):
                offenders.append(f"{_rel(path)}:{node.lineno} {what} in {owner.get(node)}()")
    assert not offenders, "library code prints or exits (raise an exception; let main() report it):\n" + "\n".join(offenders)


def test_light_modules_import_without_torch_and_the_adapter_patches_nothing():
    code = (
        "import sys\n"
        "import pr_specforge.config, pr_specforge.cli, pr_specforge.training, pr_specforge.training.recipe\n"
        "import pr_specforge.training.train, pr_specforge.training.preflight, pr_specforge.training.backends.config\n"
        "import pr_specforge.stages, pr_specforge.pipeline, pr_specforge.experiment, pr_specforge.eval.statistics\n"
        "heavy = sorted(m for m in ('torch', 'specforge') if m in sys.modules)\n"
        "assert not heavy, f'light modules imported {heavy}'\n"
        "import specforge.algorithms.eagle3.model as m, specforge.training.trainer as t, specforge.training.assembly as a\n"
        "before = (m.LogSoftmaxLoss, t.CheckpointManager, t.FSDPTrainingBackend, a._configured_logger)\n"
        "import pr_specforge._specforge, pr_specforge.modeling, pr_specforge.training.registration, pr_specforge.training.objective.ttt\n"
        "import pr_specforge.training.telemetry, pr_specforge.training.backends.checkpoint, pr_specforge.training.backends.deepspeed\n"
        "after = (m.LogSoftmaxLoss, t.CheckpointManager, t.FSDPTrainingBackend, a._configured_logger)\n"
        "assert before == after, 'importing pr_specforge patched SpecForge'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_sglang_cpu_bridge_is_never_imported_by_the_package():
    """`pr_specforge.sglang_cpu` patches SGLang: only the tests and scripts/sglang_cpu_serve.sh load it."""
    bridge = PACKAGE / "sglang_cpu"
    offenders = []
    for path, tree in _modules():
        if bridge in path.parents:
            continue
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{_rel(path)}:{node.lineno}" for n in names if n.startswith("pr_specforge.sglang_cpu")]
    assert not offenders, offenders
    code = ("import sys\n"
            "import pr_specforge, pr_specforge.cli, pr_specforge.export, pr_specforge.data.hidden_states\n"
            "import pr_specforge.data.regenerate, pr_specforge.eval.evaluator, pr_specforge.serving\n"
            "assert not [m for m in sys.modules if m.startswith('pr_specforge.sglang_cpu')], 'bridge imported'\n"
            "assert not [f for f in sys.meta_path if 'PatchAfterImport' in type(f).__name__], 'import hook installed'\n")
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _specforge_private_names() -> set:
    """Private members (`_x`, not dunders) of every SpecForge class the adapter exposes, and of
    their SpecForge base classes: the names only the adapter may use."""
    import inspect

    import pr_specforge._specforge as adapter

    names = set()
    for value in vars(adapter).values():
        if not inspect.isclass(value):
            continue
        for base in value.__mro__:
            if base.__module__.split(".")[0] == "specforge":
                names |= {n for n in vars(base) if n.startswith("_") and not n.startswith("__") and n != "_abc_impl"}
    return names


def _private_api_uses(tree: ast.Module, private: set) -> List[Tuple[int, str]]:
    """`(line, what)` for each use of SpecForge's private API in a module other than the adapter."""
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in private:
            uses.append((node.lineno, f"{ast.unparse(node)}"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "") == "pr_specforge._specforge":
            uses += [(node.lineno, f"imports {a.name}") for a in node.names if a.name.startswith("_")]
    return uses


def test_specforges_private_api_is_used_only_by_the_adapter():
    private = _specforge_private_names()
    assert {"_acc_and_loss", "_prepare_position_ids", "_prepare_target", "_device", "_atomic_save"} <= private
    offenders = [f"{_rel(path)}:{line} {what}" for path, tree in _modules() if path != ADAPTER
                 for line, what in _private_api_uses(tree, private)]
    assert not offenders, ("SpecForge's private API is used outside pr_specforge/_specforge.py (add a named adapter "
                           "function):\n" + "\n".join(offenders))


def test_the_private_api_check_catches_calls_attributes_and_imports():
    private = _specforge_private_names()
    source = (
        "from pr_specforge._specforge import Eagle3TrainStrategy, _compute_target_p_padded\n"
        "class S(Eagle3TrainStrategy):\n"
        "    def forward_loss(self, batch):\n"
        "        device = self._device()\n"
        "        CheckpointManager._atomic_save(batch, 'x')\n"
        "        return self.eagle3_model._acc_and_loss(device=device)\n"
        "    def public(self):\n"
        "        return self._mine, self.validate_batch\n"
    )
    found = {what for _, what in _private_api_uses(ast.parse(source), private)}
    assert found == {"imports _compute_target_p_padded", "self._device", "self.eagle3_model._acc_and_loss",
                     "CheckpointManager._atomic_save"}, found


WAITING_COPY_SCOPE = ("sglang_plugin", "serving/batched_tree.py")


def _waiting_copies(tree: ast.AST) -> List[Tuple[int, str]]:
    """`(line, what)` for each host-to-device copy that waits for the device: `torch.tensor` / `torch.as_tensor`
    with a `device=`, or such a tensor's `.to(...)` / `.cuda(...)` without `non_blocking=True`."""

    def is_new_tensor(node) -> bool:
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("tensor", "as_tensor")
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch")

    def non_blocking(call: ast.Call) -> bool:
        return any(k.arg == "non_blocking" and isinstance(k.value, ast.Constant) and k.value.value is True
                   for k in call.keywords)

    found = []
    for node in ast.walk(tree):
        if is_new_tensor(node) and any(k.arg == "device" for k in node.keywords):
            found.append((node.lineno, f"torch.{node.func.attr}(..., device=...)"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("to", "cuda") and is_new_tensor(node.func.value) and not non_blocking(node)):
            found.append((node.lineno, f"torch.{node.func.value.func.attr}(...).{node.func.attr}(...) that waits"))
    return found


def test_the_serving_plugin_brings_host_values_to_the_device_without_waiting():
    bad = [f"{_rel(path)}:{line}: {what}"
           for path, tree in _modules()
           if any(str(path.relative_to(PACKAGE)).startswith(scope) for scope in WAITING_COPY_SCOPE)
           for line, what in _waiting_copies(tree)]
    assert not bad, "waiting host-to-device copies (use serving.host_reads.to_device):\n" + "\n".join(bad)


def test_the_waiting_copy_check_catches_each_form():
    source = """
import torch
a = torch.tensor([1, 2], device=dev)
b = torch.as_tensor(x, device="cuda")
c = torch.tensor([1]).to(dev)
d = torch.tensor([1]).cuda()
e = torch.tensor([1]).to(dev, non_blocking=True)
f = torch.tensor([1])
"""
    assert [line for line, _ in _waiting_copies(ast.parse(source))] == [3, 4, 5, 6]
