"""The on-disk plan cache: hit, miss, invalidation (config, layout, server args, SGLang release), corrupt entries,
and a replica built from the cache that imports SGLang only when something calls it."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import textwrap

import pytest
import torch
from support.replica_harness import REPO, version_env

from verl_p2p.config import P2PConfig
from verl_p2p.errors import P2PConfigError
from verl_p2p.planning.layout import layout_from_server_args
from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs
from verl_p2p.sandbox.tiny import hf_tensor_shapes, tiny_config_dict, tiny_state_dict

install_cpu_stubs()

from verl_p2p.replica import PlanCache, RankReplica, default_plan_cache_dir  # noqa: E402
from verl_p2p.replica.plan_cache import plan_from_json, plan_to_json, read_entry  # noqa: E402
from verl_p2p.replica.stream import plan_rank  # noqa: E402

ARGS = {"tp_size": 2, "ep_size": 2, "dtype": "float32", "device": "cpu"}


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_config_dict("qwen3_moe", vocab_size=250)
    specs = {n: (s, torch.float32) for n, s in hf_tensor_shapes(cfg)}
    return cfg, specs


def _entries(cache: PlanCache) -> list:
    return sorted(cache.directory.glob("plan-*.json"))


def _plan(cfg, specs, cache, args=ARGS, rank=0):
    return plan_rank(cfg, args, layout_from_server_args(args, rank), specs, cache)


def test_miss_then_hit_gives_the_captured_plan(tiny, tmp_path):
    cfg, specs = tiny
    cache = PlanCache(tmp_path)
    first = _plan(cfg, specs, cache)
    assert not first.from_cache and first.model is not None and len(_entries(cache)) == 1
    again = _plan(cfg, specs, cache)
    assert again.from_cache and again.ctx is None and again.model is None
    assert again.plan == first.plan and again.key == first.key
    uncached = plan_rank(cfg, ARGS, layout_from_server_args(ARGS, 0), specs, None)
    assert uncached.plan == first.plan and uncached.key == first.key
    # the JSON form round-trips every field (also the fills SGLang pads the vocab with)
    assert plan_from_json(json.loads(json.dumps(plan_to_json(first.plan)))) == first.plan
    key, carried = read_entry(_entries(cache)[0])  # what a GPU host without SGLang reads
    assert carried == first.plan and key["layout"]["tp_rank"] == 0 and key["sglang_version"].startswith("0.5.12")


def test_a_cached_replica_builds_its_model_only_when_sglang_is_called(tiny, tmp_path):
    cfg, specs = tiny
    cache = PlanCache(tmp_path)
    RankReplica.build(cfg, ARGS, layout_from_server_args(ARGS, 1), specs, cache=cache)
    replica = RankReplica.build(cfg, ARGS, layout_from_server_args(ARGS, 1), specs, cache=cache)
    assert replica._model is None and replica._ctx is None
    sd = tiny_state_dict(cfg)
    name = "lm_head.weight"
    p = replica.plan.params[name]
    dst = torch.full((p.numel,), float("nan")).view(torch.uint8)
    replica.load(name, {f: sd[f] for f in p.feeds}, dst)  # the reference executor: builds ctx + model now
    assert replica._model is not None
    got = dst.view(torch.float32).view(p.shape)
    assert torch.equal(got[:122], sd[name][128:250]) and torch.equal(got[122:], torch.zeros(6, 64))


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda cfg, args, rank: (dict(cfg, rms_norm_eps=1e-5), args, rank), id="config"),
        pytest.param(lambda cfg, args, rank: (cfg, args, 1), id="layout-rank"),
        pytest.param(lambda cfg, args, rank: (cfg, dict(args, tp_size=4, ep_size=4), rank), id="layout-parallelism"),
        pytest.param(lambda cfg, args, rank: (cfg, dict(args, enable_dp_lm_head=True), rank), id="server-args"),
    ],
)
def test_a_changed_key_misses(tiny, tmp_path, change):
    cfg, specs = tiny
    cache = PlanCache(tmp_path)
    base = _plan(cfg, specs, cache)
    cfg2, args2, rank2 = change(cfg, ARGS, 0)
    other = _plan(cfg2, specs, cache, args2, rank2)
    assert not other.from_cache and other.key != base.key and len(_entries(cache)) == 2
    assert _plan(cfg, specs, cache).from_cache  # the first entry is still there and still valid


def test_changed_tensor_specs_miss(tiny, tmp_path):
    cfg, specs = tiny
    cache = PlanCache(tmp_path)
    _plan(cfg, specs, cache)
    bf16 = {n: (s, torch.bfloat16) for n, (s, _) in specs.items()}
    assert not _plan(cfg, bf16, cache).from_cache


def test_instance_fields_do_not_miss(tiny, tmp_path):
    cfg, specs = tiny
    cache = PlanCache(tmp_path)
    base = _plan(cfg, specs, cache)
    other_engine = dict(ARGS, port=31001, host="10.0.0.7", internal_states=[{"load": 3}], max_total_num_tokens=77)
    again = _plan(cfg, specs, cache, other_engine)
    assert again.from_cache and again.key == base.key


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda text: text[: len(text) // 2], id="truncated"),
        pytest.param(lambda text: text.replace('"copy"', '"fill"', 1), id="modified"),
        pytest.param(lambda text: "not json\n" + text, id="garbage"),
        pytest.param(lambda text: "", id="empty"),
    ],
)
def test_a_corrupt_entry_is_logged_and_rebuilt(tiny, tmp_path, caplog, damage):
    cfg, specs = tiny
    cache = PlanCache(tmp_path)
    first = _plan(cfg, specs, cache)
    (entry,) = _entries(cache)
    entry.write_text(damage(entry.read_text()))
    with caplog.at_level(logging.WARNING, logger="verl_p2p.replica.plan_cache"):
        rebuilt = _plan(cfg, specs, cache)
    assert not rebuilt.from_cache and rebuilt.plan == first.plan
    assert any("corrupt entry" in r.getMessage() and entry.name in r.getMessage() for r in caplog.records)
    assert _plan(cfg, specs, cache).from_cache  # rewritten whole


def test_an_unwritable_cache_costs_a_capture_not_the_build(tiny, tmp_path, caplog):
    cfg, specs = tiny
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache directory should be")
    cache = PlanCache(blocker / "plans")
    with caplog.at_level(logging.WARNING, logger="verl_p2p.replica.stream"):
        replica = RankReplica.build(cfg, ARGS, layout_from_server_args(ARGS, 0), specs, cache=cache)
    assert replica.plan.params and any("could not write" in r.getMessage() for r in caplog.records)


def test_plan_cache_dir_option(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert P2PConfig().plan_cache_dir is None
    assert PlanCache.from_option(None).directory == tmp_path / "verl_p2p" / "plans" == default_plan_cache_dir()
    assert PlanCache.from_option("") is None
    assert PlanCache.from_option(str(tmp_path / "x")).directory == tmp_path / "x"
    assert P2PConfig.from_mapping({"plan_cache_dir": ""}).plan_cache_dir == ""
    with pytest.raises(P2PConfigError, match="plan_cache_dir"):
        P2PConfig.from_mapping({"plan_cache_dir": 5})


def test_a_missing_cache_directory_is_created_private(tmp_path):
    cache = PlanCache(tmp_path / "shared" / "plans")
    st = cache.directory.stat()
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_a_cache_directory_others_can_write_is_refused_naming_the_option_and_fix(tmp_path, mode):
    """A planted entry there could list e.g. lm_head.weight as `local` (never written): the directory is refused."""
    shared = tmp_path / "plans"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(P2PConfigError) as info:
        PlanCache.from_option(str(shared))
    text = str(info.value)
    assert f"plan_cache_dir {shared} is group- or world-writable (mode {mode:o})" in text
    assert f"chmod 700 {shared}" in text and "plan_cache_dir" in text and "'' (no cache)" in text


def test_a_cache_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "plans").write_text("")
    with pytest.raises(P2PConfigError, match="is not a directory"):
        PlanCache(tmp_path / "plans")


def test_an_entry_others_can_write_is_not_trusted(tiny, tmp_path, caplog):
    cfg, specs = tiny
    cache = PlanCache(tmp_path)
    first = _plan(cfg, specs, cache)
    (entry,) = tmp_path.glob("plan-*.json")
    entry.chmod(0o666)
    with caplog.at_level(logging.WARNING, logger="verl_p2p.replica.plan_cache"):
        again = _plan(cfg, specs, cache)
    assert not again.from_cache and again.plan == first.plan
    assert any("world-writable" in r.getMessage() and entry.name in r.getMessage() for r in caplog.records)


_OTHER_PROCESS = textwrap.dedent(
    """
    import json, sys
    import torch
    from verl_p2p.planning.layout import layout_from_server_args
    from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs
    from verl_p2p.sandbox.tiny import hf_tensor_shapes, tiny_config_dict, tiny_state_dict
    from verl_p2p.replica import PlanCache, RankReplica
    from verl_p2p.replica.stream import plan_rank

    install_cpu_stubs()
    cache = PlanCache(sys.argv[1])
    args = {"tp_size": 2, "ep_size": 2, "dtype": "float32", "device": "cpu"}
    cfg = tiny_config_dict("qwen3_moe", vocab_size=250)
    specs = {n: (s, torch.float32) for n, s in hf_tensor_shapes(cfg)}
    layout = layout_from_server_args(args, 0)
    first = plan_rank(cfg, args, layout, specs, cache)
    out = {"from_cache": first.from_cache, "sglang_imported": "sglang" in sys.modules}
    replica = RankReplica.build(cfg, args, layout, specs, cache=cache)
    sd = tiny_state_dict(cfg)
    name = "model.layers.0.self_attn.q_norm.weight"
    dst = torch.empty(16 * 4, dtype=torch.uint8)
    replica.load(name, {name: sd[name]}, dst)
    out.update(loaded_equal=bool(torch.equal(dst.view(torch.float32), sd[name])), version=replica.key[0])
    print("RESULT " + json.dumps(out))
    """
)


def _other_process(version: str, cache_dir) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _OTHER_PROCESS, str(cache_dir)],
        env=version_env(version),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_sglang_release_change_misses_and_a_restart_reuses_without_sglang(tiny, tmp_path):
    """The cache is shared by both releases; a fresh process with a warm cache never imports SGLang to plan."""
    cfg, specs = tiny
    cache = PlanCache(tmp_path)
    here = _plan(cfg, specs, cache)  # this process: SGLang 0.5.12
    assert not here.from_cache
    other = _other_process("0.5.23", tmp_path)
    assert other["version"] == "0.5.23" and other["from_cache"] is False and other["loaded_equal"]
    assert len(_entries(cache)) == 2
    restarted = _other_process("0.5.12", tmp_path)
    assert restarted == {"from_cache": True, "sglang_imported": False, "loaded_equal": True, "version": "0.5.12"}


# ---- the host a plan was captured on, and where the config came from --------------------------------------


def _load_as_if(cfg, specs, cache):
    """What a warm-cache plan_rank would load right now (None: a miss), without capturing on a miss."""
    from verl_p2p.replica.plan_cache import PlanKey, config_digest
    from verl_p2p.replica.rank_context import installed_sglang_version, plan_fingerprint

    version = installed_sglang_version()
    fingerprint = plan_fingerprint(ARGS, cache.server_args_fields(version))
    return cache.load(PlanKey(version, config_digest(cfg, specs), layout_from_server_args(ARGS, 0), fingerprint))


@pytest.fixture(scope="module")
def warm(tiny, tmp_path_factory):
    cfg, specs = tiny
    cache = PlanCache(tmp_path_factory.mktemp("warm"))
    assert not _plan(cfg, specs, cache).from_cache
    return cache


def _fake_torch_version(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.99.0+other")


def _rocm_torch(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.3.0")


def _sglang_env(name, value):
    """A process started with `name=value` (the key takes the environment as the replica was imported)."""

    def change(monkeypatch):
        from verl_p2p.replica import plan_cache

        monkeypatch.setattr(plan_cache, "_SGLANG_ENV", {**plan_cache._SGLANG_ENV, name: value})

    change.__name__ = name
    return change


_sglang_cpu_engine = _sglang_env("SGLANG_USE_CPU_ENGINE", "1")  # SGLang pads the vocabulary differently
_aiter = _sglang_env("SGLANG_USE_AITER", "1")  # MoE weights shuffled after loading on ROCm


def _other_platform(monkeypatch):
    import platform

    monkeypatch.setattr(platform, "machine", lambda: "aarch64")


def _patched_sglang(monkeypatch):
    from verl_p2p.replica import plan_cache

    monkeypatch.setattr(plan_cache, "sglang_install_digest", lambda: "a-patched-build-of-the-same-version")


@pytest.mark.parametrize(
    "change", [_fake_torch_version, _rocm_torch, _sglang_cpu_engine, _aiter, _other_platform, _patched_sglang]
)
def test_a_plan_of_another_host_kind_misses(tiny, warm, monkeypatch, change):
    """A cache shared by nodes of different kinds (an NFS home) never serves one kind's plan to another."""
    cfg, specs = tiny
    assert _load_as_if(cfg, specs, warm) is not None  # the same host hits
    change(monkeypatch)
    assert _load_as_if(cfg, specs, warm) is None


def test_the_install_digest_tells_a_patched_build_from_the_stock_one(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from verl_p2p.replica import plan_cache

    package = tmp_path / "sglang"
    (package / "srt").mkdir(parents=True)
    (package / "__init__.py").write_text("__version__ = '0.5.12'\n")
    (package / "srt" / "loader.py").write_text("def load(w): return w\n")
    monkeypatch.setitem(sys.modules, "sglang", SimpleNamespace(__file__=str(package / "__init__.py")))
    plan_cache._tree_digest.cache_clear()
    stock = plan_cache.sglang_install_digest()
    assert plan_cache.sglang_install_digest() == stock
    (package / "srt" / "loader.py").write_text("def load(w): return w.t()\n")
    plan_cache._tree_digest.cache_clear()
    assert plan_cache.sglang_install_digest() != stock


def test_a_moved_checkpoint_keeps_its_plans(tiny, warm):
    """Where the config was read from (and by which transformers) changes no byte: the entry still hits."""
    cfg, specs = tiny
    moved = dict(cfg, _name_or_path="/elsewhere/Qwen3-MoE", transformers_version="9.9.9")
    assert _plan(moved, specs, warm).from_cache


def test_a_post_release_is_another_release(tiny):
    """`0.5.12.post1` on the rollout and `0.5.12` on the trainer load weights through different code."""
    from verl_p2p.errors import UnsupportedLayoutError
    from verl_p2p.replica.rank_context import preflight, release_id

    assert release_id("0.5.12.post1") != release_id("0.5.12") == release_id(" 0.5.12 ")
    assert release_id("0.5.12+cu128") != release_id("0.5.12")
    cfg, _ = tiny
    layout = layout_from_server_args(ARGS, 0)
    preflight(dict(ARGS, version="0.5.12"), layout, cfg, "0.5.12")
    with pytest.raises(UnsupportedLayoutError, match=r"0\.5\.12\.post1.*sglang==0\.5\.12\.post1"):
        preflight(dict(ARGS, version="0.5.12.post1"), layout, cfg, "0.5.12")


_WRITER = textwrap.dedent(
    """
    import json, sys
    from verl_p2p.planning.layout import RankLayout
    from verl_p2p.replica.plan_cache import PlanCache, PlanKey, read_entry

    key, plan = read_entry(sys.argv[1])
    cache = PlanCache(sys.argv[2])
    plan_key = PlanKey(
        key["sglang_version"], key["config_digest"], RankLayout(**key["layout"]), key["server_args_fingerprint"],
        host=json.dumps(key["host"], sort_keys=True),
    )
    assert cache.path(plan_key).name == sys.argv[3], (cache.path(plan_key).name, sys.argv[3])
    print("READY", flush=True)
    for _ in range(int(sys.argv[4])):
        cache.save(plan_key, plan)
    """
)


def test_concurrent_writers_of_one_entry_never_expose_a_torn_one(tiny, warm, tmp_path, caplog):
    """Two processes rewrite the same entry over and over while this one reads it: every read is the whole plan."""
    cfg, specs = tiny
    (entry,) = _entries(warm)
    expected = _load_as_if(cfg, specs, warm)
    args = [str(entry), str(warm.directory), entry.name, "150"]
    writers = [
        subprocess.Popen([sys.executable, "-c", _WRITER, *args], cwd=REPO, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        for w in writers:
            assert w.stdout.readline().strip() == "READY"
        reads = 0
        with caplog.at_level(logging.WARNING, logger="verl_p2p.replica.plan_cache"):
            while any(w.poll() is None for w in writers) or reads == 0:
                assert _load_as_if(cfg, specs, warm) == expected
                reads += 1
    finally:
        codes = [w.wait(timeout=600) for w in writers]
    assert codes == [0, 0] and reads > 0
    assert not [r for r in caplog.records if "corrupt" in r.getMessage()]
    assert not list(warm.directory.glob(".*.partial"))  # no temporary file left behind


def test_the_capture_code_digest_covers_the_key_builder():
    """stream.py builds the key (and plan_rank's checks): a change to it must miss like one to the recorder."""
    from verl_p2p.replica import plan_cache

    assert {"plan.py", "plan_cache.py", "rank_context.py", "stream.py"} <= set(plan_cache._CAPTURE_CODE)
