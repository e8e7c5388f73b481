"""Both SGLang lines, touch point by touch point: `tests/serve_contract/touch_points.py` runs inside SGLang 0.5.14
(the training environment) and SGLang 0.5.23 (`.venv-serve`) under the CPU bridge's environment and reports each
touch point of `PR_EAGLE3` as it ran there; here each is checked against what `seam` expects of that line (the
table of docs/export.md, "SGLang versions"). Real PR trees (our tensor builder) go through each line's own
`build_tree` kernel via `seam.build_tree` and must come back as the bridge's reference builder (checked against
SGLang 0.5.14 live) gives them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pr_specforge.serving import TensorTreeBuilder
from pr_specforge.sglang_cpu import child_env
from pr_specforge.sglang_cpu.tree import build_tree
from pr_specforge.sglang_plugin.checks import PRServeShape
from pr_specforge.sglang_plugin.encoding import encode_tree
from tests.serve_contract import ROOT, serve_python
from tests.serving.test_serving_tree import eager_gate, models, primed_runtime  # noqa: F401 (models: a fixture)
from tests.sglang_plugin.test_serving_import import write_pr_export

SHAPES = [PRServeShape(k=2, bw=2, m=1, gamma=3, budget=6), PRServeShape(k=4, bw=4, m=2, gamma=4, budget=16),
          PRServeShape(k=3, bw=6, m=3, gamma=4, budget=12)]
RANGE = "PR_EAGLE3 supports SGLang 0.5.14, 0.5.15.post1 and 0.5.16-0.5.23; this is SGLang "
#: what each line is at each touch point (run, not read): 0.5.14 | 0.5.23
LINES = {
    "custom_spec_algo_lacks": (["need_topk", "create_future_map", "carries_draft_hidden_states"],) * 2,
    "scheduler_passes_confidence_relay": (False, True),
    "create_future_map": ("FutureMap", "FutureMap"),
    "disagg_draft_input_takes_server_args": (True, False),
    "handle_server_args_gets": (["ServerArgs"], ["_ForeignDefaults"]),
    "idle_verify_input_takes_device": (False, True),
    "init_new_keywords": ([], ["capture_hidden_mode", "return_hidden_states_before_norm", "extend_position_info",
                               "spec_mrope_positions", "kv_loc_plan", "write_cols"]),
    "schedule_batch_has_capture_hidden_mode": (True, False),
    "req_kv_allocated_len_at": ("req", "req.kv"),
    "req_pool_idx_at": ("req", "req.kv"),
    "build_tree_12th": ("position_buf", "fill_prefix_mask"),
    "draft_takes_with_topology": (False, True),
    "verify_buffers": ("get_verify_buffers_to_fill_after_draft", "verify_mask"),
    "triton_ops_cache_locs_module": (True, False),
    "draft_backend_factory_has_server_args": (True, False),
}


def _trees(models, path) -> list:
    """Real PR trees, encoded for `build_tree`, with the bridge's reference outputs."""
    target, _, pr = models
    rows = []
    for shape in SHAPES:
        for bias, seed in ((-2.0, 0), (0.0, 1)):
            eager_gate(pr, bias)
            rt, root, feat = primed_runtime(pr, target)
            tree = TensorTreeBuilder(rt, shape.tree_config()).build(root, feat, torch.Generator().manual_seed(seed))
            parents, scores = encode_tree(tree.parents(), tree.via_recon_list, shape.k, shape.parent_width())
            order = sorted(range(shape.budget), key=scores.__getitem__)
            toks = tree.tokens()
            args = dict(bonus=[toks[0]], parent_list=[parents], top_scores_index=[[scores[i] for i in order]],
                        draft_tokens=[[toks[i + 1] for i in order]], seq_lens=[rt.length], topk=2 * shape.k,
                        steps=shape.kernel_steps(), tokens=shape.budget + 1)
            ref = build_tree(*[torch.tensor(args[k]) for k in ("bonus", "parent_list", "top_scores_index",
                                                                "draft_tokens", "seq_lens")],
                             rt.length, args["topk"], args["steps"], args["tokens"])
            rows.append({**args, "reference": [x.tolist() for x in ref]})
    with open(path, "w") as f:
        json.dump(rows, f)
    return rows


@pytest.fixture(scope="module")
def inputs(models, tmp_path_factory):
    from tests.data.conftest import build_tokenizer
    from tests.helpers import make_tiny_target

    root = tmp_path_factory.mktemp("lines")
    tok = build_tokenizer()
    make_tiny_target(str(root / "target"), hidden=64, layers=8, vocab=len(tok), tie=True, tokenizer=tok)
    return {"trees": _trees(models, root / "trees.json"), "trees_path": str(root / "trees.json"),
            "target": str(root / "target"), "draft": write_pr_export(root / "pr"), "root": root}


def _probe(python: str, inputs, name: str) -> dict:
    out = inputs["root"] / f"{name}.json"
    env = child_env({**os.environ, "PYTHONPATH": ROOT})
    done = subprocess.run([python, "-m", "tests.serve_contract.touch_points", inputs["trees_path"], str(out),
                           inputs["target"], inputs["draft"]], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=500)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("line", ["0.5.14", "0.5.23"])
def test_each_touch_point_is_what_the_seam_expects_of_the_line(line, inputs):
    got = _probe(sys.executable if line == "0.5.14" else serve_python(), inputs, line)
    assert got["sglang"] == line
    errors = {k: v for k, v in got.items() if k.endswith("_error")}
    assert not errors, errors
    col = 0 if line == "0.5.14" else 1
    for name, forms in LINES.items():
        assert got[name] == forms[col], (name, got[name])
    assert got["version_refusals"] == ["UnsupportedSGLang: " + RANGE + v for v in ("0.5.13", "0.5.24", "0.6.0")]
    assert all(got["resolved_like_eagle3"].values()), got["resolved_like_eagle3"]
    assert got["refusal_topk_1"].startswith("PRServeError: PR_EAGLE3 needs --speculative-eagle-topk >= 2")
    # 0.5.14's create_idle_input allocates on CUDA (no device argument): an idle batch of the plugin on a CPU
    # raises there; 0.5.16+ takes the device
    assert (got["idle_verify_input"] == "ok") == (line != "0.5.14")
    for tree, ran in zip(inputs["trees"], got["trees"]):
        assert ran["outputs"] == tree["reference"]  # mask, positions, retrieve index / next token / sibling, tokens
        if line == "0.5.23":  # the 0.5.14 call's positional None as the 12th argument skips the prefix mask silently:
            # every prefix column keeps the sentinel (False) of the buffer it was given, every tree column is filled
            seq_len, n = tree["seq_lens"][0], tree["tokens"]
            rows = [ran["positional_none_mask"][r * (seq_len + n):(r + 1) * (seq_len + n)] for r in range(n)]
            ref = [tree["reference"][0][r * (seq_len + n):(r + 1) * (seq_len + n)] for r in range(n)]
            assert all(row[:seq_len] == [False] * seq_len for row in rows)
            assert all(r[:seq_len] == [True] * seq_len for r in ref)  # what the kwarg call fills
            assert [row[seq_len:] for row in rows] == [r[seq_len:] for r in ref]
