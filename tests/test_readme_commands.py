"""Every command in README's shell blocks runs as printed, dry: a verl launch composes through Hydra against verl
0.9.1's own configs and passes p2p's checks (the Hydra guard, the options, verl's rollout dataclass); `make`
targets exist; the install lines name an extra and an SGLang release the package accepts. A command of a kind
this test does not know fails it: a new README command needs a dry run here."""

from __future__ import annotations

import re
import shlex

import pytest
import tomllib
from packaging.specifiers import SpecifierSet
from support.compose import CONFIG_DIRS, ROOT, compose_config
from test_hydra_recipes import check_p2p_config

README = ROOT / "README.md"
# what a user puts in place of their own paths; README's commands run from the clone's root
USER_VARS = {
    "PWD": str(ROOT),
    "MODEL_PATH": "/models/Qwen3-4B",
    "TRAIN_FILE": "/data/train.parquet",
    "TEST_FILE": "/data/test.parquet",
}


def shell_commands(text: str) -> list[str]:
    """The commands of every ```bash block: continuation lines joined, comments and blank lines dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" #", 1)[0].strip() if not line.lstrip().startswith("#") else ""
            if line:
                commands.append(line)
    return commands


COMMANDS = shell_commands(README.read_text())


def expand(word: str, env: dict[str, str]) -> str:
    return re.sub(r"\$(\w+)", lambda m: env[m.group(1)], word)


def dry_run(command: str, env: dict[str, str]) -> str:
    """Check one README command without running its effect; returns what was checked."""
    words = [expand(w, env) for w in shlex.split(command)]
    if words[0] == "export":
        name, value = words[1].split("=", 1)
        env[name] = value
        return f"export {name}"
    if words[0] == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M)
        assert words[1] in targets, f"README runs `make {words[1]}`; the Makefile has {targets}"
        return f"make {words[1]}"
    if words[:3] == ["pip", "install", "-e"]:
        extra = re.fullmatch(r"\.\[(\w+)\]", words[3])
        project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        assert extra and extra.group(1) in project["optional-dependencies"], f"no extra in {words[3]}"
        return f"extra {extra.group(1)}"
    if words[:2] == ["pip", "install"]:
        name, version = words[2].split("==")
        project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        (spec,) = [d for d in project["optional-dependencies"]["sglang"] if d.startswith(name)]
        assert version in SpecifierSet(spec[len(name) :]), (
            f"README installs {name}=={version}; the package takes {spec}"
        )
        return f"{name}=={version}"
    if words[:2] == ["python", "-m"]:
        module = words[2]
        assert module in CONFIG_DIRS, f"README launches {module}, which is not a verl trainer entry p2p supports"
        cfg = compose_config(module, words[3:])
        check_p2p_config(cfg, module)
        assert cfg.actor_rollout_ref.hybrid_engine is False  # separate pools, as README says
        return f"{module} {cfg.actor_rollout_ref.actor.strategy}"
    raise AssertionError(f"README command of a kind this test cannot dry-run: {command!r}")


def test_readme_has_the_two_commands_and_a_launch_for_each_trainer():
    assert "make demo" in COMMANDS and "make test" in COMMANDS
    launches = [c for c in COMMANDS if c.startswith("python -m ")]
    assert any("+p2p=default" in c for c in launches) and any("+p2p=fsdp" in c for c in launches)
    assert any("separate_async" in c for c in launches)


def test_every_readme_command_runs_as_printed_dry():
    env = dict(USER_VARS)
    checked = [dry_run(command, env) for command in COMMANDS]
    strategies = {c.rsplit(" ", 1)[1] for c in checked if c.startswith("verl.")}
    assert strategies == {"megatron", "fsdp2"}, checked


@pytest.mark.parametrize(
    "command, why",
    [
        ("make deploy", "the Makefile has"),
        ("pip install -e '.[nope]'", "no extra"),
        ('pip install "sglang==0.4.0"', "the package takes"),
        ("python -m verl.trainer.main_ppo --config-name=ppo_trainer +p2p=fsdp", "mandatory|naive|sync"),
        ("curl http://example", "cannot dry-run"),
    ],
)
def test_a_wrong_readme_command_fails_the_dry_run(command, why):
    """The dry run can fail: a target, extra or release that does not exist, a launch p2p refuses (v1's default
    trainer_mode=sync replaces p2p with naive), a command of an unknown kind."""
    env = {**USER_VARS, "VERL_P2P": str(ROOT)}
    if command.startswith("python -m"):
        command = command.replace(
            "+p2p=fsdp", f"hydra.searchpath=[pkg://verl.trainer.config,file://{ROOT}/conf] +p2p=fsdp"
        )
    with pytest.raises(Exception, match=why):
        dry_run(command, env)
