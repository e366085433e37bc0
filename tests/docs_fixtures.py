"""The files the documentation's commands use, named as the pages name them, and the steps a page describes in
words (``PREPARE``).  Checkpoints are the tests' own: transformers' ``from_config`` + ``save_pretrained``, the
tests' GGUF writer (tests/gguf_files.py, the gguf package's own quantizers) and Meta layout (tests/builders.py);
the fake Hugging Face cache is laid out as huggingface_hub lays one (as tests/conftest.py's ``hf_cache``).

Each builder takes (destination, workspace) and returns the path it made; tests/docs_runner.py builds one the
first time a page's text names it."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .builders import MIXTRAL, write_meta
from .conftest import TINY, build_model, save
from .docs_runner import ROOT, Block, Workspace, environment

# docs/compare.md's fixture's sizes (Q8_0 needs rows of 32 values), 12 layers: the pages' `layers=[0, 11]`
LLAMA_SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=12)
# hub id -> (model_type, seed, overrides, revisions): what `env=hub` blocks find in the Hugging Face cache; each
# revision is a commit of its own (refs/<revision>), holding the same files
HUB_REPOS = {
    "openai-community/gpt2": ("gpt2", 21, dict(n_layer=12), ["main"]),  # 12 layers: the pages' `layers = [0, 11]`
    "TinyLlama/TinyLlama-1.1B-Chat-v1.0": ("llama", 22, {}, ["main"]),  # the llama mapping's default checkpoint
    "Qwen/Qwen2.5-0.5B": ("qwen2", 23, {}, ["main"]),
    "org/model": ("llama", 24, dict(num_hidden_layers=4), ["main", "v1", "v2"]),  # compare.md's --revision v1/v2
}


def _saved(destination: Path, model_type: str, seed: int, **overrides) -> Path:
    return save(build_model(model_type, seed=seed, **overrides), destination)


def hub(destination: Path, workspace: Workspace) -> Path:
    """An HF_HOME whose hub cache holds HUB_REPOS: blobs, a snapshot of symlinks per commit, refs/<revision>."""
    for repo, (model_type, seed, overrides, revisions) in HUB_REPOS.items():
        source = _saved(workspace.base / "hub-sources" / repo, model_type, seed, **overrides)
        repo_dir = destination / "hub" / ("models--" + repo.replace("/", "--"))
        (repo_dir / "refs").mkdir(parents=True)
        (repo_dir / "blobs").mkdir()
        for file in source.iterdir():
            shutil.copy(file, repo_dir / "blobs" / f"{file.name}.blob")
        for number, revision in enumerate(revisions):
            commit = f"{number:040x}"
            (repo_dir / "refs" / revision).write_text(commit)
            snapshot = repo_dir / "snapshots" / commit
            snapshot.mkdir(parents=True)
            for file in source.iterdir():
                (snapshot / file.name).symlink_to(os.path.relpath(repo_dir / "blobs" / f"{file.name}.blob", snapshot))
    return destination


def port(module: str, names: str):
    """A port module under the name frameworks.md uses: the tests' own port (tests/mlx_ports.py, ...), whose
    classes the page's commands name."""

    def build(destination: Path, workspace: Workspace) -> Path:
        destination = destination.with_suffix(".py")  # the page names the module, `mlx_port:MLP`
        destination.parent.mkdir(parents=True, exist_ok=True)
        destination.write_text(f"from tests.{module} import {names}  # noqa: F401\n", encoding="utf-8")
        return destination

    return build


def llama_hf(destination: Path, workspace: Workspace) -> Path:
    return _saved(destination, "llama", 41, **LLAMA_SIZES)


def llama_gguf(destination: Path, workspace: Workspace, qtype: str = "Q8_0") -> Path:
    from gguf import GGMLQuantizationType as Q
    from transformers import AutoModelForCausalLM

    from .gguf_files import gguf_from_hf

    model = AutoModelForCausalLM.from_pretrained(workspace.fixture("llama-hf"))
    destination.parent.mkdir(parents=True, exist_ok=True)
    return gguf_from_hf(model, destination, "llama", getattr(Q, qtype))


def gemma3_shape_gguf(destination: Path, workspace: Workspace) -> Path:
    """Gemma-3-270M's FFN shapes (d 640, d_ff 2048, 18 layers), random N(0, 0.02), as Q8_0: 54 tensors."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    from .gguf_files import write_gguf

    rng = np.random.default_rng(3)
    d, ff, layers = 640, 2048, 18
    tensors = {}
    for layer in range(layers):
        for name, shape in (("ffn_gate.weight", (ff, d)), ("ffn_up.weight", (ff, d)), ("ffn_down.weight", (d, ff))):
            tensors[f"blk.{layer}.{name}"] = ((rng.standard_normal(shape) * 0.02).astype(np.float32), Q.Q8_0)
    meta = {"block_count": layers, "embedding_length": d, "feed_forward_length": ff, "attention.head_count": 4,
            "attention.head_count_kv": 1, "attention.key_length": 256, "context_length": 32768,
            "attention.layer_norm_rms_epsilon": 1e-6}
    destination.parent.mkdir(parents=True, exist_ok=True)
    return write_gguf(destination, "gemma3", meta, tensors)


def stories(destination: Path, workspace: Workspace) -> Path:
    """llama2.c's stories15M shape in Meta's layout: d 288, 6 layers, multiple_of 32 (d_ff 768)."""
    return write_meta(destination, dim=288, n_layers=6, multiple_of=32, seed=5)


def mixtral_tiny(destination: Path, workspace: Workspace) -> Path:
    from .builders import tiny_model

    return save(tiny_model("mixtral", 41, **MIXTRAL), destination)


def deepseek_tiny(destination: Path, workspace: Workspace) -> Path:
    """DeepSeek V3 at a tiny size: layer 0 dense, layers 1-2 four routed experts and a shared one (formats.md)."""
    from .derived_checkpoints import MOE, build

    return build("deepseek_v3", destination, 43, **dict(MOE, num_hidden_layers=3, first_k_dense_replace=1, n_group=2,
                                                         topk_group=1))


def onnx_layer0(destination: Path, workspace: Workspace) -> Path:
    """Layer 0 of the hub cache's GPT-2, exported by torch's own exporter (as tests/test_frameworks.py)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(workspace.base / "hub-sources" / "openai-community/gpt2").eval()
    destination.parent.mkdir(parents=True, exist_ok=True)
    torch.onnx.export(model.transformer.h[0].mlp, (torch.zeros(1, 4, model.config.n_embd),), destination,
                      dynamo=True, verbose=False, external_data=False)  # one file, as the page names one
    return destination


FIXTURES = {
    "hub": hub,
    "llama-hf": llama_hf,
    "llama-Q8_0.gguf": llama_gguf,
    "models/gpt2": lambda dest, ws: _saved(dest, "gpt2", 31),
    "path/to/llama": lambda dest, ws: _saved(dest, "llama", 32, num_hidden_layers=12),  # api.md: layers=[0, 11]
    "llama-checkpoint": lambda dest, ws: _saved(dest, "llama", 33),  # TINY's d 32, d_ff 88, as the page shows
    "model.gguf": lambda dest, ws: llama_gguf(dest, ws, "F32"),
    "gemma3-270m-shape.gguf": gemma3_shape_gguf,
    "stories15M": stories,
    "mixtral-tiny": mixtral_tiny,
    "deepseek-tiny": deepseek_tiny,
    "ffn_layer0.onnx": lambda dest, ws: (ws.fixture("hub"), onnx_layer0(dest, ws))[1],
    "mlx_port": port("mlx_ports", "MLP"),
    "nnx_port": port("nnx_ports", "GPT2MLP as MLP"),  # frameworks.md checks it on GPT-2
    "moe_port": port("moe_block_ports", "DeepSeekBlock, DeepSeekScalingDropped"),  # formats.md: whole blocks
}
assert TINY["llama"]["intermediate_size"] == 88  # own-module.md shows llama-checkpoint's [88, 32]


# -- steps a page describes in words ---------------------------------------------------------------------------

def _edit_baseline(work: Path, name: str, edit) -> None:
    path = work / name
    data = json.loads(path.read_text())
    keys = sorted(data["entries"])
    edit(data["entries"], keys)
    path.write_text(json.dumps(data, indent=2, sort_keys=True))


def baseline_tenth(work: Path, name: str) -> None:
    """Layer 0's stored max|Δ| edited to a tenth: today's run is then a 10x regression."""

    def edit(entries, keys):
        entry = entries[next(k for k in keys if k.endswith("layer 0000"))]
        entry["max_abs_diff"] = entry["max_abs_diff"] / 10

    _edit_baseline(work, name, edit)


def baseline_other_weights(work: Path, name: str) -> None:
    """Layer 0's entry given layer 1's fingerprint: an entry made from other weights."""

    def edit(entries, keys):
        first = next(k for k in keys if k.endswith("layer 0000"))
        second = next(k for k in keys if k.endswith("layer 0001"))
        entries[first]["max_abs_diff"] = entries[first]["max_abs_diff"] * 10  # undo baseline_tenth
        entries[first]["fingerprint"] = entries[second]["fingerprint"]

    _edit_baseline(work, name, edit)


def synthetic_written(work: Path, model: str) -> None:
    """The synthetic stand-in of ``model`` with its layer-0 shard written, as any check of it leaves it (a fresh
    cache shows the shards as not written yet): whichever page ran first, the same state."""
    import parity

    parity.load_ffn(model, layer=0)


PREPARE = {"baseline_tenth": baseline_tenth, "baseline_other_weights": baseline_other_weights,
           "synthetic_written": synthetic_written}


# -- Python blocks ---------------------------------------------------------------------------------------------

def run_python(workspace: Workspace, work: Path, block: Block) -> None:
    """A Python block: a test module (it defines ``test_`` functions) runs under pytest in a real process, as
    its reader would run it; any other block is executed here, in the page's folder, which is importable."""
    env = block.directives.get("env", "offline")
    if "def test_" in block.text:
        return _run_pytest(workspace, work, block, env)
    path, modules = list(sys.path), set(sys.modules)
    out = io.StringIO()
    try:
        with environment(workspace, work, env), contextlib.redirect_stdout(out):
            sys.path.insert(0, str(work))
            exec(compile(block.text, block.name, "exec"), {"__name__": "__docs__"})  # noqa: S102
    finally:
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            if (getattr(sys.modules[name], "__file__", None) or "").startswith(str(work)):
                del sys.modules[name]
    return None


def _run_pytest(workspace: Workspace, work: Path, block: Block, env: str) -> None:
    """The pages' test modules run together, in one real pytest process (its start-up and torch's import are
    most of the time), in a folder holding every one of them and the files the pages show; each block then
    asserts its own module's outcome."""
    outcomes = workspace.__dict__.setdefault("pytest_outcomes", {})
    if not outcomes:
        outcomes.update(_run_test_modules(workspace, env))
    name = _test_module(block)
    assert name in outcomes, f"{block.name}: its test module did not run (env={env}; the pages' test modules share one)"
    failed, log = outcomes[name]
    assert not failed, f"{block.name}: pytest failed on it:\n{log}"


def _test_module(block: Block) -> str:
    return f"test_docs_{block.page.stem.lower().replace('-', '_')}_{block.line}"


def _run_test_modules(workspace: Workspace, env: str) -> dict[str, tuple[bool, str]]:
    from xml.etree import ElementTree

    from .docs_runner import all_blocks

    folder = workspace.base / "pytest-blocks"
    folder.mkdir()
    for name, content in workspace.files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(content, encoding="utf-8")
    modules = [b for b in all_blocks() if b.runs and b.kind == "python" and "def test_" in b.text
               and b.directives.get("env", "offline") == env]
    for module in modules:
        (folder / f"{_test_module(module)}.py").write_text(module.text, encoding="utf-8")
    with environment(workspace, folder, env):
        child = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(folder)])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "--junitxml=outcome.xml"], cwd=folder, env=child, capture_output=True, text=True,
                          timeout=600)
    log = done.stdout + done.stderr
    assert (folder / "outcome.xml").is_file(), f"pytest of the pages' test modules did not run:\n{log}"
    failed = {_test_module(m): False for m in modules}
    for case in ElementTree.parse(folder / "outcome.xml").iter("testcase"):
        module = case.get("classname", "").split(".")[-1]
        if module in failed and (case.find("failure") is not None or case.find("error") is not None):
            failed[module] = True
    return {module: (bad, log) for module, bad in failed.items()}
