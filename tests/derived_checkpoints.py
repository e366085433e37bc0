"""Tiny checkpoints of transformers' families for the derived-layout tests: built with transformers' own classes
(``AutoConfig.for_model`` + ``from_config`` + ``save_pretrained``), their broken copies written with safetensors, and
the small ports and helpers several of those test modules share."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from .support import compare_json, run_main

COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, vocab_size=64, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)
KV = dict(num_key_value_heads=2, head_dim=16)

MOE = dict(intermediate_size=72, num_key_value_heads=2, head_dim=16, num_experts=4, num_local_experts=4,
           n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=24,
           n_shared_experts=1)


def build(model_type: str, folder: Path, seed: int, **values) -> Path:
    """A tiny checkpoint of ``model_type`` (COMMON's sizes, then ``values``), every parameter drawn afresh."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**COMMON, **values})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # distinct random values everywhere, biases included
        for param in model.parameters():
            param.normal_(0.0, 0.05)
    model.save_pretrained(folder)
    return folder


def with_selection_bias(folder: Path) -> Path:
    """DeepSeek's selection bias (a buffer, zero when built) set in the saved file to values that change which
    experts are chosen, so a port that puts it into the weights, or a B that changes it, differs."""
    from safetensors.torch import load_file, save_file

    weights = folder / "model.safetensors"
    tensors = load_file(weights)
    for name in [n for n in tensors if n.endswith("e_score_correction_bias")]:
        tensors[name] = torch.linspace(-0.2, 0.3, tensors[name].numel())
    save_file(tensors, weights, metadata={"format": "pt"})
    return folder


def broken_copy(folder: Path, dest: Path, change: str | tuple[str, str]) -> Path:
    """A copy whose layer 1 has two FFN tensors exchanged, or one negated, written with safetensors."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dest)
    tensors = load_file(dest / "model.safetensors")
    names = {name for name in tensors if ".1." in name}
    if isinstance(change, tuple):
        first, second = (next(n for n in names if n.endswith(f".1.{part}.weight")) for part in change)
        tensors[first], tensors[second] = tensors[second].clone(), tensors[first].clone()
    else:
        name = next(n for n in names if n.endswith(f".1.{change}.weight"))
        tensors[name] = -tensors[name]
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def build_all(root: Path, families: dict[str, tuple], breaker) -> dict[str, tuple[Path, Path]]:
    """model_type -> (its tiny checkpoint, ``breaker(folder, dest, how)``'s broken export of it), for a table whose
    rows hold the config values first and how a copy is broken third."""
    built = {}
    for seed, (model_type, (values, _, how, *_)) in enumerate(families.items()):
        folder = build(model_type, root / model_type, seed, **values)
        built[model_type] = folder, breaker(folder, root / f"{model_type}-broken", how)
    return built


class TwoLayer(nn.Module):
    """A classic FFN whose two projections carry a family's names."""

    def __init__(self, d: int, f: int, names: tuple[str, str], act, bias: bool = True):
        super().__init__()
        self.names, self.act = names, act
        setattr(self, names[0], nn.Linear(d, f, bias=bias))
        setattr(self, names[1], nn.Linear(f, d, bias=bias))

    def forward(self, x):
        return getattr(self, self.names[1])(self.act(getattr(self, self.names[0])(x)))


def tanh_gelu(x):
    return F.gelu(x, approximate="tanh")


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def in_report_order(units: list[tuple]) -> list[tuple]:
    """(layer, expert, unit) as a report lists them: by layer; the routed experts, then the named units."""
    return sorted(units, key=lambda u: (u[0], u[1] is None, u[1] or 0, u[2] or ""))


def assert_layer_one_named(capsys, good: Path, broken: Path, named: str) -> None:
    """``parity compare good broken`` of a two-layer derived layout whose layer 1 was broken: exit 1, layer 0 passes,
    layer 1 fails and is named ``named``, and the mapping says it was derived."""
    code, out, err = run_main(capsys, "compare", good, broken, "--json", "-")
    assert code == 1, out + err
    report = json.loads(out)
    verdicts = {layer["layer"]: layer for layer in report["layers"]}
    assert verdicts[0]["passed"] and not verdicts[1]["passed"]
    assert verdicts[1]["diagnosis"]["id"] == named
    assert report["mapping"].startswith("derived from transformers ")


def format_fixtures(name: str, sizes: dict):
    """The module-scoped fixtures a quantized format's tests start from, as (``root``, ``model_a``): a temporary
    folder named ``name`` for the module's checkpoints, and in it A, a tiny LLaMA of ``sizes`` (seed 3) that each of
    the module's exports converts.  A test module binds them under those names (pytest finds a fixture by its
    function's name): ``root, model_a = format_fixtures("fp8", SIZES)``."""

    @pytest.fixture(scope="module")
    def root(tmp_path_factory) -> Path:
        return tmp_path_factory.mktemp(name)

    @pytest.fixture(scope="module")
    def model_a(root) -> Path:
        return build("llama", root / "a", 3, **sizes)

    return root, model_a


def quantized_layer_one_named(capsys, a: Path, broken: Path, named: str, tensor: str) -> dict:
    """``parity compare A broken`` of a quantized export whose ``tensor`` of layer 1 was written with a mistake: exit
    1, layer 0 passes, layer 1 fails, named ``named`` in a message that names ``tensor``.  Returns layer 1's diagnosis,
    for the evidence each format's test checks."""
    code, report = compare_json(capsys, a, broken)
    assert code == 1, report
    verdicts = {layer["layer"]: layer for layer in report["layers"]}
    assert verdicts[0]["passed"], verdicts[0]
    assert not verdicts[1]["passed"]
    found = verdicts[1]["diagnosis"]
    assert found["id"] == named, found
    assert tensor in found["message"]
    return found


def quantized_copy(a: Path, dest: Path, quantize) -> dict[str, torch.Tensor]:
    """A's folder copied to ``dest``, and A's tensors with each decoder layer's matrix replaced by what
    ``quantize(name, value)`` returns for it (the tensors a format stores for that module); every other tensor as A
    holds it.  The caller edits and saves them (save_quantized), as each format's export does."""
    from safetensors.torch import load_file

    shutil.copytree(a, dest)
    out = {}
    for name, value in load_file(a / "model.safetensors").items():
        out.update(quantize(name, value) if ".layers." in name and value.dim() == 2 else {name: value})
    return out


def save_quantized(dest: Path, tensors: dict[str, torch.Tensor], quantization: dict) -> Path:
    """``tensors`` saved as ``dest``'s model.safetensors and ``quantization`` as its config.json's
    quantization_config."""
    from safetensors.torch import save_file

    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = quantization
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


def rows_scaled(a: Path, dest: Path, prefix: str, factor: float, rows: int = 8) -> Path:
    """A's folder copied to ``dest`` (once) with the first ``rows`` rows of each projection under ``prefix`` (a
    layer's FFN) multiplied by ``factor``: near-dead rows, as trained checkpoints hold them."""
    from safetensors.torch import load_file, save_file

    if dest.exists():
        return dest
    shutil.copytree(a, dest)
    tensors = load_file(dest / "model.safetensors")
    for name in [n for n in tensors if n.startswith(prefix) and n.endswith("_proj.weight")]:
        tensors[name][:rows] *= factor
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def parts_scaled(good: Path, dest: Path, parts: tuple[str, ...], factor: float) -> Path:
    """``good`` copied to ``dest`` with each tensor named in ``parts`` multiplied by ``factor`` in its own dtype (a
    scale stored off by a factor over the same codes), its safetensors metadata kept."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    shutil.copytree(good, dest)
    with safe_open(str(good / "model.safetensors"), "pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(dest / "model.safetensors")
    for name in parts:
        tensors[name] = (tensors[name].float() * factor).to(tensors[name].dtype)
    save_file(tensors, dest / "model.safetensors", metadata=metadata)
    return dest


# How a compressed-tensors config can leave down_proj unquantized while the checkpoint stores it quantized: its ignore
# list names it, the one config group targets gate and up only, or it targets nothing.
# Each: the edit, and the module a report then names (any projection where nothing is targeted).
UNSTATED = {"ignored": (lambda q: q["ignore"].append("re:.*down_proj$"), "down_proj"),
            "untargeted": (lambda q: q["config_groups"]["group_0"].update(targets=["re:.*(gate|up)_proj$"]),
                           "down_proj"),
            "no_targets": (lambda q: q["config_groups"]["group_0"].update(targets=[]), "_proj")}


def skip_listed(key: str, module: str = "down_proj"):
    """The config edit naming ``module`` in a transformers skip list ``key`` (modules_to_not_convert,
    llm_int8_skip_modules), which transformers matches as a suffix of each module's name."""
    return lambda q: q.update({key: [*(q.get(key) or []), module]})


def assert_module_not_stated(capsys, a: Path, b: Path, edit, module: str = "down_proj") -> None:
    """B's config.json rewritten by ``edit`` (an UNSTATED key, or a function of its quantization_config) so its
    loader would not quantize ``module``, its codes and scales kept: every unit fails, named
    quantized_module_not_stated in a message naming ``module``."""
    config = json.loads((b / "config.json").read_text())
    edit, module = UNSTATED[edit] if isinstance(edit, str) else (edit, module)
    edit(config["quantization_config"])
    (b / "config.json").write_text(json.dumps(config, indent=2))
    code, report = compare_json(capsys, a, b)
    assert code == 1, report
    found = [layer["diagnosis"] for layer in report["layers"]]
    assert {layer["layer"] for layer in report["layers"]} == {0, 1}, report["layers"]
    assert all(d["id"] == "quantized_module_not_stated" and f"{module} is stored quantized" in d["message"]
               for d in found), found


def assert_plain_module_named(capsys, a: Path, b: Path, module: str = "down_proj") -> None:
    """B's ``module`` of every layer replaced by A's float weight (its codes and scales dropped), its compressed-tensors
    config still quantizing it: every layer fails, quantized_module_stored_plain naming it; the same B with the
    module in ``ignore`` passes."""
    from safetensors.torch import load_file, save_file

    theirs, ours = load_file(b / "model.safetensors"), load_file(a / "model.safetensors")
    kept = {n: t for n, t in theirs.items() if f".{module}." not in n}
    kept.update({n: t for n, t in ours.items() if n.endswith(f".{module}.weight")})
    save_file(kept, b / "model.safetensors", metadata={"format": "pt"})
    code, report = compare_json(capsys, a, b)
    assert code == 1, report
    found = [layer["diagnosis"] for layer in report["layers"]]
    assert all(d["id"] == "quantized_module_stored_plain" and f"{module} is stored unquantized" in d["message"]
               for d in found) and len(found) == 2, found
    config = json.loads((b / "config.json").read_text())
    config["quantization_config"]["ignore"].append(f"re:.*{module}$")
    (b / "config.json").write_text(json.dumps(config, indent=2))
    code, report = compare_json(capsys, a, b)
    assert code == 0, report


# Edits of one stored tensor a hostile or broken export makes (None: the tensor deleted)
HOSTILE_PARTS = {"delete": None, "int8": lambda t: t.to(torch.int8), "flat": lambda t: t.flatten(),
                 "drop_row": lambda t: t[:-1], "half": lambda t: t.half(),
                 "scalar": lambda t: t.flatten()[:1].reshape(())}


def assert_hostile_part_refused(capsys, a: Path, b: Path, name: str, edit, code: int) -> None:
    """B's stored tensor ``name`` replaced by ``edit(tensor)`` (deleted where ``edit`` is None): ``parity compare A
    B`` ends with ``code`` (2: refused naming the tensor's module; 1: the layer's finding), never an internal
    error."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(b / "model.safetensors")
    value = tensors.pop(name)
    if edit is not None:
        tensors[name] = edit(value).contiguous()
    save_file(tensors, b / "model.safetensors", metadata={"format": "pt"})
    found, out, err = run_main(capsys, "compare", a, b)
    assert found == code, out + err
    assert "internal error" not in err and "Traceback" not in err, err
    module = name.split(".mlp.")[1].split(".")[0]
    assert module in (err if code == 2 else out), out + err
