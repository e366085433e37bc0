"""The architecture, checked: the import graph of the code (every import, also those inside
functions) follows the layers below, has no circles, and the light layers load no torch.

    front doors   parity.cli, parity.api, parity.testing, parity.pytest_plugin, parity.__main__
    outputs       parity.outputs.*   (text, JSON, JUnit, baselines, progress)
    engine        parity.engine.*    (reference, build/fill/run, inputs, compare, diagnose, session, suite)
    targets       parity.targets.*   (frameworks other than PyTorch: MLX, Flax NNX, NumPy, ONNX behind a torch
                                      module)
    sources       parity.sources.*   (checkpoint formats, hub, caches, synthetic weights)
    definitions   parity.definitions.*  (mappings, aliases, project files, selections, values, the mistake
                                      catalogue; no torch)

docs/architecture.md describes the layers and their modules for a reader.
    base          parity.errors, and the package root (its __version__)

A module may import its own layer and the layers below it, never one above.  parity.ffn is
the code under test: nothing in parity imports it (mappings name it as a string).
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "parity"
LAYERS = ["front", "outputs", "engine", "targets", "sources", "definitions", "base"]
FRONT = {"parity.cli", "parity.api", "parity.testing", "parity.pytest_plugin", "parity.__main__"}
MAX_LEVELS = 11  # the deepest: pytest plugin -> testing -> api -> suite -> layout (resolve, gguf, derive) ->
#                  definitions (registry, mapping_parser, toml_text, files)
MAX_FUNCTION_LINES = 60


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(name: str) -> str | None:
    if name in ("parity.ffn", "parity.examples"):  # the seed's modules and the documented example mutants
        return None
    if name in ("parity", "parity.errors"):
        return "base"
    if any(name == f or name.startswith(f + ".") for f in FRONT):
        return "front"
    for layer in ("outputs", "engine", "targets", "sources", "definitions"):
        if name == f"parity.{layer}" or name.startswith(f"parity.{layer}."):
            return layer
    raise AssertionError(f"{name}: in no layer; add it to a subpackage or to this test's table")


def runtime_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:`` (annotations only, never imported at run time)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            continue
        yield node
        yield from runtime_nodes(node)


def imports_of(path: Path) -> set[str]:
    """Every parity module this file imports at run time, at module level or inside functions."""
    found = set()
    for node in runtime_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import; write 'from parity.… import'"
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in MODULES)
    return found


GRAPH = {name: imports_of(path) - {name} for name, path in MODULES.items()}


def test_every_module_has_a_layer():
    for name in MODULES:
        layer_of(name)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_go_down_only(name):
    if name == "parity":
        return  # the package root lazily exposes the API (a front door) as parity.check / parity.load_ffn
    mine = LAYERS.index(layer_of(name) or "base")
    upward = sorted(other for other in GRAPH[name]
                    if layer_of(other) is not None and LAYERS.index(layer_of(other)) < mine and other != "parity")
    assert not upward, f"{name} ({layer_of(name)}) imports from a layer above it: {upward}"


def test_nothing_imports_the_code_under_test():
    importers = sorted(name for name, deps in GRAPH.items() if "parity.ffn" in deps)
    assert not importers, f"parity.ffn is the code under test; these import it: {importers}"


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v] - {"parity"}:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert _cycles() == []


def test_import_chain_is_short():
    depth: dict[str, int] = {}

    def level(v):
        if v not in depth:
            depth[v] = 1 + max((level(w) for w in GRAPH[v] - {"parity"}), default=0)
        return depth[v]

    deepest = max(MODULES, key=level)
    assert level(deepest) <= MAX_LEVELS, f"{deepest} sits {level(deepest)} import levels deep"


@pytest.mark.slow  # a fresh interpreter: what importing the light layers loads
def test_light_layers_load_no_torch():
    """spec, outputs and the CLI's modules: `parity --version` / `parity list` stay instant."""
    light = [n for n in MODULES if layer_of(n) in ("definitions", "outputs")] + ["parity.cli", "parity.cli.options",
                                                                         "parity.cli.commands", "parity.pytest_plugin"]
    code = ("import importlib, sys\n"
            f"for name in {light!r}:\n    importlib.import_module(name)\n"
            "print(sorted(m for m in ('torch', 'transformers', 'safetensors', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing {light} loaded {out.stdout.strip()}"


def test_no_function_is_longer_than_a_screen():
    long = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {length} lines")
    assert not long, long


def test_every_diagnosis_id_has_a_catalogue_entry():
    from parity.definitions.mistakes import MISTAKES, MistakeId

    assert set(MISTAKES) == set(MistakeId)


# -- the contributor's guide, followed: a new checkpoint format is one module and one row --------

class NpzFormat:
    """A toy format (config.json + weights.npz), written as CONTRIBUTING.md says a format is."""

    @staticmethod
    def claims(path: Path) -> bool:
        return path.is_dir() and (path / "weights.npz").is_file()

    @staticmethod
    def open_path(path: Path, allow_pickle: bool = False):
        import json

        import numpy as np
        import torch

        from parity.sources.checkpoint import Checkpoint

        names = list(np.load(path / "weights.npz").keys())

        def reader(file_name, wanted):
            arrays = np.load(path / file_name)
            return {name: torch.from_numpy(arrays[name]) for name in wanted}

        return Checkpoint(str(path), path, json.loads((path / "config.json").read_text()),
                          dict.fromkeys(names, "weights.npz"), lambda f: path / f, reader=reader,
                          notes=["read from weights.npz"])


def test_a_format_is_one_module_and_one_row(tiny, tmp_path, monkeypatch):
    import numpy as np
    from safetensors.numpy import load_file

    import parity
    from parity.sources import registry

    folder = tmp_path / "npz-llama"
    folder.mkdir()
    (folder / "config.json").write_text((tiny["llama"] / "config.json").read_text())
    np.savez(folder / "weights.npz", **load_file(tiny["llama"] / "model.safetensors"))
    monkeypatch.setattr(registry, "FORMATS", [registry.Format("npz", NpzFormat.claims, NpzFormat.open_path),
                                              *registry.FORMATS])
    report = parity.check(str(folder), layers=[0, 2])
    assert report.passed and "read from weights.npz" in report.notes
    broken = parity.check(str(folder), layers=[1], target="tests.mutants:SwappedSwiGLU")
    assert broken.layers[0].diagnosis["id"] == "gate_up_swapped"


# -- no test asserts a duration ---------------------------------------------------------------------------------

CLOCKS = {"time", "perf_counter", "monotonic", "process_time", "thread_time", "perf_counter_ns", "monotonic_ns",
          "time_ns"}


def clock_calls(node: ast.AST, tainted: set[str]) -> bool:
    """Does ``node`` read a clock: a call of time.<clock>() (or a bare clock imported by name), or a name that
    was bound from one?"""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            func = sub.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in CLOCKS and (not isinstance(func, ast.Attribute) or getattr(func.value, "id", "") == "time"):
                return True
        if isinstance(sub, ast.Name) and sub.id in tainted:
            return True
    return False


def duration_asserts(source: str) -> list[int]:
    """The line of every assert whose condition reads a clock, directly or through names bound from one."""
    tree = ast.parse(source)
    tainted: set[str] = set()
    for _ in range(3):  # names bound from names bound from a clock
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and clock_calls(node.value, tainted):
                tainted |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert) and clock_calls(node.test, tainted)]


def test_no_test_asserts_a_duration():
    """Machines are noisy: how long something takes is measured by scripts/bench.py (medians, ratios side by
    side), never asserted by a test, which would fail on a loaded 2-core machine (CONTRIBUTING.md)."""
    found = {path.name: lines for path in sorted((PACKAGE.parent / "tests").glob("*.py"))
             if (lines := duration_asserts(path.read_text()))}
    assert not found, f"tests asserting a duration (file: lines): {found}"


def test_the_duration_rule_catches_what_it_is_for():
    """It can fail: an elapsed time asserted directly or through names bound from a clock is found; a count is not."""
    direct = ("import time\ndef test():\n    started = time.perf_counter()\n"
              "    assert time.perf_counter() - started < 9\n")
    named = ("import time\ndef test():\n    t = time.monotonic()\n    elapsed = time.monotonic() - t\n"
             "    assert elapsed < 60\n")
    counted = "def test():\n    hits = 3\n    assert hits <= 4\n"
    assert duration_asserts(direct) == [4] and duration_asserts(named) == [5] and duration_asserts(counted) == []


def reached_from(name: str) -> set[str]:
    """Every parity module ``name`` imports at run time, directly or through the modules it imports."""
    seen, todo = set(), [name]
    while todo:
        for other in GRAPH[todo.pop()] - {"parity"} - seen:
            seen.add(other)
            todo.append(other)
    return seen


def test_check_and_compare_each_have_their_own_home():
    """Both flows start from one layout (``parity.engine.layout``: a mapping file's, or one derived from
    transformers); a check (``engine.check``) never reaches into a compare (``engine.compare``), a compare never into
    a check (it holds each checkpoint as an ``engine.side.Side``, builds no target), and the layout into neither:
    each flow's modules live in its own home, what both use at ``engine``'s top."""
    def under(name: str, home: str) -> bool:
        return name == f"parity.engine.{home}" or name.startswith(f"parity.engine.{home}.")

    crossing = sorted(f"{a} imports {b}" for a, deps in GRAPH.items() for b in deps
                      if under(a, "check") and under(b, "compare") or under(a, "compare") and under(b, "check")
                      or under(a, "layout") and (under(b, "check") or under(b, "compare")))
    assert crossing == []
    # nor through a module at engine's top: what a compare runs loads nothing of the check
    reached = sorted(f"{a} reaches {b}" for a in GRAPH if under(a, "compare")
                     for b in reached_from(a) if under(b, "check"))
    assert reached == []
    homes = {"layout", "check", "compare"}
    assert all((PACKAGE / "engine" / home / "__init__.py").exists() for home in homes)


def test_the_home_rule_catches_a_compare_reaching_the_check(monkeypatch):
    """It can fail: a compare module importing the check, directly or through a module at engine's top, is found."""
    monkeypatch.setitem(GRAPH, "parity.engine.compare.blocks",
                        GRAPH["parity.engine.compare.blocks"] | {"parity.engine.check.block_check"})
    with pytest.raises(AssertionError):
        test_check_and_compare_each_have_their_own_home()
    monkeypatch.undo()
    monkeypatch.setitem(GRAPH, "parity.engine.side", GRAPH["parity.engine.side"] | {"parity.engine.check.session"})
    assert "parity.engine.check.session" in reached_from("parity.engine.compare.comparison")
    with pytest.raises(AssertionError):
        test_check_and_compare_each_have_their_own_home()
