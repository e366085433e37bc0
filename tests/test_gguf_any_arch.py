"""GGUF files of architectures no mapping file names: the config from transformers' own GGUF tables, the FFN tensors
found through gguf's own name map for ``general.architecture`` (parity/sources/gguf_config.py,
parity/engine/layout/gguf.py).

Each file is written with gguf's GGUFWriter from the tensors of a tiny checkpoint built with transformers' own
classes (from_config + save_pretrained), under the names llama.cpp's converter gives them (spelled out here, per
family, not looked up in gguf's map): so the truth is known.  ``parity compare HF FILE.gguf`` passes, a broken export
fails on the broken layer only and is named, ``parity FILE.gguf`` passes with the default target, and an
architecture gguf or transformers cannot read is exit 2 in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from .gguf_files import Q, gguf_of_folder, tiny_hf
from .support import run_main

GATED = {"mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
         "mlp.down_proj.weight": "ffn_down.weight"}
KV = dict(num_key_value_heads=2)

# GGUF architecture -> (transformers model_type, config values, HF name under the layer -> llama.cpp's name under
# blk.N, what the broken export does to layer 1 (two GGUF names: exchanged; one: negated), the diagnosis compare
# names, the default target)
FAMILIES = {
    "qwen3": ("qwen3", dict(intermediate_size=64, head_dim=16, **KV), GATED, ("ffn_gate.weight", "ffn_up.weight"),
              "gate_up_exchanged", "parity.ffn:SwiGLU"),
    "stablelm": ("stablelm", dict(intermediate_size=64, **KV), GATED, ("ffn_gate.weight", "ffn_up.weight"),
                 "gate_up_exchanged", "parity.ffn:SwiGLU"),
    "phi3": ("phi3", dict(intermediate_size=64, **KV),  # gate and up fused in one tensor, in HF and in GGUF
             {"mlp.gate_up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"},
             "ffn_down.weight", "sign_flipped", "parity.ffn:SwiGLU"),
    "starcoder2": ("starcoder2", dict(intermediate_size=128, **KV),  # classic FFN with biases, tanh GELU
                   {"mlp.c_fc.weight": "ffn_up.weight", "mlp.c_fc.bias": "ffn_up.bias",
                    "mlp.c_proj.weight": "ffn_down.weight", "mlp.c_proj.bias": "ffn_down.bias"},
                   "ffn_down.weight", "sign_flipped", "parity.ffn:FeedForward"),
    "falcon": ("falcon", dict(), {"mlp.dense_h_to_4h.weight": "ffn_up.weight",  # classic, exact GELU, no biases
                                  "mlp.dense_4h_to_h.weight": "ffn_down.weight"},
               "ffn_down.weight", "sign_flipped", "parity.ffn:FeedForward"),
    "nemotron": ("nemotron", dict(intermediate_size=64, head_dim=16, **KV),  # squared ReLU: no parity.ffn module
                 {"mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"},
                 "ffn_down.weight", "sign_flipped", None),
}
QTYPES = [Q.F32, Q.F16, Q.Q8_0]


def broken(change):
    """edit(layer, tensors) for gguf_of_folder: layer 1's two tensors exchanged, or one negated."""
    def edit(layer: int, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if layer != 1:
            return tensors
        tensors = dict(tensors)
        if isinstance(change, tuple):
            first, second = change
            tensors[first], tensors[second] = tensors[second], tensors[first]
        else:
            tensors[change] = -tensors[change]
        return tensors
    return edit


@pytest.fixture(scope="session")
def files(tmp_path_factory) -> dict[str, dict]:
    """arch -> {'hf': the tiny checkpoint, QTYPE name: its GGUF, 'broken': a Q8_0 GGUF with layer 1 broken}."""
    root = tmp_path_factory.mktemp("gguf-any")
    built = {}
    for seed, (arch, (model_type, values, names, change, _, _)) in enumerate(FAMILIES.items()):
        hf = tiny_hf(model_type, root / f"{arch}-hf", 40 + seed, **values)
        built[arch] = {"hf": hf, **{q.name: gguf_of_folder(hf, root / f"{arch}-{q.name}.gguf", arch, names, q)
                                    for q in QTYPES},
                       "broken": gguf_of_folder(hf, root / f"{arch}-broken.gguf", arch, names, Q.Q8_0, broken(change))}
    return built


@pytest.mark.parametrize("qtype", [q.name for q in QTYPES])
@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_compare_hf_against_its_gguf(capsys, files, arch, qtype):
    code, out, err = run_main(capsys, "compare", files[arch]["hf"], files[arch][qtype], "--json", "-")
    assert code == 0, out + err
    report = json.loads(out)
    assert [layer["passed"] for layer in report["layers"]] == [True, True]
    candidate = report["comparison"]["candidate"]["mapping"]
    assert candidate.startswith("derived from transformers ") and candidate.endswith(f"'{arch}' map")


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_broken_gguf_fails_on_the_broken_layer_only(capsys, files, arch):
    code, out, err = run_main(capsys, "compare", files[arch]["hf"], files[arch]["broken"], "--json", "-")
    assert code == 1, out + err
    verdicts = {layer["layer"]: layer for layer in json.loads(out)["layers"]}
    assert verdicts[0]["passed"] and not verdicts[1]["passed"]
    assert verdicts[1]["diagnosis"]["id"] == FAMILIES[arch][4]


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_check_with_the_default_target(capsys, files, arch):
    """The default target the derived layout chooses passes; where no parity.ffn module expresses the FFN, exit 2
    in one line saying what the repository lacks, as for a Hugging Face folder."""
    if FAMILIES[arch][5] is None:
        code, out, err = run_main(capsys, files[arch]["Q8_0"])
        assert code == 2 and "no module of the repository (parity.ffn) expresses" in one_line(err), out + err
        return
    code, out, err = run_main(capsys, files[arch]["Q8_0"], "--layers", "all", "--json", "-")
    assert code == 0, out + err
    report = json.loads(out)
    assert report["passed"] and len(report["layers"]) == 2
    assert report["target"] == FAMILIES[arch][5] and report["mapping"].endswith(f"'{arch}' map")


def test_a_conv1d_family_reads_ggufs_linear_layout(files, tmp_path):
    """GPT-2 (transformers' Conv1D, [in, out]): llama.cpp's converter stores [out, in]; the derived routes transpose
    it back for GPT2MLP and give parity.ffn's nn.Linear the stored tensor."""
    from parity.engine.layout.resolve import resolve

    from .conftest import build_model
    from .gguf_files import gguf_gpt2

    path = gguf_gpt2(build_model("gpt2", seed=3), tmp_path / "gpt2.gguf")
    mapping = resolve(str(path)).mapping
    reference = {r.target: (r.source, r.transform) for r in mapping.reference_tensors}
    assert reference["c_fc.weight"] == ("ffn_up.weight", "transpose")
    assert reference["c_fc.bias"] == ("ffn_up.bias", "none")
    assert {r.target: (r.source, r.transform) for r in mapping.tensors}["_layer1.weight"] == ("ffn_up.weight", "none")


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("arch, said", [
    ("nosucharch", "unknown to gguf"),
    ("olmo2", "gguf knows it, but transformers' GGUF loader cannot turn it into a config"),
])
def test_an_architecture_gguf_or_transformers_cannot_read_is_exit_2(capsys, files, tmp_path, arch, said):
    import transformers

    from parity.sources.gguf_header import gguf_version

    path = gguf_of_folder(files["qwen3"]["hf"], tmp_path / f"{arch}.gguf", arch, GATED)
    for args in ([path], ["compare", files["qwen3"]["hf"], path]):
        code, out, err = run_main(capsys, *args)
        line = one_line(err)
        assert code == 2 and f"GGUF architecture '{arch}' is not supported" in line and said in line, out + err
        assert f"gguf {gguf_version()}" in line and f"transformers {transformers.__version__}" in line
        assert "parity FOLDER" in line


def test_a_mixture_of_experts_file_stays_on_its_mapping_file(files):
    """A 'llama' GGUF with experts (Mixtral) is read through mappings/mixtral-gguf.toml, not derived."""
    from parity.definitions.registry import builtin_mappings

    assert Path(builtin_mappings()["mixtral-gguf"].path).name == "mixtral-gguf.toml"
