#!/usr/bin/env python
"""Reading one layer's FFN tensors from the hub: parity's range client against huggingface_hub's HfFileSystem.

Both run against the local stand-in for the hub (tests/hub_server.py, 127.0.0.1), which counts every body
byte it sends and logs every request; the checkpoint is a LLaMA of real layout (save_pretrained, sharded).
This is how docs/performance.md decides whether HfFileSystem's range reads could replace the hand-written
client (parity.sources.hub_ranges).

    PYTHONPATH=$PWD python scripts/hub_reads.py [--hidden 1024] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def build(folder: Path, hidden: int, layers: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=8, vocab_size=256)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="8MB")
    return folder


def tensor_ranges(folder: Path, layer: int) -> dict[str, tuple[str, int, int]]:
    """name -> (shard, start, end) of the layer's three MLP weights, from the shards' own headers."""
    import struct

    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for proj in ("gate", "up", "down"):
        name = f"model.layers.{layer}.mlp.{proj}_proj.weight"
        shard = folder / index[name]
        with open(shard, "rb") as handle:
            size = struct.unpack("<Q", handle.read(8))[0]
            header = json.loads(handle.read(size))
        start, end = header[name]["data_offsets"]
        out[name] = (shard.name, 8 + size + start, 8 + size + end)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    from tests.hub_server import FakeHub

    with tempfile.TemporaryDirectory() as tmp, FakeHub() as hub:
        home, kept = Path(tmp) / "hf_home", Path(tmp) / "parity_cache"
        os.environ.update({"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"),
                           "PARITY_CACHE": str(kept), "HF_HUB_DISABLE_TELEMETRY": "1"})
        for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN"):
            os.environ.pop(key, None)  # before huggingface_hub is imported: it reads them once
        folder = build(Path(tmp) / "ckpt", args.hidden, args.layers)
        hub.add_repo("bench/llama", folder)
        layer = args.layers // 2
        ranges = tensor_ranges(folder, layer)
        wanted = sum(end - start for _, start, end in ranges.values())
        results = {}
        for route in ("parity", "HfFileSystem"):
            walls, sent, requests = [], [], []
            for _ in range(args.runs):
                shutil.rmtree(home, ignore_errors=True)  # a cold cache every run
                shutil.rmtree(kept, ignore_errors=True)
                hub.sent.clear()
                with hub.lock:
                    hub.log.clear()
                started = time.perf_counter()
                if route == "parity":
                    import parity

                    assert parity.check("bench/llama", layers=[layer]).passed
                else:
                    from huggingface_hub import HfFileSystem

                    fs = HfFileSystem(skip_instance_cache=True)
                    for shard, start, end in ranges.values():
                        with fs.open(f"bench/llama/{shard}", "rb") as handle:
                            handle.seek(start)
                            assert len(handle.read(end - start)) == end - start
                walls.append(time.perf_counter() - started)
                sent.append(sum(v for k, v in hub.sent.items() if k.endswith(".safetensors")))
                requests.append(len(hub.log))
            results[route] = {"wall_s": statistics.median(walls), "shard_bytes_sent": statistics.median(sent),
                              "requests": statistics.median(requests)}
        faults = fault_round(hub, folder, ranges)
        print(f"layer {layer}'s three MLP weights: {wanted / 2**20:.1f} MiB")
        for route, r in results.items():
            print(f"{route:<13} {r['wall_s']:6.2f} s  shard bytes sent {r['shard_bytes_sent'] / 2**20:7.1f} MiB "
                  f"({r['shard_bytes_sent'] / wanted:.2f}x the tensors)  requests {r['requests']:.0f}")
    print("one fault on the CDN while reading a tensor (each once): what each route ends with")
    for action, outcome in faults.items():
        print(f"  {action:<13} parity: {outcome['parity']:<34} HfFileSystem: {outcome['HfFileSystem']}")
    return 0


FAULTS = ("drop", "short", "long", "wrong_length", "reset", "status")


def fault_round(hub, folder: Path, ranges: dict) -> dict[str, dict[str, str]]:
    """Each fault once on the CDN, during a read of the layer's first tensor: the right bytes, an error, or
    (the one outcome a verifier cannot have) wrong bytes without a word."""
    from huggingface_hub import HfFileSystem

    from parity.sources.hub_ranges import hub_range_fetcher

    shard, start, end = next(iter(ranges.values()))
    truth = (folder / shard).read_bytes()[start:end]
    outcomes = {}
    for action in FAULTS:
        outcomes[action] = {}
        for route in ("parity", "HfFileSystem"):
            hub.faults.clear()
            hub.add_fault(action, file=shard, where="cdn", ranged=True, times=1)
            try:
                if route == "parity":
                    got = b"".join(hub_range_fetcher("bench/llama", None)(shard, start, end))
                else:
                    with HfFileSystem(skip_instance_cache=True).open(f"bench/llama/{shard}", "rb") as handle:
                        handle.seek(start)
                        got = handle.read(end - start)
                outcomes[action][route] = "right bytes" if got == truth else "WRONG BYTES, no error"
            except Exception as exc:  # noqa: BLE001 - what each route ends with is the measurement
                outcomes[action][route] = f"error ({type(exc).__name__})"
    hub.faults.clear()
    return outcomes


if __name__ == "__main__":
    sys.exit(main())
