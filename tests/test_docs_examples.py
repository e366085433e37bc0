"""The documentation is executed: every command block of README.md and docs/*.md runs against the tests' fixtures,
offline, and its exit code and shown output are checked (tests/docs_runner.py says how; Sybil reads the pages).
A block that cannot run says why on the page; ``python scripts/docs_examples.py --update`` rewrites the shown
outputs from real runs.

Blocks run in this process (tests/support.py's ``_main``), in page order: a block runs the page's earlier
blocks that leave state first (the files the page writes, the baseline it made), so any one of them can be
selected with -k or -m "not slow".  The runs
of the same command in the same files are made once (README.md and index.md show the same `parity gpt2`).
"""

from __future__ import annotations

import importlib.util

import pytest

from .docs_fixtures import FIXTURES, PREPARE
from .docs_runner import PAGES, ROOT, Workspace, all_blocks, blocks_of, compare, implied_exit, regenerate, same_line

DOCUMENTS = {page: blocks_of(page) for page in PAGES}
KEYS = {"file", "run", "env", "prepare", "exit"}
# a block that builds a large fixture, starts a process or imports JAX: seconds each, for a reason that is the point
SLOW = ("gemma3-270m-shape.gguf", "ffn_layer0.onnx", "nnx_port", "--logits", "def test_", "parity gpt2\n",
        "compare", "--config offline.toml", "SwappedSwiGLU")


def _params():
    for page, document in DOCUMENTS.items():
        for index, example in enumerate(document):
            block = example.parsed
            if block.runs or block.kind == "file":
                text = block.text + "\n" + block.directives.get("run", "") + "\n"
                marks = [pytest.mark.slow] if any(word in text for word in SLOW) else []
                yield pytest.param(page, index, id=block.name, marks=marks)


@pytest.fixture(scope="session")
def docs_workspace(tmp_path_factory):
    return Workspace(tmp_path_factory.mktemp("docs"))


@pytest.mark.parametrize("page, index", list(_params()))
def test_a_documented_command_runs_as_shown(page, index, docs_workspace):
    document = DOCUMENTS[page]
    document.namespace.setdefault("workspace", docs_workspace)
    done = document.namespace.setdefault("done", set())
    for earlier, example in enumerate(document):
        if earlier > index:
            break
        if earlier not in done and (earlier == index or _leaves_state(example.parsed)):
            done.add(earlier)
            example.evaluate()


def _leaves_state(block) -> bool:
    """An earlier block a later one may need: a file the page writes, a command that writes a file it reads."""
    return block.kind == "file" or any(word in block.text for word in ("--update-baseline", "--save-mapping"))


def test_every_command_block_runs_or_says_why_not():
    blocks = all_blocks()
    for block in blocks:
        assert set(block.directives) <= KEYS, f"{block.name}: unknown docs directive {set(block.directives) - KEYS}"
        assert block.directives.get("env", "offline") in ("offline", "hub"), block.name
        if "prepare" in block.directives:
            assert block.directives["prepare"].split()[0] in PREPARE, block.name
        if block.kind == "python" and block.text.startswith("# ") and ".py" in block.text.splitlines()[0]:
            assert block.marked, f"{block.name}: shows a file: give it file=NAME, or say it is not run and why"
        if block.marked:
            assert "<!--" not in block.marked, f"{block.name}: the reason it is not run must be visible"
    commands = [b for b in blocks if b.kind in ("shell", "python", "output")]
    marked = [b.name for b in commands if b.marked]
    assert len(commands) - len(marked) >= 35, "most documented commands run"
    assert len(marked) <= 8, f"not running a block is the exception: {marked}"


def test_every_fixture_a_page_names_is_built_from_the_tests_builders():
    texts = "\n".join(block.text for block in all_blocks() if block.runs)
    unused = [name for name in FIXTURES if name != "hub" and name not in texts]
    assert not unused, f"fixtures no page uses: {unused}"


def test_shown_lines_match_by_words_numbers_within_a_factor_and_any_version():
    assert same_line("    0   2.17e-06   416.4  ok", "    0   2.94e-06   307.3  ok")  # another CPU's noise
    assert not same_line("    0   2.17e-06   ok", "    0   2.17e-05   ok")  # ten times: a drift
    assert not same_line("    0   2.17e-06   ok", "    1   2.17e-06   ok")  # integers are exact
    assert not same_line("PASS: 2 layer(s)", "PASS: 3 layer(s)")
    assert not same_line("verdict ok", "verdict MISMATCH")
    assert not same_line("z [-8.0, 7.6]", "z [8.0, 7.6]")  # the sign is kept
    assert same_line("transformers 5.24.0 GPT2MLP", "transformers 5.25.1 GPT2MLP")
    assert not same_line("a b", "a b c")


def test_elided_output_matches_any_lines_in_place_of_the_dots():
    actual = ["head", "row 1", "row 2", "row 3", "", "PASS: 3"]
    assert compare(["head", "...", "row 3", "", "PASS: 3"], actual) is None
    assert compare(["...", "row 2", "..."], actual) is None
    assert compare(["head", "row 3", "", "PASS: 3"], actual) is not None  # no dots: nothing may be left out
    assert compare(["head", "...", "row 4", "", "PASS: 3"], actual) is not None
    assert compare(["...", "row 3", "row 2", "..."], actual) is not None  # order kept
    assert implied_exit(["...", "FAIL: 1 of 1"]) == 1 and implied_exit(["parity: error: x"]) == 2
    assert implied_exit(["PASS: 1"]) == 0 and implied_exit(["row", "..."]) is None


def test_regenerating_keeps_the_dots_and_takes_the_lines_printed_now():
    shown = ["head", "  target x", "...", "   11   2.41e-06  ok", "", "PASS: 12"]
    actual = ["head", "  target x", "  routes r", "    0   1.0e-06  ok", "   11   2.94e-06  ok", "",
              "PASS: 12 SYNTHETIC"]
    assert regenerate(shown, actual) == ["head", "  target x", "...", "   11   2.94e-06  ok", "", "PASS: 12 SYNTHETIC"]
    assert regenerate(["a", "b"], ["a", "b", "c"]) == ["a", "b", "c"]  # no dots: the whole output
    assert regenerate(["head", "...", "gone"], ["head", "other"]) is None


def test_the_update_script_rewrites_a_drifted_page_then_checks_it(tmp_path, capsys):
    """`python scripts/docs_examples.py --update PAGE` on a page whose shown output drifted, then a check."""
    spec = importlib.util.spec_from_file_location("docs_examples", ROOT / "scripts" / "docs_examples.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n```\n$ parity list  # exit 0\nan output that drifted\n```\n\nAfter.\n",
                    encoding="utf-8")
    assert script.main([str(page)]) == 1  # drifted: the check fails
    assert script.main(["--update", str(page)]) == 0
    text = page.read_text(encoding="utf-8")
    assert "drifted" not in text and "$ parity list  # exit 0\n" in text and "gpt2" in text
    assert text.endswith("\nAfter.\n")
    assert script.main([str(page)]) == 0
