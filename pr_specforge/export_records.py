"""What an export records of where it came from, and its fingerprints (`pr-specforge export` writes them; `run`'s
stages, `eval`, `diagnose` / `headroom` and the study read them).

* `RUN_RECORD_KEY` (`run_record`): the run's settings `diagnose` / `headroom` rebuild the objective with, and the
  checkpoint it was made from (`checkpoint_record`, compared by `export_is_of`);
* `export_fingerprints`: the export's weights and config less the `PROVENANCE_KEYS` records, so a rebuild in another
  directory has the same fingerprint, and the legacy fingerprint of its files as they are (`matches_export` accepts
  either).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional, Tuple

from pr_specforge.data.hidden_states import TARGET_RECORD_KEY
from pr_specforge.data.io import DataFormatError, read_json_file

#: the key under which an export's config.json records the run it came from (`run_record`)
RUN_RECORD_KEY = "pr_specforge_run"
#: config.json keys that say where an export came from, not what it computes: `export_fingerprints` leaves them out
PROVENANCE_KEYS = (TARGET_RECORD_KEY, RUN_RECORD_KEY)


#: `pr` settings of how a run started, not of what its drafter computes: `pr.init_from` names a file on the machine that
#: trained it (an absolute path, which an export must not carry), `pr.freeze_one_pass` needs it; a rebuild
#: (`diagnose`, `headroom`) trains nothing, so `run_record` keeps neither, only that the run was warm-started
WARM_START_KEYS = ("init_from", "freeze_one_pass")


def checkpoint_record(checkpoint: str, digest: Optional[Callable[[str], str]] = None) -> Optional[Dict[str, str]]:
    """The checkpoint an export was made from: its directory's name and its `training_state.pt`'s content hash
    (`run`'s export stage compares it with the run's newest checkpoint: an export of earlier weights is redone;
    derived stages record it, `stages.inputs_record`, hashing through `digest`, default `data.io.file_digest`)."""
    from pr_specforge.data.io import file_digest
    from pr_specforge.training.preflight import latest_checkpoint

    if os.path.isdir(checkpoint) and not os.path.isfile(os.path.join(checkpoint, "training_state.pt")):
        checkpoint = latest_checkpoint(checkpoint, required=False) or checkpoint  # a run directory: its newest
    state = os.path.join(checkpoint, "training_state.pt") if os.path.isdir(checkpoint) else checkpoint
    if not (os.path.isfile(state) and os.path.basename(state) == "training_state.pt"):
        return None
    return {"name": os.path.basename(os.path.dirname(os.path.abspath(state))), "sha256": (digest or file_digest)(state)}


def run_record(recipe: Optional[Dict[str, Any]], strategy: str, checkpoint: Optional[str] = None) -> Dict[str, Any]:
    """The run's settings that `diagnose` / `headroom` rebuild an export's objective with, so that they measure the
    run's numbers with default flags: the TTT length, sequence length, batch size, attention backend, the compute
    dtype the run trained in, and (a PR run) its whole `pr` section (the objective's settings, not only the
    drafter's `pr_config`, less `WARM_START_KEYS`). Settings the stored recipe lacks are left out (the rebuild then
    uses its defaults).
    With `checkpoint`, also which checkpoint it is (`checkpoint_record`)."""
    recipe = recipe or {}
    sections = {name: recipe.get(name) or {} for name in ("model", "data", "training")}
    fields = (("training", "ttt_length"), ("data", "max_length"), ("training", "batch_size"),
              ("training", "attention_backend"), ("model", "torch_dtype"), ("model", "lm_head_key"))
    record: Dict[str, Any] = {"strategy": strategy}
    record.update({key: sections[section][key] for section, key in fields if sections[section].get(key) is not None})
    if strategy == "pr" and isinstance(recipe.get("pr"), dict):
        record["pr"] = {k: v for k, v in recipe["pr"].items() if k not in WARM_START_KEYS}
        if recipe["pr"].get("init_from"):  # that it was warm-started, never the path (a machine's file, not a setting)
            record["warm_start"] = {"freeze_one_pass": bool(recipe["pr"].get("freeze_one_pass"))}
    if checkpoint and (ckpt := checkpoint_record(checkpoint)):
        record["checkpoint"] = ckpt
    return record


def export_is_of(export_dir: str, checkpoint: Optional[str]) -> bool:
    """`export_dir` holds an export of `checkpoint` (its recorded `checkpoint_record`); False when it records none."""
    cfg_path = os.path.join(export_dir, "config.json")
    if not (checkpoint and os.path.isfile(cfg_path)):
        return False
    try:
        recorded = (read_json_file(cfg_path).get(RUN_RECORD_KEY) or {}).get("checkpoint")
    except (DataFormatError, AttributeError):
        return False
    return recorded is not None and recorded == checkpoint_record(checkpoint)


def export_fingerprints(path: str) -> Tuple[str, str]:
    """`(fingerprint, legacy)` of an export directory: its weights and config, less the `PROVENANCE_KEYS` records
    (where it was made and from what run), so a rebuild in another directory has the same fingerprint; and the
    fingerprint of its files as they are (`dir_fingerprint`), what records before this one hold. A check accepts
    a recorded value equal to either (`matches_export`)."""
    from pr_specforge.data.io import dir_fingerprint

    current = dir_fingerprint(path, ignore_keys=PROVENANCE_KEYS)
    records = any(isinstance(cfg := _json_or_none(os.path.join(path, name)), dict) and set(cfg) & set(PROVENANCE_KEYS)
                  for name in os.listdir(path) if name.endswith(".json"))
    return current, (dir_fingerprint(path) if records else current)  # the weights are read twice only when they differ


def _json_or_none(path: str) -> Any:
    try:
        return read_json_file(path)
    except (DataFormatError, OSError):
        return None


def matches_export(recorded: Optional[str], fingerprints: Tuple[str, str]) -> bool:
    """A recorded drafter fingerprint names this export (`export_fingerprints`: the current or the legacy one)."""
    return recorded in fingerprints
