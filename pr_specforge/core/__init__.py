"""The drafter's parts that need only torch: what training and serving share, and the serving drafter.

Nothing here imports SpecForge or SGLang, so a serving install (`serving/pyproject.toml`, no SpecForge)
loads a PR export with these modules alone:
  * `parts` - the PR parts (`SelfQuery`, `HaltGate`, Eq. 4's `halting_distribution`) and `PRRows`, the
    row-level API over the decoder layer `M` that the training drafter and the serving drafter share;
  * `recon_parts` - the second head and the low-rank reconsideration adapter;
  * `eagle3` - `PRServingDrafter`: a single-layer EAGLE-3 drafter in plain torch with the parameter names of
    an export, plus `PRRows` (what the SGLang plugin serves with).
  * `export_format` - what an `export --to sglang` directory holds (its tensor check, its context length), which
    the exporter writes by and the serving side (`sglang_cpu.preflight`) checks by.

Does not own: the training drafter (`pr_specforge.modeling`, SpecForge's class plus `PRRows`).
"""
