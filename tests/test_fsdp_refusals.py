"""What the FSDP source accepts and refuses before anything is launched or written (issue 36).

Real verl classes (FSDPEngineWithLMHead, TrainingWorker, ActorRolloutRefWorker; engine instances made with
`object.__new__`, since verl's `initialize()` needs CUDA), real HF models and peft LoRA, real replicas built from
SGLang's model classes, and (ranks that disagree) a real FSDP2 model on two gloo CPU ranks and the go/no-go.
"""

from __future__ import annotations

import json
import os
import socket
import traceback
from types import SimpleNamespace

import pytest
import torch

from verl_p2p.errors import P2PConfigError
from verl_p2p.planning.fsdp import build_full_stream_plan, full_stream_sources, plan_full_stream
from verl_p2p.planning.plan import SourceRank, split_by_bytes
from verl_p2p.planning.targets import TargetRank
from verl_p2p.sandbox import forked
from verl_p2p.trainer.fsdp_export import FullStreamExport, FullStreamRefusedError, StreamEntry, check_stream
from verl_p2p.trainer.senders import disagreeing_streams

TP1 = {"tp_size": 1, "dtype": "float32"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from verl_p2p.sandbox.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", id_encoded=True)


def _engine(module, lora=None, qat=False):
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    engine = object.__new__(FSDPEngineWithLMHead)  # stand-in for __init__/initialize (CUDA only)
    engine.module = module
    engine.model_config = SimpleNamespace(lora=lora or {}, hf_config=getattr(module, "config", None))
    engine._is_offload_param = False
    engine._uses_fsdp2_cpu_offload_policy = False
    engine._qat_enabled = qat
    return engine


def _hf_model(path, **overrides):
    from transformers import AutoModelForCausalLM

    if "num_hidden_layers" in overrides:  # transformers keeps one attention type per layer
        overrides["layer_types"] = ["full_attention"] * overrides["num_hidden_layers"]
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **overrides)


# ---- the engine lookup -------------------------------------------------------------------------------------------


def test_the_source_finds_verls_fsdp_engine_and_still_refuses_anything_else():
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

    from verl_p2p.trainer.verl_engine import EngineAccessError, find_training_engine

    engine = object.__new__(FSDPEngineWithLMHead)
    actor = object.__new__(TrainingWorker)
    actor.engine = engine
    worker = object.__new__(ActorRolloutRefWorker)
    worker.actor = actor
    assert find_training_engine(worker) is engine
    assert find_training_engine(actor) is engine
    assert find_training_engine(engine) is engine
    actor.engine = object()  # some other engine
    with pytest.raises(EngineAccessError) as info:
        find_training_engine(worker)
    assert "actor.strategy=megatron" in str(info.value) and "actor.strategy=fsdp or fsdp2" in str(info.value)


def test_the_fsdp_engine_gets_the_full_stream_export_and_refuses_a_megatron_export_mode(checkpoint):
    from verl_p2p.trainer.verl_engine import engine_exporter

    engine = _engine(_hf_model(checkpoint))
    assert engine_exporter(engine).mode == "full_stream"
    with pytest.raises(P2PConfigError, match="export_mode=auto"):
        engine_exporter(engine, mode="pp_local")


# ---- LoRA and QAT ------------------------------------------------------------------------------------------------


def test_an_unmerged_lora_is_refused_naming_the_merge_setting_and_a_merged_one_streams_base_names(checkpoint):
    from peft import LoraConfig, get_peft_model

    base_names = [e.name for e in FullStreamExport(_engine(_hf_model(checkpoint))).manifest()]
    lora = get_peft_model(_hf_model(checkpoint), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(FullStreamRefusedError) as info:
        FullStreamExport(_engine(lora))
    assert "actor_rollout_ref.model.lora.merge=True" in str(info.value) and "not merged" in str(info.value)
    merged = FullStreamExport(_engine(lora, lora={"merge": True}))
    assert [e.name for e in merged.manifest()] == base_names  # adapters merged: the checkpoint's names only


def test_qat_is_refused(checkpoint):
    with pytest.raises(FullStreamRefusedError, match="QAT"):
        FullStreamExport(_engine(_hf_model(checkpoint), qat=True))


# ---- a stream the rollout does not publish -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def groups(checkpoint):
    """The push's groups for one TP1 target of the rollout serving `checkpoint` (a real replica)."""
    from verl_p2p.planning.layout import layout_from_server_args
    from verl_p2p.replica.stream import RankReplica
    from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs
    from verl_p2p.trainer.hf_specs import hf_specs_from_checkpoint
    from verl_p2p.trainer.push import PushTarget, group_targets

    install_cpu_stubs()
    cfg = json.loads((checkpoint / "config.json").read_text())
    replica = RankReplica.build(cfg, TP1, layout_from_server_args(TP1, 0), hf_specs_from_checkpoint(checkpoint))
    return group_targets([PushTarget(TargetRank(0, 0), replica, None)])


def test_a_stream_matching_the_rollouts_checkpoint_passes(checkpoint, groups):
    FullStreamExport(_engine(_hf_model(checkpoint))).check_stream(groups)


def test_streamed_names_the_rollout_does_not_have_are_refused_unless_allowed(checkpoint, groups):
    deeper = FullStreamExport(_engine(_hf_model(checkpoint, num_hidden_layers=3)))  # the actor has a third layer
    with pytest.raises(FullStreamRefusedError) as info:
        deeper.check_stream(groups)
    assert "model.layers.2." in str(info.value) and "unused_hf_tensors_allowed" in str(info.value)
    deeper.check_stream(groups, allowed_unused=["model.layers.2.*"])


def test_a_stream_lacking_tensors_rollout_parameters_need_is_refused(checkpoint, groups):
    shallower = FullStreamExport(_engine(_hf_model(checkpoint, num_hidden_layers=1)))
    with pytest.raises(FullStreamRefusedError) as info:
        shallower.check_stream(groups)
    assert "lacks" in str(info.value) and "model.layers.1." in str(info.value)


def test_a_shape_the_rollout_does_not_have_is_refused(groups):
    specs = groups[0].replica.plan.hf_specs
    entries = [StreamEntry(n, tuple(s), d) for n, (s, d) in specs.items()]
    entries[0] = StreamEntry(entries[0].name, (1, *entries[0].shape), entries[0].dtype)
    with pytest.raises(FullStreamRefusedError, match="disagree on tensor shapes"):
        check_stream(entries, groups)


# ---- ranks that disagree on the stream ---------------------------------------------------------------------------


def test_the_odd_rank_out_is_named_when_stream_digests_differ():
    assert disagreeing_streams({0: "a", 1: "a", 2: "a"}) == {}
    odd = disagreeing_streams({0: "a", 1: "b", 2: "a"})
    assert list(odd) == [1] and "StreamDisagreementError" in odd[1] and "ranks [0, 2]" in odd[1]
    assert list(disagreeing_streams({0: "a", 1: "b"})) == [1]  # a tie: the lowest rank's stream is the reference


def _disagreeing_rank(rank: int, world: int, port: int, model_dir: str, queue) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        from support.fsdp_ranks import cpu_platform_for_verl_fsdp, fsdp2_engine

        from verl_p2p.trainer.exports import stream_digest
        from verl_p2p.trainer.senders import ExportAbortedError, agree_to_export

        cpu_platform_for_verl_fsdp()
        engine = fsdp2_engine(model_dir, world, num_hidden_layers=3 if rank == 1 else None)
        digest, error = stream_digest(FullStreamExport(engine))
        try:
            agree_to_export(rank, None, error, digest)
            queue.put((rank, "went ahead"))
        except ExportAbortedError as exc:
            queue.put((rank, exc.failures))
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        queue.put((rank, f"error: {exc}\n{traceback.format_exc()}"))


def test_fsdp2_ranks_streaming_different_models_are_refused_on_every_rank_before_the_stream(checkpoint):
    queue = forked.context().Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [forked.process(_disagreeing_rank, (r, 2, port, str(checkpoint), queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for rank in range(2):
        failures = results[rank]
        assert isinstance(failures, dict), f"rank {rank}: {failures}"
        assert list(failures) == [1] and "StreamDisagreementError" in failures[1], failures


# ---- the plan ----------------------------------------------------------------------------------------------------


def test_every_fsdp_rank_writes_its_byte_balanced_part_of_every_target():
    targets = [TargetRank(e, r) for e in range(2) for r in range(2)]
    plan = plan_full_stream(3, targets)
    assert plan.senders() == [0, 1, 2]
    for rank in range(3):
        assert plan.targets_of(rank) == tuple(targets)
        assert {plan.part_of(rank, t) for t in targets} == {(rank, 3)}
    assert plan.left_unknown([1]) == targets  # a dead rank leaves its part of every target unknown
    sizes = [(f"p{i}", 100 + i) for i in range(10)]
    parts = [split_by_bytes(sizes, 3)[plan.part_of(r, targets[0])[0]] for r in range(3)]
    assert frozenset().union(*parts) == {n for n, _ in sizes} and sum(map(len, parts)) == len(sizes)
    alone = build_full_stream_plan([SourceRank(0, 0)], targets)  # one rank writes every target whole
    assert alone.targets_of(0) == tuple(targets) and alone.part_of(0, targets[0]) == (0, 1)
    assert full_stream_sources(2) == [SourceRank(0, 0), SourceRank(1, 0)]
    with pytest.raises(ValueError, match="build_transfer_plan"):
        build_full_stream_plan([SourceRank(0, 0), SourceRank(1, 1)], targets)


def test_the_fsdp_estimate_has_every_rank_send_and_convert_only_its_share_of_each_layout():
    from verl_p2p.planning.fsdp import estimate_full_stream
    from verl_p2p.planning.plan import build_transfer_plan
    from verl_p2p.planning.sync_estimate import estimate_sync

    targets = [TargetRank(e, 0) for e in range(2)]  # two engines of one layout
    keys = dict.fromkeys(targets, "tp1")
    est = estimate_full_stream(4, targets, dict.fromkeys(targets, 4000), keys)
    assert [s.rank for s in est.senders] == [0, 1, 2, 3]
    assert all(s.convert_bytes == 1000 and sum(n for _, n in s.links) == 2000 for s in est.sources)
    staged = estimate_sync(build_transfer_plan(full_stream_sources(4), targets), {t: {0: 4000} for t in targets}, keys)
    assert all(s.convert_bytes == 2000 for s in staged.senders)  # k senders of one target each: twice the work


def test_a_tied_lm_head_is_not_in_the_stream_and_the_stream_matches_a_tied_rollout(tmp_path):
    """verl's stream of a tied model carries lm_head.weight (the embedding under a second name); a tied checkpoint
    has no such tensor, so without dropping it the pre-launch check would refuse every tied model (Qwen3-4B).
    (That the export drops it as the manifest says: test_fsdp_source.py, whose Qwen3 is tied.)"""
    from verl_p2p.planning.layout import layout_from_server_args
    from verl_p2p.replica.stream import RankReplica
    from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs
    from verl_p2p.sandbox.tiny import write_tiny_checkpoint
    from verl_p2p.trainer.hf_specs import hf_specs_from_checkpoint
    from verl_p2p.trainer.push import PushTarget, group_targets

    install_cpu_stubs()
    path = write_tiny_checkpoint(tmp_path / "tied", "qwen3", tie_word_embeddings=True)
    model = _hf_model(path)
    assert "lm_head.weight" in model.state_dict()  # what verl's get_per_tensor_param iterates
    export = FullStreamExport(_engine(model))
    assert "lm_head.weight" not in [e.name for e in export.manifest()]
    cfg = json.loads((path / "config.json").read_text())
    replica = RankReplica.build(cfg, TP1, layout_from_server_args(TP1, 0), hf_specs_from_checkpoint(path))
    export.check_stream(group_targets([PushTarget(TargetRank(0, 0), replica, None)]))
