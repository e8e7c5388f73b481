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
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator, List, Tuple

PACKAGE = Path(__file__).resolve().parents[1] / "pr_specforge"
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
