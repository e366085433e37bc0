"""Partial remote loading: which shards and byte ranges a layer needs, and a ranged reader
checked against safe_open on real files written by save_pretrained(max_shard_size=...)."""

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open

import parity
from parity.errors import CheckpointError
from parity.sources import hub
from parity.sources.ranges import RangedReader, Span, layer_ranges, local_fetcher, plan


def index_of(folder):
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]


def mlp_names(layer):
    return [f"model.layers.{layer}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]


def recording(fetch):
    calls = []

    def wrapped(file_name, start, end):
        calls.append((file_name, start, end))
        return fetch(file_name, start, end)

    return wrapped, calls


def stored(folder, file_name, name):
    with safe_open(str(folder / file_name), framework="pt") as handle:
        return handle.get_tensor(name)


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_layer_needs_only_the_shards_and_bytes_of_its_tensors(llama_sharded, layer):
    weight_map = index_of(llama_sharded)
    reader = RangedReader(local_fetcher(llama_sharded))
    headers = {f: reader.header(f) for f in set(weight_map.values())}
    ranges = layer_ranges(weight_map, headers, mlp_names(layer))
    holding = {weight_map[n] for n in mlp_names(layer)}
    assert set(ranges) == holding and len(holding) < len(headers)  # a strict subset of the shards
    nbytes = sum(stored(llama_sharded, weight_map[n], n).nbytes for n in mlp_names(layer))
    assert sum(end - start for spans in ranges.values() for start, end in spans) == nbytes
    for file_name, spans in ranges.items():
        size = os.path.getsize(llama_sharded / file_name)
        assert all(8 < start < end <= size for start, end in spans)


def test_ranged_reader_equals_safe_open_and_fetches_nothing_else(llama_sharded):
    weight_map = index_of(llama_sharded)
    fetch, calls = recording(local_fetcher(llama_sharded))
    reader = RangedReader(fetch, max_gap=0)
    names = mlp_names(1)
    for file_name in sorted({weight_map[n] for n in names}):
        in_file = [n for n in names if weight_map[n] == file_name]
        got = reader.read(file_name, in_file)
        for name in in_file:
            want = stored(llama_sharded, file_name, name)
            assert got[name].dtype == want.dtype and torch.equal(got[name], want)
    touched = {f for f, _, _ in calls}
    header_bytes = sum(8 + int.from_bytes((llama_sharded / f).read_bytes()[:8], "little") for f in touched)
    tensor_bytes = sum(stored(llama_sharded, weight_map[n], n).nbytes for n in names)
    fetched = sum(end - start for _, start, end in calls)
    assert fetched - header_bytes == tensor_bytes
    assert touched == {weight_map[n] for n in names}


def test_plan_merges_adjacent_and_near_ranges():
    spans = {n: Span(n, "F32", (4,), s, e) for n, s, e in [("a", 100, 116), ("b", 116, 132), ("c", 200, 216)]}
    assert [(s, e, [m.name for m in ms]) for s, e, ms in plan(spans, ["c", "a", "b"])] == \
        [(100, 132, ["a", "b"]), (200, 216, ["c"])]
    assert [(s, e) for s, e, _ in plan(spans, ["a", "c"], max_gap=100)] == [(100, 216)]
    assert [(s, e) for s, e, _ in plan(spans, ["a", "c"], max_gap=10)] == [(100, 116), (200, 216)]


def test_reader_with_gaps_still_reads_exact_tensors(llama_sharded):
    weight_map = index_of(llama_sharded)
    file_name = weight_map["model.layers.0.mlp.down_proj.weight"]
    names = [n for n, f in weight_map.items() if f == file_name]
    got = RangedReader(local_fetcher(llama_sharded), max_gap=1 << 20).read(file_name, names[::2])
    assert all(torch.equal(got[n], stored(llama_sharded, file_name, n)) for n in names[::2])


def test_progress_counts_every_byte(llama_sharded):
    bars = []

    class Bar:
        def __init__(self, description, total):
            self.description, self.total, self.done, self.closed = description, total, 0, False
            bars.append(self)

        def update(self, n):
            self.done += n

        def close(self):
            self.closed = True

    weight_map = index_of(llama_sharded)
    name = "model.layers.2.mlp.up_proj.weight"
    RangedReader(local_fetcher(llama_sharded), progress=Bar).read(weight_map[name], [name])
    (bar,) = bars
    assert bar.total == bar.done == stored(llama_sharded, weight_map[name], name).nbytes and bar.closed


def test_truncated_or_foreign_files_are_checkpoint_errors(llama_sharded, tmp_path):
    weight_map = index_of(llama_sharded)
    name = "model.layers.1.mlp.gate_proj.weight"
    file_name = weight_map[name]
    data = (llama_sharded / file_name).read_bytes()
    (tmp_path / file_name).write_bytes(data[:-1])
    with pytest.raises(CheckpointError, match="cut short|expected"):
        reader = RangedReader(local_fetcher(tmp_path))
        last = max(reader.header(file_name).values(), key=lambda s: s.end).name
        reader.read(file_name, [last])
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        RangedReader(local_fetcher(tmp_path)).read("junk.safetensors", [name])


@pytest.fixture()
def online_hub_without_shards(llama_sharded, tmp_path, monkeypatch):
    """'tiny-org/sharded' with only config.json and the index in the cache, the hub 'reachable',
    and byte ranges served from the local folder by a recording fetcher."""
    home = tmp_path / "hf_home"
    commit = "89abcdef0123456789abcdef0123456789abcdef"
    repo_dir = home / "hub" / "models--tiny-org--sharded"
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    for name in ("config.json", "model.safetensors.index.json"):
        shutil.copy(llama_sharded / name, snapshot / name)
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setenv("PARITY_CACHE", str(tmp_path / "parity_cache"))  # tensors read by range: this test's own
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(hub, "hub_reachable", lambda: True)
    fetch, calls = recording(local_fetcher(llama_sharded))
    revisions = []
    monkeypatch.setattr(hub, "hub_range_fetcher", lambda repo, revision: revisions.append((repo, revision)) or fetch)
    return calls, revisions, commit


def test_hub_check_reads_only_the_layers_byte_ranges(online_hub_without_shards, llama_sharded):
    calls, revisions, commit = online_hub_without_shards
    report = parity.check("tiny-org/sharded", layers=[2])
    assert report.passed and report.weights == "real"
    weight_map = index_of(llama_sharded)
    assert revisions == [("tiny-org/sharded", commit)]  # pinned to the commit config.json came from
    assert {f for f, _, _ in calls} == {weight_map[n] for n in mlp_names(2)}
    shard_bytes = sum(os.path.getsize(llama_sharded / f) for f in set(weight_map.values()))
    assert sum(end - start for _, start, end in calls) < shard_bytes / 3


def test_hub_reader_prefers_a_cached_shard(online_hub_without_shards, llama_sharded, tmp_path):
    calls, _, commit = online_hub_without_shards
    weight_map = index_of(llama_sharded)
    snapshot = tmp_path / "hf_home" / "hub" / "models--tiny-org--sharded" / "snapshots" / commit
    for name in mlp_names(0):
        if not (snapshot / weight_map[name]).exists():
            shutil.copy(llama_sharded / weight_map[name], snapshot / weight_map[name])
    assert parity.check("tiny-org/sharded", layers=[0]).passed
    assert calls == []


def test_hub_range_failure_falls_back_to_the_whole_shard(online_hub_without_shards, llama_sharded, monkeypatch, caplog):
    def refuse(file_name, start, end):
        raise hub.RangeFailed("416 Range Not Satisfiable")
        yield  # pragma: no cover

    monkeypatch.setattr(hub, "hub_range_fetcher", lambda repo, revision: refuse)
    downloaded = []
    monkeypatch.setattr(hub, "_download", lambda repo, file_name, revision, offline: downloaded.append(file_name) or (
        llama_sharded / file_name))
    assert parity.check("tiny-org/sharded", layers=[1]).passed
    assert set(downloaded) >= {index_of(llama_sharded)[n] for n in mlp_names(1)}
    assert "downloading the whole file" in caplog.text  # a log record: the CLI prints it as a "parity: ..." line


@pytest.mark.parametrize("flags", [["--quiet"], ["--json", "-"]])
def test_quiet_and_json_stdout_silence_progress_bars(tiny, flags, capsys):
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars

    from parity.cli import main

    enable_progress_bars()
    try:
        assert main([str(tiny["llama"]), "--layer", "0", *flags]) == 0
        assert are_progress_bars_disabled()
    finally:
        enable_progress_bars()
    out = capsys.readouterr()
    if flags == ["--quiet"]:
        assert out.out.strip().startswith("PASS") and "max|Δ|" not in out.out + out.err
    else:
        assert json.loads(out.out)["passed"] is True


def test_progress_bars_on_by_default_on_a_terminal(tiny, capsys, monkeypatch):
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars

    from parity.cli import main

    monkeypatch.setattr("parity.outputs.progress.bar_wanted", lambda quiet, json_stdout, stream=None: True)
    enable_progress_bars()
    assert main([str(tiny["llama"]), "--layer", "0"]) == 0
    assert not are_progress_bars_disabled()
    assert "max|Δ|" in capsys.readouterr().out


def test_no_library_progress_bars_when_stderr_is_no_terminal(tiny, capsys):
    """A CI log (stderr not a terminal) gets no huggingface_hub or transformers bars (issue 10)."""
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars
    from transformers.utils import logging as hf_logging

    from parity.cli import main

    enable_progress_bars()
    try:
        assert main([str(tiny["llama"]), "--layer", "0"]) == 0
        assert are_progress_bars_disabled() and not hf_logging.is_progress_bar_enabled()
    finally:
        enable_progress_bars()
        hf_logging.enable_progress_bar()


def test_tensors_read_by_range_are_cached_for_the_commit(online_hub_without_shards, llama_sharded, monkeypatch):
    calls, _, commit = online_hub_without_shards
    first = parity.check("tiny-org/sharded", layers=[1])
    assert calls
    calls.clear()
    again = parity.check("tiny-org/sharded", layers=[1])
    assert calls == []  # nothing fetched the second time
    for now, before in zip(again.layers, first.layers, strict=True):  # the same weights, read from the cache
        # (not bit-equal deviations: the tensors may sit at other memory alignments, which can change a kernel's
        # rounding)
        assert now.passed and now.preactivation_range == pytest.approx(before.preactivation_range, rel=1e-5)
    monkeypatch.setattr(hub, "hub_reachable", lambda: False)  # and offline, from the same cache
    assert parity.check("tiny-org/sharded", layers=[1]).passed and calls == []
    with pytest.raises(hub.OfflineError, match="not in the local Hugging Face cache"):
        parity.check("tiny-org/sharded", layers=[0])  # never read: fails fast, says what to do


def test_branch_names_are_not_cached(llama_sharded, tmp_path):
    from parity.sources.tensorcache import TensorCache

    reads = []

    def read(file_name, names):
        reads.append(names)
        return {n: torch.ones(2) for n in names}

    for cache in (TensorCache("org/x", "main"), TensorCache("org/x", None)):
        cache.read_through("a.safetensors", ["t"], read)
        cache.read_through("a.safetensors", ["t"], read)
    assert len(reads) == 4
    pinned = TensorCache("org/x", "0" * 40)
    pinned.read_through("a.safetensors", ["t", "u"], read)
    assert pinned.read_through("a.safetensors", ["u", "t"], read)["u"].tolist() == [1.0, 1.0] and len(reads) == 5
