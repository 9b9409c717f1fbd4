"""The device scripts write only into directories of their own (finding R19).

What lives for one device call is a fresh `mktemp -d`; what must keep its path across calls on a warm machine (the
carried stack parts, the unpacked stack, a kept model, a JSON that grows) keeps its fixed name under /tmp and is
checked by scripts/private_dir.sh before anything is copied there or run from there: made with mode 0700, refused
when it is a symbolic link, another user's, or writable by group or others.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def private_dir(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", f'source {SCRIPTS / "private_dir.sh"} && private_dir "$1" THE_VAR', "-", str(path)],
        capture_output=True,
        text=True,
    )


def test_a_missing_directory_is_made_private(tmp_path):
    done = private_dir(tmp_path / "a" / "stack")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "a" / "stack").stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("how", ["group-writable", "world-writable", "symlink", "another user's"])
def test_a_directory_others_can_write_or_own_is_refused_naming_the_variable(tmp_path, how):
    target = tmp_path / "stack"
    if how == "symlink":
        (tmp_path / "elsewhere").mkdir()
        target.symlink_to(tmp_path / "elsewhere")
    else:
        target.mkdir(mode=0o700)
        if how == "another user's":
            if os.geteuid() != 0:
                pytest.skip("making a directory another user's needs root")
            os.chown(target, 65534, 65534)
        else:
            target.chmod(0o770 if how == "group-writable" else 0o777)
    done = private_dir(target)
    assert done.returncode == 3
    assert str(target) in done.stderr and ("set THE_VAR" in done.stderr or "chmod 700" in done.stderr), done.stderr


def test_gpu_e2e_refuses_a_stack_folder_others_can_write_before_unpacking_or_running_it(tmp_path):
    stack = tmp_path / "stack"
    stack.mkdir()
    stack.chmod(0o777)
    (stack / "part.aa").write_bytes(b"planted")
    env = {**os.environ, "STACK": str(stack), "SITE_ROOT": str(tmp_path / "root"), "OUT": str(tmp_path / "out")}
    done = subprocess.run(["bash", str(SCRIPTS / "gpu_e2e.sh")], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 3
    assert f"{stack} is writable by group or others (mode 777)" in done.stderr, done.stderr
    assert not (tmp_path / "root" / "site").exists()  # nothing unpacked, nothing run


def test_gpu_grpo_run_refuses_a_kept_model_folder_another_user_owns(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("making a directory another user's needs root")
    tiny = tmp_path / "tiny"
    tiny.mkdir(mode=0o755)
    os.chown(tiny, 65534, 65534)
    env = {
        **os.environ,
        "TINY_DIR": str(tiny),
        "STACK": str(tmp_path / "stack"),
        "SITE_ROOT": str(tmp_path / "root"),
        "OUT": str(tmp_path / "out"),
        "KEEP_TINY": "1",
    }
    script = str(SCRIPTS / "gpu_grpo_run.sh")
    done = subprocess.run(["bash", script], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2
    assert f"{tiny} belongs to uid 65534" in done.stderr and "set TINY_DIR" in done.stderr, done.stderr


def test_no_script_writes_to_a_fixed_tmp_path_unchecked():
    """Every fixed /tmp default left in a gpu_*.sh script is a cross-call directory checked by private_dir."""
    checked = {
        "gpu_e2e.sh": {"STACK", "SITE_ROOT", "SITE"},  # SITE: SITE21's, checked by gpu_stack_install.sh
        "gpu_grpo_run.sh": {"STACK", "SITE_ROOT", "TINY_DIR"},
        "gpu_real_sizes.sh": {"SITE21", "STATE_DIR"},
        "gpu_stack_install.sh": {"STACK21", "SITE21"},
    }
    import re

    for name, allowed in checked.items():
        text = (SCRIPTS / name).read_text()
        fixed = set(re.findall(r"(\w+)=\$\{\w+:-/tmp\b", text))
        assert fixed <= allowed, (name, fixed - allowed)
        assert "/tmp/e2e" not in text and "/tmp/out" not in text, name
