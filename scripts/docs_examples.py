#!/usr/bin/env python
"""Run every command the documentation shows (README.md, docs/*.md) against the tests' fixtures, offline, and
check its shown output; with --update, rewrite the shown outputs from the real runs, so they cannot drift.

    python scripts/docs_examples.py            # check, as tests/test_docs_examples.py does
    python scripts/docs_examples.py --update   # regenerate the shown outputs
    python scripts/docs_examples.py docs/ci.md # one page (or several)

What is run and how output is compared: tests/docs_runner.py.  --update keeps each block's ``...`` elisions
(the lines around them are re-read from the run) and says which blocks it could not place or whose exit code
no longer matches the page's words: those need a hand edit.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["HF_HUB_OFFLINE"] = "1"  # before huggingface_hub is imported: the docs run offline


def rewrite(page: Path, examples, updates: dict) -> list[str]:
    """The page with each checked block's output replaced by the regenerated one; what needs a hand edit."""
    from tests.docs_runner import Block

    text, problems, pieces, position = page.read_text(encoding="utf-8"), [], [], 0
    for example in examples:
        block: Block = example.parsed
        if id(block) not in updates:
            continue
        lines, ok = [], True
        for step, regenerated, code, expected in updates[id(block)]:
            if regenerated is None:
                problems.append(f"{block.name}: `{step.command}`: the shown lines around `...` are not in the output")
                ok = False
            elif code != expected:
                problems.append(f"{block.name}: `{step.command}` exits {code}, the page says {expected}")
            if block.kind == "shell":
                lines.append(f"$ {step.command}")
            lines += regenerated if regenerated is not None else step.shown
        if ok:
            pieces += [text[position:block.start], "\n".join(lines) + "\n"]
            position = block.end
    page.write_text("".join(pieces) + text[position:], encoding="utf-8")
    return problems


def main(argv: list[str] | None = None) -> int:
    from tests.docs_runner import PAGES, Workspace, blocks_of

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pages", nargs="*", type=Path, help="pages to run (default: README.md and docs/*.md)")
    parser.add_argument("--update", action="store_true", help="rewrite the shown outputs from real runs")
    args = parser.parse_args(argv)
    pages = [page.resolve() for page in args.pages] or PAGES
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="parity-docs-") as base:
        workspace = Workspace(Path(base))
        for page in pages:
            document, updates = blocks_of(page), {}
            examples = list(document)
            document.namespace.update(workspace=workspace, update=updates if args.update else None)
            for example in examples:
                try:
                    example.evaluate()
                except AssertionError as error:
                    failures.append(str(error))
            if args.update:
                failures += rewrite(page, examples, updates)
            name = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
            print(f"{name}: {sum(e.parsed.runs for e in examples)} block(s) run", flush=True)
    for failure in failures:
        print(f"\n{failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
