"""Property tests: whatever bytes a checkpoint file or a mapping file holds, parity either
succeeds or raises a ParityError subclass (exit code 2 with a message) — never anything else.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import struct
import tomllib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parity.definitions.datafiles import builtin_mapping_dir
from parity.definitions.mapping_parser import parse_mapping
from parity.engine.check.session import Session
from parity.engine.layout.resolve import resolve
from parity.errors import ParityError
from parity.sources.registry import open_local

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ST = "model.safetensors"
FFN = ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
       "model.layers.0.mlp.down_proj.weight"]
DTYPES = ["F32", "F16", "BF16", "F64", "I32", "I8", "U8", "BOOL", "F8_E4M3", "C64", "Q9", ""]


def read_through_runner(folder: Path) -> None:
    """The whole read path: open the folder, resolve its mapping and config, read layer 0's FFN tensors."""
    checkpoint = open_local(folder)
    checkpoint.read(sorted(checkpoint.weight_map)[:8])
    Session(resolve(str(folder))).read_layer(0)


def only_parity_errors(action, *args) -> None:
    try:
        action(*args)
    except ParityError:
        pass


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory, tiny) -> Path:
    """A private copy of the tiny LLaMA checkpoint; each example overwrites one of its files."""
    return Path(shutil.copytree(tiny["llama"], tmp_path_factory.mktemp("fuzz") / "llama"))


# -- model.safetensors ----------------------------------------------------------------------
def safetensors_bytes(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


tensor_entry = st.fixed_dictionaries({
    "dtype": st.sampled_from(DTYPES),
    "shape": st.lists(st.integers(-2, 40), max_size=3),
    "data_offsets": st.lists(st.integers(-8, 12_000), min_size=0, max_size=3),
})
headers = st.dictionaries(st.one_of(st.sampled_from(FFN + ["__metadata__"]), st.text(max_size=12)),
                          st.one_of(tensor_entry, st.integers(), st.text(max_size=5), st.none()), max_size=5)


@st.composite
def plausible_safetensors(draw) -> bytes:
    """Valid layout (length, JSON header, data) with FFN-like tensors whose fields may be wrong."""
    header, offset = {}, 0
    right = {FFN[0]: [88, 32], FFN[1]: [88, 32], FFN[2]: [32, 88]}
    for name in draw(st.permutations(FFN))[:draw(st.sampled_from([1, 2, 3, 3, 3]))]:
        dtype = draw(st.sampled_from(["F32", "F32", "F32", "F16", "BF16", "I32"]))
        shape = draw(st.sampled_from([right[name]] * 4 + [[32, 88], [80, 32], [2, 2], []]))
        size = ({"F32": 4, "F16": 2, "BF16": 2, "I32": 4}[dtype] * math.prod(shape)
                + draw(st.sampled_from([0] * 12 + [4, -4])))
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += max(size, 0)
    rng = random.Random(draw(st.integers(0, 2**32)))  # the data is too large to draw byte by byte
    if draw(st.booleans()):
        data = rng.randbytes(offset)  # raw bytes: NaN/Inf patterns likely
    else:
        data = struct.pack(f"<{offset // 4}f", *(rng.gauss(0, 0.05) for _ in range(offset // 4))) + b"\0" * (offset % 4)
    return safetensors_bytes(header, data + draw(st.sampled_from([b""] * 8 + [b"\0" * 4, b"\xff"])))


@FAST
@given(st.one_of(st.binary(max_size=2048),
                 st.builds(safetensors_bytes, headers, st.binary(max_size=512)),
                 plausible_safetensors()))
def test_random_safetensors_bytes_raise_only_parity_errors(llama_folder, blob):
    (llama_folder / ST).write_bytes(blob)
    only_parity_errors(read_through_runner, llama_folder)


# -- config.json ----------------------------------------------------------------------------
json_values = st.recursive(st.none() | st.booleans() | st.integers(-3, 64) | st.floats(allow_nan=False)
                           | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                           max_leaves=10)
CONFIG_KEYS = ["model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "vocab_size", "hidden_act", "mlp_bias", "n_embd", "n_layer", "head_dim"]


@st.composite
def config_texts(draw) -> str:
    base = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 88, "num_hidden_layers": 3,
            "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 64}
    for key in draw(st.lists(st.sampled_from(CONFIG_KEYS), max_size=3)):
        if draw(st.booleans()):
            base[key] = draw(st.one_of(st.sampled_from(["llama", "gpt2", "gemma", "bert", "silu", "gelu"]),
                                       json_values))
        else:
            base.pop(key, None)
    return json.dumps(base)


@FAST
@given(st.one_of(st.binary(max_size=512).map(lambda b: b.decode("latin-1")), st.text(max_size=200),
                 json_values.map(json.dumps), config_texts()))
def test_random_config_json_raises_only_parity_errors(llama_folder, tiny, text):
    shutil.copy(tiny["llama"] / ST, llama_folder / ST)
    (llama_folder / "config.json").write_text(text, encoding="utf-8", errors="surrogatepass")
    only_parity_errors(read_through_runner, llama_folder)


def test_deeply_nested_config_json(llama_folder, tiny):
    shutil.copy(tiny["llama"] / ST, llama_folder / ST)
    (llama_folder / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ParityError, match="config.json"):
        open_local(llama_folder)


# -- mapping files --------------------------------------------------------------------------
def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{toml_value(str(k))} = {toml_value(v)}" for k, v in value.items()) + "}"


def toml_document(data: dict) -> str:
    return "".join(f"{toml_value(str(key))} = {toml_value(value)}\n" for key, value in data.items())


GPT2 = tomllib.loads((builtin_mapping_dir() / "gpt2.toml").read_text())
KNOWN_KEYS = ["name", "model_types", "checkpoint", "layer_key", "key_prefixes", "reference", "module", "target",
              "class", "args", "tensors", "from", "transform", "chunk", "optional", "synthetic", "config", "notes",
              "num_layers", "hidden_size", "description", "default_checkpoint", "_layer1.weight"]
safe_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=12)
toml_values = st.recursive(
    st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats(allow_nan=False, allow_infinity=False) | safe_text
    | st.sampled_from(["h.{layer}.mlp", "{layer", "{0}", "transpose", "config.n_embd", "a:b",
                       "parity.ffn:FeedForward"]),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.sampled_from(KNOWN_KEYS) | safe_text, inner, max_size=4),
    max_leaves=12)


@st.composite
def mutated_gpt2(draw) -> dict:
    """The valid gpt2 mapping with a few values replaced or keys deleted, so validation goes deep."""
    data = json.loads(json.dumps(GPT2))
    for _ in range(draw(st.integers(1, 3))):
        table = data
        while isinstance(table, dict) and table and draw(st.booleans()):
            key = draw(st.sampled_from(sorted(table)))
            if not isinstance(table[key], dict) or not table[key]:
                break
            table = table[key]
        if not isinstance(table, dict):
            continue
        key = draw(st.sampled_from(sorted(table) + KNOWN_KEYS))
        if draw(st.booleans()):
            table.pop(key, None)
        else:
            table[key] = draw(toml_values)
    return data


def parse_or_mapping_error(text: str) -> None:
    only_parity_errors(parse_mapping, text, Path("fuzz.toml"))


@FAST
@given(st.text(max_size=400))
def test_random_unicode_mapping_text(text):
    parse_or_mapping_error(text)


@FAST
@given(st.dictionaries(st.sampled_from(KNOWN_KEYS) | safe_text, toml_values, max_size=8))
def test_random_toml_structures(data):
    text = toml_document(data)
    assert tomllib.loads(text) == json.loads(json.dumps(data))  # the serialiser writes what we meant
    parse_or_mapping_error(text)


@FAST
@given(mutated_gpt2())
def test_mutated_valid_mapping(data):
    text = toml_document(data)
    parse_or_mapping_error(text)
    if data == GPT2:
        assert parse_mapping(text, Path("fuzz.toml")).name == "gpt2"


def test_non_integer_layer_count_in_config(llama_folder, tiny):
    """Found by the fuzzer: GPT2Config does not validate the num_hidden_layers alias of n_layer, and int('llama')
    was a traceback."""
    shutil.copy(tiny["gpt2"] / ST, llama_folder / ST)
    config = json.loads((tiny["gpt2"] / "config.json").read_text()) | {"num_hidden_layers": "llama"}  # alias of n_layer
    (llama_folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ParityError, match=r"config\.json: 'num_hidden_layers' = 'llama': expected an integer"):
        read_through_runner(llama_folder)
