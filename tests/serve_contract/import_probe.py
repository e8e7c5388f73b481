"""Run as a script (`python -m tests.serve_contract.import_probe EXPORT_DIR [TARGET_DIR]`): the serving import path
of `PR_EAGLE3` - the entry point, the registration, the worker, SGLang's draft model, and loading a PR export -
and of `scripts/sglang_cpu_serve*.sh` - the CPU bridge (installed, as its server processes install it) and, with
TARGET_DIR, its preflight run on TARGET_DIR and the export as the PR script runs it - with `specforge` refused at
import (a meta-path hook), so any import of it on that path fails the run.
Prints `serving path ok: <sglang version>`; exit 1 naming the module that imported SpecForge."""

from __future__ import annotations

import importlib.abc
import sys
import traceback
from typing import Optional

REFUSED = ("specforge", "pr_specforge._specforge", "pr_specforge.modeling", "pr_specforge.export")


class RefuseSpecForge(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == r or name.startswith(r + ".") for r in REFUSED):
            raise ImportError(f"the serving path imported {name}")
        return None


def main(export_dir: str, target_dir: Optional[str] = None) -> int:
    sys.meta_path.insert(0, RefuseSpecForge())
    try:
        import torch
        from importlib.metadata import version

        from pr_specforge.sglang_cpu import attention, bridge, kernels, preflight, server, tree  # noqa: F401

        bridge.install()  # what `site/sitecustomize.py` does in each server process of the CPU scripts
        if target_dir is not None:
            from pr_specforge.sglang_cpu.server import free_port

            if preflight.main([target_dir, export_dir, str(free_port()), "PR_EAGLE3"]) != 0:
                return 1
        from pr_specforge.sglang_plugin import register
        from pr_specforge.sglang_plugin import draft_model, timing, worker  # noqa: F401  (what the scheduler loads)
        from pr_specforge.sglang_plugin.checks import check_drafter, load_pr_drafter, read_export_config

        register()
        cfg = read_export_config(export_dir)
        check_drafter(export_dir, cfg)
        drafter = load_pr_drafter(export_dir, "cpu", torch.float32, torch.zeros(cfg["vocab_size"], cfg["hidden_size"]))
        assert hasattr(drafter, "pr_self_query") and drafter.max_depth >= 1
    except ImportError:
        traceback.print_exc()
        return 1
    leaked = sorted(m for m in sys.modules if any(m == r or m.startswith(r + ".") for r in REFUSED))
    if leaked:
        print(f"imported {leaked}")
        return 1
    print("serving path ok:", version("sglang"))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
