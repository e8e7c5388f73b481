"""The compute dtype `auto` resolves to: what the hardware runs fast.

On a CPU, bf16 is fast only with native bf16 arithmetic (AMX or AVX512-BF16, the
`amx_bf16` / `avx512_bf16` flags of /proc/cpuinfo); elsewhere torch emulates it and
fp32 is ~2.7x faster (a SmolLM2 forward of 4 x 512 tokens on an AVX-512F CPU without
bf16: 512 tok/s in fp32, 190 tok/s in bf16). On CUDA, bf16 where the GPU supports it.

Used by `data regenerate`, `data hidden-states`, `train` (a recipe's `model.torch_dtype:
auto`), `run` and `experiment`; an explicit dtype always wins. Offline features and the drafter
that trains on them resolve alike, so `auto` features and an `auto` recipe agree on one machine.
"""

from __future__ import annotations

import functools

DTYPES = ("bfloat16", "float32", "float16")
CHOICES = ("auto", *DTYPES)
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when the CPU advertises native bf16 arithmetic (AMX-BF16 or AVX512-BF16)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return bool(set(line.split(":", 1)[1].split()) & set(NATIVE_BF16_FLAGS))
    except OSError:
        pass
    return False


def resolve_dtype(choice: str, device: str = "cpu") -> str:
    """`auto` -> the fast dtype for `device`; any other choice is returned as given (validated)."""
    if choice != "auto":
        if choice not in DTYPES:
            raise ValueError(f"dtype must be one of {CHOICES}, got {choice!r}")
        return choice
    if str(device).startswith("cuda"):
        import torch

        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if cpu_has_native_bf16() else "float32"


def torch_dtype(choice: str, device: str = "cpu"):
    import torch

    return getattr(torch, resolve_dtype(choice, device))
