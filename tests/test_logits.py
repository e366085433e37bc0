"""--logits: the target substituted inside the full transformers model."""

import pytest
import torch

import parity
from parity.engine.check import logits as logits_module

from . import mutants as m


def test_correct_module_leaves_logits_unchanged(tiny):
    report = parity.check(str(tiny["llama"]), logits=True)
    assert report.logits["weights"] == "real" and report.logits["layers"] == [0, 1, 2]
    assert report.logits["max_abs_diff"] < 1e-5 and report.logits["top1_agreement"] == 1.0


@pytest.fixture(scope="module")
def gpt2_wide(tmp_path_factory):
    """Tiny GPT-2 (transformers' own init) with c_fc weights scaled 10x, so each MLP's pre-activations
    reach |z| ~ 4, where exact and tanh GELU differ (most near 2.7).  At the shared fixture's weight
    scale |z| stays ~0.01: the GELU variants then move the logits by about float32 noise."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gpt2", n_embd=32, n_layer=3, n_head=2, n_positions=64, vocab_size=64)
    torch.manual_seed(31)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for block in model.transformer.h:
            block.mlp.c_fc.weight.mul_(10.0)
    folder = tmp_path_factory.mktemp("gpt2_wide") / "gpt2"
    model.save_pretrained(folder)
    return folder


def float64_logits(folder, exact_gelu: bool = False) -> tuple[torch.Tensor, float]:
    """The truth: the model's logits for parity's --logits tokens computed in float64 (with PyTorch's
    exact GELU in every MLP, when asked), and the largest |pre-activation| any MLP saw."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float64).eval()
    reached = []
    for block in model.transformer.h:
        if exact_gelu:
            block.mlp.act = torch.nn.GELU()
        block.mlp.act.register_forward_pre_hook(lambda _module, args: reached.append(float(args[0].abs().max())))
    with torch.no_grad():
        return model(logits_tokens(model)).logits, max(reached)


def logits_tokens(model) -> torch.Tensor:
    """The token ids parity.engine.check.logits feeds (seed 0)."""
    vocab = model.get_output_embeddings().weight.shape[0]
    return torch.randint(0, vocab, (1, logits_module.TOKENS), generator=torch.Generator().manual_seed(0))


def float32_noise(folder, truth: torch.Tensor) -> float:
    """How far transformers' own float32 forward is from the float64 one: the floor any comparison sits on."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return float((model(logits_tokens(model)).logits.double() - truth).abs().max())


def test_wrong_gelu_moves_logits(gpt2_wide):
    base, reached = float64_logits(gpt2_wide)
    moved, _ = float64_logits(gpt2_wide, exact_gelu=True)
    truth = float((moved - base).abs().max())  # what the exact GELU really does to these logits
    noise = float32_noise(gpt2_wide, base)
    assert reached > 2.5, reached  # the fixture reaches the range where the GELU variants differ
    assert truth > 100 * noise, (truth, noise)  # so the effect is measurable in float32 at all
    wrong = parity.check(str(gpt2_wide), target=m.gpt2_exact_gelu, logits=True).logits
    correct = parity.check(str(gpt2_wide), logits=True).logits
    assert wrong["max_abs_diff"] == pytest.approx(truth, rel=0.1), (wrong, truth, noise)  # 0.1 * truth >= 10x noise
    assert correct["max_abs_diff"] <= 10 * noise, (correct, noise)  # the right module moves them by noise only
    assert wrong["max_abs_diff"] < 0.01 * wrong["logit_scale"] and wrong["top1_agreement"] == 1.0  # subtle, not gross


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
