"""Structure-aware fuzzing: a VALID tiny input (a safetensors header, config.json, a sharded index, a GGUF
file, Meta's params.json, a mapping, a project file, a baseline) with ONE field set to an extreme value:
0, negative, huge, the wrong type, NaN, nesting 5000 deep, an overlong string.

Property: parity succeeds or raises its own error (ParityError: exit 2 with a message) — never another
exception, never a hang (each example is bounded in time) and never a new memory peak for a few-KB file.
Random bytes are tests/test_fuzz.py's; here every example is one valid structure, one field off.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import shutil
import signal
import struct
import tomllib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from parity.definitions.datafiles import builtin_mapping_dir
from parity.errors import ParityError

from .hostile_files import (
    ARRAY,
    FLOAT64,
    INT64,
    STRING,
    UINT32,
    UINT64,
    Value,
    gguf_bytes,
    nested,
    nested_arrays,
    read_gguf,
    st_header,
    st_write,
)

# PARITY_FUZZ_EXAMPLES=500 explores further; the default keeps the file to seconds
EXAMPLES = settings(max_examples=int(os.environ.get("PARITY_FUZZ_EXAMPLES", "25")), deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
EXAMPLE_SECONDS = 30  # a hang fails the example instead of blocking CI
MEMORY_GROWTH_KB = 1024 * 1024  # no new peak of 1 GB over what the process already used
ST = "model.safetensors"
FFN0 = ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.down_proj.weight"]
DEEP = "\x00DEEP\x00"  # stands for arrays nested 5000 deep (json/toml writers would recurse too deeply)

# One field's extreme values: 0, negative, huge, wrong type, NaN/inf, deep nesting, overlong strings.
EXTREMES = [0, -1, -2, -2**31, 2**31, 2**63, 2**64, 10**30, 1.5, -0.0, 1e308, math.nan, math.inf, -math.inf,
            "", "x", "frobnicate", "x" * 100_000, "a\nb", True, False, None, [], [0], [1, 2, 3], {}, {"a": 1}, DEEP]
extremes = st.sampled_from(EXTREMES)


class ExampleTimeout(KeyboardInterrupt):
    """Raised into a slow example (a KeyboardInterrupt, so no `except Exception` in parity swallows it)."""


@contextlib.contextmanager
def bounded(what: str):
    def expire(_signum, _frame):
        raise ExampleTimeout(f"{what}: took more than {EXAMPLE_SECONDS}s (a hang?)")

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, EXAMPLE_SECONDS)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown < MEMORY_GROWTH_KB, f"{what}: a new memory peak {grown // 1024} MB above the previous one"


def only_parity_errors(what: str, action, *args, **kwargs) -> None:
    """The property: success, or a ParityError whose message is one line naming something."""
    with bounded(what):
        try:
            action(*args, **kwargs)
        except ParityError as exc:
            assert str(exc).strip(), f"{what}: an empty error message"


def json_text(document) -> str:
    return json.dumps(document).replace(json.dumps(DEEP), nested(5000))


def toml_value(value) -> str:
    if value == DEEP:
        return "[" * 5000 + "]" * 5000
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_value(v)}" for k, v in value.items()) + "}"


def toml_document(data: dict) -> str:
    """Top-level scalars first, then one [table] per dict (nested dicts inline)."""
    lines = [f"{json.dumps(k)} = {toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for name, table in data.items():
        if isinstance(table, dict):
            lines.append(f"[{json.dumps(name)}]")
            lines.extend(f"{json.dumps(k)} = {toml_value(v)}" for k, v in table.items() if v is not None)
    return "\n".join(lines) + "\n"


def set_path(data: dict, path: tuple[str, ...], value) -> None:
    table = data
    for key in path[:-1]:
        if not isinstance(table.get(key), dict):
            table[key] = {}
        table = table[key]
    table[path[-1]] = value


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("structured")


def fresh(src: Path, dst: Path) -> Path:
    shutil.rmtree(dst, ignore_errors=True)
    return Path(shutil.copytree(src, dst))


def read_layer(model: str, **kwargs) -> None:
    from parity.engine.suite import open_session

    open_session(model, **kwargs).read_layer(0)


# -- safetensors header: one entry's dtype, shape or offsets ---------------------------------------
HEADER_VALUES = st.one_of(extremes, st.sampled_from([
    "F8_E4M3", "F8_E5M2", "F64", "F16", "I8", "BOOL", "Q4", "F4", [2**40, 2**20], [-88, 32], [0, 32], [88],
    [88, 32, 1], [0, 2**63], [-8, 100], [100, 0], [0, 11264, 5]]))


@EXAMPLES
@given(name=st.sampled_from([*FFN0, "__metadata__", "model.norm.weight", "new.tensor"]),
       field=st.sampled_from(["dtype", "shape", "data_offsets", None]), value=HEADER_VALUES)
def test_safetensors_header_field(tiny, work, name, field, value):
    folder = fresh(tiny["llama"], work / "st")
    header, data = st_header(folder / ST)
    if field is None or not isinstance(header.get(name), dict):
        header[name] = value
    else:
        header[name][field] = value
    st_write(folder / ST, json_text(header), data)
    only_parity_errors(f"{ST} {name}.{field} = {value!r:.40}", read_layer, str(folder))


# -- config.json ------------------------------------------------------------------------------------
CONFIG_KEYS = ["num_hidden_layers", "hidden_size", "intermediate_size", "hidden_act", "model_type",
               "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "rope_theta",
               "torch_dtype", "dtype", "max_position_embeddings", "mlp_bias", "rope_scaling", "architectures",
               "tie_word_embeddings", "n_layer"]


@EXAMPLES
@given(key=st.sampled_from(CONFIG_KEYS), value=extremes)
@example(key="num_hidden_layers", value=2**31)  # each class the issue names, always among the examples
@example(key="num_hidden_layers", value=0)
@example(key="intermediate_size", value=0)
@example(key="hidden_act", value="frobnicate")
def test_config_json_field(tiny, work, key, value):
    import parity

    folder = fresh(tiny["llama"], work / "config")
    config = json.loads((folder / "config.json").read_text()) | {key: value}
    (folder / "config.json").write_text(json_text(config))
    only_parity_errors(f"config.json {key} = {value!r:.40}", parity.check, str(folder), layers=[0])


# -- a sharded folder's index -----------------------------------------------------------------------
INDEX_VALUES = st.one_of(extremes, st.sampled_from(["model-00099-of-00099.safetensors", "../outside.safetensors",
                                                    "/etc/passwd", "config.json", ".", "model.safetensors.index.json"]))


@EXAMPLES
@given(where=st.sampled_from(["weight_map", "metadata", "tensor", "other shard"]), value=INDEX_VALUES)
def test_index_json_field(llama_sharded, work, where, value):
    from parity.engine.check.inspect import inspect_model

    folder = fresh(llama_sharded, work / "index")
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    if where == "tensor":
        index["weight_map"][FFN0[1]] = value
    elif where == "other shard":  # the tensor pointed to a shard that exists but does not hold it
        shards = sorted(set(index["weight_map"].values()))
        index["weight_map"][FFN0[1]] = shards[hash(repr(value)) % len(shards)]
    else:
        index[where] = value
    path.write_text(json_text(index))
    only_parity_errors(f"index {where} = {value!r:.40}", read_layer, str(folder))
    only_parity_errors(f"inspect: index {where} = {value!r:.40}", inspect_model, str(folder))


# -- GGUF: one metadata value or one tensor directory field -----------------------------------------
@pytest.fixture(scope="module")
def gguf_base(work):
    from .conftest import build_model
    from .gguf_files import Q, gguf_from_hf

    return read_gguf(gguf_from_hf(build_model("llama", seed=7), work / "base.gguf", "llama", Q.F32))


def gguf_value(value) -> Value | None:
    """A GGUF-typed value for one extreme (None: not representable in GGUF)."""
    if value == DEEP:
        return nested_arrays(5000)
    if isinstance(value, bool) or value is None or isinstance(value, dict):
        return None
    if isinstance(value, int):
        for vtype, low, high in ((UINT32, 0, 2**32), (INT64, -2**63, 0), (UINT64, 0, 2**64)):
            if low <= value < high:
                return Value(vtype, value)
        return None
    if isinstance(value, float):
        return Value(FLOAT64, value)
    if isinstance(value, str):
        return Value(STRING, value, claimed_length=10**12 if value == "x" else None)
    items = [v for v in value if isinstance(v, int)]
    return Value(ARRAY, items, item=UINT32)


GGUF_KEYS = ["llama.block_count", "llama.embedding_length", "llama.feed_forward_length",
             "llama.attention.head_count", "llama.attention.head_count_kv", "llama.context_length",
             "llama.attention.layer_norm_rms_epsilon", "llama.rope.freq_base", "llama.expert_count",
             "llama.vocab_size", "general.architecture", "general.alignment", "split.count", "x.unknown"]
TENSOR_VALUES = st.sampled_from([0, 1, 3, 33, 2**31, 2**32 - 1, 2**63, 2**64 - 1, 999, 8])


@EXAMPLES
@given(target=st.sampled_from(["metadata", "dims", "offset", "qtype", "counts"]), key=st.sampled_from(GGUF_KEYS),
       value=extremes, number=TENSOR_VALUES)
@example(target="metadata", key="llama.block_count", value=2**31, number=0)
@example(target="metadata", key="general.alignment", value=0, number=0)
@example(target="metadata", key="x.unknown", value=DEEP, number=0)
@example(target="metadata", key="x.unknown", value="x", number=0)  # a string claiming 10^12 bytes
@example(target="offset", key="x.unknown", value=0, number=2**63)
@example(target="dims", key="x.unknown", value=0, number=2**31)
def test_gguf_field(gguf_base, work, target, key, value, number):
    import copy

    gguf = copy.deepcopy(gguf_base)
    tensor = next(t for t in gguf.tensors if t.name == "blk.0.ffn_up.weight")
    if target == "metadata":
        encoded = gguf_value(value)
        if encoded is None:
            return
        gguf.metadata[key] = encoded
        if key == "general.alignment" and isinstance(value, int) and 0 < value < 2**16:
            gguf.alignment = value
    elif target == "dims":
        tensor.dims = [tensor.dims[0], number] if number else [number, tensor.dims[1]]
    elif target in ("offset", "qtype"):
        setattr(tensor, target, number % 2**32 if target == "qtype" else number)
    else:
        gguf.claimed_kv, gguf.claimed_tensors = (number, None) if number % 2 else (None, number)
    path = work / "fuzz.gguf"
    try:
        path.write_bytes(gguf_bytes(gguf))
    except (struct.error, OverflowError):
        return  # not writable as GGUF: nothing to test
    only_parity_errors(f"GGUF {target} {key} = {value!r:.40} / {number}", read_layer, str(path))


# -- Meta params.json -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def meta_base(work):
    from .builders import write_meta

    return write_meta(work / "meta-base", n_layers=2)


@EXAMPLES
@given(key=st.sampled_from(["dim", "n_layers", "n_heads", "n_kv_heads", "multiple_of", "ffn_dim_multiplier",
                            "norm_eps", "rope_theta", "vocab_size"]), value=extremes)
@example(key="multiple_of", value=0)
@example(key="n_layers", value=0)
@example(key="norm_eps", value="x")
@example(key="rope_theta", value=[1])
def test_meta_params_field(meta_base, work, key, value):
    folder = fresh(meta_base, work / "meta")
    params = json.loads((folder / "params.json").read_text()) | {key: value}
    (folder / "params.json").write_text(json_text(params))
    only_parity_errors(f"params.json {key} = {value!r:.40}", read_layer, str(folder), allow_pickle=True)


# -- mapping files ----------------------------------------------------------------------------------
LLAMA = tomllib.loads((builtin_mapping_dir() / "llama.toml").read_text())
MAPPING_PATHS = [("num_layers",), ("hidden_size",), ("name",), ("model_types",), ("checkpoint", "layer_key"),
                 ("checkpoint", "key_prefixes"), ("reference", "module"), ("target", "class"),
                 ("target", "args"), ("target", "args", "emb_size"), ("target", "args", "hidden_dim"),
                 ("tensors", "_up.weight"), ("tensors", "_gate.weight"), ("tensors", "_extra.weight"),
                 ("reference", "tensors"), ("experts", "count")]
MAPPING_VALUES = st.one_of(extremes.filter(lambda v: v is not None), st.sampled_from([
    "model.layers.{layer[0]}.mlp", "model.layers.{layer:>99999999}.mlp", "model.layers.{layer!r}.mlp",
    "model.layers.{expert}.mlp", "os:system", "builtins:exec", "config.__class__", "config.hidden_size",
    {"config": 5}, {"config": "hidden_size", "default": -1}, {"from": "up_proj.weight", "chunk": [0, 3]},
    {"from": "up_proj.weight", "chunk": [0, 1000000000]}, {"from": "up_proj.weight", "transform": "transpose"},
    {"from": "nope.weight", "optional": True}, [""], ["", "model."]]))


@EXAMPLES
@given(path=st.sampled_from(MAPPING_PATHS), value=MAPPING_VALUES)
@example(path=("num_layers",), value=1000000000)
@example(path=("hidden_size",), value=0)
@example(path=("checkpoint", "layer_key"), value="model.layers.{layer[0]}.mlp")
@example(path=("checkpoint", "key_prefixes"), value=[])
@example(path=("tensors", "_up.weight"), value={"from": "up_proj.weight", "chunk": [0, 3]})
def test_mapping_field(tiny, work, path, value):
    import copy

    import parity

    data = copy.deepcopy(LLAMA)
    set_path(data, path, value)
    mapping = work / "fuzz.toml"
    mapping.write_text(toml_document(data))
    only_parity_errors(f"mapping {'.'.join(path)} = {value!r:.40}", parity.check, str(tiny["llama"]),
                       mapping=str(mapping), layers=[0])


# -- project files ----------------------------------------------------------------------------------
PROJECT_PATHS = ["checks", "baseline", "baseline_factor", "baseline_slack", "junit", "defaults", "model", "layers",
                 "layer", "seed", "atol", "target", "mapping", "checkpoint", "experts", "logits", "require_real"]


@EXAMPLES
@given(key=st.sampled_from(PROJECT_PATHS), value=extremes.filter(lambda v: v is not None))
def test_project_file_field(tiny, work, key, value):
    from parity.definitions.project import load_project
    from parity.definitions.selection import parse_selection

    check = {"model": str(tiny["llama"]), "layers": [0]}
    top = {"checks": [check]}
    if key in ("checks", "baseline", "baseline_factor", "baseline_slack", "junit", "defaults"):
        top[key] = value
    else:
        check[key] = value
    path = work / "parity.toml"
    checks = top.pop("checks")
    text = toml_document(top) + ("".join(f"[[checks]]\n{toml_document(c)}" for c in checks)
                                 if isinstance(checks, list) and all(isinstance(c, dict) for c in checks)
                                 else f"checks = {toml_value(checks)}\n")
    path.write_text(text)

    def load():
        for spec in load_project(path).checks:
            parse_selection(spec.layers, 3)

    only_parity_errors(f"parity.toml {key} = {value!r:.40}", load)


# -- baselines --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def baseline_run(tiny, work):
    import parity
    from parity.outputs.baseline import write_baseline

    report = parity.check(str(tiny["llama"]), layers=[0])
    write_baseline(work / "base.json", [report])
    return report, json.loads((work / "base.json").read_text())


@EXAMPLES
@given(where=st.sampled_from(["parity_baseline", "entries", "entry", "max_abs_diff", "passed", "fingerprint",
                              "tolerance", "weights"]), value=extremes)
def test_baseline_field(baseline_run, work, where, value):
    import copy

    from parity.outputs.baseline import compare_baseline, load_baseline

    report, base = baseline_run
    data = copy.deepcopy(base)
    key = next(iter(data["entries"]))
    if where in ("parity_baseline", "entries"):
        data[where] = value
    elif where == "entry":
        data["entries"][key] = value
    else:
        data["entries"][key][where] = value
    path = work / "fuzz-baseline.json"
    path.write_text(json_text(data))
    only_parity_errors(f"baseline {where} = {value!r:.40}",
                       lambda: compare_baseline([report], load_baseline(path)))


# -- the property itself can fail ---------------------------------------------------------------------
def test_the_bounds_catch_a_hang_and_a_foreign_exception(monkeypatch):
    import sys
    import time

    monkeypatch.setattr(sys.modules[__name__], "EXAMPLE_SECONDS", 1)
    with pytest.raises(ExampleTimeout, match="took more than 1s"):
        only_parity_errors("a hang", time.sleep, 30)
    with pytest.raises(ZeroDivisionError):
        only_parity_errors("a crash", lambda: 1 / 0)
    only_parity_errors("parity's own error", lambda: (_ for _ in ()).throw(ParityError("named")))
