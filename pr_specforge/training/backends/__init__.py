"""Training-runtime pieces pr_specforge plugs into SpecForge's trainer.

Owns: the recipe's `backend:` section (`BackendConfig`), the checkpoint manager
that stores the resolved recipe in every checkpoint and orders/fsyncs its
writes (`checkpoint`), and the DeepSpeed ZeRO-1/2 backend (`deepspeed`).

Does not own: the trainer loop or the FSDP/DDP backend (SpecForge's).
"""

from pr_specforge.training.backends.config import BACKEND_SECTION, BackendConfig

__all__ = ["BACKEND_SECTION", "BackendConfig"]
