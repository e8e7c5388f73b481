"""`data regenerate --server` against a live SGLang server on this CPU, next to in-process regeneration.

The same conversations, greedy, float32 on both sides, the same chat template (SGLang applies the
target's tokenizer template for `/v1/chat/completions`). Replies are compared token by token.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.data.conftest import CONVERSATIONS, write_jsonl
from tests.export.conftest import ENV

MAX_NEW = 16


def _regenerate(tmp_path, name, *source):
    out = tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "pr_specforge.cli", "data", "regenerate", "--input", str(tmp_path / "conv.jsonl"),
           "--output", str(out), "--max-new-tokens", str(MAX_NEW), "--temperature", "0", *source]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return {r["id"]: [m["content"] for m in r["conversations"] if m["role"] == "assistant"]
            for r in map(json.loads, out.read_text().splitlines())}


def test_regenerate_through_a_live_sglang_server_matches_in_process_regeneration(live_run, plain_server, tmp_path):
    from transformers import AutoTokenizer

    write_jsonl(tmp_path / "conv.jsonl", CONVERSATIONS)
    served = _regenerate(tmp_path, "server", "--server", f"http://127.0.0.1:{plain_server}", "--model", "default")
    local = _regenerate(tmp_path, "local", "--target", live_run["target"], "--dtype", "float32")
    assert served.keys() == local.keys() == {c["id"] for c in CONVERSATIONS}
    tok = AutoTokenizer.from_pretrained(live_run["target"])
    same = total = 0
    for rid in local:
        for a, b in zip(served[rid], local[rid]):
            ta, tb = tok(a, add_special_tokens=False)["input_ids"], tok(b, add_special_tokens=False)["input_ids"]
            total += max(len(ta), len(tb))
            same += sum(x == y for x, y in zip(ta, tb))
    print(f"regenerate --server vs in-process: {same}/{total} reply tokens agree")
    assert served == local, {rid: (served[rid], local[rid]) for rid in local if served[rid] != local[rid]}
