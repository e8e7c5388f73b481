"""Offline evaluation of drafters, and the statistics and report of the EAGLE-3 vs PR experiment.

* `evaluator`          `Evaluator`: acceptance length, speed, losslessness, diagnostics per
                       drafter x prompt set x budget x temperature (the tree is `pr_specforge.serving`'s)
* `report`             the evaluation's markdown tables and plots (`report.md`)
* `cli`                `pr-specforge eval`
* `statistics`         PR's tau gain over EAGLE-3 with a paired bootstrap CI, per cell and per seed
* `headroom`           `pr-specforge headroom`: the paper's Figure 1 / Table 7 on held-out features
                       (`headroom_report`: its markdown and PNGs)
* `experiment_report`  `pr-specforge experiment`'s report (`benchmarks/results/smollm2-cpu*.{md,json}`)

Importing the package imports nothing heavy; `evaluator` loads torch and the serving code.
"""
