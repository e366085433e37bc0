"""A quantized checkpoint in a method no reader of parity's takes (torchao's, HQQ's, quark's FP8 ``weight`` beside
its per-row ``weight_scale``, a misspelt method): exit 2 naming the quant_method, locally and from the hub cache, never
its stored tensors judged as plain weights (float tensors under such a method passed before)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from .derived_checkpoints import format_fixtures
from .support import cache_repo, run_main, use_hf_home

root, model_a = format_fixtures("unread", dict(hidden_size=64, intermediate_size=128, num_key_value_heads=2))


def stated(a: Path, dest: Path, method: str, *, fp8_rows: bool) -> Path:
    """A's folder with config.json stating ``method``; ``fp8_rows``: every decoder matrix stored as FP8 codes
    (float8_e4m3fn, one float32 scale per output row as X.weight_scale), else A's weights kept."""
    shutil.copytree(a, dest)
    tensors = load_file(a / "model.safetensors")
    if fp8_rows:
        for name in [n for n, v in tensors.items() if ".layers." in n and v.dim() == 2]:
            scale = tensors[name].abs().amax(1, keepdim=True) / torch.finfo(torch.float8_e4m3fn).max
            tensors[name + "_scale"] = scale
            tensors[name] = (tensors[name] / scale).to(torch.float8_e4m3fn)
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "modules_to_not_convert": ["lm_head"]}
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.mark.parametrize(("method", "fp8_rows", "said"), [
    ("quark", True, "which transformers loads with its QuarkHfQuantizer"),
    ("torchao", False, "which transformers loads with its TorchAoHfQuantizer"),
    ("hqq", False, "which transformers loads with its HqqHfQuantizer"),
    ("gtpq", False, "which transformers' quantizers do not know either (did you mean 'gptq'?)"),
    ("modelopt", False, "which transformers' quantizers do not know either; parity reads"),
])
def test_a_quant_method_parity_does_not_read_is_exit_2_naming_it(model_a, root, capsys, method, fp8_rows, said):
    b = stated(model_a, root / method, method, fp8_rows=fp8_rows)
    for command in (("compare", model_a, b), (b,)):
        code, out, err = run_main(capsys, *command)
        assert code == 2, out + err
        assert f"quantization_config.quant_method is {method!r}, {said}" in err and "Traceback" not in err, err
        assert "parity reads fp8, mxfp8, fbgemm_fp8, compressed-tensors, gptq, awq" in err


def test_an_unread_quant_method_from_the_hub_cache_is_refused_the_same_way(model_a, root, tmp_path, capsys,
                                                                            monkeypatch):
    home = use_hf_home(monkeypatch, tmp_path / "hf")
    cache_repo(home, "someone/tiny-llama-quark", stated(model_a, root / "hub-quark", "quark", fp8_rows=True))
    code, out, err = run_main(capsys, "compare", model_a, "someone/tiny-llama-quark")
    assert code == 2, out + err
    assert "'someone/tiny-llama-quark': config.json's quantization_config.quant_method is 'quark'" in err
