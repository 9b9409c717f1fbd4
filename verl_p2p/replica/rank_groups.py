"""Stand-in parallel groups for one rollout rank: membership answers, no communication.

SGLang's model classes ask their parallel groups who they are while building and loading a rank's shard; the
replica answers with these objects (`stand_in_groups`), which refuse anything that would communicate.
"""

from __future__ import annotations

from typing import Any

import torch

from verl_p2p.planning.layout import RankLayout


class StandInGroup:
    """Stand-in for SGLang's `GroupCoordinator`: membership answers, no communication.

    One fresh object per group per rank context; never mutated after construction.
    """

    def __init__(self, name: str, ranks: list[int], rank: int):
        if rank not in ranks:
            raise ValueError(f"rank {rank} is not a member of group {name} {ranks}")
        self.unique_name = f"verl_p2p_stand_in:{name}"
        self.group_name = name
        self.ranks = list(ranks)
        self.rank = rank
        self.local_rank = rank
        self.world_size = len(ranks)
        self.rank_in_group = self.ranks.index(rank)
        self.first_rank = self.ranks[0]
        self.last_rank = self.ranks[-1]
        self.is_first_rank = rank == self.first_rank
        self.is_last_rank = rank == self.last_rank
        self.next_rank = self.ranks[(self.rank_in_group + 1) % self.world_size]
        self.prev_rank = self.ranks[(self.rank_in_group - 1) % self.world_size]
        self.device = torch.device("cpu")
        self.local_size = self.world_size
        self.cpu_group = None
        self.device_group = None
        for flag in ("use_pynccl", "use_pymscclpp", "use_custom_allreduce", "use_torch_symm_mem_all_reduce"):
            setattr(self, flag, False)
        for comm in ("pynccl_comm", "pymscclpp_comm", "ca_comm", "qr_comm", "torch_symm_mem_comm", "mq_broadcaster"):
            setattr(self, comm, None)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"{self.unique_name} (verl_p2p rank-context stand-in) has no {name!r}: the replica builds and loads "
            "weights without communication; if this SGLang release needs it there, extend StandInGroup"
        )

    def __repr__(self) -> str:
        return f"StandInGroup({self.group_name}, ranks={self.ranks}, rank={self.rank})"


def group_ranks(layout: RankLayout) -> dict[str, list[int]]:
    """The global ranks of every parallel group rank `layout.tp_rank` belongs to (rollout PP is 1)."""
    r, t = layout.tp_rank, layout.tp_size
    attn_start = layout.attn_dp_rank * layout.attn_tp_size
    moe_tp_start = layout.moe_ep_rank * layout.moe_tp_size
    return {
        "world": list(range(t)),
        "tp": list(range(t)),
        "pp": [r],
        "attn_tp": list(range(attn_start, attn_start + layout.attn_tp_size)),
        "attn_cp": [r],
        "moe_dp": [r],
        "moe_tp": list(range(moe_tp_start, moe_tp_start + layout.moe_tp_size)),
        "moe_ep": [layout.moe_tp_rank + k * layout.moe_tp_size for k in range(layout.ep_size)],
    }


def stand_in_groups(layout: RankLayout) -> dict[str, StandInGroup]:
    """A fresh set of stand-in groups for one rank; like SGLang, a group spanning the TP group *is* it."""
    ranks = group_ranks(layout)
    groups = {"world": StandInGroup("world", ranks["world"], layout.tp_rank)}
    groups["tp"] = StandInGroup("tp", ranks["tp"], layout.tp_rank)
    for name, members in ranks.items():
        if name not in groups:
            same = members == ranks["tp"] and name != "pp"
            groups[name] = groups["tp"] if same else StandInGroup(name, members, layout.tp_rank)
    return groups
