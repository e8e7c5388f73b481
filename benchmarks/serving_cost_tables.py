"""The tables of benchmarks/serving_cost.py (its markdown): what each cell of a result reads as, and the notes under
them. Loaded by serving_cost.py from its own folder; it re-exports every function here."""

from __future__ import annotations



WAYS = ("eagle3", "pr_m0", "pr_m3")
#: the draft phase's parts in the order a PR round runs them (`pr_specforge.op_parts` labels; `model`: the draft
#: model's forwards, as in EAGLE3); a part not named here comes after them
PART_ORDER = ("model", "load", "tree", "frontier", "bids", "row_inputs", "rows", "readouts", "pool", "repricing", "cut",
              "pack", "encoding", "verify_input", "other")

def markdown(result: dict) -> str:
    if result.get("ops") == "only":
        return ops_markdown(result, header=True)
    ops = ops_markdown(result)
    table = throughput_markdown(result) if result.get("timed", True) is False else timed_markdown(result)
    return table + ("\n" + ops if ops else "")


def ops_markdown(result: dict, header: bool = False) -> str:
    """The op counts (`--ops`): each way's device ops per round by phase, what PR adds to EAGLE3's draft per round,
    PR's draft per row step and once a round where its rounds label their row steps, and by part ("" where the run
    counted none)."""
    blocks = [(key, block) for key, block in result["cells"].items() if "ops" in block]
    if not blocks:
        return ""
    lines = []
    if header:
        lines += [f"# Device ops per served round: PR_EAGLE3 vs SGLang's EAGLE3 ({result['machine']}, "
                  f"{result['dtype']})",
                  "", f"Commit {result['commit']}, {result['date']}, {result['cpu']}{device_note(result)}; target "
                  f"{result['target_name']}, drafter {result['draft_name']}; {result['max_new']} new tokens a request; "
                  f"PR_EAGLE3's readouts: {result['readouts']}. {m0_note(result)}", ""]
    lines += [OPS_NOTE, "", SPLIT_NOTE, "", "| shape | requests | way | round ops | draft | verify | extend | other "
              "| added to eagle3's draft per round | draft per row step (row steps) | draft once a round "
              "| rounds counted |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, block in blocks:
        shape, n = key.split("/")
        r = block["ops_ratios"]
        for w in WAYS:
            c, split = block["ops"][w], r.get(f"{w}_row_split")
            added = "-" if w == "eagle3" else _signed(c["draft"] - block["ops"]["eagle3"]["draft"])
            per_step = f"{split['ops_per_row_step']:.1f} ({split['row_steps']:g})" if split else "-"
            once = f"{split['ops_per_round']:.0f}" if split else "-"
            lines.append(f"| {shape} | {n} | {w} | {c['round']:.0f} | {c['draft']:.0f} | {c['verify']:.0f} "
                         f"| {c['extend']:.0f} | {c['other']:.0f} | {added} | {per_step} | {once} "
                         f"| {c['rounds_counted']} |")
    parts = sorted({p for _, block in blocks for w in WAYS[1:] for p in block["ops"][w]["draft_parts"]},
                   key=lambda p: (PART_ORDER.index(p) if p in PART_ORDER else len(PART_ORDER), p))
    lines += ["", "PR_EAGLE3's draft phase by part, per round; where the rounds label their row steps, as ops per row "
              "step + ops once a round (`model`: the draft model's forwards, as in EAGLE3; the rest is PR's round "
              "logic; `other`: the draft phase's unlabelled ops):", "",
              "| shape | requests | way | " + " | ".join(parts) + " |", "|---|---|---|" + "---|" * len(parts)]
    for key, block in blocks:
        shape, n = key.split("/")
        for w in WAYS[1:]:
            c, split = block["ops"][w], block["ops_ratios"].get(f"{w}_row_split")
            if split:
                cells = [f"{split['parts'][p]['per_row_step']:.1f} + {split['parts'][p]['per_round']:g}"
                         if p in split["parts"] else "0" for p in parts]
            else:
                cells = [f"{c['draft_parts'].get(p, 0):g}" for p in parts]
            lines.append(f"| {shape} | {n} | {w} | " + " | ".join(cells) + " |")
    if header:
        lines += ["", f"Command: `{result['command']}`"]
    return "\n".join(lines + [""])


def _signed(x: float) -> str:
    return f"{x:+.0f}" if x else "0"


SPLIT_NOTE = ("Per round, not per draft step: a round's ops over gamma would spread the ops made once a round (load, "
              "root, cut, pack, encoding) over its steps. Where the counted rounds label their row steps "
              "(`pr_specforge.op_parts.step`, PR's round), its draft splits into ops per row step and ops once a "
              "round; SGLang's own EAGLE-3 draft labels no step (\"-\").")

OPS_NOTE = ("Device ops: each outermost torch operator of a decode round's profile that works on its device (not a "
            "view or an allocation alone), the kernel launch it is on a GPU (`pr_specforge.sglang_plugin.op_counts`); "
            "medians over the counted rounds whose batch is all of a cell's requests. Op counts do not depend on the "
            "machine's speed or load.")


def timed_markdown(result: dict) -> str:
    ms = lambda x: f"{1000 * x:.1f}"  # noqa: E731
    lines = [f"# Served round cost: PR_EAGLE3 vs SGLang's EAGLE3 ({result['machine']}, {result['dtype']})", "",
             f"Commit {result['commit']}, {result['date']}, {result['cpu']}, torch threads {result['threads']}"
             f"{device_note(result)}; "
             f"target {result['target_name']}, drafter {result['draft_name']}; {result['max_new']} new tokens a "
             f"request, {result['repeats']} repeats; medians over rounds whose batch is all of a cell's requests. "
             f"PR_EAGLE3's readouts: {readouts_note(result)}. {m0_note(result)}", "",
             "| shape | requests | way | round ms | floor ms | bookkeeping ms | draft ms | draft floor ms | verify ms "
             "| extend ms | tau | tokens/s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, block in result["cells"].items():
        shape, n = key.split("/")
        for w in WAYS:
            c = block["ways"][w]
            lines.append(f"| {shape} | {n} | {w} | {ms(c['round_s'])} | {ms(c['floor_s'])} | {ms(c['bookkeeping_s'])} "
                         f"| {ms(c['draft_s'])} | {ms(c['draft_floor_s'])} | {ms(c['verify_s'])} | {ms(c['extend_s'])} | {c['tau']:.3f} "
                         f"| {c['tokens_per_s']:.2f} |")
    lines += ["", "Ratios of the whole round (round, floor) and of its draft phase alone (draft, draft floor):", "",
              "| shape | requests | m0 / eagle3 round | m0 / eagle3 floor | m3 / m0 round | m3 / m0 floor "
              "| m0 / eagle3 draft | m3 / m0 draft | m3 / m0 draft floor "
              "| m0 within 1.05x of EAGLE3 | m3 within 0.05 of the floor ratio | m0 / eagle3 per target forward |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, block in result["cells"].items():
        shape, n = key.split("/")
        r = block["ratios"]
        third = r.get("target_m3_within_0.05_of_floor_ratio", r.get("target_m3_within_1.05_of_m0"))
        lines.append(f"| {shape} | {n} | {r['m0_over_eagle3']:.3f} | {r['m0_floor_over_eagle3_floor']:.3f} "
                     f"| {r['m3_over_m0']:.3f} | {r['m3_floor_over_m0_floor']:.3f} | {r['draft_m0_over_eagle3']:.3f} "
                     f"| {r['draft_m3_over_m0']:.3f} | {r['draft_floor_m3_over_m0']:.3f} "
                     f"| {'met' if r['target_m0_within_1.05_of_eagle3'] else 'not met'} | {'met' if third else 'not met'} "
                     f"| {per_target(r)} |")
    pairs = [(key, block["per_server_pair"]) for key, block in result["cells"].items() if block.get("per_server_pair")]
    if pairs:
        lines += ["", "Each repeat ran its own pair of servers (new processes); the ratios of each pair, in repeat order:",
                  "", "| shape | requests | m0 / eagle3 round | m0 / eagle3 per target forward | m3 / m0 round "
                  "| m3 / m0 floor |", "|---|---|---|---|---|---|"]
        for key, per in pairs:
            shape, n = key.split("/")
            col = lambda k: ", ".join(f"{r[k]:.3f}" if k in r else "-" for r in per)  # noqa: E731
            lines.append(f"| {shape} | {n} | {col('m0_over_eagle3')} | {col('m0_over_eagle3_per_target')} "
                         f"| {col('m3_over_m0')} | {col('m3_floor_over_m0_floor')} |")
    lines += ["", f"Command: `{result['command']}`", ""]
    return "\n".join(lines)


def throughput_markdown(result: dict) -> str:
    """An untimed run (`--untimed`, `--overlap`): tau and tokens per second, no round times."""
    overlap = "on" if result.get("overlap") else "off"
    lines = [f"# Served tokens per second: PR_EAGLE3 vs SGLang's EAGLE3 ({result['machine']}, {result['dtype']})", "",
             f"Commit {result['commit']}, {result['date']}, {result['cpu']}, torch threads {result['threads']}"
             f"{device_note(result)}, SGLang's overlap schedule {overlap}; untimed servers (no round times: the timing "
             f"wrappers synchronise the device); target {result['target_name']}, drafter {result['draft_name']}; "
             f"{result['max_new']} new tokens a request, {result['repeats']} repeats, a new server pair each; "
             f"PR_EAGLE3's readouts: {readouts_note(result)}. {m0_note(result)}", "",
             "| shape | requests | way | tau | tokens/s |", "|---|---|---|---|---|"]
    for key, block in result["cells"].items():
        shape, n = key.split("/")
        for w in WAYS:
            c = block["ways"][w]
            lines.append(f"| {shape} | {n} | {w} | {c['tau']:.3f} | {c['tokens_per_s']:.2f} |")
    lines += ["", "Ratios of tokens per second, pooled and per server pair (in repeat order):", "",
              "| shape | requests | m0 / eagle3 | m3 / m0 | m0 / eagle3 per pair | m3 / m0 per pair |",
              "|---|---|---|---|---|---|"]
    for key, block in result["cells"].items():
        shape, n = key.split("/")
        r, per = block["ratios"], block.get("per_server_pair", [])
        col = lambda k: ", ".join(f"{p[k]:.3f}" for p in per)  # noqa: E731
        lines.append(f"| {shape} | {n} | {r['m0_tokens_per_s_over_eagle3']:.3f} | {r['m3_tokens_per_s_over_m0']:.3f} "
                     f"| {col('m0_tokens_per_s_over_eagle3')} | {col('m3_tokens_per_s_over_m0')} |")
    lines += ["", f"Command: `{result['command']}`", ""]
    return "\n".join(lines)


def per_target(r: dict) -> str:
    """m = 0's round over EAGLE3's, each in units of its own server's target forward, and the 1.05x target on it."""
    if "m0_over_eagle3_per_target" not in r:  # older results
        return "-"
    met = "met" if r["target_m0_within_1.05_of_eagle3_per_target"] else "not met"
    return f"{r['m0_over_eagle3_per_target']:.3f} ({met})"


def device_note(result: dict) -> str:
    """`, GPU name, CUDA graphs on|off` for a GPU run (older results, and CPU runs, have none)."""
    if result.get("device") != "cuda":
        return ""
    return f", {result.get('gpu')}, SGLang's CUDA graphs {'on' if result.get('cuda_graph') else 'off'}"


def m0_note(result: dict) -> str:
    """Who drafted the pr_m0 way (`--m0-draft`; results before it existed: PR's round)."""
    if result.get("m0_draft", "pr") == "sglang":
        return "pr_m0: every request at m = 0, drafted by SGLang's own EAGLE-3 draft (PR_EAGLE3_M0_DRAFT=sglang)."
    return "pr_m0: PR's round with no reconsideration row (PR_EAGLE3_M0_DRAFT=pr, or before it existed)."


def readouts_note(result: dict) -> str:
    """The PR server's readout mode and, as it logged it, whether a row's readouts were call-independent there."""
    said = [block["readouts"] for block in result["cells"].values() if block.get("readouts")]
    if not said:
        return "one call per request"
    modes, same = "/".join(sorted({s["mode"] for s in said})), all(s["row_invariant"] for s in said)
    return f"{modes} (a row's readouts the same bits in any call on that machine: {'yes' if same else 'no'})"
