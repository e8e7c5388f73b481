"""`--speculative-algorithm PR_EAGLE3`: Parallel Reconsideration served inside SGLang (0.5.14, 0.5.15.post1,
0.5.16-0.5.23), as a plugin.

SGLang runs every function of the `sglang.srt.plugins` entry-point group (pyproject.toml) in each of
its processes before it parses arguments; ours is `register`, which adds `PR_EAGLE3` to SGLang's
speculative registry (`SpeculativeAlgorithm.register`), and its per-request admission to SGLang's plugin hook
registry (`HookRegistry`, which SGLang applies). Nothing of SGLang is edited.

  * `algorithm` - the registration: an algorithm that answers as EAGLE-3 (3-layer capture, the
    draft KV pool, EAGLE radix keys), fills what 0.5.14's `CustomSpecAlgo` lacks, runs the EAGLE
    family's argument handling, then the start-up refusals of `checks`.
  * `worker` - SGLang's V2 EAGLE worker with a PR draft worker: its `draft` builds the paper's round
    with `pr_specforge.serving.tensor_tree` per request, reading the drafter's committed context from
    SGLang's draft KV pool, and encodes the tree for SGLang's own `build_tree`; verify and
    draft-extend are SGLang's.
  * `checks` - the shape, the refusals, loading the PR drafter from the export (`core.eagle3`: no SpecForge).
  * `admission` - per request, in the scheduler (a hook of SGLang's plugin hook registry): the refusals of what
    the server cannot serve (HTTP 400, one line), and each `PR_EAGLE3` response's `meta_info["pr_eagle3"]`.
  * `seam` - every SGLang call whose form differs between the supported lines, and the version refusal.
  * `timing` - with `PR_EAGLE3_ROUND_TIMES=FILE` only: each decode round's time, phases and model compute, for
    EAGLE-3 and PR_EAGLE3 alike (`benchmarks/serving_cost.py`).
  * `op_counts` - with `PR_EAGLE3_OP_COUNTS=FILE` only: each decode round's device ops, by phase and by part
    (`pr_specforge.op_parts` labels PR's parts), for both alike (`benchmarks/serving_cost.py --ops`).

On a CPU, `pr_specforge.sglang_cpu` (the bridge) is still what makes SGLang's EAGLE path run.
"""

from __future__ import annotations

import os

ALGORITHM = "PR_EAGLE3"
TIMES_ENV = "PR_EAGLE3_ROUND_TIMES"  # `timing.ENV`, read here without importing SGLang
OPS_ENV = "PR_EAGLE3_OP_COUNTS"  # `op_counts.ENV`, likewise


def one_line_refusals() -> None:
    """A `checks.PRServeError` that ends an SGLang process (a launch refused while SGLang resolves its arguments,
    before anything starts) prints as its one line, `PRServeError: ...`, instead of a traceback through SGLang's
    launch path; any other exception goes to the hook the process had. Idempotent."""
    import sys

    previous = sys.excepthook
    if getattr(previous, "pr_eagle3", False):
        return

    def hook(kind, value, tb):
        from pr_specforge.sglang_plugin.checks import PRServeError

        if isinstance(value, PRServeError):
            sys.stderr.write(f"PRServeError: {value}\n")  # the process's last words, as a CLI main would say them
        else:
            previous(kind, value, tb)

    hook.pr_eagle3 = True
    sys.excepthook = hook


def require_sglang() -> None:
    """SGLang in this environment, else a `checks.PRServeError` (one line, with `one_line_refusals`): the plugin is
    SGLang's, installed into its environment (`pip install ./serving`), never run without it."""
    import importlib.util
    import sys

    if importlib.util.find_spec("sglang") is None:
        from pr_specforge.sglang_plugin.checks import PRServeError
        from pr_specforge.sglang_plugin.seam import SUPPORTED

        raise PRServeError(f"{ALGORITHM} is a plugin of SGLang ({SUPPORTED}), and {sys.executable} has no SGLang: "
                           "install the serving package into SGLang's own environment (its python -m pip install ./serving)")


def register() -> None:
    """The entry point: register `PR_EAGLE3` (idempotent; a second call in one process does nothing). Without
    SGLang, a one-line refusal (`require_sglang`)."""
    one_line_refusals()
    require_sglang()
    from pr_specforge.sglang_plugin.algorithm import register_algorithm

    register_algorithm()
    from pr_specforge.sglang_plugin.admission import install as install_admission

    install_admission()
    if os.environ.get(TIMES_ENV):
        from pr_specforge.sglang_plugin.timing import install

        install()
    if os.environ.get(OPS_ENV):
        from pr_specforge.sglang_plugin.op_counts import install as install_op_counts

        install_op_counts()
