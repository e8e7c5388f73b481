"""How long CI takes: `.ci/run` from a clean clone (the three installs side by side, then `make test`), timed.

    python benchmarks/test_time.py run [--emulate-avx2] [--json benchmarks/results/test_time.json] [--md ...]

`run` clones HEAD into a fresh directory, runs `.ci/run` there with pytest's JUnit report and the server start-up
record on (`PYTEST_ADDOPTS`, `PR_SPECFORGE_SERVER_STARTS`), and writes the JSON and markdown: the machine (CPU model,
whether it has AVX-512 and native bf16), the seconds of each install, of the tests and of the whole `.ci/run`, the
number of server start-ups, the 20 slowest tests. With `--emulate-avx2` it runs as on an AVX2-only CPU (a private
mount namespace whose /proc/cpuinfo lacks the AVX-512 and AMX flags, torch's kernels and oneDNN capped at AVX2: bf16
then runs emulated, ~0.9 GFLOP/s a core, as on an AVX2-only AMD EPYC); that needs root (`unshare -m`). Measure on a
quiet machine: a second job beside it slows the 2-core suite severalfold.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
#: what makes a process see an AVX2-only CPU (see the module's docstring)
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "DNNL_MAX_CPU_ISA": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def cpu(cpuinfo: str = "/proc/cpuinfo") -> dict:
    model, flags = platform.processor() or "unknown", set()
    with open(cpuinfo) as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    native_bf16 = bool(flags & {"avx512_bf16", "amx_bf16"})
    return {"model": model, "cores": os.cpu_count(), "flags": {f: f in flags for f in FLAGS},
            "kind": "native bf16" if native_bf16 else ("AVX-512 without bf16" if "avx512f" in flags else "AVX2 only")}


def slowest(junit: str, n: int = 20) -> List[dict]:
    cases = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        failed = any(child.tag in ("failure", "error") for child in case)
        skipped = any(child.tag == "skipped" for child in case)
        cases.append({"test": name, "seconds": round(float(case.get("time", 0.0)), 1),
                      "outcome": "failed" if failed else "skipped" if skipped else "passed"})
    return sorted(cases, key=lambda c: -c["seconds"])[:n]


def totals(junit: str) -> Dict[str, float]:
    root = ET.parse(junit).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    return {k: (float(suite.get(k, 0)) if k == "time" else int(suite.get(k, 0)))
            for k in ("tests", "failures", "errors", "skipped", "time")}


def report(junit: str, setup_times: str, starts: str, ci_seconds: float, commit: str, emulated: bool,
           command: str, cpuinfo: str = "/proc/cpuinfo") -> dict:
    from tests.live_servers import start_counts
    from tests.live_servers import starts as read_starts

    lines = read_starts(starts)
    kinds = start_counts(lines)
    with open(setup_times) as f:
        installs = json.load(f)
    t = totals(junit)
    machine = cpu(cpuinfo)
    if emulated:
        machine["host"] = cpu()  # the CPU the emulation ran on, as it is
        machine["emulated"] = ("an AVX2-only CPU emulated on this one: /proc/cpuinfo without AVX-512/AMX flags, "
                               + ", ".join(f"{k}={v}" for k, v in AVX2_ENV.items()))
    return {"commit": commit, "date": time.strftime("%Y-%m-%d", time.gmtime()), "machine": machine,
            "command": command, "ci_run_s": round(ci_seconds, 1),
            "installs_s": {k: v["seconds"] for k, v in installs.items()},
            "tests_s": round(t["time"], 1), "tests": {k: v for k, v in t.items() if k != "time"},
            "server_startups": len(lines), "server_startups_by_kind": kinds,
            "slowest": slowest(junit)}


def markdown(r: dict) -> str:
    m = r["machine"]
    out = [f"# CI's time at {r['commit']} ({r['date']})", "",
           f"Machine: {m['model']}, {m['cores']} cores, {m['kind']}" + (f"; {m['emulated']}" if m.get("emulated") else ""),
           f"Command: `{r['command']}`", "",
           "| part | seconds |", "| --- | --- |"]
    for k, v in r["installs_s"].items():
        out.append(f"| install `scripts/{k}.sh` (side by side) | {v} |")
    out += [f"| tests (`make test`'s pytest) | {r['tests_s']} |", f"| whole `.ci/run` | {r['ci_run_s']} |", "",
            f"Tests: {r['tests']}. Server start-ups: {r['server_startups']} ({r['server_startups_by_kind']}).", "",
            "| slowest tests | seconds |", "| --- | --- |"]
    out += [f"| `{c['test']}` | {c['seconds']} |" for c in r["slowest"]]
    return "\n".join(out) + "\n"


def write(result: dict, json_path: str, md_path: str) -> None:
    for path, text in ((json_path, json.dumps(result, indent=2) + "\n"), (md_path, markdown(result))):
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)


def run(args) -> int:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    work = tempfile.mkdtemp(prefix="ci-timed-")
    clone = os.path.join(work, "clone")
    subprocess.run(["git", "clone", "-q", ROOT, clone], check=True)
    junit, starts = os.path.join(work, "junit.xml"), os.path.join(work, "starts.txt")
    env = dict(os.environ, PYTEST_ADDOPTS=f"--junitxml={junit}", PR_SPECFORGE_SERVER_STARTS=starts, CI="true")
    cmd = ["bash", ".ci/run"]
    fake = os.path.join(work, "cpuinfo-avx2")
    if args.emulate_avx2:
        with open("/proc/cpuinfo") as src, open(fake, "w") as dst:
            for line in src:
                if line.startswith("flags"):
                    key, flags = line.split(":", 1)
                    line = key + ": " + " ".join(f for f in flags.split()
                                                 if not f.startswith(("avx512", "amx"))) + "\n"
                dst.write(line)
        env.update(AVX2_ENV)
        inner = f"mount --bind {shlex.quote(fake)} /proc/cpuinfo && exec bash .ci/run"
        cmd = ["unshare", "-m", "bash", "-c", inner]
    print(f"timing .ci/run in {clone} ({'emulated AVX2-only' if args.emulate_avx2 else 'this CPU'}) ...", flush=True)
    t0 = time.time()
    with open(os.path.join(work, "ci.log"), "w") as log:
        done = subprocess.run(cmd, cwd=clone, env=env, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.time() - t0
    print(f".ci/run exited {done.returncode} after {seconds:.0f} s (log: {work}/ci.log)")
    if not os.path.exists(junit):
        return 1
    result = report(junit, os.path.join(clone, ".setup-logs", "times.json"), starts, seconds, commit,
                    args.emulate_avx2, "python benchmarks/test_time.py run" + (" --emulate-avx2" if args.emulate_avx2 else ""),
                    cpuinfo=fake if args.emulate_avx2 else "/proc/cpuinfo")
    result["exit"] = done.returncode
    write(result, args.json, args.md)
    print(markdown(result))
    return done.returncode


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="clone HEAD, time .ci/run, write the JSON and markdown")
    r.add_argument("--emulate-avx2", action="store_true")
    for q in (r,):
        q.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "test_time.json"))
        q.add_argument("--md", default=os.path.join(ROOT, "benchmarks", "results", "test_time.md"))
    args = p.parse_args(argv)
    sys.path.insert(0, ROOT)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
