"""Checks `scripts/sglang_cpu_serve.sh` runs before it starts SGLang (seconds; no SGLang import).

    python -m pr_specforge.sglang_cpu.preflight TARGET_DIR DRAFT_DIR PORT [ALGORITHM]

SGLang meets each of these far into its start-up, with a traceback or not at all: an `export --to hf`
directory as the draft ("not a registered model"), the target as the draft ("no attribute
hot_token_id"), a renamed or missing tensor, a draft whose config's context length is below the
target's (a `ValueError` about `SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN`), a port in use (`Errno 98`,
then a hang). Each is one line here, naming the directory or port and the fix, and exit 2.
DRAFT_DIR `none` (`scripts/sglang_cpu_serve_plain.sh`, the plain reference server): the target and the port only.
With ALGORITHM `PR_EAGLE3` (the last `--speculative-algorithm` the script passes), the export is also
checked as the `PR_EAGLE3` plugin checks it at start-up (`sglang_plugin.checks.check_drafter`).
The tensor check is the exporter's own (`core.export_format.check_tensors`: every name, shape and
the vocab map) against the serving drafter built on the meta device, reading only the tensors' headers.
Nothing here imports SpecForge or SGLang: it runs in SGLang's own environment with only the serving install
(`pip install ./serving`, which ships this package). PYTHON without SGLang is refused too. On success it prints
the draft attention backend the installed SGLang line takes on a CPU (`draft_attention`; empty: the bridge's own).
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from pr_specforge.data.io import DataFormatError, read_json_file
from pr_specforge.sglang_cpu import draft_attention

#: what SGLang serves as a drafter, and what it does not (`export --to hf` directories); as in
#: `pr_specforge.modeling` (not imported here: it imports SpecForge, whose import warns on stderr)
EAGLE3_ARCHITECTURE, HF_EXPORT_ARCHITECTURES = "LlamaForCausalLMEagle3", ("LlamaForCausalLMEagle3PR", "LlamaForCausalLMEagle3TwoLayer")


class PreflightError(ValueError):
    """What SGLang would fail on; the message is the one line the script prints."""


def _config(path: str, what: str) -> Dict[str, Any]:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise PreflightError(f"{what} {path}: does not exist")
    if not os.path.isdir(path):
        raise PreflightError(f"{what} {path}: is a file, not a model directory")
    if not os.path.isfile(cfg_path):
        run = any(os.path.exists(os.path.join(path, n)) for n in ("resolved_recipe.yaml", "training_state.pt"))
        raise PreflightError(f"{what} {path}: no config.json" + (
            " (a training run or checkpoint: serve `pr-specforge export CKPT OUT --to sglang --target TARGET`'s OUT)"
            if run else ""))
    try:
        cfg = read_json_file(cfg_path)
    except DataFormatError as e:
        raise PreflightError(str(e)) from None
    if not isinstance(cfg, dict):
        raise PreflightError(f"{cfg_path}: not a model config (a JSON object)")
    return cfg


def _arch(cfg: Dict[str, Any]) -> Optional[str]:
    return (cfg.get("architectures") or [None])[0]


def check_target(target: str) -> Dict[str, Any]:
    cfg = _config(target, "TARGET")
    if _arch(cfg) in (EAGLE3_ARCHITECTURE, *HF_EXPORT_ARCHITECTURES):
        raise PreflightError(f"TARGET {target} is a drafter ({_arch(cfg)}); give the target model first, the drafter second")
    return cfg


def check_draft_kind(draft: str, target: str) -> Dict[str, Any]:
    """An `export --to sglang` directory, not an HF export, not a target."""
    cfg = _config(draft, "DRAFT")
    arch = _arch(cfg)
    if arch in HF_EXPORT_ARCHITECTURES:
        raise PreflightError(f"DRAFT {draft} is an `export --to hf` directory ({arch}), which SGLang cannot load; serve "
                             "`pr-specforge export CKPT OUT --to sglang --target TARGET` instead (a two-layer drafter "
                             "is served by `pr-specforge eval` only)")
    if arch != EAGLE3_ARCHITECTURE or os.path.realpath(draft) == os.path.realpath(target):
        raise PreflightError(f"DRAFT {draft} is not an EAGLE-3 drafter (architectures {cfg.get('architectures')}; a target "
                             f"model?); serve `pr-specforge export CKPT OUT --to sglang --target TARGET`")
    return cfg


def _header_tensors(path: str) -> Dict[str, Any]:
    """The file's tensors as meta tensors of their shapes, except the vocab map (`t2d`, `d2t`), read in full."""
    import torch
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            return {k: f.get_tensor(k) if k in ("t2d", "d2t") else torch.empty(f.get_slice(k).get_shape(), device="meta")
                    for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise PreflightError(f"{path}: not a readable safetensors file ({e})") from None


def check_draft_tensors(draft: str, cfg: Dict[str, Any]) -> None:
    """Every EAGLE-3 tensor the draft config asks for, with its shape, and a consistent vocab map (the exporter's
    own check, `core.export_format.check_tensors`). The `pr_*` tensors, which SGLang's EAGLE-3 loader skips, are
    `PR_EAGLE3`'s to check (`check_pr_drafter`)."""
    from pr_specforge.core.eagle3 import ServingDrafterError, eagle3_tensors
    from pr_specforge.core.export_format import SAFETENSORS_NAME, ExportError, check_tensors
    from pr_specforge.core.parts import PR_PARAM_PREFIXES

    path = os.path.join(draft, SAFETENSORS_NAME)
    if not os.path.isfile(path):
        raise PreflightError(f"DRAFT {draft}: no {SAFETENSORS_NAME} (an `export --to sglang` writes one)")
    weights = _header_tensors(path)
    missing_map = [k for k in ("t2d", "d2t") if k not in weights]
    if missing_map:
        raise PreflightError(f"{path}: no {' / '.join(missing_map)} tensor (the vocab map SGLang's hot_token_id comes from)")
    try:
        check_tensors(eagle3_tensors(cfg), {k: v for k, v in weights.items() if not k.startswith(PR_PARAM_PREFIXES)},
                      cfg, EAGLE3_ARCHITECTURE)
    except (ExportError, ServingDrafterError, TypeError, ValueError, KeyError) as e:
        raise PreflightError(f"DRAFT {draft}: {' '.join(str(e).split())}") from None


def check_context(draft: str, cfg: Dict[str, Any], target: str) -> None:
    from pr_specforge.core.export_format import ExportError, declared_context, target_context

    try:
        need = target_context(target)
    except ExportError as e:
        raise PreflightError(str(e)) from None
    own = declared_context(cfg)
    if need is not None and own is not None and own < need:
        raise PreflightError(f"DRAFT {draft}: its config's context length {own} is below the target's {need}, which SGLang "
                             "refuses; export it again with `pr-specforge export CKPT OUT --to sglang --target TARGET "
                             "--overwrite` (the export writes the target's context length)")


def check_port(port: str) -> int:
    """A port number that nothing on 127.0.0.1 holds yet."""
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not 0 < number < 65536:
        raise PreflightError(f"PORT {port!r}: not a port number (1-65535)")
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", number))
        except OSError as e:
            raise PreflightError(f"PORT {number} on 127.0.0.1 is in use ({e.strerror}); pick another PORT") from None
    return number


def check_pr_drafter(draft: str, cfg: Dict[str, Any]) -> None:
    """`--speculative-algorithm PR_EAGLE3`: the plugin's own start-up refusals of the export (a plain EAGLE-3
    export, missing or renamed PR tensors), here before SGLang starts instead of deep in its start-up."""
    from pr_specforge.sglang_plugin.checks import PRServeError, check_drafter

    try:
        check_drafter(draft, cfg)
    except PRServeError as e:
        raise PreflightError(f"DRAFT {draft}: {e}") from None


PLAIN = "none"  # DRAFT_DIR of a plain server (no speculative decoding): `scripts/sglang_cpu_serve_plain.sh`


def check_sglang() -> Tuple[int, ...]:
    """The release of the SGLang this interpreter would serve with (read from its metadata: nothing imported)."""
    from importlib.metadata import PackageNotFoundError, version

    from pr_specforge.sglang_plugin.seam import UnsupportedSGLang, version_tuple

    try:
        return version_tuple(version("sglang"))
    except PackageNotFoundError:
        raise PreflightError(f"PYTHON {sys.executable} has no SGLang: serve with the interpreter of SGLang's own "
                             "environment (PYTHON=/path/to/its/bin/python)") from None
    except UnsupportedSGLang as e:
        raise PreflightError(str(e)) from None


def preflight(target: str, draft: str, port: str, algorithm: str = "EAGLE3") -> Optional[str]:
    """The cheap checks first: SGLang, the port and the configs before the tensors. DRAFT_DIR `none`: a plain
    server, whose target and port are checked. Returns the draft attention backend of the installed SGLang line
    (`draft_attention`; None for a plain server)."""
    release = check_sglang()
    check_target(target)
    if draft == PLAIN:
        check_port(port)
        return None
    cfg = check_draft_kind(draft, target)
    check_port(port)
    check_context(draft, cfg, target)
    if algorithm == "PR_EAGLE3":
        check_pr_drafter(draft, cfg)
    check_draft_tensors(draft, cfg)
    return draft_attention(release)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args: List[str] = list(sys.argv[1:] if argv is None else argv)
    if len(args) not in (3, 4):
        print("usage: python -m pr_specforge.sglang_cpu.preflight TARGET_DIR DRAFT_DIR PORT [ALGORITHM]", file=sys.stderr)
        return 2
    import warnings

    warnings.simplefilter("ignore")  # this command's stderr is its one line
    try:
        attention = preflight(*args)
    except PreflightError as e:
        print(f"sglang_cpu_serve: {e}", file=sys.stderr)
        return 2
    print(attention or "")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
