"""A quiet run keeps this package's lines on the console after Ray has replaced `builtins.print`.

Ray's driver swaps `builtins.print` for its tqdm `safe_print` the first time a worker's log line reaches it, for
the rest of the process. The router then saw `safe_print` (a Ray file) as the code that printed and sent every
line of ours to the log: a `verl-p2p plan` run in-process after a Ray test in the same pytest worker printed
nothing, and so would the demo's own lines after its first Ray worker logged."""

from __future__ import annotations

import builtins
import json
import re

from verl_p2p.cli import main as cli_main
from verl_p2p.cli.quiet import run_quietly
from verl_p2p.sandbox.tiny import tiny_config_dict


def test_ours_on_the_console_and_theirs_in_the_log_after_ray_patched_print(tmp_path, capsys, monkeypatch):
    from ray.experimental import tqdm_ray

    monkeypatch.setattr(builtins, "print", builtins.print)  # put back after: Ray's patch is for good
    monkeypatch.setattr(tqdm_ray, "_manager", None)
    tqdm_ray.instance()  # what Ray's driver calls on a worker's first log line
    assert builtins.print is tqdm_ray.safe_print

    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny_config_dict("qwen3_moe")))
    plan = ["plan", "--model", str(config), "--trainer", "tp=1", "--rollout", "tp=2", "--plan-cache-dir", ""]

    def main() -> int:
        print("a line of another package")  # this test file is not part of verl_p2p: the log's
        return cli_main(plan)

    assert run_quietly("routing", False, main) == 0
    out = capsys.readouterr().out
    assert "model " in out and "HF tensors" in out, out  # plan's own lines
    assert "a line of another package" not in out
    log = re.search(r"goes to (\S+);", out).group(1)
    assert "a line of another package" in open(log).read()
