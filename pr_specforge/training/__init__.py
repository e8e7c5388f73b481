"""Training: everything `pr-specforge train` (and `diagnose`) needs, around SpecForge's trainer.

Read it in this order:

* `recipe`        a recipe file -> SpecForge's strict `Config` + the `pr:` section
                  (`pr_specforge.config.PRConfig`) + `backend:`; `extends:`, dotted overrides
* `preflight`     the checks made before the first step (target, vocab map, features, draft config)
* `registration`  the `pr` algorithm registered with SpecForge: `PRTrainStrategy`, providers,
                  `build_registry` (SpecForge's built-in registry plus `pr`)
* `objective/`    the PR training model and loss, one function per equation of the paper
                  (`ttt.py`: Eq. 3, 5, 7, 12; `loss.py`: Eq. 6; `metrics.py`: its telemetry)
* `warm_start`    `pr.init_from` / `pr.freeze_one_pass`: reconsideration on an existing EAGLE-3 drafter
* `online`        `data.online: true`: the target runs inside every training rank
* `backends/`     `backend:` (`config`), recipe-carrying crash-safe checkpoints (`checkpoint`),
                  DeepSpeed ZeRO-1/2 (`deepspeed`)
* `simulate`      the acceptance simulator: `sim/` lengths (one-pass, width-2, PR) at each eval and in
                  `diagnose`; its chain observer is what `pr-specforge headroom` counts with
* `telemetry`     `metrics.jsonl`, tracker panel names, the console line, `pr-specforge plot`
* `train`         the entry point: launch (one process or torchrun), resume, Ctrl-C, the runtime
                  patches a run installs (`install_training_runtime`), `assembled_run`
* `diagnose`      `pr-specforge diagnose`: the training objective of a checkpoint on held-out features

SpecForge itself is reached only through `pr_specforge._specforge`. Importing this package
imports nothing heavy.
"""
