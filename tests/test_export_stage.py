"""Stage descriptions from a plan, and the sender / non-sender drive (single process, no Megatron)."""

from __future__ import annotations

import pytest
import torch

from verl_p2p.errors import P2PError
from verl_p2p.planning.plan import SourceRank, build_transfer_plan
from verl_p2p.planning.targets import TargetRank
from verl_p2p.trainer.senders import ExportStage, drive_export, stage_of

# TP2 x PP2 in Megatron's default order: ranks 0,1 are stage 0, ranks 2,3 stage 1
SOURCES = [SourceRank(0, 0), SourceRank(1, 0), SourceRank(2, 1), SourceRank(3, 1)]


def _stream(consumed: list[str], n: int = 3):
    for i in range(n):
        consumed.append(f"t{i}")  # what a collective inside the export would be: it must run on every rank
        yield f"t{i}", torch.full((2,), float(i))


def test_one_target_gives_one_sender_per_stage():
    plan = build_transfer_plan(SOURCES, [TargetRank(0, 0)], split=False)
    stages = [stage_of(r, SOURCES, plan) for r in range(4)]
    assert [s.is_sender for s in stages] == [True, False, True, False]
    assert [s.ranks for s in stages] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [s.pp_rank for s in stages] == [0, 0, 1, 1] and all(s.pp_size == 2 for s in stages)


def test_the_split_makes_every_rank_of_a_stage_a_sender_of_one_target():
    plan = build_transfer_plan(SOURCES, [TargetRank(0, 0)])  # two ranks per stage, one target: two parts
    assert all(stage_of(r, SOURCES, plan).is_sender for r in range(4))
    assert [plan.part_of(r, TargetRank(0, 0)) for r in range(4)] == [(0, 2), (1, 2), (0, 2), (1, 2)]


def test_more_targets_than_a_stage_has_ranks_makes_every_rank_a_sender():
    plan = build_transfer_plan(SOURCES, [TargetRank(e, r) for e in range(2) for r in range(2)])
    assert all(stage_of(r, SOURCES, plan).is_sender for r in range(4))


def test_sender_gets_the_stream_non_sender_drains_it_to_the_end():
    sender = stage_of(0, SOURCES, senders=[0, 2])
    drained = stage_of(1, SOURCES, senders=[0, 2])
    seen_by_sender: list[str] = []
    seen_by_drainer: list[str] = []
    got = [name for name, _ in drive_export(sender, _stream(seen_by_sender))]
    assert got == ["t0", "t1", "t2"] and seen_by_sender == got
    assert list(drive_export(drained, _stream(seen_by_drainer))) == []
    assert seen_by_drainer == ["t0", "t1", "t2"], "a non-sender must run the whole export (its collectives)"


def test_stage_without_any_sender_still_drains():
    idle = stage_of(3, SOURCES, senders=[0])
    seen: list[str] = []
    assert idle.senders == () and list(drive_export(idle, _stream(seen))) == [] and len(seen) == 3


def test_invalid_stage_descriptions_are_rejected():
    with pytest.raises(P2PError, match="not in its own stage"):
        ExportStage(rank=5, pp_rank=0, pp_size=2, ranks=(0, 1), senders=())
    with pytest.raises(P2PError, match="not ranks of pipeline stage"):
        ExportStage(rank=0, pp_rank=0, pp_size=2, ranks=(0, 1), senders=(2,))
    with pytest.raises(P2PError, match="not among the export sources"):
        stage_of(7, SOURCES, senders=[])


# ------------------------------------------------------------------ fallback decisions (verl_p2p.trainer.export)


class _BridgeStandIn:
    """Only what `choose_export_mode` reads of an AutoBridge: its export dtype and the adapter-name rule."""

    class _ModelBridge:
        @staticmethod
        def _is_adapter_param_name(name: str) -> bool:
            return ".adapter." in name

    def __init__(self, export_weight_dtype: str = "bf16"):
        self.export_weight_dtype = export_weight_dtype
        self._model_bridge = self._ModelBridge()


def _chunk(extra: str | None = None) -> torch.nn.Module:
    chunk = torch.nn.Module()
    chunk.decoder = torch.nn.Linear(2, 2)
    if extra == "quantizer":
        chunk.decoder.weight_quantizer = torch.nn.Identity()
    if extra == "adapter":
        chunk.decoder.adapter = torch.nn.Linear(2, 2)
    return chunk


def test_fallback_is_chosen_with_its_reason():
    from verl_p2p.trainer.export import choose_export_mode

    assert choose_export_mode([_chunk()], _BridgeStandIn()).mode == "pp_local"
    fp8 = choose_export_mode([_chunk()], _BridgeStandIn("fp8"))
    qat = choose_export_mode([_chunk(), _chunk("quantizer")], _BridgeStandIn())
    lora = choose_export_mode([_chunk("adapter")], _BridgeStandIn())
    assert (fp8.mode, qat.mode, lora.mode) == ("filter_full",) * 3
    assert "fp8" in fp8.reason and "weight_quantizer" in qat.reason and "decoder.adapter.weight" in lora.reason


def test_fallback_filter_keeps_exactly_this_stages_names():
    from verl_p2p.trainer.export import StageOwnership

    last = StageOwnership(
        names=frozenset({"model.norm.weight", "model.layers.1.mlp.experts.0.up_proj.weight"}),
        layer_prefixes=frozenset({"model.layers.1"}),
        claims_unowned=False,
        claimed_elsewhere=frozenset({"model.embed_tokens.weight"}),
        prefixes_elsewhere=frozenset({"model.layers.0"}),
    )
    first = StageOwnership(
        names=frozenset({"model.embed_tokens.weight"}),
        layer_prefixes=frozenset({"model.layers.0"}),
        claims_unowned=True,
        claimed_elsewhere=last.names,
        prefixes_elsewhere=last.layer_prefixes,
    )
    stream = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.experts.5.up_proj.weight",  # another EP rank's expert: same layer, same stage
        "model.layers.10.input_layernorm.weight",  # `layers.1` must not match `layers.10`
        "model.norm.weight",
        "renamed.by.a.hook",  # claimed by no stage: kept once, by stage 0
    ]
    assert [n for n in stream if first.owns(n)] == [stream[0], stream[1], stream[3], stream[5]]
    assert [n for n in stream if last.owns(n)] == [stream[2], stream[4]]
