"""The speculative decoder on a GPU: lossless at T = 0 and seeded at T = 1, EAGLE-3 and PR drafters.

    python scripts/gpu_serving_check.py [--device cuda] [--json out.json]

The CPU test suite checks the same invariants (tests/serving/test_serving_decode.py);
this script runs them with the target and both drafters on `--device`, fp32, on the
tiny random models of the test suite (no downloads). Prints PASS/FAIL and exits 1 on FAIL.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.helpers


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--new-tokens", type=int, default=40)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False  # exact-argmax comparisons need full fp32

    from pr_specforge.serving import SpeculativeDecoder, TreeConfig, autoregressive_decode
    from tests.helpers import make_drafters
    from tests.serving.test_serving_tree import eager_gate, sharpen, strong_self_query, tiny_target

    target = tiny_target(seed=1).to(args.device)
    eagle, pr, _ = make_drafters(max_depth=2)
    sharpen(eagle, pr)
    strong_self_query(pr)
    eager_gate(pr, -2.0)
    drafters = {"eagle3": eagle.eval().to(args.device), "pr": pr.eval().to(args.device)}
    prompts = [[5, 17, 33, 2, 9, 41, 8], [60, 3, 3, 71, 12], [1, 2, 3]]
    rows, ok = [], True
    for name, drafter in drafters.items():
        dec = SpeculativeDecoder(target, drafter, TreeConfig(budget=24))
        for prompt in prompts:
            ref, _ = autoregressive_decode(target, prompt, args.new_tokens)
            res = dec.generate(prompt, args.new_tokens)
            a = dec.generate(prompt, args.new_tokens, temperature=1.0, seed=3)
            b = dec.generate(prompt, args.new_tokens, temperature=1.0, seed=3)
            row = {"drafter": name, "prompt": prompt, "lossless_t0": res.tokens == ref, "tau_t0": res.tau,
                   "recon_rows": res.recon_rows, "seeded_t1": a.tokens == b.tokens and len(a.tokens) == args.new_tokens}
            ok &= row["lossless_t0"] and row["seeded_t1"]
            rows.append(row)
            print(json.dumps(row))
    # deep acceptance through non-contiguous tree slots (the target's continuation written into the drafted
    # tree, as in the CPU test): the KV-cache commit must stay exact on the GPU too
    from tests.serving.test_serving_decode import oracle_draft

    real_draft = SpeculativeDecoder.draft
    for name, drafter in drafters.items():
        prompt = prompts[0]
        ref, _ = autoregressive_decode(target, prompt, 60)
        SpeculativeDecoder.draft = oracle_draft(ref + [0] * 20, len(prompt))
        try:
            res = SpeculativeDecoder(target, drafter, TreeConfig(budget=24, gamma=6)).generate(prompt, 60)
        finally:
            SpeculativeDecoder.draft = real_draft
        row = {"drafter": name, "check": "oracle_deep_accept", "lossless_t0": res.tokens == ref, "tau_t0": res.tau}
        ok &= row["lossless_t0"] and res.tau > 4.0
        rows.append(row)
        print(json.dumps(row))
    ok &= any(r.get("recon_rows", 0) > 0 for r in rows if r["drafter"] == "pr")  # PR really reconsidered on the GPU
    result = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
              "torch": torch.__version__, "rows": rows, "pass": bool(ok)}
    if args.json:
        from pr_specforge.data.io import atomic_write_json

        atomic_write_json(args.json, result)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
