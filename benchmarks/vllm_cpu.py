"""vLLM's CPU build serving SmolLM2-135M alone and with an `export --to vllm` drafter, one server at a time.

    TORCHDYNAMO_DISABLE=1 python benchmarks/vllm_cpu.py --target work/smollm2/target \
        --draft work/smollm2/export/pr-vllm --machine "quiet 2-core CPU" \
        --json benchmarks/results/vllm_cpu.json --md benchmarks/results/vllm_cpu.md

(`make run` makes the target and the PR run; `pr-specforge export work/smollm2/runs/pr work/smollm2/export/pr-vllm
--to vllm --target work/smollm2/target` the export.) Each server (`scripts/vllm_cpu_serve.sh`, float32,
--enforce-eager, 127.0.0.1) answers MT-Bench's first turns (held out from `make run`'s training data) through the
target's chat template, one request at a time, greedy, `--max-new` tokens with EOS ignored; it is stopped before
the next one starts, also on failure. Per way: tokens per second (output tokens over the requests' summed wall
time, prefill included), and with the drafter the acceptance length (1 + accepted / drafts: tokens per verify
round, vLLM's counters), its drafts and accepted tokens, and how many outputs equal the target alone's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run(args) -> dict:
    from benchmarks.serving_cost import commit, prompt_ids
    from pr_specforge.vllm_live import complete_one_at_a_time, vllm_server

    prompts = prompt_ids(args.target, args.prompts)
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE=str(args.kv_gib))
    rows = {}
    with tempfile.TemporaryDirectory() as logs:
        for way, export in (("target alone", "-"), ("with the drafter", args.draft)):
            print(f"[vllm_cpu] {way}: starting a server", flush=True)
            with vllm_server(args.target, export, Path(logs) / f"{len(rows)}.log", env=env) as port:
                complete_one_at_a_time(port, prompts[:1], args.max_new, spec=False)  # warm-up, not counted
                rows[way] = complete_one_at_a_time(port, prompts, args.max_new, spec=export != "-")
    plain = [r["output_ids"] for r in rows["target alone"]]
    out = {"provenance": {"commit": commit(), "date": datetime.date.today().isoformat(), "machine": args.machine,
                          "cpu": f"{platform.processor() or platform.machine()} x {os.cpu_count()}",
                          "command": "python benchmarks/vllm_cpu.py " + shlex.join(args.argv),
                          "vllm": _version(), "prompts": f"MT-Bench first turns 1-{len(prompts)}",
                          "max_new": args.max_new, "dtype": "float32", "requests": "one at a time"},
           "ways": {}}
    for way, rs in rows.items():
        tokens = sum(len(r["output_ids"]) for r in rs)
        cell = {"tokens": tokens, "wall_s": sum(r["wall_s"] for r in rs),
                "tokens_per_s": tokens / sum(r["wall_s"] for r in rs),
                "outputs_equal_target_alone": sum(r["output_ids"] == p for r, p in zip(rs, plain)), "requests": len(rs)}
        if "num_drafts" in rs[0]:
            drafts, accepted = sum(r["num_drafts"] for r in rs), sum(r["num_accepted_tokens"] for r in rs)
            cell.update(drafts=drafts, accepted=accepted, acceptance_length=1 + accepted / drafts,
                        speculative_tokens=sum(r["num_draft_tokens"] for r in rs) // drafts)
        out["ways"][way] = cell
    out["speedup"] = out["ways"]["with the drafter"]["tokens_per_s"] / out["ways"]["target alone"]["tokens_per_s"]
    return out


def _version() -> str:
    from pr_specforge.vllm_live import VLLM_PYTHON

    return subprocess.run([VLLM_PYTHON, "-c", "from importlib.metadata import version; print(version('vllm-cpu'))"],
                          capture_output=True, text=True).stdout.strip()


def render(res: dict) -> str:
    p = res["provenance"]
    lines = ["# vLLM on this CPU: SmolLM2-135M alone and with its `export --to vllm` drafter", "",
             "| commit | date | machine | vLLM | command |", "| --- | --- | --- | --- | --- |",
             f"| {p['commit']} | {p['date']} | {p['machine']} ({p['cpu']}) | vllm-cpu {p['vllm']} | `{p['command']}` |", "",
             f"{p['prompts']}, {p['max_new']} new tokens each, greedy, {p['dtype']}, {p['requests']}, one server at "
             "a time.", "",
             "| way | tokens/s | acceptance length | drafts | accepted | outputs = target alone |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for way, c in res["ways"].items():
        acc = f"{c['acceptance_length']:.3f}" if "acceptance_length" in c else "-"
        lines.append(f"| {way} | {c['tokens_per_s']:.1f} | {acc} | {c.get('drafts', '-')} | {c.get('accepted', '-')} | "
                     f"{c['outputs_equal_target_alone']}/{c['requests']} |")
    lines += ["", f"With the drafter / alone: {res['speedup']:.2f}x tokens per second."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True, help="an `export --to vllm` directory")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--kv-gib", type=int, default=2)
    p.add_argument("--machine", required=True, help="what the machine is and whether it was quiet")
    p.add_argument("--json", default=None)
    p.add_argument("--md", default=None)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    for name, value in (("--prompts", args.prompts), ("--max-new", args.max_new), ("--kv-gib", args.kv_gib)):
        if value < 1:
            p.error(f"{name} must be >= 1, got {value}")
    from pr_specforge.data.io import DataFormatError, atomic_write_json, atomic_write_text, check_writable_file

    try:  # the outputs are the project's one ownership rule's, checked before any server starts
        for flag, path, fmt in (("--json", args.json, "JSON"), ("--md", args.md, "Markdown")):
            if path:
                check_writable_file(flag, path, fmt=fmt, inputs=[args.target, args.draft])
    except DataFormatError as e:
        p.error(str(e))

    res = run(args)
    text = render(res)
    print(text)
    if args.json:
        atomic_write_json(args.json, res)
    if args.md:
        atomic_write_text(args.md, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
