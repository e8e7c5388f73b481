"""One tiny trained `pr` run shared by the export tests (6 steps, ~5 s on CPU)."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import write_workspace

ENV = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1", WANDB_MODE="disabled")


def train_workspace(root, **kwargs):
    """Write a workspace whose draft config uses `fc_norm: true` (as every shipped recipe does) and train it."""
    recipe = write_workspace(str(root), **kwargs)
    draft = os.path.join(str(root), "draft.json")
    with open(draft) as f:
        cfg = json.load(f)
    cfg["fc_norm"] = True
    with open(draft, "w") as f:
        json.dump(cfg, f)
    proc = subprocess.run([sys.executable, "-m", "pr_specforge.cli", "train", "-c", recipe], cwd=str(root), env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return recipe


@pytest.fixture(scope="session")
def trained_pr_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("pr_run")
    train_workspace(root, strategy="pr", steps=6, pr_section={"max_depth": 2})
    return root
