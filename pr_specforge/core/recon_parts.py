"""Reconsideration-only parts of the PR drafter: the second head and the low-rank adapter on `M`.

Owns:
  * `ReconHead` — depths >= 1's own final norm and lm_head (`pr.recon_head: separate`),
    copied from the one-pass `norm` / `lm_head` when created and when warm-starting.
  * `ReconAdapter` — a LoRA-style low-rank delta on every linear map of the decoder
    layer `M` (q, k, v, o, MLP gate, up, down), applied only on reconsideration rows
    (`pr.recon_adapter_rank`). The up-projections start at zero, so a fresh adapter
    changes nothing; the one-pass rows never see it.

Tensor names avoid every substring SGLang's EAGLE-3 loader acts on (`.q_proj`,
`.gate_proj`, ...), so stock SGLang skips them (see `pr_specforge.export`).

Does not own: when a row is a reconsideration row (the caller passes a row mask to
`LlamaForCausalLMEagle3PR.layer_qkv` / `layer_finish`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

#: the linear maps of `M` the adapter adapts: adapter name -> (module path under `midlayer`)
ADAPTED = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "mlp_in_g": "mlp.gate_proj",
    "mlp_in_u": "mlp.up_proj",
    "mlp_out": "mlp.down_proj",
}


class LowRank(nn.Module):
    """`x -> up(down(x))`, rank `r`; `up` starts at zero (a fresh adapter is the identity)."""

    def __init__(self, in_features: int, out_features: int, rank: int, std: float) -> None:
        super().__init__()
        self.down = nn.Linear(in_features, rank, bias=False)
        self.up = nn.Linear(rank, out_features, bias=False)
        with torch.no_grad():
            nn.init.normal_(self.down.weight, std=std)
            self.up.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


class ReconAdapter(nn.Module):
    """One `LowRank` per linear map of `M` (see `ADAPTED`)."""

    def __init__(self, midlayer: nn.Module, rank: int, std: float) -> None:
        super().__init__()
        for name, path in ADAPTED.items():
            lin = midlayer.get_submodule(path)
            self.add_module(name, LowRank(lin.in_features, lin.out_features, rank, std))

    def delta(self, name: str, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The adapter's change to map `name` for input `x [N, T, in]`, zero where `rows [N, T, 1]` is 0."""
        return getattr(self, name)(x) * rows.to(x.dtype)


class ReconHead(nn.Module):
    """Depths >= 1's readout: `lm_head2(norm2(f))` (`norm2` skipped when the drafter's `norm_output` is off)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Linear) -> None:
        super().__init__()
        self.norm = type(norm)(norm.weight.shape[0], eps=norm.variance_epsilon)
        self.lm_head = nn.Linear(lm_head.in_features, lm_head.out_features, bias=False)
        self.copy_from(norm, lm_head)

    @torch.no_grad()
    def copy_from(self, norm: nn.Module, lm_head: nn.Linear) -> None:
        self.norm.weight.copy_(norm.weight)
        self.lm_head.weight.copy_(lm_head.weight)

    def forward(self, feature: torch.Tensor, norm_output: bool) -> torch.Tensor:
        return self.lm_head(self.norm(feature) if norm_output else feature)


def row_mask(recon_rows: Optional[torch.Tensor], n: int, t: int, device) -> Optional[torch.Tensor]:
    """`[N]` or `[N, T]` bool/float reconsideration-row mask -> `[N, T, 1]` float, or None."""
    if recon_rows is None:
        return None
    m = recon_rows.to(device=device, dtype=torch.float32)
    if m.dim() == 1:
        m = m[:, None].expand(n, t)
    if tuple(m.shape) != (n, t):
        raise ValueError(f"recon_rows has shape {tuple(recon_rows.shape)}; expected [{n}] or [{n}, {t}]")
    return m[..., None]
