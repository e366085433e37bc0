"""Executing the documentation: every command a page of README.md or docs/ shows runs, and its shown output is
checked, or regenerated from real runs (``python scripts/docs_examples.py --update``).

Pages are read with Sybil (https://sybil.readthedocs.io), the ecosystem's tool for executable documentation.
Why Sybil, not pytest-examples or pytest-markdown-docs: those run Python blocks only and compare ``print``
output written as comments, while most of these pages are shell sessions (``$ parity ...`` then what it
printed) and output blocks; Sybil lexes Markdown fences and HTML-comment directives with their line numbers and
lets each block have its own evaluator, without dependencies of its own.  Its lexer finds the blocks and its
``Document``/``Example`` carry them (one namespace per page: the page's working folder); the evaluators here
run them.

What a page can say, in HTML comments the reader does not see (``<!-- docs: KEY=VALUE ... -->``, right above a
block; blocks below it are unaffected):

- ``file=NAME``: the block is the file NAME the page uses; it is written into the page's working folder when
  the page reaches it (a ``.py`` file shown on any page is there from the start of every page: pages show one
  version of each module).
- ``run="parity ..."``: the output block below is what that command prints (for output shown without a
  ``$`` line).
- ``env=hub``: run with the fake Hugging Face cache (``HUB_REPOS``: tiny real checkpoints under hub ids),
  not the empty one that makes mapping names fall back to the synthetic stand-in.
- ``prepare="NAME ARGS"``: a step of ``PREPARE`` runs first (an edit the page describes in words, such as a
  baseline's stored values edited to a tenth).
- ``exit=N``: the exit code the command must have, where its shown output does not end with its summary.

A command block (a ``bash``/``sh``/``console`` fence, a fence whose first line starts with ``$``, a ``python``
fence, an output block with ``run=``) that cannot run offline says why in the paragraph right above it, in
words the reader sees, containing "not run by the docs tests"; any other command block runs.

How shown output is checked (``compare``): line by line after paths are normalised (an absolute path into the
page's working folder reads ``~/project/...``, parity's temporary cache ``~/.cache/parity``, the repository's
own files ``parity/...``, as an installed parity has them); a line ``...``
stands for any number of lines; words must be equal, a version such as ``5.24.0`` matches any version, and a
number written with a decimal point or an exponent matches within a factor of ``NUMBER_FACTOR``: the float32
noise figures differ between CPUs (layer 0 of the synthetic GPT-2: noise 2.17e-06 on one machine, 2.94e-06 on
another; x1.35).  The exit code must be exactly the one the output implies (``PASS`` 0, ``FAIL`` 1,
``ERROR``/``parity: error`` 2), the ``# exit N`` comment of the command, or 0 for a command shown without
output.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import re
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from sybil import Document
from sybil.parsers.markdown.lexers import RawFencedCodeBlockLexer

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"not\s+run\s+by\s+the\s+docs\s+tests", re.IGNORECASE)
DIRECTIVE = re.compile(r"<!--\s*docs:(.*?)-->", re.DOTALL)
SHELL = {"bash", "sh", "shell", "console"}
NUMBER_FACTOR = 2.0
FENCES = RawFencedCodeBlockLexer(info_pattern=re.compile(r"(?P<language>[^\n`]*)$\n", re.MULTILINE))


@dataclass
class Block:
    """One fenced block of a page: where it is, what it holds, what the page says about it."""

    page: Path
    line: int
    start: int  # offset of the block's text in the page (after the opening fence line)
    end: int
    language: str
    text: str
    directives: dict[str, str] = field(default_factory=dict)
    marked: str | None = None  # the visible sentence saying why it is not run

    @property
    def name(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page.name
        return f"{page}:{self.line}"

    @property
    def kind(self) -> str:
        """file, shell, python, output (a command's output with run=), or other (data, not a command)."""
        if "file" in self.directives:
            return "file"
        if self.language in SHELL or (not self.language and self.text.startswith("$ ")):
            return "shell"
        if self.language == "python":
            return "python"
        if not self.language and "run" in self.directives:
            return "output"
        return "other"

    @property
    def runs(self) -> bool:
        return self.kind != "other" and self.marked is None


def _above(text: str, start: int) -> tuple[dict[str, str], str]:
    """The directives in the HTML comments right above a fence, and the paragraph above them."""
    before = text[:start].rstrip("\n")
    directives: dict[str, str] = {}
    while True:
        match = re.search(r"<!--(?:(?!<!--).)*?-->\s*\Z", before, re.DOTALL)
        if not match:
            break
        found = DIRECTIVE.fullmatch(match.group(0).strip())
        if found:
            for word in shlex.split(found.group(1)):
                key, _, value = word.partition("=")
                directives.setdefault(key, value)
        before = before[:match.start()].rstrip("\n")
    paragraph = before.rsplit("\n\n", 1)[-1]
    return directives, paragraph


def blocks_of(page: Path) -> Document:
    """The page as a Sybil document whose examples are its fenced blocks (``example.parsed``: a Block)."""

    def parser(document: Document):
        for region in FENCES(document):
            source = region.lexemes["source"]
            opening = document.text.index("\n", region.start) + 1
            directives, paragraph = _above(document.text, region.start)
            language = region.lexemes["language"].strip().split(" ")[0]
            marked = paragraph if NOT_RUN.search(paragraph) else None
            region.parsed = Block(page, document.text.count("\n", 0, region.start) + 1, opening,
                                  opening + len(source), language, str(source), directives, marked)
            region.evaluator = evaluate
            yield region

    return Document.parse(str(page), parser)


def all_blocks() -> list[Block]:
    return [example.parsed for page in PAGES for example in blocks_of(page)]


def shown_files(blocks: list[Block]) -> dict[str, str]:
    """Every ``.py`` file a page shows (file=NAME), by name; two pages showing two versions is an error."""
    files: dict[str, str] = {}
    for block in blocks:
        name = block.directives.get("file", "")
        if name.endswith(".py"):
            if files.setdefault(name, block.text) != block.text:
                raise AssertionError(f"{block.name}: shows another {name} than an earlier page does")
    return files


# -- splitting a block into commands and their shown output -----------------------------------------------------

@dataclass
class Step:
    """One command of a block, the output the page shows for it (None: none shown) and the exit code it
    must have."""

    command: str
    shown: list[str] | None
    exit_code: int | None = None


def _exit_comment(command: str) -> int | None:
    found = re.search(r"#\s*exit (\d+)", command)
    return int(found.group(1)) if found else None


def implied_exit(lines: list[str]) -> int | None:
    """The exit code a shown output implies by its last summary: PASS 0, FAIL 1, ERROR or an error 2 (lines after
    it, such as `baseline: wrote ...`, are notes).  None when the output ends elided or shows no summary."""
    tail = [line.lstrip() for line in lines if line.strip()]
    if not tail or tail[-1] == "...":
        return None
    for line in reversed(tail):
        for start, code in (("PASS", 0), ("FAIL", 1), ("ERROR", 2), ("parity: error", 2),
                            ("parity: internal error", 2)):
            if line.startswith(start):
                return code
    return None


def steps_of(block: Block) -> list[Step]:
    """The commands of a shell block (``$`` sessions or plain command lines), or the run= command of an
    output block, each with its shown output."""
    lines = block.text.splitlines()
    if block.kind == "output":
        return [Step(block.directives["run"], lines)]
    if not block.text.startswith("$ "):  # plain command lines, continuations joined; nothing shown
        joined = re.sub(r"\\\n\s*", " ", block.text)
        return [Step(line, None) for line in joined.splitlines() if line.strip() and not line.startswith("#")]
    steps: list[Step] = []
    for line in lines:
        if line.startswith("$ "):
            steps.append(Step(line[2:], []))
        else:
            steps[-1].shown.append(line)
    return steps


def expected_exit(step: Step, block: Block, shown: list[str] | None = None) -> int | None:
    """The exit code the page gives the command: its ``# exit N`` comment, the block's exit=N, what its shown
    output implies, 0 for a command shown without output; None when the page does not say."""
    shown = step.shown if shown is None else shown
    for code in (_exit_comment(step.command), block.directives.get("exit"), implied_exit(shown) if shown else None):
        if code is not None:
            return int(code)
    return None if shown else 0


# -- comparing shown output with a real run --------------------------------------------------------------------

NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
VERSION = re.compile(r"\d+\.\d+\.\d+\S*")
PUNCTUATION = "()[]{},;:'\"`"


def _same_word(shown: str, actual: str) -> bool:
    if shown == actual:
        return True
    a, b = shown.strip(PUNCTUATION), actual.strip(PUNCTUATION)
    if shown.replace(a, "", 1) != actual.replace(b, "", 1):  # the punctuation around must be the same
        return False
    if VERSION.fullmatch(a) and VERSION.fullmatch(b):
        return True
    if not (NUMBER.fullmatch(a) and NUMBER.fullmatch(b)) or not re.search(r"[.eE]", a):
        return False
    x, y = float(a), float(b)
    if x == y:
        return True
    return x * y > 0 and max(abs(x), abs(y)) <= NUMBER_FACTOR * min(abs(x), abs(y))


def same_line(shown: str, actual: str) -> bool:
    """Equal words; numbers with a decimal point or exponent within NUMBER_FACTOR; versions any version."""
    a, b = shown.split(), actual.split()
    return len(a) == len(b) and all(_same_word(x, y) for x, y in zip(a, b, strict=True))


def _loose(line: str) -> list[str]:
    """A line's words with every number blanked: where a shown line belongs in a regenerated output."""
    return [NUMBER.sub("#", word) for word in line.split()]


def segments(shown: list[str]) -> list[list[str] | None]:
    """Shown lines split at ``...`` lines (None stands for each ``...``)."""
    parts: list[list[str] | None] = [[]]
    for line in shown:
        if line.strip() == "...":
            parts += [None, []]
        else:
            parts[-1].append(line)
    return [part for part in parts if part != []]


def _find(segment: list[str], actual: list[str], start: int, match) -> int | None:
    for at in range(start, len(actual) - len(segment) + 1):
        if all(match(s, a) for s, a in zip(segment, actual[at:at + len(segment)], strict=False)):
            return at
    return None


def compare(shown: list[str], actual: list[str], match=same_line) -> str | None:
    """None when ``actual`` is what ``shown`` shows; else what differs."""
    parts, position = segments(shown), 0
    for index, part in enumerate(parts):
        if part is None:
            continue
        anchored_start = index == 0
        anchored_end = index == len(parts) - 1
        if anchored_start and anchored_end:
            at = 0 if len(part) == len(actual) else None
            at = at if at == 0 and all(match(s, a) for s, a in zip(part, actual, strict=True)) else None
        elif anchored_start:
            at = 0 if _find(part, actual[:len(part)], 0, match) == 0 else None
        elif anchored_end:
            tail = len(actual) - len(part)
            at = tail if tail >= position and _find(part, actual, tail, match) == tail else None
        else:
            at = _find(part, actual, position, match)
        if at is None:
            return _difference(part, actual, position)
        position = at + len(part)
    return None


def _difference(part: list[str], actual: list[str], position: int) -> str:
    for line in part:
        if not any(same_line(line, a) for a in actual[position:]):
            return f"shown line not printed (from line {position + 1} of the output on):\n  {line!r}"
    return "shown lines not printed in this order or with other lines between them (no `...` there)"


def _loosely(shown: str, actual: str) -> bool:
    """The shown line's words, numbers blanked, begin the actual line's: where a drifted line now is."""
    words = _loose(shown)
    return bool(words) and _loose(actual)[:len(words)] == words


def _locate(line: str, actual: list[str], start: int) -> int | None:
    """Where a shown line is in the output from ``start`` on: the line itself, else one like it."""
    for match in (same_line, _loosely):
        found = _find([line], actual, start, match)
        if found is not None:
            return found
    return None


def regenerate(shown: list[str], actual: list[str]) -> list[str] | None:
    """The shown output rewritten from ``actual``, keeping its ``...`` elisions: each shown segment becomes the
    real lines from where its first line is to where its last is (each found as printed, else as a line like
    it); a segment at the start or end of the block reaches the start or end of the output.  None if a segment
    cannot be placed."""
    parts = segments(shown)
    if len(parts) == 1:
        return list(actual)
    out, position = [], 0
    for index, part in enumerate(parts):
        if part is None:
            out.append(next(line for line in shown if line.strip() == "..."))
            continue
        first = 0 if index == 0 else _locate(part[0], actual, position)
        if first is None:
            return None
        last = len(actual) - 1 if index == len(parts) - 1 else _locate(part[-1], actual, first + (len(part) > 1))
        if last is None:
            return None
        out += actual[first:last + 1]
        position = last + 1
    return out


# -- the working folder, its environment and the fixtures ----------------------------------------------------

class Workspace:
    """The fixtures the pages use, built once on first use, and one working folder per page.

    Fixtures are named as the pages name them (``llama-hf``, ``mixtral-tiny``, ``models/gpt2``, ...) and are
    copied into a page's folder when its text names them; ``fixtures.py`` builds them with transformers'
    ``from_config`` + ``save_pretrained`` and the tests' GGUF and Meta writers."""

    def __init__(self, base: Path):
        self.base = base
        self.built: dict[str, Path] = {}
        self.cache = base / "parity-cache"  # PARITY_CACHE: the synthetic stand-ins, shared by every page
        self.results: dict[tuple, tuple[int, str]] = {}
        self.files = shown_files(all_blocks())

    def fixture(self, name: str) -> Path:
        from tests.docs_fixtures import FIXTURES

        if name not in self.built:
            self.built[name] = FIXTURES[name](self.base / "fixtures" / name, self)
        return self.built[name]

    def hf_home(self, env: str) -> Path:
        if env == "hub":
            return self.fixture("hub")
        empty = self.base / "empty-hf-home"
        empty.mkdir(parents=True, exist_ok=True)
        return empty

    def folder(self, page: Path) -> Path:
        """A fresh working folder for ``page``: the fixtures its command blocks name, every shown ``.py`` file."""
        from tests.docs_fixtures import FIXTURES

        work = self.base / "pages" / page.stem
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
        text = "\n".join(block.text + " ".join(block.directives.values())
                          for block in (example.parsed for example in blocks_of(page)) if block.runs)
        for name in FIXTURES:
            if name != "hub" and name in text:
                source = self.fixture(name)  # a module the page names (`mlx_port:MLP`) is a .py file
                _place(source, work / (name if Path(name).suffix else name + source.suffix))
        for name, content in self.files.items():
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            (work / name).write_text(content, encoding="utf-8")
        return work

    def normalise(self, text: str, work: Path) -> str:
        for path, shown in ((work, "~/project"), (self.cache, "~/.cache/parity"), (self.base, "/tmp"),
                            (ROOT, "parity")):
            text = text.replace(str(path), shown)
        return text


def _place(source: Path, destination: Path) -> None:
    destination.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        shutil.copytree(source, destination, symlinks=True)
    elif source.stat().st_size > 20 << 20:  # a large file is linked, not copied
        destination.symlink_to(source)
    else:
        shutil.copy(source, destination)


@contextlib.contextmanager
def environment(workspace: Workspace, work: Path, env: str):
    """What a fresh shell in ``work`` would have: offline, the HF home of ``env``, parity's cache and the XDG
    caches in the temporary folder; restored afterwards (``pytest.MonkeyPatch``, which works outside pytest)."""
    import pytest

    from tests.support import use_hf_home

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("PARITY_CACHE", str(workspace.cache))
        patch.setenv("XDG_CACHE_HOME", str(workspace.base / "xdg-cache"))
        patch.delenv("PARITY_REQUIRE_REAL", raising=False)
        use_hf_home(patch, workspace.hf_home(env))
        patch.chdir(work)
        yield


def _tree_digest(work: Path, fixtures: set[str]) -> str:
    """What a command's output can depend on in its folder, fixtures aside (a fixture is the same on every page,
    and one a command names is in its folder): every other file's content (the page's files, what earlier
    commands wrote)."""
    digest = hashlib.sha256()
    for path in sorted(work.rglob("*")):
        relative = path.relative_to(work).as_posix()
        if any(relative == name or relative.startswith(name + "/") for name in fixtures):
            continue
        if path.is_file() and not path.is_symlink() and path.stat().st_size < 1 << 20:
            digest.update(relative.encode() + path.read_bytes())
    return digest.hexdigest()


def run_parity(workspace: Workspace, work: Path, args: list[str], env: str) -> tuple[int, str]:
    """``parity ARGS`` in this process (tests/support.py's ``_main``): exit code and what it printed, stdout
    and stderr together in the order written, as a terminal shows them.  Runs of the same command in a folder
    holding the same files are made once."""
    from tests.docs_fixtures import FIXTURES
    from tests.support import _main

    fixtures = set(FIXTURES) | {name + ".py" for name in FIXTURES}  # a module fixture is placed as NAME.py
    key = (tuple(args), env, _tree_digest(work, fixtures))
    if key not in workspace.results:
        out = io.StringIO()
        with environment(workspace, work, env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                code = _main(args)
            except SystemExit as stop:  # argparse's usage errors
                code = stop.code if isinstance(stop.code, int) else 2
        workspace.results[key] = (code, workspace.normalise(out.getvalue(), work))
    return workspace.results[key]


# -- evaluating a block --------------------------------------------------------------------------------------

def page_folder(example) -> Path:
    namespace = example.namespace
    if "work" not in namespace:
        namespace["work"] = namespace["workspace"].folder(Path(example.path))
    return namespace["work"]


def evaluate(example) -> str | None:
    """Sybil's evaluator for every block: None when the block ran as shown, else why not (an AssertionError)."""
    block: Block = example.parsed
    workspace: Workspace = example.namespace["workspace"]
    work = page_folder(example)
    if block.kind == "file":
        (work / block.directives["file"]).parent.mkdir(parents=True, exist_ok=True)
        (work / block.directives["file"]).write_text(block.text, encoding="utf-8")
        return None
    if not block.runs:
        return None
    if "prepare" in block.directives:
        from tests.docs_fixtures import PREPARE

        name, *args = block.directives["prepare"].split()
        with environment(workspace, work, block.directives.get("env", "offline")):
            PREPARE[name](work, *args)
    if block.kind == "python":
        from tests.docs_fixtures import run_python

        try:
            return run_python(workspace, work, block)
        except AssertionError:
            raise
        except Exception as error:  # what the reader would see: the block raises
            raise AssertionError(f"{block.name}: raised {type(error).__name__}: {error}") from error
    for step in steps_of(block):
        run_step(workspace, work, block, step, example.namespace.get("update"))
    return None


def command_args(block: Block, command: str) -> list[list[str]] | None:
    """The parity invocations of one command line (``a && b``); an install step (``pip install``) is left out:
    the suite runs where the test extra is installed.  Anything else cannot run here."""
    words = shlex.split(command, comments=True)
    runs, current = [], []
    for word in [*words, "&&"]:
        if word != "&&":
            current.append(word)
            continue
        if current[:2] == ["pip", "install"]:
            pass
        elif current[:1] == ["parity"]:
            runs.append(current[1:])
        elif current[:3] == ["python", "-m", "parity"]:
            runs.append(current[3:])
        else:
            raise AssertionError(f"{block.name}: the docs tests cannot run `{' '.join(current)}`: say in the "
                                 "paragraph above the block why it is not run by the docs tests")
        current = []
    return runs


def run_step(workspace: Workspace, work: Path, block: Block, step: Step, update: dict | None) -> None:
    """Run one command of a block and check it as the page shows it (or, updating, keep what it printed)."""
    env = block.directives.get("env", "offline")
    runs = command_args(block, step.command)
    if not runs:  # an install step alone (`pip install 'parity[mlx]'`): the test extra has installed it
        return
    code, printed = 0, ""
    for args in runs:
        code, printed = run_parity(workspace, work, args, env)
        if code:
            break
    actual = printed.splitlines()
    if update is not None and step.shown is not None:  # a block that shows output: regenerate it
        regenerated = regenerate(step.shown, actual) if step.shown else []
        expected = expected_exit(step, block, regenerated or step.shown)
        update.setdefault(id(block), []).append((step, regenerated, code, code if expected is None else expected))
        return
    expected = expected_exit(step, block)
    assert expected is not None, (f"{block.name}: `{step.command}`: the shown output does not end with its summary; "
                                  "add `# exit N` to the command, or exit=N to the block's docs directive")
    assert code == expected, (f"{block.name}: `{step.command}` exited {code}, the page says {expected}; "
                              f"it printed:\n{printed}")
    if step.shown:
        problem = compare(step.shown, actual)
        assert problem is None, f"{block.name}: `{step.command}`: {problem}\nit printed:\n{printed}"
