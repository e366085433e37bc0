"""Every broken input ends in exit code 2 with a message naming the problem: never a
traceback, never a hang, never a write into the checkpoint folder.

Each case runs the `parity` command (parity.cli.main, in this process) on a broken copy
of a tiny checkpoint (the session fixtures are never modified); a run that hangs fails.
A few representative cases also run the real executable (marked slow), concurrently in
one module fixture, since each pays the torch/transformers import.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import stat
import struct
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from parity.definitions.datafiles import builtin_mapping_dir

from .hostile_files import ARRAY, STRING, UINT32, nested_arrays
from .hostile_files import Value as HValue
from .support import ROOT, run_main, run_parity, use_hf_home

ST = "model.safetensors"
GATE0 = "model.layers.0.mlp.gate_proj.weight"
UP0 = "model.layers.0.mlp.up_proj.weight"
DOWN0 = "model.layers.0.mlp.down_proj.weight"


# -- building broken inputs -----------------------------------------------------------------
def header(path: Path) -> tuple[int, dict, bytes]:
    data = path.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    return length, json.loads(data[8:8 + length]), data


def write_header(path: Path, new_header: dict, old_length: int, data: bytes) -> None:
    text = json.dumps(new_header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + old_length:])


def edit_tensors(path: Path, edit: Callable[[dict], None]) -> None:
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def truncate_half(folder: Path) -> None:
    data = (folder / ST).read_bytes()
    (folder / ST).write_bytes(data[: len(data) // 2])


def garbage_header(folder: Path) -> None:
    data = bytearray((folder / ST).read_bytes())
    data[8:200] = b"\xff" * 192
    (folder / ST).write_bytes(bytes(data))


def offsets_past_end(folder: Path) -> None:
    length, head, data = header(folder / ST)
    last = max((k for k in head if k != "__metadata__"), key=lambda k: head[k]["data_offsets"][1])
    head[last]["data_offsets"][1] += 4096
    write_header(folder / ST, head, length, data)
    (folder / "which.txt").write_text(last)


def shape_disagrees_with_offsets(folder: Path) -> None:
    length, head, data = header(folder / ST)
    head[UP0]["shape"] = [88, 33]
    write_header(folder / ST, head, length, data)


def rename_gate(folder: Path) -> None:
    edit_tensors(folder / ST, lambda t: t.__setitem__(GATE0.replace("gate_proj", "gate"), t.pop(GATE0)))


def wrong_up_shape(folder: Path) -> None:
    edit_tensors(folder / ST, lambda t: t.__setitem__(UP0, torch.zeros(80, 32)))


def nan_in_down(folder: Path) -> None:
    edit_tensors(folder / ST, lambda t: t[DOWN0].__setitem__((0, 0), float("nan")))


def inf_in_up(folder: Path) -> None:
    edit_tensors(folder / ST, lambda t: t[UP0].__setitem__((1, 1), float("inf")))


def int_weights(folder: Path) -> None:
    edit_tensors(folder / ST, lambda t: t.__setitem__(UP0, torch.ones(88, 32, dtype=torch.int32)))


def pickle_only(folder: Path) -> None:
    (folder / ST).unlink()
    torch.save({"w": torch.zeros(1)}, folder / "pytorch_model.bin")


def fifo_weights(folder: Path) -> None:
    (folder / ST).unlink()
    os.mkfifo(folder / ST)


def config_edit(edit: Callable[[dict], object]) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        edit(config)
        (folder / "config.json").write_text(json.dumps(config))
    return apply


def invalid_config_json(folder: Path) -> None:
    (folder / "config.json").write_text('{"model_type": "llama",')


def shard_outside(folder: Path) -> None:
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"][GATE0] = "../elsewhere.safetensors"
    index_path.write_text(json.dumps(index))


# -- hostile values: sizes a file claims, values of the wrong type or range -------------------
def fp8_up(folder: Path) -> None:
    edit_tensors(folder / ST, lambda t: t.__setitem__(UP0, t[UP0].to(torch.float8_e4m3fn)))


def write_gguf_copy(folder: Path, edit: Callable | None = None) -> None:
    """folder/m.gguf: the tiny LLaMA as GGUF, with one field made hostile (tests/hostile_files.py)."""
    from .conftest import build_model
    from .gguf_files import Q, gguf_from_hf
    from .hostile_files import gguf_bytes, read_gguf

    path = gguf_from_hf(build_model("llama", seed=5), folder / "m.gguf", "llama", Q.F32)
    if edit is not None:
        gguf = read_gguf(path)
        edit(gguf)
        path.write_bytes(gguf_bytes(gguf))


def gguf_edit(edit: Callable | None) -> Callable[[Path], None]:
    return lambda folder: write_gguf_copy(folder, edit)


def gguf_meta(key: str, value) -> Callable:
    return lambda gguf: gguf.metadata.__setitem__(key, value)


def gguf_tensor(field_name: str, value) -> Callable:
    return lambda gguf: setattr(next(t for t in gguf.tensors if t.name == "blk.0.ffn_up.weight"), field_name, value)


def q8_rows_of_33(gguf) -> None:
    tensor = next(t for t in gguf.tensors if t.name == "blk.0.ffn_up.weight")
    tensor.qtype, tensor.dims = 8, [33, 88]  # Q8_0 packs rows in blocks of 32 values


def gguf_fifo(folder: Path) -> None:
    os.mkfifo(folder / "m.gguf")


def meta_folder(edit: dict) -> Callable[[Path], None]:
    """Meta's release layout (params.json + consolidated.00.pth) with params.json edited."""
    def apply(folder: Path) -> None:
        from .builders import write_meta

        write_meta(folder / "meta", n_layers=2)
        params = json.loads((folder / "meta" / "params.json").read_text()) | edit
        (folder / "meta" / "params.json").write_text(json.dumps(params))
    return apply


def index_edit(edit: Callable[[dict, Path], None]) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        path = folder / "model.safetensors.index.json"
        index = json.loads(path.read_text())
        edit(index, folder)
        path.write_text(json.dumps(index))
    return apply


def shard_missing(index: dict, folder: Path) -> None:
    index["weight_map"][UP0] = "model-00099-of-00099.safetensors"


def shard_wrong(index: dict, folder: Path) -> None:
    index["weight_map"][UP0] = next(f for f in sorted(set(index["weight_map"].values()))
                                    if f != index["weight_map"][UP0])


def shard_corrupt(index: dict, folder: Path) -> None:
    (folder / index["weight_map"][UP0]).write_bytes(b"\xff" * 100)


def bin_index_only(folder: Path) -> None:
    for path in folder.glob("*.safetensors"):
        path.unlink()
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {UP0: "pytorch_model-1.bin"}}))


def empty_folder(folder: Path) -> None:
    shutil.rmtree(folder)
    folder.mkdir()


def mapping_edit(old: str, new: str) -> Callable[[Path], Path]:
    def write(root: Path) -> Path:
        path = root / "hostile.toml"
        text = (builtin_mapping_dir() / "llama.toml").read_text()
        assert old in text
        path.write_text(text.replace(old, new, 1))
        return path
    return write


def fifo_mapping(root: Path) -> Path:
    os.mkfifo(root / "fifo.toml")
    return root / "fifo.toml"


def project_file(name: str, text: str) -> Callable[[Path], Path]:
    def write(root: Path) -> Path:
        (root / name).write_text(text)
        return root / name
    return write


# -- mapping files (written next to, never inside, the checkpoint) ----------------------------
def invalid_toml(root: Path) -> Path:
    path = root / "broken.toml"
    path.write_text('name = "x"\nmodel_types = ["llama"\n')
    return path


def unknown_key_toml(root: Path) -> Path:
    path = root / "unknown_key.toml"
    path.write_text((builtin_mapping_dir() / "llama.toml").read_text().replace("[target]\n", "[target]\nklass = 1\n"))
    return path


@dataclass
class Case:
    id: str
    expect: list[str]  # substrings the error message must contain ("{folder}": the checkpoint copy)
    args: list[str] = field(default_factory=list)  # "{ckpt}" = the checkpoint argument, "{mapping}" = the file
    source: str = "llama"  # which tiny checkpoint to copy; None: no checkpoint folder
    breaks: Callable[[Path], None] | None = None
    mapping: Callable[[Path], Path] | None = None
    env: dict[str, str] = field(default_factory=dict)
    ckpt: str | None = "{folder}"  # the MODEL argument (None: none, as `parity check` takes)
    smoke: bool = False  # run by the real `parity` executable too (marked slow): a few representatives
    command: list[str] = field(default_factory=list)  # ["inspect"], ["check"]: before MODEL


CASES = [
    Case("nonexistent-path", ["/no/such/checkpoint", "no such file or folder"], source=None,
         ckpt="/no/such/checkpoint"),
    Case("unknown-name", ["not-a-family", "not a mapping name", "parity list"], source=None, ckpt="not-a-family"),
    Case("offline-uncached-hub-id", ["someone/some-model", "HF_HUB_OFFLINE", "--checkpoint", "cache"], source=None,
         ckpt="someone/some-model", env={"HF_HOME": "{root}/hf_home", "HF_HUB_CACHE": "{root}/hf_home/hub"},
         smoke=True),
    Case("mapping-name-uncached-checkpoint", ["someone/llama-copy", "HF_HUB_OFFLINE", "--checkpoint"], source=None,
         ckpt="llama", args=["--checkpoint", "someone/llama-copy"],
         env={"HF_HOME": "{root}/hf_home", "HF_HUB_CACHE": "{root}/hf_home/hub"}),
    Case("truncated-safetensors", ["{folder}/model.safetensors", "truncated"], breaks=truncate_half, smoke=True),
    Case("garbage-header", ["{folder}/model.safetensors", "header is not valid JSON"], breaks=garbage_header),
    Case("offsets-past-end", ["{folder}/model.safetensors", "model.norm.weight", "lies at bytes"],
         breaks=offsets_past_end),
    Case("shape-vs-offsets", ["{folder}/model.safetensors", UP0, "[88, 33]", "data_offsets span"],
         breaks=shape_disagrees_with_offsets),
    Case("empty-safetensors", ["{folder}/model.safetensors", "0 bytes"], breaks=lambda f: (f / ST).write_bytes(b"")),
    Case("fifo-safetensors", ["{folder}/model.safetensors", "not a regular file"], breaks=fifo_weights, smoke=True),
    Case("missing-ffn-tensor", [GATE0, "closest present", "model.layers.0.mlp.gate.weight"], args=["--layer", "0"],
         breaks=rename_gate),
    Case("unexpected-shape", ["up_proj.weight", "[80, 32]", "[88, 32]", "d_ff"], args=["--layer", "0"],
         breaks=wrong_up_shape),
    Case("nan-weights", [DOWN0, "NaN", "checkpoint is defective"], args=["--layer", "0"], breaks=nan_in_down),
    Case("inf-weights", [UP0, "NaN/Inf", "checkpoint is defective"], args=["--layer", "0"], breaks=inf_in_up),
    Case("integer-weights", [UP0, "int32", "not floating point"], args=["--layer", "0"], breaks=int_weights),
    Case("layer-out-of-range", ["layer 7", "valid: 0-2"], args=["--layer", "7"]),
    Case("layers-spec-out-of-range", ["layer 3", "valid: 0-2"], args=["--layers", "1-3"]),
    Case("invalid-toml", ["broken.toml", "invalid TOML"], args=["--mapping", "{mapping}"], mapping=invalid_toml),
    Case("unknown-mapping-key", ["unknown_key.toml:", "target.klass", "unknown key"], args=["--mapping", "{mapping}"],
         mapping=unknown_key_toml),
    Case("target-not-importable", ["nowhere.mod", "cannot import"], args=["--target", "nowhere.mod:X"]),
    Case("target-missing-attribute", ["tests.broken_targets", "has no attribute 'Nope'"],
         args=["--target", "tests.broken_targets:Nope"]),
    Case("target-raises-in-init", ["tests.broken_targets:RaisesInInit", "boom in __init__"],
         args=["--target", "tests.broken_targets:RaisesInInit"]),
    Case("target-not-a-module", ["tests.broken_targets:not_a_module", "not a torch.nn.Module"],
         args=["--target", "tests.broken_targets:not_a_module"]),
    Case("target-wrong-signature",
         ["WrongSignature", "unexpected keyword argument", "signature is WrongSignature(width)"],
         args=["--target", "tests.broken_targets:WrongSignature"]),
    Case("target-forward-raises", ["tests.broken_targets:ForwardRaises", "[3, 16, 32]", "ValueError: boom in forward"],
         args=["--layer", "0", "--target", "tests.broken_targets:ForwardRaises"]),
    Case("target-wrong-output-shape", ["tests.broken_targets:WrongOutputShape", "[3, 16, 5]", "[3, 16, 32]"],
         args=["--layer", "0", "--target", "tests.broken_targets:WrongOutputShape"]),
    Case("target-returns-none", ["tests.broken_targets:ReturnsNone", "NoneType, not a torch.Tensor"],
         args=["--layer", "0", "--target", "tests.broken_targets:ReturnsNone"]),
    Case("target-parameter-checkpoint-lacks", ["_gate.bias", "gate_proj.bias"],
         args=["--layer", "0", "--target", "tests.broken_targets:swiglu_with_bias"]),
    Case("pickle-folder", ["pytorch_model.bin", "pickle", "safetensors"], breaks=pickle_only),
    Case("pickle-file", ["pytorch_model.bin", "pickle"], breaks=pickle_only, ckpt="{folder}/pytorch_model.bin"),
    Case("config-invalid-json", ["{folder}/config.json", "not valid JSON"], breaks=invalid_config_json),
    Case("config-not-an-object", ["{folder}/config.json", "JSON object"],
         breaks=lambda f: (f / "config.json").write_text("[1, 2]")),
    Case("config-unserved-model-type", ["'frobnicator'", "llama", "gpt2", "docs/own-module.md", "--mapping"],
         breaks=config_edit(lambda c: c.__setitem__("model_type", "frobnicator"))),
    Case("config-bad-value", ["config.json", "'hidden_size' = 'big'", "expected an integer"],
         breaks=config_edit(lambda c: c.__setitem__("hidden_size", "big"))),
    Case("no-config", ["no config.json"], breaks=lambda f: (f / "config.json").unlink()),
    Case("shard-outside-folder", ["model.safetensors.index.json", "../elsewhere.safetensors", "outside"],
         source="llama_sharded", breaks=shard_outside),
    Case("json-report-unwritable", ["--json {root}/no/such/dir/r.json", "does not exist", "checked before computing"],
         args=["--layer", "0", "--json", "{root}/no/such/dir/r.json"]),
    # -- hostile inputs (issue 9): one representative of each class ------------------------------
    # sizes a file claims, checked against what the file holds before anything is allocated or iterated
    Case("config-claims-a-million-layers", ["config.json", "'num_hidden_layers' = 1000000", "30 tensors"],
         args=["--layer", "0"], breaks=config_edit(lambda c: c.__setitem__("num_hidden_layers", 1000000))),
    Case("config-zero-layers", ["config.json", "'num_hidden_layers' = 0", "at least one layer"],
         breaks=config_edit(lambda c: c.__setitem__("num_hidden_layers", 0))),
    Case("config-more-layers-than-weights", ["num_hidden_layers", "holds no tensor of layer 3", "layers 0-2"],
         breaks=config_edit(lambda c: c.__setitem__("num_hidden_layers", 4))),
    Case("gguf-block-count-2^31", ["m.gguf", "'llama.block_count' = 2147483648"], ckpt="{folder}/m.gguf",
         breaks=gguf_edit(gguf_meta("llama.block_count", HValue(UINT32, 2**31)))),
    Case("gguf-block-count-0", ["m.gguf", "'llama.block_count' = 0"], ckpt="{folder}/m.gguf",
         breaks=gguf_edit(gguf_meta("llama.block_count", HValue(UINT32, 0)))),
    Case("gguf-dims-claim-gigabytes", ["blk.0.ffn_up.weight", "claims bytes", "the file has only"],
         ckpt="{folder}/m.gguf", breaks=gguf_edit(gguf_tensor("dims", [32, 150_000_000]))),
    Case("gguf-offset-2^63", ["blk.0.ffn_up.weight", "the file has only"], ckpt="{folder}/m.gguf",
         breaks=gguf_edit(gguf_tensor("offset", 2**63))),
    Case("gguf-q8-rows-not-blocks", ["blk.0.ffn_up.weight", "Q8_0", "not a multiple of its block size 32"],
         ckpt="{folder}/m.gguf", breaks=gguf_edit(q8_rows_of_33)),
    Case("gguf-alignment-0", ["m.gguf", "'general.alignment' = 0", "power of two"], ckpt="{folder}/m.gguf",
         breaks=gguf_edit(gguf_meta("general.alignment", HValue(UINT32, 0)))),
    Case("gguf-string-claims-10^12-bytes", ["m.gguf", "claims 1000000000000 bytes"], ckpt="{folder}/m.gguf",
         breaks=gguf_edit(gguf_meta("x.strings", HValue(ARRAY, [HValue(STRING, "ab", claimed_length=10**12)],
                                                        item=STRING)))),
    Case("gguf-arrays-5000-deep", ["m.gguf", "nested more than"], ckpt="{folder}/m.gguf",
         breaks=gguf_edit(gguf_meta("x.nested", nested_arrays(5000)))),
    Case("mapping-a-billion-layers", ["hostile.toml", "num_layers", "1000000000"], args=["--mapping", "{mapping}"],
         mapping=mapping_edit('default_checkpoint', 'num_layers = 1000000000\ndefault_checkpoint')),
    # values of the wrong type or range, each message naming the file, the field and the value
    Case("config-intermediate-size-0", ["config.json", "'intermediate_size' = 0"],
         breaks=config_edit(lambda c: c.__setitem__("intermediate_size", 0))),
    Case("config-unknown-activation", ["config.json", "'hidden_act' = 'frobnicate'", "ACT2FN"],
         breaks=config_edit(lambda c: c.__setitem__("hidden_act", "frobnicate"))),
    Case("meta-multiple-of-0", ["params.json", "'multiple_of' = 0"], ckpt="{folder}/meta",
         args=["--allow-pickle"], breaks=meta_folder({"multiple_of": 0})),
    Case("meta-norm-eps-string", ["params.json", "'norm_eps' = 'x'"], ckpt="{folder}/meta",
         args=["--allow-pickle"], breaks=meta_folder({"norm_eps": "x"})),
    Case("meta-rope-theta-list", ["params.json", "'rope_theta' = [1]"], ckpt="{folder}/meta",
         args=["--allow-pickle"], breaks=meta_folder({"rope_theta": [1]})),
    Case("meta-zero-layers", ["params.json", "'n_layers' = 0"], ckpt="{folder}/meta", args=["--allow-pickle"],
         breaks=meta_folder({"n_layers": 0})),
    Case("mapping-template-indexes-layer", ["hostile.toml", "checkpoint.layer_key", "{layer[0]}", "not allowed"],
         args=["--mapping", "{mapping}"],
         mapping=mapping_edit('layer_key = "model.layers.{layer}.mlp"', 'layer_key = "model.layers.{layer[0]}.mlp"')),
    Case("mapping-no-key-prefixes", ["hostile.toml", "checkpoint.key_prefixes", "empty"],
         args=["--mapping", "{mapping}"], mapping=mapping_edit('key_prefixes = [""]', "key_prefixes = []")),
    Case("mapping-hidden-size-0", ["hostile.toml", "hidden_size", "out of range"], args=["--mapping", "{mapping}"],
         mapping=mapping_edit('default_checkpoint', 'hidden_size = 0\ndefault_checkpoint')),
    # weights parity cannot compute with as stored
    Case("fp8-weights", [UP0, "float8_e4m3fn", "FP8", "scale"], args=["--layer", "0"], breaks=fp8_up),
    Case("mapping-chunk-does-not-divide", ["hostile.toml", "chunk [0, 3]", "[88, 32]"],
         args=["--layer", "0", "--mapping", "{mapping}"],
         mapping=mapping_edit('"_up.weight" = "up_proj.weight"',
                              '"_up.weight" = { from = "up_proj.weight", chunk = [0, 3] }')),
    # sharded folders: a check and `parity inspect` validate alike
    Case("index-names-missing-shard", ["model-00099-of-00099.safetensors", "model.safetensors.index.json",
                                       "does not exist"], source="llama_sharded", breaks=index_edit(shard_missing)),
    Case("inspect-index-names-missing-shard", ["model-00099-of-00099.safetensors", "does not exist"],
         command=["inspect"], source="llama_sharded", breaks=index_edit(shard_missing)),
    Case("inspect-tensor-in-wrong-shard", [UP0, "holds no tensor", "index and the shards disagree"],
         command=["inspect"], source="llama_sharded", breaks=index_edit(shard_wrong)),
    Case("inspect-corrupt-shard", ["not a readable safetensors file"], command=["inspect"], source="llama_sharded",
         breaks=index_edit(shard_corrupt)),
    Case("bin-index-names-missing-shard", ["pytorch_model-1.bin", "pytorch_model.bin.index.json", "does not exist"],
         args=["--allow-pickle"], breaks=bin_index_only),
    # special files and odd paths
    Case("fifo-gguf", ["m.gguf", "FIFO", "not a regular file"], ckpt="{folder}/m.gguf", breaks=gguf_fifo),
    Case("fifo-mapping", ["fifo.toml", "FIFO", "not a regular file"], args=["--mapping", "{mapping}"],
         mapping=fifo_mapping),
    Case("fifo-config-json", ["config.json", "FIFO"], breaks=lambda f: (f / "config.json").unlink()
         or os.mkfifo(f / "config.json")),
    Case("empty-folder", ["{folder}", "the folder is empty"], breaks=empty_folder),
    Case("newline-in-path", ["a\\nb", "the folder is empty"], ckpt="{root}/a\nb",
         breaks=lambda f: (f.parent / "a\nb").mkdir()),
    Case("pyproject-tool-not-a-table", ["pyproject.toml", "'tool'", "must be a table"], ckpt=None, source=None,
         command=["check"], args=["--config", "{mapping}"], mapping=project_file("pyproject.toml", 'tool = "x"\n')),
    Case("pyproject-without-tool-parity", ["pyproject.toml", "no [tool.parity] table"], ckpt=None, source=None,
         command=["check"], args=["--config", "{mapping}"],
         mapping=project_file("pyproject.toml", '[project]\nname = "x"\n')),
    Case("target-names-a-builtin", ["os:system", "built-in function", "does not call it"],
         args=["--layer", "0", "--target", "os:system"]),
    Case("internal-error", ["internal error", "ZeroDivisionError", "please report", "--debug"],
         args=["--layer", "0", "--target", "tests.broken_targets:BrokenParameters"], smoke=True),
]


# -- running them ---------------------------------------------------------------------------
def snapshot(folder: Path | None) -> dict[str, str]:
    """Every entry under the folder with its content hash (kind only for FIFOs: reading one blocks)."""
    if folder is None:
        return {}
    found = {}
    for path in sorted(folder.rglob("*")):
        mode = path.lstat().st_mode
        rel = str(path.relative_to(folder))
        if stat.S_ISREG(mode):
            found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            found[rel] = f"mode {stat.S_IFMT(mode):o}"
    return found


@dataclass
class Outcome:
    case: Case
    folder: Path | None
    root: Path
    before: dict[str, str]
    after: dict[str, str] | None = None
    result: subprocess.CompletedProcess | None = None

    def fill(self, text: str) -> str:
        return text.replace("{folder}", str(self.folder)).replace("{root}", str(self.root))


def prepare(case: Case, root: Path, sources: dict[str, Path]) -> tuple[Outcome, list[str], dict[str, str]]:
    folder = None
    if case.source is not None:  # a private copy: the session fixtures stay intact
        folder = root / "ckpt"
        shutil.copytree(sources[case.source], folder)
        if case.breaks is not None:
            case.breaks(folder)
    outcome = Outcome(case, folder, root, snapshot(folder))
    mapping = case.mapping(root) if case.mapping else None
    model = [] if case.ckpt is None else [outcome.fill(case.ckpt)]
    args = [*case.command, *model, *[outcome.fill(a).replace("{mapping}", str(mapping)) for a in case.args]]
    env = {key: outcome.fill(value) for key, value in case.env.items()}
    return outcome, args, env


def execute(outcome: Outcome, args: list[str], env: dict[str, str]) -> Outcome:
    outcome.result = run_parity(*args, env=env, cwd=ROOT, timeout=300)  # a hang fails the test, not CI
    outcome.after = snapshot(outcome.folder)
    return outcome


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory, tiny, llama_sharded) -> dict[str, Outcome]:
    wanted = {item.callspec.params["case"].id for item in request.session.items
              if getattr(item, "callspec", None) and isinstance(item.callspec.params.get("case"), Case)}
    sources = {**tiny, "llama_sharded": llama_sharded}
    jobs = [prepare(case, tmp_path_factory.mktemp(case.id), sources) for case in EXECUTABLE if case.id in wanted]
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return {o.case.id: o for o in pool.map(lambda job: execute(*job), jobs)}


def check_outcome(outcome: Outcome, stdout: str, stderr: str, returncode: int) -> None:
    """Exit 2, one 'parity: ...' line naming the problem, no traceback, the checkpoint folder untouched."""
    assert returncode == 2, (stdout, stderr)
    assert "Traceback" not in stderr and "Traceback" not in stdout
    message = stderr.strip().splitlines()[-1]
    assert message.startswith("parity: "), stderr
    for expected in outcome.case.expect:
        assert outcome.fill(expected) in message, (expected, message)
    assert outcome.after == outcome.before, "the checkpoint folder changed"


EXECUTABLE = [case for case in CASES if case.smoke]  # every case runs in process; these by the executable too
HANG_S = 120  # an in-process run that takes longer hangs (a FIFO opened for reading, say): it fails the test


class Hang(BaseException):
    """Raised by SIGALRM into a run that hangs: a BaseException, so no `except Exception` in parity catches it."""


@contextmanager
def no_hang(seconds: int = HANG_S):
    """Fail a run that takes longer than ``seconds`` instead of blocking the suite (what the real process's
    timeout did): SIGALRM interrupts even a blocking open() of a FIFO."""
    def alarm(_signum, _frame):
        raise Hang(f"the run took more than {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.slow  # the real executable, a few representative cases (run concurrently in `outcomes`)
@pytest.mark.parametrize("case", EXECUTABLE, ids=[case.id for case in EXECUTABLE])
def test_broken_input_exit_2_executable(case, outcomes):
    outcome = outcomes[case.id]
    check_outcome(outcome, outcome.result.stdout, outcome.result.stderr, outcome.result.returncode)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_broken_input_exit_2_in_process(case, tmp_path, tiny, llama_sharded, monkeypatch, capsys):
    outcome, args, env = prepare(case, tmp_path, {**tiny, "llama_sharded": llama_sharded})
    if "HF_HOME" in env:  # as a process started with it sees it: huggingface_hub's constants too
        home = use_hf_home(monkeypatch, Path(env.pop("HF_HOME")))
        assert env.pop("HF_HUB_CACHE", str(home / "hub")) == str(home / "hub")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(ROOT)
    with no_hang():
        code, out, err = run_main(capsys, *args)
    outcome.after = snapshot(outcome.folder)
    check_outcome(outcome, out, err, code)


def test_cases_cover_every_checkpoint_source(tiny):
    assert {case.source for case in CASES} - {None} <= {*tiny, "llama_sharded"}
    assert len({case.id for case in CASES}) == len(CASES)


def test_debug_shows_the_traceback(tiny, tmp_path, capsys):
    """--debug lets the error leave parity.cli.main: the interpreter prints its traceback and exits non-zero."""
    from parity.errors import CheckpointError

    folder = shutil.copytree(tiny["llama"], tmp_path / "ckpt")
    truncate_half(folder)
    with pytest.raises(CheckpointError, match="truncated"):
        run_main(capsys, folder, "--debug")


def test_internal_error_in_process_is_one_line(monkeypatch, capsys):
    import parity.cli
    import parity.engine.suite

    def broken(*args, **kwargs):
        raise KeyError("unexpected")

    monkeypatch.setattr(parity.engine.suite, "run_session", broken)
    assert parity.cli.main(["llama"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "internal error" in err and "--debug" in err
    with pytest.raises(KeyError):
        parity.cli.main(["llama", "--debug"])


# -- the hub: gated repositories and offline caches (huggingface_hub patched, no network) ----
def gated(*args, **kwargs):
    import httpx2
    from huggingface_hub import errors

    request = httpx2.Request("GET", "https://huggingface.co/someorg/gated/resolve/main/config.json")
    raise errors.GatedRepoError("Access to model someorg/gated is restricted.",
                                response=httpx2.Response(403, request=request))


@pytest.fixture()
def gated_hub(monkeypatch):
    import huggingface_hub

    from parity.sources.hub import hub_reachable

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", gated)
    hub_reachable.cache_clear()
    yield
    hub_reachable.cache_clear()


def test_gated_repo_says_accept_licence_and_set_token(gated_hub, capsys):
    import parity.cli

    assert parity.cli.main(["someorg/gated"]) == 2
    err = capsys.readouterr().err
    assert "someorg/gated" in err and "gated" in err and "licence" in err and "HF_TOKEN" in err
    assert "Traceback" not in err


def test_gated_default_checkpoint_falls_back_to_synthetic(gated_hub):
    from parity.engine.layout.resolve import resolve

    resolved = resolve("gpt2")
    assert resolved.checkpoint.weights == "synthetic" and "gated" in resolved.checkpoint.weights_note


def test_offline_message_when_hub_unreachable_without_hf_hub_offline(monkeypatch, tmp_path):
    from huggingface_hub import constants

    from parity.errors import OfflineError
    from parity.sources.hub import open_hub

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("parity.sources.hub.hub_reachable", lambda: False)
    with pytest.raises(OfflineError) as info:
        open_hub("someone/uncached")
    message = str(info.value)
    assert "not reachable" in message and "HF_HUB_OFFLINE=1" in message and "--checkpoint" in message
    assert str(tmp_path / "hub") in message


# -- the reference side: weights whose shapes disagree with config.json ----------------------
def test_reference_names_both_shapes_when_config_and_weights_disagree(tiny):
    from parity.engine.layout.resolve import load_config, open_checkpoint
    from parity.engine.reference import ReferenceModel
    from parity.errors import ShapeMismatchError

    config = load_config(open_checkpoint(str(tiny["llama"])))
    reference = ReferenceModel(config)
    shapes = reference.tensor_shapes("model.layers.0.mlp")
    tensors = {name: torch.zeros(shape) for name, shape in shapes.items()}
    tensors["up_proj.weight"] = torch.zeros(80, 32)
    with pytest.raises(ShapeMismatchError, match=r"up_proj.weight.*\[80, 32\].*\[88, 32\]"):
        reference.build("model.layers.0.mlp", tensors)


def test_mapping_error_names_the_line(tmp_path):
    from parity.definitions.mapping_parser import load_mapping
    from parity.errors import MappingError

    text = (builtin_mapping_dir() / "gpt2.toml").read_text()
    path = tmp_path / "m.toml"
    path.write_text(text.replace('"_layer2.weight" = { from = "c_proj.weight", transform = "transpose" }',
                                 '"_layer2.weight" = { from = "c_proj.weight", transform = "flip" }'))
    line = next(i for i, row in enumerate(path.read_text().splitlines(), 1) if '"flip"' in row)
    with pytest.raises(MappingError, match=rf"m\.toml:{line}: key 'tensors\.\"_layer2\.weight\"\.transform'"):
        load_mapping(path)
    path.write_text(text.replace('layer_key = "h.{layer}.mlp"', 'layer_key = "h.{layer}.{mlp"'))
    with pytest.raises(MappingError, match=r"checkpoint\.layer_key.*not a valid template"):
        load_mapping(path)
