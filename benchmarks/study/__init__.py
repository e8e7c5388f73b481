"""The studies' shared code and the regime study's rooms (`benchmarks/regimes.py` is its command line).

    common            what every study shares: paths, the final evaluation's prompt sets, the served tree,
                      how a warm start and its matched baseline continue one checkpoint (regimes, pilots, best)
    regime_settings   the regime study's definitions: GSM8K's splits, the drafters, the report folders and cells
    regime_stages     the stages of a regime over one workdir (data, trainings, diagnose, export, headroom)
    regime_serves     the serve plans: the screening and report serves, their rounds, what a folder has finished
    regime_keep       `save` and `restore`: a workdir's served rows and small records kept across machines
    regime_verdict    the verdict rules: each seed's cells and gains, the verdicts, the conditions the paper relies on
    regime_render     benchmarks/results/regimes.{md,json}: the tables, the provenance table, the held-out plot

Importing any of them loads neither torch nor SpecForge (the stages import their work when they run).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # pr_specforge from this checkout, however a study started
