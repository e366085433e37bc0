"""Faults on the way to the hub, for real: parity against ``tests/hub_server.FakeHub`` on 127.0.0.1,
through huggingface_hub's own HTTP code (HF_ENDPOINT pointed at the server, HF_HOME a temp folder,
HF_HUB_OFFLINE unset).  The repository is conftest's ``llama_sharded``: ten shards, so a layer
touches only some of them.  Each fault gives the right result (the one the local copy gives) or
exit 2 with a one-line message; the range cache never keeps a partial or corrupt entry; a later
run after the fault succeeds.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import parity
from parity.cli import main
from parity.errors import UsageError
from parity.sources import hub as hub_source
from tests.hub_server import FakeHub
from tests.support import default_sigint, run_json

REPO = "tiny-org/sharded"
LAYER = "2"
MAX_TRIES = 4  # requests one persistent fault may see (3 seen: a range read, its retry, the whole-file fallback)
TIMEOUT_S = 1  # HF_HUB_DOWNLOAD_TIMEOUT, HF_HUB_ETAG_TIMEOUT and PARITY_HUB_TIMEOUT here: a stall costs seconds
TEST_LIMIT_S = 120  # per test, so that nothing hangs
ROOT = Path(__file__).resolve().parents[1]


class Overtime(BaseException):
    """Not an Exception: parity's own handlers must not swallow it."""


@pytest.fixture(autouse=True)
def _deadline():
    def expire(signum, frame):
        raise Overtime(f"the test ran over {TEST_LIMIT_S} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, TEST_LIMIT_S)
    faulthandler.dump_traceback_later(TEST_LIMIT_S + 30, exit=True)  # if even the alarm cannot get through
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        faulthandler.cancel_dump_traceback_later()


def point_huggingface_hub_at(endpoint: str, home: Path, cache: Path, monkeypatch) -> dict[str, str]:
    """HF_ENDPOINT and friends: in the environment (subprocesses, and what parity reads at call time) and in
    huggingface_hub's constants (read once, at its import, by this process).  HF_HUB_OFFLINE is unset."""
    from huggingface_hub import constants

    env = {"HF_ENDPOINT": endpoint, "HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"),
           "HF_TOKEN_PATH": str(home / "token"), "HF_HUB_DOWNLOAD_TIMEOUT": str(TIMEOUT_S),
           "HF_HUB_ETAG_TIMEOUT": str(TIMEOUT_S), "PARITY_HUB_TIMEOUT": str(TIMEOUT_S), "PARITY_CACHE": str(cache),
           "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    template = endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    patched = {"ENDPOINT": endpoint, "HUGGINGFACE_CO_URL_TEMPLATE": template,
               "HF_HUB_OFFLINE": False, "HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"),
               "HF_TOKEN_PATH": str(home / "token"), "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"),
               "AGENT_HARNESSES_PATH": str(home / ".agent_harnesses.json"),
               "HF_HUB_DOWNLOAD_TIMEOUT": TIMEOUT_S, "HF_HUB_ETAG_TIMEOUT": TIMEOUT_S}
    for name, value in patched.items():
        monkeypatch.setattr(constants, name, value)
    return env


@pytest.fixture()
def hub(llama_sharded, tmp_path, monkeypatch):
    """The fake hub serving REPO (llama_sharded), started and always stopped; huggingface_hub pointed at it."""
    from huggingface_hub.utils import close_session

    hub_source.hub_reachable.cache_clear()
    server = FakeHub().start()
    try:
        server.folder, server.commit = llama_sharded, server.add_repo(REPO, llama_sharded)
        server.env = point_huggingface_hub_at(server.endpoint, tmp_path / "hf_home", tmp_path / "parity_cache",
                                              monkeypatch)
        yield server
    finally:
        close_session()  # huggingface_hub's keep-alive connections to this server go with it
        server.stop()
        hub_source.hub_reachable.cache_clear()


# -- what the truth is ------------------------------------------------------------------------------

def index_of(folder: Path) -> dict[str, str]:
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]


def layer_names(layer: str = LAYER) -> list[str]:
    return [f"model.layers.{layer}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]


def stored(folder: Path, file_name: str, name: str) -> torch.Tensor:
    with safe_open(str(folder / file_name), framework="pt") as handle:
        return handle.get_tensor(name)


def layer_shards(folder: Path, layer: str = LAYER) -> list[str]:
    return sorted({index_of(folder)[n] for n in layer_names(layer)})


def layer_bytes(folder: Path, layer: str = LAYER) -> dict[str, int]:
    """What reading a layer by range may cost: per shard its 8-byte length, its header, its layer tensors."""
    weight_map, out = index_of(folder), {}
    for name in layer_names(layer):
        file_name = weight_map[name]
        if file_name not in out:
            out[file_name] = 8 + int.from_bytes((folder / file_name).read_bytes()[:8], "little")
        out[file_name] += stored(folder, file_name, name).nbytes
    return out


@pytest.fixture(scope="module")
def local_fingerprint(llama_sharded) -> str:
    """The same check on the local copy: the fingerprint of the weights it read."""
    report = parity.check(str(llama_sharded), layers=[int(LAYER)])
    assert report.passed and report.layers[0].fingerprint
    return report.layers[0].fingerprint


def run_cli(capsys, *args: str) -> tuple[int, dict | None, str]:
    """parity MODEL ... --json - in this process -> (exit code, the JSON report or None, stderr)."""
    capsys.readouterr()  # only this run's output
    code, report, err = run_json(capsys, *args)
    if code != 0 and report is None:
        report = {"stderr": err}  # what a failed assertion shows
    return code, report, err


def assert_right_result(code: int, report: dict | None, fingerprint: str) -> None:
    assert code == 0, report
    assert report["passed"] and report["weights"] == "real"
    assert [row["fingerprint"] for row in report["layers"]] == [fingerprint]  # the very bytes of the local copy


def one_line_error(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert lines and lines[-1].startswith("parity: error: "), err
    assert "internal error" not in err and "Traceback" not in err
    return lines[-1]


def cache_entries(hub: FakeHub) -> dict[str, Path]:
    """Every file in the range cache; each must be a whole entry holding the true tensor -> {tensor: path}."""
    root = Path(hub.env["PARITY_CACHE"]) / "ranges"
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []
    assert not [p for p in files if p.name.endswith(".tmp")], "a temporary file was left behind"
    weight_map, found = index_of(hub.folder), {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            (name,) = handle.keys()
            tensor = handle.get_tensor(name)
        assert torch.equal(tensor, stored(hub.folder, weight_map[name], name)), f"{path} holds wrong bytes"
        found[name] = path
    return found


# -- the happy path, measured ---------------------------------------------------------------------

def test_a_layer_from_the_hub_equals_the_local_copy_and_costs_only_its_byte_ranges(hub, local_fingerprint, capsys):
    code, report, _ = run_cli(capsys, REPO, "--layer", LAYER)
    assert_right_result(code, report, local_fingerprint)
    small = {f: len((hub.folder / f).read_bytes()) for f in ("config.json", "model.safetensors.index.json")}
    assert dict(hub.sent) == small | layer_bytes(hub.folder)  # nothing else: not a byte of another tensor
    assert 0 < len(layer_shards(hub.folder)) < len({*index_of(hub.folder).values()})
    shard_requests = [e for e in hub.requests(where="hub") if (e["file"] or "").endswith(".safetensors")]
    assert shard_requests and all(f"/resolve/{hub.commit}/" in e["path"] for e in shard_requests)  # pinned
    assert all(e["status"] == 302 for e in shard_requests)  # LFS files are served by the CDN, as on the hub
    assert not [e for e in hub.log if e.get("unknown")], hub.log  # nothing asked that the hub would not answer
    assert set(cache_entries(hub)) == set(layer_names())

    hub.reset_counts()  # a later run: the layer's tensors come from the range cache, no shard byte is sent
    code, report, _ = run_cli(capsys, REPO, "--layer", LAYER)
    assert_right_result(code, report, local_fingerprint)
    assert not [f for f in hub.sent if f.endswith(".safetensors")]


def test_a_new_commit_is_read_from_that_commit(hub, local_fingerprint, tmp_path, capsys):
    from tests.conftest import build_model, save

    run_cli(capsys, REPO, "--layer", LAYER)
    newer = save(build_model("llama", seed=99), tmp_path / "newer", max_shard_size="20KB")
    commit = hub.add_repo(REPO, newer)  # main moves; the old commit stays served
    want = parity.check(str(newer), layers=[int(LAYER)]).layers[0].fingerprint
    hub.reset_counts()
    code, report, _ = run_cli(capsys, REPO, "--layer", LAYER)
    assert code == 0 and report["layers"][0]["fingerprint"] == want  # not the old commit's cached tensors
    shard_paths = [e["path"] for e in hub.requests(where="hub") if (e["file"] or "").endswith(".safetensors")]
    assert shard_paths and all(f"/resolve/{commit}/" in p for p in shard_paths)
    code, report, _ = run_cli(capsys, REPO, "--layer", LAYER, "--revision", hub.commit)
    assert_right_result(code, report, local_fingerprint)  # the first commit, asked for by --revision


@pytest.mark.slow  # a fresh process: huggingface_hub reads HF_ENDPOINT at import
def test_the_cli_run_with_only_the_environment_pointing_at_the_server(hub, local_fingerprint):
    """A fresh process: huggingface_hub reads HF_ENDPOINT at import, parity probes that host (not huggingface.co)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")} | hub.env
    done = subprocess.run([sys.executable, "-m", "parity", REPO, "--layer", LAYER, "--json", "-"], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=TEST_LIMIT_S - 20)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["layers"][0]["fingerprint"] == local_fingerprint
    assert dict(hub.sent)["config.json"] and all(hub.sent[f] == n for f, n in layer_bytes(hub.folder).items())


# -- faults parity rides out: the right result, then a later run from the cache -----------------------

RECOVERS = {  # fault on the layer's first shard (unless "file" says otherwise) -> the right result
    "503 from the hub, then success": dict(action="status", status=503, where="hub", ranged=True),
    "502 from the CDN, then success": dict(action="status", status=502, where="cdn", ranged=True),
    "connection dropped mid-range": dict(action="drop", where="cdn", ranged=True, skip=2),
    "connection dropped mid-range, every time": dict(action="drop", where="cdn", ranged=True, times=None),
    "connection closed before an answer": dict(action="reset", where="cdn", ranged=True),
    "short body: a well-formed 206 for half the range, every time": dict(action="short", where="cdn", times=None),
    "body shorter than its Content-Range": dict(action="wrong_length", where="cdn", skip=2),
    "body longer than the range asked": dict(action="long", where="cdn", times=None),
    "slow server: no answer within the timeout, once": dict(action="stall", seconds=3, where="cdn", ranged=True),
    "slow server: stops mid-body, once": dict(action="stall_body", seconds=3, where="cdn", skip=2),
    "slow server: trickles, within the timeout": dict(action="trickle", seconds=0.3, where="cdn", times=None),
    "Range ignored: 200 and the whole file": dict(action="ignore_range", where="cdn", ranged=True, times=None),
    "503 for config.json's metadata, then success": dict(action="status", status=503, file="config.json",
                                                          method="HEAD"),
    "500 for config.json's body, then success": dict(action="status", status=500, file="config.json",
                                                      method="GET"),
    "the index's download dropped midway": dict(action="drop", file="model.safetensors.index.json", method="GET"),
    "config.json's metadata stalls past the timeout": dict(action="stall", seconds=3, file="config.json",
                                                           method="HEAD"),
}


@pytest.mark.parametrize("fault", RECOVERS.values(), ids=RECOVERS.keys())
def test_a_fault_parity_rides_out_gives_the_right_result(hub, local_fingerprint, fault, capsys):
    shard = layer_shards(hub.folder)[0]
    injected = hub.add_fault(**({"file": shard} | fault))
    code, report, err = run_cli(capsys, REPO, "--layer", LAYER)
    assert_right_result(code, report, local_fingerprint)
    assert injected.hits >= 1
    cached = cache_entries(hub)  # whole entries of the true tensors only
    if fault["action"] == "ignore_range":  # the whole shard, from huggingface_hub's cache instead
        size = (hub.folder / shard).stat().st_size  # (the 200's body is cut off by closing: up to one more)
        assert "downloading the whole file" in err and size <= hub.sent[shard] <= 2 * size
        assert not [n for n in cached if index_of(hub.folder)[n] == shard]
    else:
        assert set(cached) == set(layer_names())
        assert hub.sent[shard] >= layer_bytes(hub.folder)[shard]
    hub.faults.clear()
    hub.reset_counts()  # the run after: nothing of a shard is sent again
    code, report, _ = run_cli(capsys, REPO, "--layer", LAYER)
    assert_right_result(code, report, local_fingerprint)
    assert not [f for f in hub.sent if f.endswith(".safetensors")]


# -- faults that persist: exit 2, one clear line, nothing partial kept, the later run succeeds ------

FAILS = {  # fault on the layer's first shard -> what the one-line message must say
    "503 on every try": (dict(action="status", status=503, where="cdn", ranged=True, times=None), "HTTP 503"),
    "connection closed before an answer, every try": (dict(action="reset", where="cdn", times=None),
                                                      "could not read bytes"),
    "a server that stalls past the timeout, every try": (dict(action="stall", seconds=4, where="cdn", times=None),
                                                         f"no answer within {TIMEOUT_S} s"),
    "403 from the CDN": (dict(action="status", status=403, where="cdn", times=None), "HF_TOKEN"),
    "404 from the CDN": (dict(action="status", status=404, where="cdn", times=None), "HTTP 404"),
}


SLOW_FAILS = {"a server that stalls past the timeout, every try"}  # every try waits out the timeout: seconds


@pytest.mark.parametrize(("fault", "says"), [
    pytest.param(*value, id=key, marks=[pytest.mark.slow] * (key in SLOW_FAILS)) for key, value in FAILS.items()])
def test_a_fault_that_persists_is_exit_2_with_a_clear_message(hub, local_fingerprint, fault, says, capsys):
    shard = layer_shards(hub.folder)[0]
    injected = hub.add_fault(file=shard, **fault)
    code, report, err = run_cli(capsys, REPO, "--layer", LAYER)
    assert code == 2 and report["kind"] == "error" and report["passed"] is False
    assert 1 <= injected.hits <= MAX_TRIES  # bounded: a few tries, each within the timeout, never a retry loop
    line = one_line_error(err)
    assert REPO in line and shard in line and says in line, line
    assert not [n for n in cache_entries(hub) if index_of(hub.folder)[n] == shard]  # nothing of it kept
    hub.faults.clear()
    code, report, _ = run_cli(capsys, REPO, "--layer", LAYER)  # the fault is gone: the later run succeeds
    assert_right_result(code, report, local_fingerprint)
    assert set(cache_entries(hub)) == set(layer_names())


def test_gated_repository_needs_a_granted_token(hub, local_fingerprint, capsys, monkeypatch):
    hub.add_repo("tiny-org/gated", hub.folder, gated=True)
    for token, status in ((None, 401), ("hf_not_granted", 403)):
        if token:
            monkeypatch.setenv("HF_TOKEN", token)
        hub.reset_counts()
        code, _, err = run_cli(capsys, "tiny-org/gated", "--layer", LAYER)
        line = one_line_error(err)
        assert code == 2 and "'tiny-org/gated' is a gated repository" in line and "HF_TOKEN" in line
        assert {e["status"] for e in hub.log if e["where"] == "hub" and e["file"]} == {status}
    monkeypatch.setenv("HF_TOKEN", "hf_granted")
    hub.reset_counts()
    code, report, _ = run_cli(capsys, "tiny-org/gated", "--layer", LAYER)
    assert_right_result(code, report, local_fingerprint)
    assert {e["auth"] for e in hub.requests(where="hub") if e["file"]} == {"Bearer hf_granted"}
    assert {e["auth"] for e in hub.requests(where="cdn")} == {None}  # the token never leaves the hub
    monkeypatch.delenv("HF_TOKEN")  # config.json and the index are cached now: the ranges are refused
    code, _, err = run_cli(capsys, "tiny-org/gated", "--layer", "1")
    assert code == 2 and "'tiny-org/gated' is a gated repository" in one_line_error(err)


NOT_FOUND = {
    "repository": (["tiny-org/nope"], "'tiny-org/nope' is neither a mapping name, a local path nor a hub repository"),
    "revision": ([REPO, "--revision", "v9"], f"'{REPO}': revision 'v9' does not exist"),
    "config.json": (["tiny-org/no-config"], "'tiny-org/no-config' has no config.json"),
    "a shard the index lists": (["tiny-org/lost-shard"], "is listed in model.safetensors.index.json but missing"),
}


@pytest.mark.parametrize(("args", "says"), NOT_FOUND.values(), ids=NOT_FOUND.keys())
def test_404_is_exit_2_and_names_what_is_missing(hub, args, says, capsys):
    folder = hub.folder
    hub.add_repo("tiny-org/no-config", files={"model.safetensors.index.json": (folder / "model.safetensors.index.json")
                                              .read_bytes()})
    lost = layer_shards(folder)[0]
    hub.add_repo("tiny-org/lost-shard", files={p.name: p.read_bytes() for p in folder.iterdir() if p.name != lost})
    code, report, err = run_cli(capsys, *args, "--layer", LAYER)
    assert code == 2 and report["kind"] == "error" and report["passed"] is False and says in one_line_error(err)
    assert not [e for e in hub.log if e.get("unknown")]


# -- the range cache: only whole, verified entries are used -----------------------------------------

def test_a_damaged_cache_entry_is_read_again_and_never_trusted(hub, local_fingerprint, capsys, monkeypatch):
    run_cli(capsys, REPO, "--layer", LAYER)
    entries = cache_entries(hub)
    flipped, cut = (entries[n] for n in layer_names()[:2])
    data = bytearray(flipped.read_bytes())
    data[-1] ^= 0xFF  # one bit pattern in the tensor's bytes: the file still opens, the hash does not match
    flipped.write_bytes(bytes(data))
    cut.write_bytes(cut.read_bytes()[:-100])  # a torn write of an older parity
    hub.reset_counts()
    code, report, _ = run_cli(capsys, REPO, "--layer", LAYER)
    assert_right_result(code, report, local_fingerprint)
    weight_map = index_of(hub.folder)
    assert {f for f in hub.sent if f.endswith(".safetensors")} == {weight_map[n] for n in layer_names()[:2]}
    assert set(cache_entries(hub)) == set(layer_names())  # rewritten whole

    flipped.write_bytes(bytes(data))  # offline, a damaged entry is an error, never a wrong result
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub_source.hub_reachable.cache_clear()
    code, _, err = run_cli(capsys, REPO, "--layer", LAYER)
    assert code == 2 and "not in the local Hugging Face cache" in one_line_error(err)
    assert not flipped.exists()


def test_ctrl_c_while_an_entry_is_written_leaves_nothing(hub, local_fingerprint, capsys, monkeypatch):
    import safetensors.torch

    real_save = safetensors.torch.save_file

    def interrupted(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)
        Path(filename).write_bytes(Path(filename).read_bytes()[:40])  # half written, then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", interrupted)
    assert main([REPO, "--layer", LAYER, "--quiet"]) == 130
    root = Path(hub.env["PARITY_CACHE"]) / "ranges"
    assert not [p for p in root.rglob("*") if p.is_file()]  # no entry, no temporary file
    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    code, report, _ = run_cli(capsys, REPO, "--layer", LAYER)
    assert_right_result(code, report, local_fingerprint)
    assert set(cache_entries(hub)) == set(layer_names())


@pytest.mark.slow  # a real SIGINT into a real process, while the hub stalls
def test_ctrl_c_while_a_range_is_read_leaves_nothing_a_later_run_trusts(hub, local_fingerprint, capsys):
    shard = layer_shards(hub.folder)[-1]
    stalled = hub.add_fault("stall_body", file=shard, where="cdn", skip=2, seconds=60)  # the tensor, not the header
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")} | hub.env
    env["HF_HUB_DOWNLOAD_TIMEOUT"] = "60"  # the read is still waiting when Ctrl-C comes
    process = subprocess.Popen([sys.executable, "-m", "parity", REPO, "--layer", LAYER, "--quiet"], env=env, cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    try:
        deadline = time.monotonic() + TEST_LIMIT_S - 30
        while not stalled.hits and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert stalled.hits, process.communicate(timeout=10)
        time.sleep(0.5)  # half the tensor's bytes are on their way
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130 and "interrupted" in err
    cached = cache_entries(hub)  # sound, and none for the shard cut short
    assert not [n for n in cached if index_of(hub.folder)[n] == shard]
    code, report, _ = run_cli(capsys, REPO, "--layer", LAYER)
    assert_right_result(code, report, local_fingerprint)
    assert set(cache_entries(hub)) == set(layer_names())


# -- the server speaks huggingface_hub's protocol; parity probes HF_ENDPOINT -------------------------

def test_huggingface_hub_itself_reads_the_fake_hub(hub):
    from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_download, hf_hub_url

    shard = layer_shards(hub.folder)[0]
    meta = get_hf_file_metadata(hf_hub_url(REPO, shard))
    assert (meta.commit_hash, meta.size) == (hub.commit, (hub.folder / shard).stat().st_size)
    assert meta.location.startswith(hub.cdn) and meta.etag  # an LFS file: redirected, sha256 ETag
    path = Path(hf_hub_download(REPO, "config.json", revision=hub.commit))
    assert path.read_bytes() == (hub.folder / "config.json").read_bytes() and path.parent.name == hub.commit
    assert HfApi().model_info(REPO).sha == hub.commit
    assert not [e for e in hub.log if e.get("unknown")]


def test_reachability_is_probed_at_hf_endpoint(hub, monkeypatch):
    import socket

    from huggingface_hub import constants

    assert hub_source.hub_reachable()
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{closed.getsockname()[1]}")
        hub_source.hub_reachable.cache_clear()
        assert not hub_source.hub_reachable()


@pytest.mark.parametrize("value", ["0", "-1", "nan", "soon"])
def test_a_bad_parity_hub_timeout_is_named(monkeypatch, value):
    monkeypatch.setenv("PARITY_HUB_TIMEOUT", value)
    with pytest.raises(UsageError, match="PARITY_HUB_TIMEOUT"):
        hub_source.reach_timeout()


def test_a_single_file_repository_by_range(hub, tiny, capsys):
    commit = hub.add_repo("tiny-org/gpt2", tiny["gpt2"])
    want = parity.check(str(tiny["gpt2"]), layers=[1]).layers[0].fingerprint
    code, report, _ = run_cli(capsys, "tiny-org/gpt2", "--layer", "1")
    assert_right_result(code, report, want)
    weights = hub.requests(where="hub", file="model.safetensors")
    assert weights and all(f"tiny-org/gpt2/resolve/{commit}/" in e["path"] for e in weights)  # pinned
    assert len(cache_entries_of(hub, "tiny-org/gpt2")) == 4  # c_fc and c_proj, weights and biases


def cache_entries_of(hub: FakeHub, repo_id: str) -> list[Path]:
    root = Path(hub.env["PARITY_CACHE"]) / "ranges" / repo_id.replace("/", "--")
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_leftover_temporary_files_are_swept_and_old_entries_not_trusted(tmp_path, monkeypatch):
    from parity.sources.tensorcache import STALE_TMP_S, TensorCache

    monkeypatch.setenv("PARITY_CACHE", str(tmp_path))
    cache = TensorCache("org/x", "0" * 40)
    reads = []

    def read(file_name, names):
        reads.append(list(names))
        return {n: torch.arange(4.0) for n in names}

    cache.read_through("a.safetensors", ["t"], read)
    entry = cache._path("a.safetensors", "t")
    old, young = entry.parent / ".x.1.aa.tmp", entry.parent / ".y.2.bb.tmp"
    for leftover in (old, young):
        leftover.write_bytes(b"partial")
    os.utime(old, (time.time() - STALE_TMP_S - 60,) * 2)
    from safetensors.torch import save_file

    save_file({"t": torch.zeros(4)}, str(entry), metadata={"source": "a.safetensors"})  # an older parity's entry
    assert cache.read_through("a.safetensors", ["t"], read)["t"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert reads == [["t"], ["t"]]  # not trusted: read again, and rewritten
    assert not old.exists() and young.exists()  # a young one may be another run's write in progress
    assert cache.read_through("a.safetensors", ["t"], read)["t"].tolist() == [0.0, 1.0, 2.0, 3.0] and len(reads) == 2
