"""Data-prep ranks under `torchrun`: who am I, which rows are mine, wait for the others.

    torchrun --nproc_per_node 8 -m pr_specforge.cli data hidden-states --device cuda ...

Outside torchrun (no RANK/WORLD_SIZE in the environment) everything here is a
no-op for one rank, so the single-process commands are unchanged. Under
torchrun a gloo process group (CPU collectives, also on GPU machines) carries
the only things ranks share: barriers (features: after rank 0 has written the
in-progress manifest, so no rank writes into a directory that does not yet say
what it holds; before rank 0 finishes the job) and the per-rank counters it
sums into the manifest. Rows are assigned by a
rule that depends on the input alone (never on which outputs already exist),
so a rank killed and rerun takes back exactly its own rows.

It deliberately knows nothing about rows, features or models.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

#: Rank 0 waits at the final barrier for the slowest rank's whole shard.
BARRIER_TIMEOUT = datetime.timedelta(hours=48)


@dataclass(frozen=True)
class Shard:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def owns(self, k: int) -> bool:
        """Whether item `k` of a deterministic sequence belongs to this rank (round robin)."""
        return k % self.world == self.rank

    def device(self, device: str) -> str:
        """`cuda` means this rank's own GPU (`cuda:LOCAL_RANK`); other devices pass through."""
        if device == "cuda" and self.world > 1:
            import torch

            torch.cuda.set_device(self.local_rank)
            return f"cuda:{self.local_rank}"
        return device


def current_shard() -> Shard:
    """This process's rank from torchrun's environment (one rank outside torchrun)."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return Shard()
    shard = Shard(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"])))
    if not 0 <= shard.rank < shard.world:
        raise ValueError(f"RANK={shard.rank} is outside WORLD_SIZE={shard.world}")
    return shard


def _group(shard: Shard):
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=shard.rank, world_size=shard.world, timeout=BARRIER_TIMEOUT)
    return dist


def gather_to_main(shard: Shard, obj) -> list | None:
    """Every rank's `obj` on rank 0 (a list in rank order), None elsewhere. Doubles as a barrier."""
    if shard.world == 1:
        return [obj]
    dist = _group(shard)
    out = [None] * shard.world if shard.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


def barrier(shard: Shard) -> None:
    if shard.world > 1:
        _group(shard).barrier()


def close(shard: Shard) -> None:
    """Tear down the process group this module started (if any)."""
    if shard.world > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
