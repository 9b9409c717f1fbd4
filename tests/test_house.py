"""The house rules, checked on the tree itself: documents and paths, rooms, imports, entry points, SGLang range.

Everything here reads the repository (and imports what the configs name); nothing starts a process.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "verl_p2p"
DOCS = REPO / "docs"

# The background notes of earlier experiments live outside the repository: no project file may point there.
OUTSIDE_NOTES = ("DESIGN.md", "PROTOCOL.md", "ENVIRONMENT.md", "GPU_SGLANG.md", "../shared", "/work/")
TOP_DIRS = ("verl_p2p/", "docs/", "conf/", "scripts/", "tests/", "recipes/")


def rooms() -> list[str]:
    """Every subpackage of verl_p2p: the rooms of the house."""
    return sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))


def modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the package."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported_modules(path: Path, known: dict[str, Path]) -> set[str]:
    """Modules of the package that `path` imports (anywhere in it, lazy imports included, and
    `importlib.import_module("...")` / `__import__("...")` of a literal name), and the external top-level packages
    it imports, as names."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        literal = _literal_import(node)
        if literal is not None:
            names.add(literal)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            for alias in node.names:  # `from pkg import submodule`
                if f"{node.module}.{alias.name}" in known:
                    names.add(f"{node.module}.{alias.name}")
    return names


def _literal_import(node: ast.AST) -> str | None:
    """The module a call `importlib.import_module("x.y")`, `import_module("x.y")` or `__import__("x.y")` imports."""
    if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant):
        return None
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in ("import_module", "__import__") or not isinstance(node.args[0].value, str):
        return None
    return node.args[0].value


def project_text_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "pyproject.toml", REPO / "constraints.txt", REPO / "Makefile"]
    for top in ("verl_p2p", "docs", "conf", "scripts", "recipes", "tests"):
        files += [p for p in (REPO / top).rglob("*") if p.suffix in (".py", ".md", ".yaml", ".sh", ".toml")]
    return [p for p in files if p.is_file() and p != Path(__file__).resolve()]


# ------------------------------------------------------------------------------------------ documents and paths


def test_no_project_file_points_outside_the_repository():
    problems = []
    for path in project_text_files():
        text = path.read_text(errors="replace")
        where = path.relative_to(REPO)
        problems += [f"{where}: mentions {name}" for name in OUTSIDE_NOTES if name in text]
        for token in re.findall(r"(?<![\w/.])((?:verl_p2p|docs|conf|scripts|tests|recipes)/[\w/.-]*\.\w+)", text):
            if not (REPO / token).exists() and not (path.parent / token).exists():
                problems.append(f"{where}: names {token}, which is not in the repository")
        for token in re.findall(r"[\w./-]+\.md\b", text):
            if not any((base / token).exists() for base in (REPO, path.parent, DOCS)):
                problems.append(f"{where}: names {token}, which is not in the repository")
    assert not problems, "\n".join(problems)


def test_markdown_links_resolve():
    problems = []
    for path in [REPO / "README.md", *DOCS.glob("*.md"), *REPO.glob("*/README.md"), *PACKAGE.glob("*/README.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)", path.read_text()):
            if "://" not in target and not (path.parent / target).exists():
                problems.append(f"{path.relative_to(REPO)} links to {target}")
    assert not problems, problems


def test_architecture_names_every_room():
    text = (DOCS / "architecture.md").read_text()
    missing = [room for room in rooms() if f"`verl_p2p/{room}/`" not in text]
    assert len(rooms()) >= 9 and not missing, f"docs/architecture.md does not describe the room(s) {missing}"
    for part in ("sequenceDiagram", "## The path of one byte", "## Rooms", "## Failure semantics", "failures.md"):
        assert part in text


def test_readme_layout_lists_every_room():
    layout = (REPO / "README.md").read_text().split("## Layout", 1)[1]
    assert [room for room in rooms() if f"`verl_p2p/{room}/`" not in layout] == []


def test_every_option_is_documented():
    from verl_p2p.config import P2PConfig

    headings = set(re.findall(r"^### (\S+)\s*$", (DOCS / "options.md").read_text(), re.M))
    undocumented = [key for key in P2PConfig.valid_keys() if key not in headings]
    assert not undocumented, f"docs/options.md lacks a `### <option>` entry for {undocumented}"
    for arg in ("remote_instance_weight_loader_start_seed_via_transfer_engine", "enable_memory_saver"):
        assert arg in headings


# ------------------------------------------------------------------------------------------ imports


def _graph() -> dict[str, set[str]]:
    known = modules()
    return {
        name: {m for m in imported_modules(path, known) if m in known and m != name} for name, path in known.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_literal_dynamic_imports_count_as_imports(tmp_path):
    """A module reaching another through `importlib.import_module("...")` needs it as much as through `import`:
    the engine <-> plugin circle went unseen while only import statements counted."""
    known = {"pkg.a": tmp_path / "a.py", "pkg.b": tmp_path / "b.py"}
    known["pkg.a"].write_text("import importlib\n\ndef f():\n    importlib.import_module('pkg.b')\n")
    known["pkg.b"].write_text("from pkg.a import f\n")
    graph = {n: {m for m in imported_modules(p, known) if m in known and m != n} for n, p in known.items()}
    assert _cycles(graph) == [["pkg.a", "pkg.b"]]


def test_no_import_cycles_between_modules():
    """Counting lazy (in-function) imports too: a cycle through them is still two modules that need each other.
    A package's `__init__` re-exporting its submodules is not a cycle with them."""
    graph = _graph()
    for name in graph:  # a package __init__ importing its own submodules
        graph[name] = {m for m in graph[name] if not m.startswith(name + ".")}
    assert _cycles(graph) == []


# Standard-library modules a pure module may use; anything else (os, io, socket, subprocess, pathlib, asyncio,
# threading, requests, aiohttp, torch, ...) is I/O or heavy.
PURE_STDLIB = {"__future__", "collections", "dataclasses", "typing", "enum", "functools", "itertools", "math", "re"}


def test_planning_imports_no_io():
    problems = []
    known = modules()
    for path in (PACKAGE / "planning").glob("*.py"):
        for name in imported_modules(path, known):
            if name.startswith("verl_p2p."):
                if not name.startswith(("verl_p2p.planning", "verl_p2p.errors")):
                    problems.append(f"{path.name} imports {name}")
            elif name.split(".")[0] not in PURE_STDLIB:
                problems.append(f"{path.name} imports {name}")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("open", "print", "input", "exec"):
                problems.append(f"{path.name} calls {node.func.id}()")
    assert not problems, problems


def test_product_rooms_do_not_import_the_stand_ins():
    """loopback/, sandbox/, e2e/ and cli/ are for demo, proofs and tests: nothing on the production path needs them."""
    stand_ins = ("verl_p2p.loopback", "verl_p2p.sandbox", "verl_p2p.e2e", "verl_p2p.cli")
    graph = _graph()
    problems = [
        f"{name} imports {m}"
        for name, imported in graph.items()
        if not name.startswith(stand_ins)
        for m in imported
        if m.startswith(stand_ins)
    ]
    assert not problems, problems


def test_rollout_is_the_only_room_speaking_http():
    known = modules()
    http = ("aiohttp", "requests", "http.client", "urllib.request")
    product = ("backend", "trainer", "planning", "replica", "transfer")
    problems = [
        f"{name} imports {m}"
        for name, path in known.items()
        if name.split(".")[1:2] and name.split(".")[1] in product
        for m in imported_modules(path, known)
        if m.startswith(http)
    ]
    assert not problems, problems


# ------------------------------------------------------------------------------------------ public paths


def _resolve(dotted: str):
    """Import `dotted` as a module, else as `module.attribute`."""
    try:
        return importlib.import_module(dotted)
    except ModuleNotFoundError:
        module, _, attribute = dotted.rpartition(".")
        return getattr(importlib.import_module(module), attribute)


def _configured_paths() -> list[tuple[str, str, str]]:
    """(file, key, dotted path) for every custom_backend_module, checkpoint_manager_class and _target_ in the
    configs, recipes, docs and README."""
    recipes = [p for p in (REPO / "recipes").rglob("*") if p.is_file()]
    files = [REPO / "README.md", *(REPO / "conf").rglob("*.yaml"), *recipes, *DOCS.glob("*.md")]
    pattern = re.compile(r"(custom_backend_module|checkpoint_manager_class|_target_)\s*[:=]\s*['\"]?([\w.]+)")
    found = []
    for path in files:
        for key, value in pattern.findall(path.read_text()):
            if value.startswith("verl_p2p"):
                found.append((str(path.relative_to(REPO)), key, value))
    return found


def test_configured_import_paths_resolve():
    found = _configured_paths()
    keys = {key for _, key, _ in found}
    assert keys == {"custom_backend_module", "checkpoint_manager_class", "_target_"}, found
    for where, key, value in found:
        assert _resolve(value) is not None, f"{where}: {key}={value} does not resolve"
    # every dotted verl_p2p name the user-facing text mentions (not config keys such as engine_kwargs.verl_p2p.x)
    for path in [REPO / "README.md", *DOCS.glob("*.md"), *(REPO / "conf").rglob("*.yaml")]:
        for dotted in set(re.findall(r"(?<![\w.])verl_p2p(?:\.[A-Za-z_]\w*)+", path.read_text())):
            assert _resolve(dotted) is not None, f"{path.relative_to(REPO)}: {dotted} does not resolve"


def test_entry_points_resolve():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for name, target in project["scripts"].items():
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), name
    for target in project["entry-points"]["verl.plugins"].values():
        importlib.import_module(target)
    from verl_p2p.cli import main

    assert main(["--help"]) == 0


# ------------------------------------------------------------------------------------------ SGLang releases


def test_sglang_extra_states_the_tested_range_and_the_matrix_covers_it():
    from support.replica_harness import SGLANG_DIRS

    from verl_p2p.replica.rank_context import TESTED_SGLANG_RANGE

    low, high = TESTED_SGLANG_RANGE
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["sglang"] == [f"sglang>={low},<={high}"]
    matrix = sorted(SGLANG_DIRS, key=lambda v: tuple(map(int, v.split("."))))
    assert matrix[0] == low and matrix[-1] == high and len(matrix) >= 3
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert all(v in setup for v, folder in SGLANG_DIRS.items() if folder is not None)


@pytest.mark.parametrize("version", ["0.5.11", "0.5.24", "0.6.0", "0.4.9.post1", "garbage"])
def test_sglang_release_outside_the_range_is_refused_naming_it(monkeypatch, version):
    import sglang

    from verl_p2p.planning.layout import layout_from_server_args
    from verl_p2p.replica.rank_context import RankContext, UnsupportedSGLangVersionError
    from verl_p2p.sandbox.tiny import tiny_config_dict

    monkeypatch.setattr(sglang, "__version__", version)
    args = {"tp_size": 2, "dtype": "float32"}
    with pytest.raises(UnsupportedSGLangVersionError, match=rf"SGLang {re.escape(version)} .*0\.5\.12 \.\. 0\.5\.23"):
        RankContext(args, layout_from_server_args(args, 0), tiny_config_dict("qwen3"))


def test_rank_state_is_chosen_by_features_not_by_the_version_string(monkeypatch):
    """The installed SGLang decides the adapter by what it offers, whatever in-range version it claims; a
    release whose runtime context places ranks but lacks record_fields is refused naming what is missing."""
    import sglang

    from verl_p2p.planning.layout import layout_from_server_args
    from verl_p2p.replica.rank_context import RankContext, RankStateFeatures, UnsupportedSGLangVersionError
    from verl_p2p.sandbox.tiny import tiny_config_dict

    features = RankStateFeatures.detect()
    expected = "_RuntimeContextAdapter" if features.context_placement else "_GlobalsAdapter"
    claimed = "0.5.23" if expected == "_GlobalsAdapter" else "0.5.12"
    monkeypatch.setattr(sglang, "__version__", claimed)
    args = {"tp_size": 2, "dtype": "float32"}
    ctx = RankContext(args, layout_from_server_args(args, 1), tiny_config_dict("qwen3"))
    assert type(ctx._adapter).__name__ == expected
    with ctx:
        import sglang.srt.distributed.parallel_state as ps

        assert ps.get_tensor_model_parallel_rank() == 1
    assert RankStateFeatures(False, False, False, False).adapter_kind("0.5.12") == "module_globals"
    assert RankStateFeatures(True, False, False, True).adapter_kind("0.5.17") == "module_globals"
    assert RankStateFeatures(True, True, False, True).adapter_kind("0.5.21") == "runtime_context"
    with pytest.raises(UnsupportedSGLangVersionError, match="record_fields"):
        RankStateFeatures(True, True, True, False).adapter_kind("0.5.22")


def test_quant_imports_only_torch():
    """quant/ is arithmetic: torch (and triton, torch's own kernel compiler, for the GPU path), the pure standard
    library and `logging` (the GPU path's fallback is logged), `verl_p2p.errors` and itself; no SGLang, no I/O."""
    problems = []
    known = modules()
    for path in (PACKAGE / "quant").glob("*.py"):
        for name in imported_modules(path, known):
            if name.startswith("verl_p2p."):
                if not name.startswith(("verl_p2p.quant", "verl_p2p.errors")):
                    problems.append(f"{path.name} imports {name}")
            elif name.split(".")[0] not in PURE_STDLIB | {"torch", "triton", "logging"}:
                problems.append(f"{path.name} imports {name}")
    assert not problems, problems
