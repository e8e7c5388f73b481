"""Put this directory on PYTHONPATH with PR_SPECFORGE_SGLANG_CPU=1 and every Python process started
with that environment (SGLang's scheduler subprocesses included) installs the CPU bridge's import hook.
`pr_specforge.sglang_cpu.child_env` builds that environment."""

import os

if os.environ.get("PR_SPECFORGE_SGLANG_CPU") == "1":
    from pr_specforge.sglang_cpu.bridge import install

    install()
