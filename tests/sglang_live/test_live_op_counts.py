"""`benchmarks/serving_cost.py --ops only` live on this CPU at the small shape (k 2, B_w 2, gamma 3, B 6): one pair of
servers (SGLang's EAGLE3 and PR_EAGLE3, `PR_EAGLE3_OP_COUNTS`) counts every decode round's device ops under the torch
profiler, by phase and by part (`pr_specforge.sglang_plugin.op_counts`). The counts are real ops of real rounds:
verify and draft-extend are SGLang's in both algorithms and count the same; SGLang's tree build (the CPU bridge's
stand-in of one sgl-kernel kernel) and each attention call are one op in both; EAGLE3's draft has no PR part; a batch
all at m = 0 is SGLang's own draft (`PR_EAGLE3_M0_DRAFT=sglang`, the default): EAGLE3's ops, op for op; PR's round
at m = 3 shows its parts, the reconsideration's (bids, repricing) among them, and adds ops to m = 0."""

from __future__ import annotations

import json

from tests.export.conftest import ENV
from tests.helpers import load_benchmark

PR_PARTS = ("load", "tree", "readouts", "encoding", "verify_input")


def test_the_op_counter_counts_each_phases_ops_and_splits_prs_draft_by_part(live_run, tmp_path, monkeypatch):
    for name, value in ENV.items():  # the servers' environment, as the live tests' own servers get it
        monkeypatch.setenv(name, value)
    bench = load_benchmark("serving_cost")
    out = tmp_path / "ops.json"
    assert bench.main(["--target", live_run["target"], "--draft", live_run["pr"], "--shapes", "small", "--ops", "only",
                       "--requests", "1,2", "--max-new", "6", "--work", str(tmp_path / "work"), "--json", str(out),
                       "--md", str(tmp_path / "ops.md")]) == 0
    cells = json.loads(out.read_text())["cells"]
    assert set(cells) == {"small/1", "small/2"}
    for key, block in cells.items():
        ops = block["ops"]
        e, m0, m3 = ops["eagle3"], ops["pr_m0"], ops["pr_m3"]
        for w, c in ops.items():
            assert c["rounds_counted"] >= 1 and c["draft"] > 0 and c["verify"] > 0 and c["extend"] > 0, (key, w)
            assert c["round"] == c["draft"] + c["verify"] + c["extend"] + c["other"], (key, w)
            assert c["draft"] == sum(c["draft_parts"].values()), (key, w)
        # verify and draft-extend are SGLang's in both servers: the same ops, op for op
        assert e["verify"] == m0["verify"] == m3["verify"] and e["extend"] == m0["extend"] == m3["extend"], key
        assert set(e["draft_parts"]) <= {"model", "other"} and e["draft_parts"]["model"] > 0, key
        assert "aten::topk" in e["draft_names"]["other"], key  # SGLang's own top-k selection
        # SGLang's tree build: the CPU bridge's stand-in of sgl-kernel's one kernel, one op in both
        assert e["draft_names"]["other"]["kernel:build_tree"] == 1, key
        # m = 0 for every request of the batch: SGLang's own draft (`PR_EAGLE3_M0_DRAFT=sglang`), op for op EAGLE3's
        assert m0["draft"] == e["draft"] and m0["draft_names"] == e["draft_names"], key
        assert m3["draft_names"]["verify_input"]["kernel:build_tree"] == 1, key
        # each attention call of a layer is one op, whatever the CPU's backend loops over inside
        for c in (e, m0, m3):
            model = c["draft_names"]["model"]
            assert model["kernel:attention"] > 0 and "aten::scaled_dot_product_attention" not in model, key
        assert set(PR_PARTS) <= set(m3["draft_parts"]) and m3["draft_parts"]["model"] > 0, key
        assert m3["draft_parts"]["bids"] > 0 and m3["draft_parts"]["repricing"] > 0 and m3["draft_parts"]["pool"] > 0
        assert m3["draft"] > m0["draft"], key
        r = block["ops_ratios"]
        assert r["pr_m0_added_ops_per_step"] == (m0["draft"] - e["draft"]) / 3
        assert r["pr_m3_added_ops_per_round"] == m3["draft"] - e["draft"]
        # PR's round labels its row steps (gamma - 1 of them after the root): its draft splits into ops per row step
        # and ops once a round; SGLang's own draft (EAGLE3's, m = 0's) labels none
        split = r["pr_m3_row_split"]
        assert split["row_steps"] == 2 and split["ops_per_row_step"] * 2 + split["ops_per_round"] == m3["draft"], key
        assert split["parts"]["load"]["per_row_step"] == 0 and split["parts"]["repricing"]["per_round"] == 0, key
        assert "eagle3_row_split" not in r and "pr_m0_row_split" not in r, key
    table = (tmp_path / "ops.md").read_text()
    assert "| small | 2 | pr_m3 |" in table and "added to eagle3's draft per round" in table
