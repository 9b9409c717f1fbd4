"""The command line as a user meets it, each check a `verl-p2p` subprocess: the help and version (every option
explained with its default, nothing heavy imported to print it, quiet into a closed pipe), usage errors
(exit 2, the bad thing named), `plan`'s refusals before anything heavy runs, its quiet output, what a cold
capture says, and alike source rows folded."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verl_p2p.cli import COMMANDS
from verl_p2p.planning.model_cards import MODEL_CARDS
from verl_p2p.sandbox.tiny import tiny_config_dict

ROOT = str(Path(__file__).resolve().parents[1])


def verl_p2p(*args: str, python: tuple[str, ...] = (), timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "MC_LOG_LEVEL": "ERROR"}
    command = [sys.executable, *python, "-m", "verl_p2p.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def imported(importtime_stderr: str) -> set[str]:
    """Top-level modules a `python -X importtime` run imported."""
    return {m.group(1).split(".")[0] for m in re.finditer(r"^import time:.*\|\s+(\S+)$", importtime_stderr, re.M)}


def noise(text: str) -> list[str]:
    return [line for line in text.splitlines() if "Traceback" in line or "Warning" in line]


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(tiny_config_dict("qwen3_moe")))  # 4 heads / 2 KV heads, 8 experts of width 32
    return path


def test_help_lists_every_command_and_points_to_its_own_help():
    done = verl_p2p("--help")
    assert done.returncode == 0, done.stderr
    for command in COMMANDS:
        line = re.search(rf"^  {re.escape(command.name)}\s+(\S.*)$", done.stdout, re.M)
        assert line, f"{command.name} missing from:\n{done.stdout}"
    assert "verl-p2p <command> --help" in done.stdout
    bare = verl_p2p()
    assert bare.returncode == 2 and "commands:" in bare.stderr


def test_version_prints_the_package_version():
    from verl_p2p import __version__

    done = verl_p2p("--version")
    assert (done.returncode, done.stdout.strip()) == (0, f"verl-p2p {__version__}")


def test_an_unknown_command_is_named_and_exits_2():
    done = verl_p2p("deploy")
    assert done.returncode == 2
    assert "unknown command 'deploy'" in done.stderr and "plan" in done.stderr


@pytest.mark.parametrize("command", [c.name for c in COMMANDS])
def test_every_command_answers_help_and_exits_2_on_a_usage_error(command):
    assert verl_p2p(command, "--help").returncode == 0
    done = verl_p2p(command, "--no-such-option")
    named = "--no-such-option" in done.stderr or "arguments are required" in done.stderr  # argparse's first error
    assert done.returncode == 2 and "error:" in done.stderr and named, done.stderr[-500:]


def test_plan_without_arguments_prints_what_to_pass():
    done = verl_p2p("plan")
    assert done.returncode == 2
    assert "give --model" in done.stderr and "--trainer" in done.stderr and "usage: verl-p2p plan" in done.stderr


def test_an_unknown_model_is_answered_with_the_cards_before_torch_is_imported():
    start = time.perf_counter()
    done = verl_p2p(
        "plan", "--model", "qwen-9000", "--trainer", "tp=1", "--rollout", "tp=1", python=("-X", "importtime")
    )
    seconds = time.perf_counter() - start
    assert done.returncode == 2
    message = [line for line in done.stderr.splitlines() if line.startswith("verl-p2p plan:")]
    assert message and "'qwen-9000'" in message[0] and all(card in message[0] for card in MODEL_CARDS)
    assert not {"torch", "sglang", "megatron"} & imported(done.stderr)
    assert seconds < 30  # a bare interpreter's start: nothing heavy loaded (a loose bound for a busy machine)


def test_a_rollout_layout_sglang_cannot_build_is_refused_before_any_capture(tiny_config):
    """tp=3 over 4 attention heads: SGLang's model class asserts deep in its constructor; the plan refuses it
    first, naming the option and the values that work, with no SGLang imported and no traceback."""
    done = verl_p2p(
        "plan", "--model", str(tiny_config), "--trainer", "tp=1", "--rollout", "tp=3x2", "--plan-cache-dir", "",
        python=("-X", "importtime"),
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    text = "\n".join(line for line in done.stderr.splitlines() if not line.startswith("import time:"))
    assert "before any capture" in text and "Traceback" not in text
    assert "--rollout tp=3: SGLang splits the 4 attention heads evenly, so tp must be one of 1, 2, 4" in text
    assert "tp/ep = 3 ranks, which must divide its width moe_intermediate_size=32" in text
    assert not {"torch", "sglang"} & imported(done.stderr)


def test_a_trainer_expert_split_megatron_refuses_is_named():
    done = verl_p2p("plan", "--model", "qwen3-30b-a3b", "--trainer", "tp=4,ep=3", "--rollout", "tp=4,ep=4",
                    "--plan-cache-dir", "")  # fmt: skip
    assert done.returncode == 2
    assert "--trainer ep=3: Megatron needs ep to divide the 128 experts: 1, 2, 4, 8, 16, 32, 64, 128" in done.stderr
    # GLM-4.5-Air: 96 heads, 8 KV heads; tp=12 divides the heads but neither divides nor is a multiple of 8
    kv = verl_p2p("plan", "--model", "glm-4.5-air", "--trainer", "tp=1", "--rollout", "tp=12", "--plan-cache-dir", "")
    assert kv.returncode == 2, kv.stderr[-1000:]
    assert "--rollout tp=12: SGLang needs attention tp to divide the 8 KV heads or be a multiple of them" in kv.stderr
    assert "so tp must be one of 1, 2, 4, 8, 16, 24, 32, 48, 96" in kv.stderr
    # the vocabulary (151552) and the expert width (1408) rule out 24, 48 and 96: the values every rule takes
    assert "--rollout tp values that pass every rule with ep=1, dp_attn=1: 1, 2, 4, 8, 16, 32\n" in kv.stderr


def test_plan_is_quiet_says_what_a_cold_capture_costs_and_folds_alike_sources(tiny_config, tmp_path):
    """A cold run: its own lines only (third-party output in the log it names), where the plan cache is and how
    big, what was captured and how long it took; the 4 trainer sources, alike apart from their targets, in one
    row. A warm run reads the plans from the cache; `-v` shows the third-party output."""
    cache = tmp_path / "plans"
    argv = ["plan", "--model", str(tiny_config), "--trainer", "tp=1,ep=1,dp=4", "--rollout", "tp=2,ep=2"]
    cold = verl_p2p(*argv, "--plan-cache-dir", str(cache))
    assert cold.returncode == 0, cold.stderr[-3000:]
    assert noise(cold.stdout + cold.stderr) == [], noise(cold.stdout + cold.stderr)[:5]
    log = re.search(r"^\[plan\] third-party output .* goes to (\S+);", cold.stderr, re.M)
    assert log, cold.stderr[:1000]
    assert noise(Path(log.group(1)).read_text())  # the noise exists: it is in the log
    Path(log.group(1)).unlink()
    assert f"[plan] plan cache: {cache} (0 plans" in cold.stderr
    assert "captured (SGLang's own model class built on the meta device" in cold.stderr
    assert re.search(
        r"^\[plan\] 1 of 1 write plans captured in \d+\.\d s; plan cache: .* \(1 plans, ", cold.stderr, re.M
    )
    assert "sources 0-3 (4 alike):" in cold.stdout and not re.findall(r"^\s+[0-3]\s+0\s", cold.stdout, re.M)
    assert "source 0: e0r0[1/2]:" in cold.stdout and "source 3: e0r1[2/2]:" in cold.stdout

    warm = verl_p2p(*argv, "--plan-cache-dir", str(cache))
    # one rank captured per layout (the other rank of tp=2 named from it): one plan, read from the cache
    assert warm.returncode == 0 and warm.stderr.count("plan from the plan cache") == 1
    assert f"plan cache: {cache} (1 plans" in warm.stderr and "write plans captured" not in warm.stderr

    shown = verl_p2p(*argv, "--plan-cache-dir", "", "-v")
    assert shown.returncode == 0 and noise(shown.stderr) and "third-party output" not in shown.stderr
    assert "plan cache: off" in shown.stderr


def test_plan_json_stays_machine_readable_in_the_quiet_run(tiny_config):
    done = verl_p2p("plan", "--model", str(tiny_config), "--trainer", "tp=1", "--rollout", "tp=2", "--json",
                    "--plan-cache-dir", "")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["target_bytes"].keys() == {"e0r0", "e0r1"}


# ------------------------------------------------------------------------------------------ the help itself

HEAVY = {"torch", "sglang", "verl", "megatron", "transformers", "mooncake"}
OWN_PARSER = [c.name for c in COMMANDS if c.name != "plan"]  # plan's options: verl_p2p/cli/plan.py's own help


def option_entries(help_text: str) -> dict[str, str]:
    """Each option line of argparse's help (`  --opt METAVAR  text`, continued on deeper-indented lines): its
    invocation -> its help text, joined into one line."""
    entries: dict[str, str] = {}
    current = None
    for line in help_text.splitlines():
        start = re.match(r"^  (-\S.*?)(?:\s{2,}(\S.*))?$", line)
        if start:
            current = start.group(1)
            entries[current] = start.group(2) or ""
        elif current is not None and re.match(r"^ {6,}\S", line):
            entries[current] = f"{entries[current]} {line.strip()}".strip()
        else:
            current = None
    return entries


def test_the_help_and_the_package_description_name_both_trainers():
    import tomllib

    description = tomllib.loads(Path(ROOT, "pyproject.toml").read_text())["project"]["description"]
    done = verl_p2p("--help")
    for text in (done.stdout, description):
        assert "Megatron or FSDP" in text and "Megatron trainer" not in text, text


@pytest.mark.parametrize("command", OWN_PARSER)
def test_every_option_says_what_it_does_and_its_default_as_typed(command):
    """Each option has a text and ends it with its default (a required one says so); defaults read as a user types
    them (no None, False or Python tuple); the usage names the command as the user runs it."""
    done = verl_p2p(command, "--help")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"usage: verl-p2p {command} "), done.stdout[:200]
    entries = option_entries(done.stdout)
    assert len(entries) > 2 and "-h, --help" in entries, done.stdout
    for invocation, text in entries.items():
        if invocation == "-h, --help":
            continue
        assert re.search(r"\(default: \S|\(required\)", text), f"{command} {invocation}: {text!r}"
        assert text.split("(default")[0].split("(required")[0].strip(), f"{command} {invocation}: no text"
        for python in ("None", "False", "True", "('", "['"):
            assert python not in text, f"{command} {invocation}: {text!r}"


def test_help_imports_nothing_heavy():
    """`verl-p2p <command> --help` parses before torch, SGLang, verl or Megatron is imported (they cost seconds)."""
    heavy = {}
    for argv in (["--help"], *([c.name, "--help"] for c in COMMANDS)):
        done = verl_p2p(*argv, python=("-X", "importtime"))
        assert done.returncode == 0, done.stderr[-2000:]
        heavy[argv[0]] = sorted(HEAVY & imported(done.stderr))
    assert all(not modules for modules in heavy.values()), heavy


def test_help_into_a_closed_pipe_exits_0_without_a_traceback():
    """`verl-p2p -h | head -2`: the reader has gone by the time help is written (here: before the process
    starts), with stdout buffered (a user's default) and unbuffered (PYTHONUNBUFFERED=1)."""
    failures = []
    for buffering in ("buffered", "unbuffered"):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
        env.update(PYTHONPATH=ROOT, **({"PYTHONUNBUFFERED": "1"} if buffering == "unbuffered" else {}))
        for argv in (["-h"], *([c.name, "--help"] for c in COMMANDS)):
            read, write = os.pipe()
            os.close(read)
            try:
                command = [sys.executable, "-m", "verl_p2p.cli", *argv]
                done = subprocess.run(command, stdout=write, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
            finally:
                os.close(write)
            if done.returncode != 0 or done.stderr:
                failures.append((buffering, argv[0], done.returncode, done.stderr.strip().splitlines()[-1:]))
    assert not failures, failures
