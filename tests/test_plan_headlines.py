"""Every predicted figure README's prediction table quotes is printed by the command quoted beside it."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from verl_p2p.cli import main as cli_main

README = Path(__file__).resolve().parents[1] / "README.md"


def _rows() -> list[tuple[str, str, str]]:
    """(model, figure, command) of each row of the table whose header has 'predicted p2p sync'."""
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if "predicted p2p sync" in line and line.startswith("|"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True))
        rows.append((cells["model"], cells["predicted p2p sync"], cells["command (prints the figure)"].strip("`")))
    return rows


def test_the_table_quotes_a_command_for_every_figure():
    rows = _rows()
    assert len(rows) >= 2
    for model, figure, command in rows:
        assert re.fullmatch(r"\d+\.\d{3} s", figure), (model, figure)
        assert command.startswith("verl-p2p plan --model "), (model, command)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("row", _rows(), ids=lambda r: r[0])
def test_each_quoted_command_prints_its_figure(row, capsys, tmp_path):
    model, figure, command = row
    argv = shlex.split(command)[1:]  # drop the program name
    assert cli_main([*argv, "--plan-cache-dir", str(tmp_path / "plans")]) == 0
    out = capsys.readouterr().out
    seconds = figure.removesuffix(" s")
    assert re.search(rf"predicted sync {re.escape(seconds)} s|\s{re.escape(seconds)}s\s", out), (model, out[-3000:])
    if "--trainer" not in argv:  # the published layouts: each row's whole sync beside its wire prediction
        rows = re.findall(r"\s(\d+\.\d{3})s +\d+\.\d{3}s +\d+\.\d{3}s +(\d+\.\d{3})s .*whole sync [\w-]+-bound\)", out)
        assert rows, (model, out[-3000:])
        for predicted, whole in rows:  # the whole sync adds the export and fixed costs to the wire
            assert float(whole) > float(predicted), (model, predicted, whole)
