"""A push whose target dies (SIGKILL) or freezes (SIGSTOP) in the middle of a write: it fails within
p2p_transfer_timeout + a small margin, names the target, and every other target still gets all its bytes.

Two engines of one layout (TP2/EP2) x two ranks, one source: ranks of equal layout share one load. The
model has a large vocabulary so one write call to a rank moves 64 MiB and the signal lands inside it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import signal
import threading
import time

import pytest
import torch

from verl_p2p.errors import TransferError, WriteInFlightError
from verl_p2p.planning.targets import TargetRank
from verl_p2p.trainer.push import PushTarget, push
from verl_p2p.transfer.base import TransportProxy
from verl_p2p.transfer.buffers import TransferBuffers
from verl_p2p.transfer.mooncake import MooncakeTransport
from verl_p2p.transfer.receiver import spec_from_plan, start_receivers, stop_all
from verl_p2p.transfer.writer import InFlightCalls, Writer

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
pytestmark = pytest.mark.slow

SERVER_ARGS = {"tp_size": 2, "ep_size": 2, "dtype": "float32"}
CONFIG = dict(vocab_size=262144, hidden_size=128, head_dim=32)  # embed/lm_head: 64 MiB per rank
SLOT_BYTES = 64 << 20
TIMEOUT_S = 3.0
MARGIN_S = 3.0
VICTIM = TargetRank(1, 0)
BIG = 32 << 20


class SignalMidWrite(TransportProxy):
    """The real Mooncake transport, plus one hook: when a large write call to `session_id` starts (not its
    first call, so the connection is already up), `action` runs 5 ms later, while the call is in flight.
    Records when the call started, when the action ran and when the call returned."""

    def __init__(self, inner: MooncakeTransport, session_id: str, action) -> None:
        self.inner, self.victim, self.action = inner, session_id, action
        self.calls = 0
        self.started = self.acted = self.returned = None
        self.failed = None

    def _act(self) -> None:
        self.action()
        self.acted = time.monotonic()

    def write(self, session_id, local_addrs, remote_addrs, lengths) -> None:
        hook = session_id == self.victim and self.started is None and self.calls > 0 and sum(lengths) >= BIG
        if session_id == self.victim:
            self.calls += 1
        if not hook:
            return self.inner.write(session_id, local_addrs, remote_addrs, lengths)
        self.started = time.monotonic()
        timer = threading.Timer(0.005, self._act)
        timer.start()
        try:
            self.inner.write(session_id, local_addrs, remote_addrs, lengths)
            self.failed = False
        except TransferError:
            self.failed = True
            raise
        finally:
            self.returned = time.monotonic()


@pytest.fixture(scope="module")
def model():
    from verl_p2p.planning.layout import layout_from_server_args
    from verl_p2p.replica.stream import RankReplica
    from verl_p2p.sandbox.cpu_stubs import install_cpu_stubs
    from verl_p2p.sandbox.tiny import hf_tensor_shapes, tiny_config_dict, tiny_state_dict

    install_cpu_stubs()
    cfg = tiny_config_dict("qwen3_moe", **CONFIG)
    specs = {n: (s, torch.float32) for n, s in hf_tensor_shapes(cfg)}
    replicas = [RankReplica.build(cfg, SERVER_ARGS, layout_from_server_args(SERVER_ARGS, r), specs) for r in (0, 1)]
    hf = tiny_state_dict(cfg, id_encoded=False)
    digests = {}
    for r, rep in enumerate(replicas):
        digests[r] = {}
        for name, p in rep.plan.params.items():
            dst = torch.empty(p.nbytes, dtype=torch.uint8)
            rep.load(name, {n: hf[n] for n in p.feeds}, dst)
            digests[r][name] = hashlib.blake2b(dst.numpy(), digest_size=16).hexdigest()
    return replicas, hf, digests


@pytest.fixture(scope="module")
def receivers(model):
    replicas, _, _ = model
    specs = {f"{e}.{r}": spec_from_plan(replicas[r].plan.params) for e in (0, 1) for r in (0, 1)}
    specs["spare"] = specs[f"{VICTIM.engine}.{VICTIM.rank}"]  # replaces the victim once it is killed
    handles = start_receivers(specs)
    out = {TargetRank(e, r): handles[f"{e}.{r}"] for e in (0, 1) for r in (0, 1)}
    out["spare"] = handles["spare"]
    yield out
    stop_all(handles.values())


@pytest.fixture(scope="module")
def transport():
    return MooncakeTransport("127.0.0.1", protocol="tcp", timeout_s=TIMEOUT_S)


def run_push(transport, model, receivers, inflight=None):
    """One push to every live receiver; `inflight`: the calls in flight shared with earlier pushes' Writers (as one
    trainer rank's SourceSession shares them), or a private set."""
    replicas, hf, _ = model
    live = {t: h for t, h in receivers.items() if t != "spare"}
    targets = [PushTarget(t, replicas[t.rank], h.remote_info()) for t, h in sorted(live.items())]
    buffers = TransferBuffers(SLOT_BYTES, transport)
    writer = Writer(
        transport, {t.target: t.remote for t in targets}, timeout_s=TIMEOUT_S, num_workers=4, inflight=inflight
    )
    start = time.monotonic()
    try:
        return push(iter(hf.items()), targets, buffers, writer), None, start, time.monotonic()
    except TransferError as exc:
        return None, exc, start, time.monotonic()
    finally:
        writer.close()
        buffers.release(settle_timeout_s=0.0)


def check_targets(model, receivers, which):
    _, _, digests = model
    for t in which:
        assert receivers[t].digest() == digests[t.rank], f"{t}: bytes differ from the replica's"


def replace_victim(receivers):
    receivers[VICTIM].kill()
    receivers[VICTIM] = receivers.pop("spare")


def test_healthy_push_shares_loads_between_equal_layouts(model, receivers, transport):
    metrics, error, _, _ = run_push(transport, model, receivers)
    assert error is None
    assert metrics.total_bytes == 2 * metrics.loaded_bytes  # each rank's bytes loaded once, written to 2 engines
    assert metrics.num_batches >= 4
    check_targets(model, receivers, [t for t in receivers if t != "spare"])


def _fails_mid_write(model, receivers, transport, action_name, inflight=None):
    victim = receivers[VICTIM]
    sig = signal.SIGKILL if action_name == "kill" else signal.SIGSTOP

    def action():
        os.kill(victim.pid, sig)  # only the signal: `acted` is taken right after it

    others = [t for t in receivers if t not in (VICTIM, "spare")]
    for t in others:
        receivers[t].fill()
    hooked = SignalMidWrite(transport, victim.session_id, action)
    metrics, error, start, end = run_push(hooked, model, receivers, inflight)
    hooked.returned_by_end = hooked.returned is not None and hooked.returned <= end
    assert metrics is None and error is not None
    assert hooked.started is not None and hooked.started < hooked.acted, "the signal did not land in a write"
    msg = str(error)
    assert f"engine 1 rank 0 (session {victim.session_id})" in msg
    assert "engine 0 rank 0" not in msg and "engine 0 rank 1" not in msg and "engine 1 rank 1" not in msg
    check_targets(model, receivers, others)
    return hooked, msg, end


def test_killed_target_fails_push_others_complete(model, receivers, transport):
    hooked, msg, end = _fails_mid_write(model, receivers, transport, "kill")
    assert hooked.acted < hooked.returned and hooked.failed is True  # the in-flight call failed: killed mid-write
    assert "timed out" not in msg  # a dead peer fails on the transport's error, not by waiting out the deadline
    # the transport's message gives the call's duration beside its timeout: a reader can tell a dead peer (a
    # quick failure) from a call that outlived the timeout (a frozen peer, or this writer stopped past it)
    assert re.search(r"returned after \d+\.\d s \(transfer timeout \d+ s\)", msg), msg
    replace_victim(receivers)


def test_frozen_target_times_out_others_complete(model, receivers, transport, caplog):
    """Then, as the same trainer rank's next pushes (their Writers share its calls in flight): the first push's call
    is still blocked when the push fails (Mooncake's own timeout, MC_TRANSFER_TIMEOUT, fires a little after ours);
    the next push waits for it instead of refusing the target at once, and writes the still-frozen target again
    (timed out again, the others complete); thawed while a later push runs, that push writes it whole."""
    inflight = InFlightCalls()
    hooked, msg, end = _fails_mid_write(model, receivers, transport, "freeze", inflight)
    assert f"timed out after {TIMEOUT_S:g} s" in msg
    assert not hooked.returned_by_end  # the push failed while the Mooncake call was still blocked
    assert end - hooked.started >= TIMEOUT_S  # failed on our deadline, not on an early transport error
    others = [t for t in receivers if t not in (VICTIM, "spare")]

    for t in others:
        receivers[t].fill()
    with caplog.at_level(logging.WARNING, logger="verl_p2p.transfer.writer"):
        _, again, start, end = run_push(transport, model, receivers, inflight)  # still frozen
    assert not isinstance(again, WriteInFlightError), f"refused at once for the blocked call: {again}"
    assert "write calls to return before this push: all returned" in caplog.text, caplog.text  # it waited
    assert f"engine {VICTIM.engine} rank {VICTIM.rank}" in str(again) and "timed out" in str(again), again
    check_targets(model, receivers, others)

    for t in others:
        receivers[t].fill()
    thaw = threading.Timer(TIMEOUT_S / 3, receivers[VICTIM].thaw)
    thaw.start()
    metrics, error, start, end = run_push(transport, model, receivers, inflight)
    thaw.join()
    assert error is None, f"thawed during the push, yet: {error}"
    check_targets(model, receivers, [t for t in receivers if t != "spare"])
