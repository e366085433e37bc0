"""--logits: the target substituted inside the full transformers model."""

import parity
from parity import logits as logits_module

from . import mutants as m


def test_correct_module_leaves_logits_unchanged(tiny):
    report = parity.check(str(tiny["llama"]), logits=True)
    assert report.logits["weights"] == "real" and report.logits["layers"] == [0, 1, 2]
    assert report.logits["max_abs_diff"] < 1e-5 and report.logits["top1_agreement"] == 1.0


def test_wrong_gelu_moves_logits(tiny):
    wrong = parity.check(str(tiny["gpt2"]), target=m.gpt2_exact_gelu, logits=True).logits
    correct = parity.check(str(tiny["gpt2"]), logits=True).logits
    assert wrong["max_abs_diff"] > 10 * correct["max_abs_diff"] and wrong["max_abs_diff"] < 1e-1


def test_swapped_gate_up_moves_logits_more(tiny):
    swapped = parity.check(str(tiny["gemma3_text"]), target=m.SwappedGeGLU, logits=True).logits
    correct = parity.check(str(tiny["gemma3_text"]), logits=True).logits
    assert swapped["max_abs_diff"] > 1000 * max(correct["max_abs_diff"], 1e-9)


def test_too_large_for_memory_is_said_not_crashed(tiny, monkeypatch):
    monkeypatch.setattr(logits_module, "available_memory", lambda: 1024)
    report = parity.check(str(tiny["llama"]), layers=[0], logits=True)
    assert "GiB" in report.logits["skipped"] and report.passed


def test_logits_in_json(tiny):
    import json

    data = json.loads(parity.check(str(tiny["qwen2"]), layers=[1], logits=True).to_json())
    assert set(data["logits"]) >= {"max_abs_diff", "top1_agreement", "tokens", "layers", "weights"}
