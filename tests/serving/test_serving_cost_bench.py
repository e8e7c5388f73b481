"""`benchmarks/serving_cost.py` without servers: a cell keeps only the rounds whose batch is all of its requests,
its medians and ratios come from those rounds, the targets are read as documented, and bad inputs stop in one line.
(The timing lines themselves are checked live: tests/sglang_live/test_live_tree.py and test_live_pr_eagle3.py.)"""

import json

import pytest
import torch

from tests.helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("serving_cost")


def _round(rids, round_s, floor_s, draft_s=0.02, draft_floor=0.01):
    return {"batch": len(rids), "rids": rids, "round_s": round_s, "floor_s": floor_s, "draft_s": draft_s,
            "verify_s": 0.1, "extend_s": 0.01, "target_compute_s": floor_s - draft_floor,
            "draft_compute_s": draft_floor, "draft.draft_compute_s": draft_floor}


def test_a_cell_keeps_full_batches_only_and_takes_medians(bench):
    asks = [{"rids": ["a", "b"], "tokens": 20, "rounds": 10, "wall_s": 2.0},
            {"rids": ["c", "d"], "tokens": 30, "rounds": 10, "wall_s": 2.0}]
    rounds = [_round(["a", "b"], 0.2, 0.15), _round(["c", "d"], 0.4, 0.3), _round(["c", "d"], 0.3, 0.2),
              _round(["a"], 9.0, 9.0),  # the batch shrank: left out
              _round(["x", "y"], 9.0, 9.0)]  # another cell's requests: left out
    cell = bench.cell_summary(asks, rounds, 2)
    assert cell["rounds_timed"] == 3
    assert cell["round_s"] == pytest.approx(0.3) and cell["floor_s"] == pytest.approx(0.2)
    assert cell["bookkeeping_s"] == pytest.approx(0.1)
    assert cell["draft_floor_s"] == pytest.approx(0.01) and cell["draft_bookkeeping_s"] == pytest.approx(0.01)
    assert cell["tau"] == pytest.approx(2.5)
    assert cell["tokens_per_s"] == pytest.approx(12.5)
    with pytest.raises(RuntimeError, match="no timed round"):
        bench.cell_summary(asks, rounds[3:], 2)


def test_ratios_and_targets(bench):
    cell = lambda r, f, d, df: {"round_s": r, "floor_s": f, "bookkeeping_s": r - f, "draft_s": d,  # noqa: E731
                                "draft_floor_s": df}
    cells = {"eagle3": cell(1.0, 0.9, 0.1, 0.08), "pr_m0": cell(1.04, 0.92, 0.12, 0.09),
             "pr_m3": cell(1.20, 1.08, 0.2, 0.15)}
    r = bench.ratios(cells, gpu=False)
    assert r["m0_over_eagle3"] == pytest.approx(1.04) and r["target_m0_within_1.05_of_eagle3"]
    assert r["m3_floor_over_m0_floor"] == pytest.approx(1.08 / 0.92)
    assert r["target_m3_within_0.05_of_floor_ratio"] == (1.20 / 1.04 <= 1.08 / 0.92 + 0.05)
    assert not bench.ratios(cells, gpu=True)["target_m3_within_1.05_of_m0"]
    assert "m0_over_eagle3_per_target" not in r  # no target compute timed: no per-target ratio
    slow = dict(cells, eagle3=dict(cells["eagle3"], target_compute_s=0.6), pr_m0=dict(cells["pr_m0"], target_compute_s=0.65))
    per = bench.ratios(slow, gpu=False)  # m0's server ran its target forward 8% slower: per forward, 0.96x
    assert per["m0_over_eagle3_per_target"] == pytest.approx((1.04 / 0.65) / (1.0 / 0.6))
    assert per["target_m0_within_1.05_of_eagle3_per_target"]
    assert bench.per_target(per) == "0.960 (met)" and bench.per_target(r) == "-"
    result = {"machine": "m", "dtype": "float32", "commit": "c", "date": "d", "cpu": "cpu", "threads": 2,
              "target_name": "t", "draft_name": "p", "max_new": 8, "repeats": 1, "command": "python x",
              "cells": {"paper/1": {"ways": {w: dict(c, verify_s=0.1, extend_s=0.01, tau=1.5, tokens_per_s=3.0)
                                             for w, c in cells.items()}, "ratios": r}}}
    table = bench.markdown(result)
    assert "| paper | 1 | pr_m3 | 1200.0 |" in table and "| met |" in table
    assert "PR_EAGLE3's readouts: one call per request." in table  # a result from before the readouts switch
    result["cells"]["paper/1"]["readouts"] = {"mode": "batched", "row_invariant": True}
    assert "readouts: batched (a row's readouts the same bits in any call on that machine: yes)" in bench.markdown(result)


def test_each_server_pairs_ratios_are_kept_and_tabled(bench):
    """Each repeat runs its own pair of servers: its ratios come from its own asks and rounds only."""
    def way(rids, round_s, target_s):
        ask = {"rids": rids, "tokens": 10, "rounds": 5, "wall_s": 1.0}
        return ask, [dict(_round(rids, round_s, round_s - 0.05), target_compute_s=target_s)]
    fast = {"eagle3": way(["a"], 1.0, 0.8), "pr_m0": way(["b"], 1.1, 0.88), "pr_m3": way(["c"], 1.21, 0.9)}
    pair = bench.pair_ratios(fast, 1, gpu=False)
    assert set(pair) == set(bench.PAIR_RATIOS)
    assert pair["m0_over_eagle3"] == pytest.approx(1.1) and pair["m3_over_m0"] == pytest.approx(1.1)
    assert pair["m0_over_eagle3_per_target"] == pytest.approx(1.0)  # the PR server ran every forward 10% slower
    assert bench.pair_ratios(fast, 2, gpu=False) == {}  # no round held both requests of the cell in that pair
    r = bench.ratios({w: bench.cell_summary([a], rounds, 1) for w, (a, rounds) in fast.items()}, gpu=False)
    result = {"machine": "m", "dtype": "float32", "commit": "c", "date": "d", "cpu": "cpu", "threads": 2,
              "target_name": "t", "draft_name": "p", "max_new": 8, "repeats": 2, "command": "python x",
              "cells": {"small/1": {"ways": {w: bench.cell_summary([a], rounds, 1) for w, (a, rounds) in fast.items()},
                                    "ratios": r, "per_server_pair": [pair, {}]}}}
    assert "| small | 1 | 1.100, - | 1.000, - | 1.100, - |" in bench.markdown(result)


def test_an_untimed_run_reports_tau_and_tokens_per_second_only(bench):
    """`--untimed` / `--overlap`: no round times, so no round table; tokens/s ratios pooled and per server pair."""
    asks = {"eagle3": [{"tokens": 40, "rounds": 20, "wall_s": 4.0}, {"tokens": 40, "rounds": 20, "wall_s": 2.0}],
            "pr_m0": [{"tokens": 40, "rounds": 20, "wall_s": 4.0}, {"tokens": 40, "rounds": 20, "wall_s": 4.0}],
            "pr_m3": [{"tokens": 40, "rounds": 10, "wall_s": 5.0}, {"tokens": 40, "rounds": 10, "wall_s": 5.0}]}
    cells = {w: bench.throughput(a) for w, a in asks.items()}
    assert cells["eagle3"] == {"tau": 2.0, "tokens_per_s": 15.0} and cells["pr_m3"]["tau"] == 4.0
    r = bench.throughput_ratios(cells)
    assert r == {"m0_tokens_per_s_over_eagle3": pytest.approx(10 / 15), "m3_tokens_per_s_over_m0": pytest.approx(0.8)}
    per = [bench.throughput_ratios({w: bench.throughput([a[i]]) for w, a in asks.items()}) for i in range(2)]
    result = {"machine": "m", "dtype": "float32", "commit": "c", "date": "d", "cpu": "cpu", "threads": 2,
              "target_name": "t", "draft_name": "p", "max_new": 8, "repeats": 2, "command": "python x --overlap",
              "timed": False, "overlap": True,
              "cells": {"paper/1": {"ways": cells, "ratios": r, "per_server_pair": per}}}
    table = bench.markdown(result)
    assert "SGLang's overlap schedule on; untimed servers" in table and "round ms" not in table
    assert "| paper | 1 | pr_m3 | 4.000 | 8.00 |" in table
    assert "| paper | 1 | 0.667 | 0.800 | 1.000, 0.500 | 0.800, 0.800 |" in table


def test_the_pr_servers_readouts_are_read_from_its_log(bench, tmp_path):
    log = tmp_path / "paper-pr.log"
    from pr_specforge.sglang_plugin.worker import READY_LINE

    log.write_text("[t] PR_EAGLE3 draft worker ready\n[t] " + READY_LINE % ("triton", "batched", "capture", False) + "\n")
    assert bench.served_readouts(str(log)) == {"mode": "batched", "row_invariant": False, "attention": "triton",
                                               "graph": "capture"}
    log.write_text("[t] PR_EAGLE3 draft worker ready\n")
    with pytest.raises(RuntimeError, match="paper-pr.log: the PR_EAGLE3 server did not log its readouts"):
        bench.served_readouts(str(log))


def test_bad_inputs_stop_in_one_line(bench, tmp_path):
    target, draft = tmp_path / "target", tmp_path / "draft"
    with pytest.raises(SystemExit, match=r"--target .*: no config.json there"):
        bench.main(["--target", str(target), "--draft", str(draft)])
    target.mkdir(), draft.mkdir()
    (target / "config.json").write_text("{}")
    (draft / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    with pytest.raises(SystemExit, match="not a PR export"):
        bench.main(["--target", str(target), "--draft", str(draft)])
    (draft / "config.json").write_text(json.dumps({"pr_config": {}}))
    with pytest.raises(SystemExit, match="'huge' is not one of paper, small"):
        bench.main(["--target", str(target), "--draft", str(draft), "--shapes", "huge"])
    with pytest.raises(SystemExit, match="must be >= 1"):
        bench.main(["--target", str(target), "--draft", str(draft), "--requests", "0"])
    with pytest.raises(SystemExit, match=r"--cuda-graph needs --device cuda \(the CPU bridge runs without graphs\)$"):
        bench.main(["--target", str(target), "--draft", str(draft), "--cuda-graph"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="--device cuda: torch sees no CUDA device here$"):
            bench.main(["--target", str(target), "--draft", str(draft), "--device", "cuda"])


def test_a_gpu_result_names_its_gpu_and_graphs_and_a_cpu_result_does_not(bench):
    assert bench.device_note({"device": "cuda", "gpu": "NVIDIA H200", "cuda_graph": True}) == \
        ", NVIDIA H200, SGLang's CUDA graphs on"
    assert bench.device_note({"device": "cpu"}) == "" and bench.device_note({}) == ""


def test_the_gpu_launch_is_stock_sglang_on_triton_and_the_cpu_launch_goes_through_the_bridge():
    from pr_specforge.sglang_cpu.server import launch_command, server_env

    gpu = launch_command("T", 30000, "--x", device="cuda")
    assert gpu[gpu.index("--device") + 1] == "cuda" and gpu[gpu.index("--attention-backend") + 1] == "triton"
    assert "--disable-overlap-schedule" in gpu and "--disable-cuda-graph" in gpu and gpu[-1] == "--x"
    assert "--disable-cuda-graph" not in launch_command("T", 30000, device="cuda", cuda_graph=True)
    cpu = launch_command("T", 30000)
    assert cpu[cpu.index("--device") + 1] == "cpu" and cpu[cpu.index("--attention-backend") + 1] == "torch_native"
    assert server_env("cpu", {})["TRITON_INTERPRET"] == "1" and server_env("cuda", {"A": "1"}) == {"A": "1"}
    with pytest.raises(ValueError, match="device 'tpu' is not one of cpu, cuda"):
        launch_command("T", 30000, device="tpu")


def test_the_gpu_check_script_stops_in_one_line_without_a_gpu(tmp_path):
    import os
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the script would run")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([os.path.join(root, "scripts", "gpu_pr_eagle3_check.sh"), str(tmp_path)], capture_output=True,
                         text=True, env=dict(os.environ, PYTHON=sys.executable), timeout=120)
    assert out.returncode == 2
    assert out.stdout.strip().splitlines() == [f"gpu_pr_eagle3_check: {sys.executable} sees no CUDA device: run it on "
                                               "a GPU machine"]


def _counted(rids, draft_parts, verify=100, extend=20, in_steps=None, steps=0):
    """One counted round's line; `in_steps` (part -> ops inside the row steps) and `steps`: a round that labels its
    `steps` row steps, as PR's does."""
    ops = {"draft": draft_parts, "verify": {"model": verify}, "extend": {"model": extend}}
    line = {"batch": len(rids), "rids": rids, "ops": ops, "names": {"draft": {p: {"aten::add": v} for p, v in
                                                                              draft_parts.items()}}}
    if in_steps is not None:
        line["steps"] = {"draft": {"steps": steps, "ops": sum(in_steps.values()), "parts": in_steps}}
    return line


def test_op_counts_per_cell_per_round_and_per_row_step_and_by_part(bench):
    """`--ops`: a cell's op counts from its full-batch rounds only; per round, what PR adds to EAGLE3's draft; where
    the rounds label their row steps, the draft split into ops per row step and ops once a round, by part too;
    the tables."""
    asks = [{"rids": ["a", "b"]}]
    eagle3 = [_counted(["a", "b"], {"model": 30, "other": 15}), _counted(["a"], {"model": 99})]
    m0 = [_counted(["a", "b"], {"model": 30, "readouts": 9, "encoding": 12})]
    m3_parts = {"model": 36, "readouts": 9, "encoding": 12, "bids": 6, "repricing": 24}
    m3_in_steps = {"model": 24, "readouts": 6, "bids": 6, "repricing": 24}  # two row steps; the rest once a round
    m3 = [_counted(["a", "b"], m3_parts, in_steps=m3_in_steps, steps=2)]
    ops = {w: bench.cell_ops(asks, rounds, 2) for w, rounds in zip(bench.WAYS, (eagle3, m0, m3))}
    assert ops["eagle3"] == {"round": 165, "draft": 45, "verify": 100, "extend": 20, "other": 0,
                             "draft_parts": {"model": 30, "other": 15}, "rounds_counted": 1,
                             "draft_names": {"model": {"aten::add": 30}, "other": {"aten::add": 15}}}
    assert ops["pr_m3"]["draft_row_steps"] == 2 and ops["pr_m3"]["draft_in_row_steps"] == sum(m3_in_steps.values())
    r = bench.ops_ratios(ops, gamma=3)
    draft = {w: ops[w]["draft"] for w in bench.WAYS}
    assert r["pr_m3_added_ops_per_round"] == draft["pr_m3"] - draft["eagle3"]
    assert r["pr_m3_added_ops_per_step"] == pytest.approx((draft["pr_m3"] - draft["eagle3"]) / 3)  # kept, not printed
    split = r["pr_m3_row_split"]
    assert split["ops_per_row_step"] == sum(m3_in_steps.values()) / 2
    assert split["ops_per_round"] == draft["pr_m3"] - sum(m3_in_steps.values())
    assert split["parts"]["repricing"] == {"per_row_step": m3_in_steps["repricing"] / 2, "per_round": 0}
    assert split["parts"]["encoding"] == {"per_row_step": 0, "per_round": m3_parts["encoding"]}
    assert "eagle3_row_split" not in r and "pr_m0_row_split" not in r  # rounds that label no step: no split
    with pytest.raises(RuntimeError, match="no counted round"):
        bench.cell_ops(asks, eagle3[1:], 2)
    result = {"machine": "m", "dtype": "float32", "commit": "abc", "date": "d", "cpu": "c", "target_name": "t",
              "draft_name": "p", "max_new": 8, "readouts": "batched", "ops": "only", "command": "cmd",
              "cells": {"small/2": {"ops": ops, "ops_ratios": r}}}
    table = bench.markdown(result)
    once = draft["pr_m3"] - sum(m3_in_steps.values())
    assert (f"| small | 2 | pr_m3 | 207 | {draft['pr_m3']} | 100 | 20 | 0 | +{draft['pr_m3'] - draft['eagle3']} "
            f"| {sum(m3_in_steps.values()) / 2:.1f} (2) | {once} | 1 |") in table
    assert "| small | 2 | eagle3 | 165 | 45 | 100 | 20 | 0 | - | - | - | 1 |" in table
    assert "| model | bids | readouts | repricing | encoding |" in table  # the round's order, then any other
    assert "| small | 2 | pr_m3 | 12.0 + 12 | 3.0 + 0 | 3.0 + 3 | 12.0 + 0 | 0.0 + 12 |" in table
    assert "| small | 2 | pr_m0 | 30 | 0 | 9 | 0 | 12 |" in table  # per round, unsplit
    assert "over gamma would spread" in table
