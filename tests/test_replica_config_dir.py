"""The rollout config a rank context hands SGLang lives in this user's private directory: a directory planted
in the shared temporary directory by someone else (or its config) is never used."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import stat
import tempfile
from pathlib import Path

import pytest

from verl_p2p.replica.rank_context import checkpoint_config_dir

rank_context = importlib.import_module("verl_p2p.replica.rank_context")

CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64}
PLANTED = dict(CONFIG, auto_map={"AutoConfig": "evil.Config"}, hidden_size=65)


@pytest.fixture
def shared_tmp(monkeypatch, tmp_path):
    """A fresh shared temporary directory for this test (and no private directory chosen yet)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    rank_context._private_config_base.cache_clear()
    yield tmp_path
    rank_context._private_config_base.cache_clear()


def _read(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def _digest(cfg: dict) -> str:
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]


def test_a_config_planted_under_the_old_shared_name_is_not_used(shared_tmp):
    planted = shared_tmp / f"verl_p2p_cfg_{_digest(CONFIG)}"
    planted.mkdir()
    (planted / "config.json").write_text(json.dumps(PLANTED))
    path = checkpoint_config_dir(CONFIG)
    assert _read(path) == CONFIG
    assert not os.path.samefile(path, planted)
    base = os.stat(os.path.dirname(path))
    assert base.st_uid == os.getuid() and stat.S_IMODE(base.st_mode) == 0o700


@pytest.mark.parametrize("kind", ["loose-mode", "symlink"])
def test_a_planted_private_directory_is_refused(shared_tmp, kind, caplog):
    """Someone else's (here: world-writable, or a symlink to elsewhere) `verl_p2p_cfg-<uid>` is not trusted."""
    name = shared_tmp / f"verl_p2p_cfg-{os.getuid()}"
    elsewhere = shared_tmp / "elsewhere"
    target = (elsewhere if kind == "symlink" else name) / _digest(CONFIG)
    target.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps(PLANTED))
    if kind == "symlink":
        name.symlink_to(elsewhere, target_is_directory=True)
    else:
        name.chmod(0o777)
    path = checkpoint_config_dir(CONFIG)
    assert _read(path) == CONFIG
    # by path components: the fallback `mkdtemp` name shares the text prefix `verl_p2p_cfg-<uid>` one time in 37
    # (its random suffix starting with the uid's digit), which a string prefix test took for the planted directory
    assert not Path(os.path.realpath(path)).is_relative_to(os.path.realpath(target.parent))
    assert any("not a private directory" in r.getMessage() for r in caplog.records)


def test_a_modified_config_in_the_private_directory_is_rewritten(shared_tmp):
    path = checkpoint_config_dir(CONFIG)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(PLANTED, f)
    assert checkpoint_config_dir(CONFIG) == path and _read(path) == CONFIG
