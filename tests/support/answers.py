"""Rank-info and server-info answers of a rollout engine, valid and malformed (a deterministic fuzz), and the whole
path one engine's answers take to the trainer's writes, with every write the transport is asked for recorded.

The path is the production one: the aiohttp client and P2PReplicaAdapter read `/server_info` and each rank's
`/remote_instance_transfer_engine_info` over HTTP, `check_live_server_args`, the driver's TopologyCache
(layouts, plan), the trainer's RankReplica (SGLang's model classes), `check_push` + `push`. Stand-ins: the HTTP
server (tests/support/fake_sglang.py, serving the answer under test) and the transport (`RecordingTransport`:
it records write calls and moves no byte, which is what "nothing was written" is checked against).
"""

from __future__ import annotations

import asyncio
import copy
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from support.fake_sglang import FakeSGLang
from verl_p2p.planning.targets import ANSWER_KEY
from verl_p2p.rollout.launch import MEMORY_SAVER, SEED_FLAG

SEED = 20251201
TP = 2
SERVER_ARGS = {"tp_size": TP, "ep_size": 1, "dp_size": 1, "pp_size": 1, "dtype": "float32", SEED_FLAG: True}
SERVER_ARGS[MEMORY_SAVER] = False
VERSION = "0.5.12"  # the trainer's SGLang release: the replica reproduces its own release only
BASE = 0x7F0000000000


class RecordingTransport:
    """Stand-in transport: accepts registrations, records every write call, moves no byte."""

    session_id = "127.0.0.1:1"

    def __init__(self) -> None:
        self.writes: list[tuple[str, list[int], list[int]]] = []

    def register(self, addr: int, nbytes: int) -> None:
        pass

    def unregister(self, addr: int) -> None:
        pass

    def write(self, session_id, local_addrs, remote_addrs, lengths) -> None:
        self.writes.append((session_id, list(remote_addrs), list(lengths)))


def valid_rank_info(plan_params: Mapping[str, Any], rank: int) -> list[Any]:
    """`[session_id, {name: [address, numel, element_size]}]` as a real rank publishes it for this plan."""
    weights, offset = {}, 0
    for name, p in plan_params.items():
        weights[name] = [BASE + (rank << 32) + offset, int(p.nbytes) // p.dtype.itemsize, p.dtype.itemsize]
        offset += -(-int(p.nbytes) // 256) * 256
    return [f"127.0.0.1:{17000 + rank}", weights]


@dataclass(frozen=True)
class Case:
    """One malformed answer: `apply(fake)` makes the stand-in server serve it; `needle` must be in the error."""

    id: str
    apply: Callable[[FakeSGLang], None]
    needle: str


def serve_valid(fake: FakeSGLang, infos: Mapping[int, list[Any]]) -> None:
    fake.rank_info = copy.deepcopy(dict(infos))
    fake._encoded.clear()


async def _connect_and_push(url: str, replica_for, hf: Mapping[str, Any], transport: RecordingTransport) -> Any:
    from verl_p2p.backend.topology import EngineMeta, SourceMeta, TopologyCache
    from verl_p2p.config import P2PConfig
    from verl_p2p.rollout.adapter import P2PReplicaAdapter
    from verl_p2p.rollout.launch import check_live_server_args
    from verl_p2p.trainer.push import PushTarget, push
    from verl_p2p.transfer.buffers import TransferBuffers
    from verl_p2p.transfer.writer import Writer

    adapter = P2PReplicaAdapter(0, url, config=P2PConfig(http_timeout=5.0))
    try:
        info = await adapter.server_info(refresh=True)
        check_live_server_args(info, engine=0, url=adapter.url)
        answers = await adapter.rank_answers()
    finally:
        adapter.close()
    cache = TopologyCache()
    cache.update_engine(EngineMeta(0, "digest", info, {r: a.info for r, a in answers.items()}))
    _, assignments = cache.plan([SourceMeta(0, 0)], [0])
    mine = assignments[0]
    targets = [
        PushTarget(t, replica_for(mine.server_infos[t.engine], mine.layouts[t]), mine.rank_infos[t])
        for t in mine.targets
    ]
    buffers = TransferBuffers(1 << 20, transport)
    writer = Writer(transport, dict(mine.rank_infos), timeout_s=5.0)
    try:
        return push(iter(hf.items()), targets, buffers, writer)
    finally:
        writer.close()
        buffers.release()


def connect_and_push(url: str, replica_for, hf: Mapping[str, Any], transport: RecordingTransport) -> Any:
    return asyncio.run(_connect_and_push(url, replica_for, hf, transport))


# ---- the fuzz ----------------------------------------------------------------------------------------------------


def _set_rank(rank: int, edit: Callable[[list[Any]], None]) -> Callable[[FakeSGLang], None]:
    def apply(fake: FakeSGLang) -> None:
        edit(fake.rank_info[rank])
        fake._encoded.clear()

    return apply


def _answer(body: Any) -> Callable[[FakeSGLang], None]:
    def apply(fake: FakeSGLang) -> None:
        fake.fail("remote_instance_transfer_engine_info", 200, body)

    return apply


def _server(**fields: Any) -> Callable[[FakeSGLang], None]:
    def apply(fake: FakeSGLang) -> None:
        for key, value in fields.items():
            if key == "version":  # the stand-in answers its own version field
                fake.version = value
            elif value is _DROP:
                fake.server_args.pop(key, None)
            else:
                fake.server_args[key] = value

    return apply


_DROP = object()


def _nth(info: list[Any], k: int) -> str:
    """The k-th parameter name (sorted) of a rank's weights info, wrapping around."""
    names = sorted(info[1])
    return names[k % len(names)]


def rank_info_cases() -> list[Case]:
    """Malformed rank-info answers. Every random draw happens here (parameters are drawn by index into the
    rank's sorted names), so a case is the same whether it runs alone or with the others."""
    rng = random.Random(SEED)
    cases: list[Case] = []

    def pick() -> int:
        return rng.randrange(1 << 16)

    def entry(index: int, value: Any, needle: str, rank: int = 0) -> None:
        k = pick()

        def edit(info: list[Any]) -> None:
            info[1][_nth(info, k)][index] = value

        field = ["address", "numel", "element_size"][index]
        cases.append(Case(f"r{rank} {field}={value!r}"[:60], _set_rank(rank, edit), needle))

    # whole answers (every rank answers the same body)
    for body, needle in [
        ([], "not a JSON object"),
        ("garbage", "not a JSON object"),
        (42, "not a JSON object"),
        (None, "not a JSON object"),
        ({"rank": 0}, f"has no '{ANSWER_KEY}'"),
        ({"rank": 0, "info": ["127.0.0.1:1", {}]}, f"has no '{ANSWER_KEY}'"),
        ({ANSWER_KEY: {"session": "127.0.0.1:1"}}, "not a list"),
        ({ANSWER_KEY: "127.0.0.1:17000"}, "not a list"),
        ({ANSWER_KEY: ["127.0.0.1:17000"]}, "not a list"),
        ({ANSWER_KEY: []}, "not a list"),
        ({"rank": "zero", ANSWER_KEY: ["127.0.0.1:17000", {"w": [BASE, 1, 4]}]}, "is not an integer"),
    ]:
        cases.append(Case(f"answer={str(body)[:40]}", _answer(body), needle))
    # session ids
    for session, needle in [
        (None, "not a 'host:port' string"),
        (17000, "not a 'host:port' string"),
        ("", "not a 'host:port' string"),
        ("127.0.0.1", "not 'host:port'"),
        ("127.0.0.1:", "not 'host:port'"),
        ("127.0.0.1:0", "not 'host:port'"),
        ("127.0.0.1:99999", "not 'host:port'"),
        (":17000", "not 'host:port'"),
        ("127.0.0.1:port", "not 'host:port'"),
        (" 127.0.0.1:17000", "not 'host:port'"),
        (["127.0.0.1", 17000], "not a 'host:port' string"),
    ]:

        def set_session(info: list[Any], session=session) -> None:
            info[0] = session

        cases.append(Case(f"session={session!r}", _set_rank(rng.randrange(TP), set_session), needle))
    # the weights object
    for weights, needle in [
        ([], "not an object"),
        ("w", "not an object"),
        (None, "not an object"),
        ({}, "no parameters"),
    ]:

        def set_weights(info: list[Any], weights=weights) -> None:
            info[1] = weights

        cases.append(Case(f"weights={weights!r}", _set_rank(0, set_weights), needle))
    # one parameter's entry
    for value, needle in [
        (7, "not [address"),
        ("BASE", "not [address"),
        ({"a": BASE}, "not [address"),
        ([BASE, 8], "not [address"),
    ]:
        k = pick()

        def set_entry(info: list[Any], k=k, value=value) -> None:
            info[1][_nth(info, k)] = value

        cases.append(Case(f"entry={str(value)[:30]}", _set_rank(0, set_entry), needle))
    # addresses, sizes, element sizes
    entry(0, -rng.randrange(1, 1 << 40), "not a positive address")
    entry(0, 0, "not a positive address")
    entry(0, hex(BASE), "is not an integer")
    entry(0, float(BASE), "is not an integer")
    entry(0, True, "is not an integer")
    entry(0, None, "is not an integer")
    entry(0, (1 << 64) - 8, "64-bit address space")
    entry(1, -rng.randrange(1, 1000), "negative")
    entry(1, "8", "is not an integer")
    entry(1, 8.0, "is not an integer")
    entry(1, 1 << 62, "64-bit address space")
    entry(1, 0, "publishes numel 0")
    entry(1, None, "is not an integer")
    entry(2, 0, "element_size 0 is not one of")
    entry(2, 3, "element_size 3 is not one of")
    entry(2, 16, "element_size 16 is not one of")
    entry(2, -4, "element_size -4 is not one of")
    entry(2, "4", "is not an integer")
    entry(2, 2, "x 2 B")  # a plausible size that disagrees with the plan's float32

    # sizes that disagree with the plan
    extra = rng.randrange(1, 64)

    def grow(info: list[Any]) -> None:  # the last parameter in memory: a larger one overlaps nothing
        info[1][max(info[1], key=lambda n: info[1][n][0])][1] += extra

    cases.append(Case("numel+k", _set_rank(1, grow), "trainer writes numel"))
    halved = pick()

    def halve(info: list[Any]) -> None:
        entry = info[1][_nth(info, halved)]
        entry[1] //= 2
        entry[2] *= 2  # same bytes, other element size

    cases.append(Case("numel/2 x elsize*2", _set_rank(0, halve), "trainer writes numel"))

    # names
    dropped, renamed, emptied = pick(), pick(), pick()

    def drop(info: list[Any]) -> None:
        del info[1][_nth(info, dropped)]

    cases.append(Case("missing param", _set_rank(1, drop), "is not published by the rollout"))
    # the fix names the one cause a user cannot see in the config: SGLang's silent Transformers-backend fallback
    cases.append(Case("missing param, fix names the fallback", _set_rank(0, drop), "generic Transformers backend"))

    def rename(info: list[Any]) -> None:
        name = _nth(info, renamed)
        info[1][name.replace("model.", "model.model.", 1)] = info[1].pop(name)

    cases.append(Case("renamed param", _set_rank(0, rename), "is not published by the rollout"))

    def empty_name(info: list[Any]) -> None:
        info[1][""] = info[1].pop(_nth(info, emptied))

    cases.append(Case("empty param name", _set_rank(0, empty_name), "is not a name"))

    # overlapping ranges: inside one rank, and across two ranks publishing one session
    inner, outer, fraction = pick(), pick(), rng.random()

    def overlap(info: list[Any]) -> None:
        a = _nth(info, inner)
        b = _nth(info, outer if _nth(info, outer) != a else outer + 1)
        address, numel, size = info[1][a]
        info[1][b][0] = address + size * int(fraction * numel)

    cases.append(Case("overlap in rank", _set_rank(0, overlap), "overlap"))
    first, second = pick(), pick()

    def same_address(info: list[Any]) -> None:
        a = _nth(info, first)
        b = _nth(info, second if _nth(info, second) != a else second + 1)
        info[1][b][0] = info[1][a][0]

    cases.append(Case("two params one address", _set_rank(1, same_address), "overlap"))

    def shared_session(fake: FakeSGLang) -> None:
        fake.rank_info[1][0] = fake.rank_info[0][0]
        for name, value in fake.rank_info[1][1].items():
            value[0] = fake.rank_info[0][1][name][0] + 256
        fake._encoded.clear()

    cases.append(Case("two ranks one session, overlapping", shared_session, "published ranges overlap"))

    def not_json(fake: FakeSGLang) -> None:
        fake.fail("remote_instance_transfer_engine_info", 200, b"<html>proxy error</html>")

    cases.append(Case("not JSON", not_json, "malformed transfer-engine info"))
    return [Case(f"rank-info {i:02d}: {c.id}", c.apply, c.needle) for i, c in enumerate(cases)]


def server_info_cases() -> list[Case]:
    """Malformed or impossible server-info answers (inconsistent tp/ep/dp, wrong types, missing flags)."""
    rng = random.Random(SEED + 1)

    def body(value: Any) -> Callable[[FakeSGLang], None]:
        def apply(fake: FakeSGLang) -> None:
            fake.fail("server_info", 200, value)

        return apply

    cases = [
        Case("server_info=[]", body([]), "not a JSON object"),
        Case("server_info='ok'", body("ok"), "not a JSON object"),
        Case("server_info=null", body(None), "not a JSON object"),
        Case("tp_size='two'", _server(tp_size="two"), "tp_size='two' is not an integer"),
        Case("tp_size=2.0", _server(tp_size=2.0), "tp_size=2.0 is not an integer"),
        Case("tp_size=true", _server(tp_size=True), "tp_size=True is not an integer"),
        Case("tp_size=0", _server(tp_size=0), "tp_size=0 is outside"),
        Case("tp_size<0", _server(tp_size=-rng.randrange(1, 64)), "is outside"),
        Case("tp_size huge", _server(tp_size=rng.randrange(10**6, 10**9)), "is outside"),
        Case("ep_size=3", _server(ep_size=3), "not divisible by ep_size=3"),
        Case("ep_size=0", _server(ep_size=0), "ep_size=0 is outside"),
        Case("ep_size='1'", _server(ep_size="1"), "ep_size='1' is not an integer"),
        Case("dp_size=2 no dp-attn", _server(dp_size=2), "without DP attention runs 2 copies"),
        Case("dp_size=2 attn_dp_size=2", _server(dp_size=2, attn_dp_size=2, enable_dp_attention=True), "2 copies"),
        Case("attn_dp_size=3", _server(attn_dp_size=3), "not divisible by attn_dp_size=3"),
        Case("dp attn, dp_size=3", _server(dp_size=3, enable_dp_attention=True), "not divisible by dp_size=3"),
        Case("enable_dp_attention=1", _server(dp_size=2, enable_dp_attention=1), "is not true/false"),
        Case("enable_eplb='true'", _server(enable_eplb="true"), "is not true/false"),
        Case("pp_size=2", _server(pp_size=2), "pp_size > 1"),
        Case("moe_dp_size=2", _server(moe_dp_size=2), "moe_dp_size > 1"),
        Case("redundant experts=-1", _server(ep_num_redundant_experts=-1), "is outside 0.."),
        Case("seed flag missing", _server(**{SEED_FLAG: _DROP}), "needs SGLang >= 0.5.12"),
        Case("seed flag off", _server(**{SEED_FLAG: False}), "does not publish its weight memory"),
        Case("seed off, saver on", _server(**{SEED_FLAG: False, MEMORY_SAVER: True}), "memory saver"),
        Case("version=0.5", _server(version=0.5), "version=0.5 is not a release string"),
        Case("quantization=fp8", _server(quantization="fp8"), "quantization='fp8'"),
        Case("dtype=bfloat16", _server(dtype="bfloat16"), "x 2 B"),  # the plan's sizes disagree with the rank info
    ]
    return [Case(f"server-info {i:02d}: {c.id}", c.apply, c.needle) for i, c in enumerate(cases)]
