"""`parity compare` tells the synthetic truth as every other door does, and never passes on nothing silently: a
stand-in on either side is SYNTHETIC in the text, JSON, JUnit and HTML, --require-real (and ``require_real=True``)
refuses it, A and B one set of files is said in the summary, and a revision given with a local path is exit 2
naming the option."""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET

import pytest

import parity
from parity.errors import SyntheticWeightsError

from .builders import tiny_stand_in, written_stand_in
from .conftest import TINY
from .support import run_main

TINY_GPT2 = TINY["gpt2"] | {"architectures": ["GPT2LMHeadModel"], "activation_function": "gelu_new"}


@pytest.fixture
def stand_in(monkeypatch, tmp_path, capsys):
    """`gpt2` offline is a tiny synthetic stand-in; returns a local copy of it (a real B holding its values)."""
    tiny_stand_in(monkeypatch, tmp_path, "gpt2", TINY_GPT2)
    return str(written_stand_in(capsys, tmp_path, "gpt2"))


def test_a_stand_in_is_synthetic_in_every_view(stand_in, tmp_path, capsys):
    b = stand_in
    out_json, out_xml, out_html = (tmp_path / f"r.{ext}" for ext in ("json", "xml", "html"))
    code, out, err = run_main(capsys, "compare", "gpt2", b, "--json", out_json, "--junit", out_xml, "--html", out_html)
    assert code == 0, err
    assert "!! SYNTHETIC weights (A)" in out and "openai-community/gpt2" in out
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("PASS") and "SYNTHETIC weights" in summary and "--require-real" in summary
    report = json.loads(out_json.read_text())
    assert report["weights"] == "synthetic" and report["comparison"]["reference"]["weights"] == "synthetic"
    assert report["comparison"]["candidate"]["weights"] == "real"
    cases = ET.parse(out_xml).getroot().iter("testcase")
    assert all("(synthetic weights)" in case.get("name") for case in cases)
    assert "SYNTHETIC WEIGHTS" in out_html.read_text()
    for view in (out, out_html.read_text(), report["weights_note"]):  # a compare has no --checkpoint to suggest
        assert "--checkpoint" not in view and "local path or a reachable hub id" in view


def test_require_real_refuses_a_stand_in_before_anything_is_compared(stand_in, capsys):
    b = stand_in
    code, out, err = run_main(capsys, "compare", "gpt2", b, "--require-real")
    assert code == 2 and not out.strip()
    assert "gpt2: real weights are required" in err and "Traceback" not in err
    with pytest.raises(SyntheticWeightsError, match="real weights are required"):
        parity.compare("gpt2", b, require_real=True)
    assert parity.compare("gpt2", b, layers=[0]).synthetic  # the library's default: compared, and says so


def test_a_checkpoint_compared_with_itself_says_it_judged_no_conversion(stand_in, tiny, capsys):
    """`parity compare gpt2 gpt2` offline once passed 'bit-identical' on the stand-in with no word of it: now the
    stand-in is SYNTHETIC, and A and B being one set of files is said in the summary and the JSON's notes."""
    code, out, err = run_main(capsys, "compare", "gpt2", "gpt2")
    summary = out.strip().splitlines()[-1]
    assert code == 0 and "A and B are the same files" in summary and "SYNTHETIC" in summary, err
    code, out, err = run_main(capsys, "compare", str(tiny["llama"]), str(tiny["llama"]) + "/", "--json", "-")
    report = json.loads(out)
    assert code == 0 and any(n.startswith("A and B are the same files") for n in report["notes"]), err
    assert "A and B are the same files" not in run_main(capsys, "compare", "gpt2", stand_in)[1]


@pytest.mark.parametrize("option, side", [("--revision", "A"), ("--revision-b", "B")])
def test_a_revision_with_a_local_path_is_exit_2_naming_the_option(tiny, tmp_path, capsys, option, side):
    other = shutil.copytree(tiny["llama"], tmp_path / "llama-copy")
    code, _, err = run_main(capsys, "compare", str(tiny["llama"]), str(other), option, "v2")
    assert code == 2, err
    assert f"{option} v2:" in err and "is a local path" in err
    assert (str(tiny["llama"]) if side == "A" else str(other)) in err


def test_a_check_refuses_a_revision_with_a_local_path_too(tiny, capsys):
    code, _, err = run_main(capsys, str(tiny["llama"]), "--revision", "v2")
    assert code == 2 and "--revision v2:" in err and "is a local path" in err
