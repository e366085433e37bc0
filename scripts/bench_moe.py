"""Row (i) of scripts/bench.py: a whole MoE block of the DeepSeek-V3 shape checked in bounded memory.

One MoE layer of DeepSeek V3's shape (d = 7168, 256 routed experts of width 2048, top-8 of 8 groups, one shared
expert; random bfloat16 values, 22.6 GB on disk, written once in row blocks) is checked as a whole block with a port
that reads each expert from the checkpoint when a token needs it (a user's block of this size cannot hold 256
experts either).  Against it: the floor of reading every expert once (bfloat16 -> float32) and computing its share
of parity's tokens, in one process.

The goal (issue 28): parity's time within 1.3 x the floor of a check, which reads the experts twice: once for the
reference, once for the port's own reads (a user's own check would too), so 1.3 x twice the floor.  The port's time
inside parity's process (its one run on every token, and its two runs on a few tokens for determinism) is counted by
the port itself and shown apart from parity's own: the reference (each expert read once, computed in float64, the
truth, and in float32, the noise floor), the inputs, the verdict.  A second floor computes each expert in float64
and float32 from whole copies of its matrices (as the reference did before it computed them a cache-sized slice at a
time, engine.experts.SlicedExpert): the floor of a check whose truth is computed so.  Peak RSS: at most 4 x one
expert's float32 size + 1 GiB.  Whether each goal is met is printed with the measured ratio (``moe_summary``), in
wall seconds and in CPU seconds of the same run (a shared machine's load distorts these least).

Measured (docs/performance.md, row (i), one run each): peak RSS met in every run since fbd3116 (1.45-1.57 GiB against
1.66).  Time: before the reads overlapped the computing, the idle runs took 1.48 x (1fbee1f) and 1.27 x (36d15e1)
twice the floor in wall time, 1.20 x and 1.04 x in CPU seconds.  Since (speed28b: posix_fadvise WILLNEED on the
expert after the next, the next read from an expert's first use), two idle runs of 2026-12-02 took 1.21 x and 1.17 x
wall, 1.14 x and 1.12 x CPU: met in both; the broken port's row 97.6 s, 1.45 GiB, its mistake named.

``python scripts/bench_moe.py [FOLDER]`` runs the same check with BIASED_LAZY_BLOCK (a routing mistake: the replays
of engine.check.block_replay read experts again) and prints its time, peak RSS and the mistake named.
"""

from __future__ import annotations

import json
from pathlib import Path

GIB = 2**30
DEEPSEEK_V3_LAYER = dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], hidden_size=7168,
                         intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1,
                         num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
                         num_hidden_layers=1, first_k_dense_replace=0, num_attention_heads=128,
                         num_key_value_heads=128, vocab_size=129280, torch_dtype="bfloat16")

READER = '''
def read_header(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n)), 8 + n

def read_tensor(path, header, start, name):
    """One bfloat16 tensor read with plain file reads (no mmap: its pages would count as this process's RSS)."""
    info = header[name]
    begin, end = info["data_offsets"]
    with open(path, "rb") as f:
        f.seek(start + begin)
        raw = bytearray(f.read(end - begin))
    return torch.frombuffer(raw, dtype=torch.bfloat16).reshape(info["shape"])
'''

# A user's block that does not hold its experts: DeepSeek V3's routing, each expert read from the checkpoint when a
# token is routed to it (as an offloading inference engine does).
LAZY_BLOCK = '''
import atexit, json, os, time, torch
import torch.nn.functional as F
from torch import nn

''' + READER + '''
class Expert(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(d, f, False), nn.Linear(d, f, False)
        self.down_proj = nn.Linear(f, d, False)
    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

class Router(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(c.n_routed_experts, c.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(c.n_routed_experts))

SPENT = []  # this port's seconds per forward, written next to this file at exit (the bench reads them)
atexit.register(lambda: open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "port_seconds.json"), "w"
                             ).write(json.dumps(SPENT)))

class LazyDeepSeekBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c, self.gate = config, Router(config)
        self.shared_experts = Expert(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
        self.file = os.path.join(os.environ["PARITY_BENCH_MOE"], "model.safetensors")
        self.header, self.start = read_header(self.file)
    def forward(self, x):
        started = time.perf_counter()
        try:
            return self.routed(x)
        finally:
            SPENT.append(time.perf_counter() - started)
    def routed(self, x):
        c, shape = self.c, x.shape
        x = x.reshape(-1, shape[-1])
        scores = F.linear(x.float(), self.gate.weight.float()).sigmoid()
        biased = scores + self.gate.e_score_correction_bias
        groups = biased.view(len(x), c.n_group, -1)
        best = groups.topk(2, -1).values.sum(-1).topk(c.topk_group, -1).indices
        keep = torch.zeros(len(x), c.n_group).scatter_(1, best, 1.0)
        masked = biased.masked_fill(~keep.bool().repeat_interleave(groups.shape[-1], 1), float("-inf"))
        index = masked.topk(c.num_experts_per_tok, -1).indices
        weights = scores.gather(1, index)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * c.routed_scaling_factor
        out = torch.zeros_like(x)
        for e in index.unique().tolist():
            token, slot = (index == e).nonzero(as_tuple=True)
            w = {p: read_tensor(self.file, self.header, self.start, f"model.layers.0.mlp.experts.{e}.{p}.weight"
                                ).to(x.dtype) for p in ("gate_proj", "up_proj", "down_proj")}
            h = x[token]
            y = F.linear(F.silu(F.linear(h, w["gate_proj"])) * F.linear(h, w["up_proj"]), w["down_proj"])
            out.index_add_(0, token, y * weights[token, slot, None].to(x.dtype))
        return (out + self.shared_experts(x)).reshape(shape)
'''

# The same block with a routing mistake (the selection bias put into the routing weights, a real porting slip): a
# failing streamed block, whose mistake parity names by replays that read experts again (engine.check.block_replay).
BIASED_LAZY_BLOCK = LAZY_BLOCK.replace("weights = scores.gather(1, index)", "weights = biased.gather(1, index)")

# The floor: every expert read once (bfloat16 -> float32) and applied to its share of parity's tokens; with "check",
# computed in float64 and in float32 as parity's reference must (the truth and the noise floor).
FLOOR = '''
import json, sys, torch
import torch.nn.functional as F
''' + READER + '''
folder, count, d, tokens, dtypes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]
x = torch.randn(tokens, d)
path = f"{folder}/model.safetensors"
header, start = read_header(path)
for e in range(count):
    stored = {p: read_tensor(path, header, start, f"model.layers.0.mlp.experts.{e}.{p}.weight")
              for p in ("gate_proj", "up_proj", "down_proj")}
    for dtype in dtypes:
        w, h = {p: t.to(getattr(torch, dtype)) for p, t in stored.items()}, x.to(getattr(torch, dtype))
        y = F.linear(F.silu(F.linear(h, w["gate_proj"])) * F.linear(h, w["up_proj"]), w["down_proj"])
print(float(y.abs().max()))
'''


def tokens_per_expert(config: dict) -> int:
    """How many tokens parity routes to each expert on average (engine.block.block_inputs: ROW_TARGETS rows of
    max(MIN_TOKENS, 2·E/k) tokens, k experts each), at least one."""
    from parity.engine.block import MIN_TOKENS, ROW_TARGETS

    count, top_k = config["n_routed_experts"], config["num_experts_per_tok"]
    rows = len(ROW_TARGETS) * max(MIN_TOKENS, -(-2 * count // top_k))
    return max(1, round(rows * top_k / count))


def build_moe_layer(folder: Path, *, experts: int = 256) -> Path:
    """config.json + one safetensors file holding layer 0's block: router, selection bias, ``experts`` experts (256:
    DeepSeek V3's; fewer profiles the same width in less time), the shared expert (random bfloat16, written in row
    blocks: no more than a block in memory).  A folder already holding one is reused (the file is written once)."""
    if (folder / "config.json").is_file():
        return folder
    import torch

    c = dict(DEEPSEEK_V3_LAYER, n_routed_experts=experts)
    d, f, count = c["hidden_size"], c["moe_intermediate_size"], c["n_routed_experts"]
    prefix = "model.layers.0.mlp."
    shapes = {f"{prefix}gate.weight": ("BF16", (count, d)), f"{prefix}gate.e_score_correction_bias": ("F32", (count,))}
    for owner in [*(f"experts.{e}" for e in range(count)), "shared_experts"]:
        shapes |= {f"{prefix}{owner}.gate_proj.weight": ("BF16", (f, d)),
                   f"{prefix}{owner}.up_proj.weight": ("BF16", (f, d)),
                   f"{prefix}{owner}.down_proj.weight": ("BF16", (d, f))}
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (dtype, shape) in shapes.items():
        size = (2 if dtype == "BF16" else 4) * (shape[0] * (shape[1] if len(shape) > 1 else 1))
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    generator = torch.Generator().manual_seed(0)
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / "model.safetensors.partial"
    with open(partial, "wb") as out:
        out.write(len(raw).to_bytes(8, "little") + raw)
        for dtype, shape in shapes.values():
            if dtype == "F32":
                out.write((torch.randn(shape, generator=generator) * 0.01).numpy().tobytes())
                continue
            rows, cols = shape
            for start in range(0, rows, 1024):
                block = torch.randn(min(1024, rows - start), cols, generator=generator) * (1 / cols**0.5)
                out.write(block.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    partial.rename(folder / "model.safetensors")
    config = dict(c, dtype=c["torch_dtype"])
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def moe_commands(folder: Path, work: Path, python: str) -> dict[str, list[str]]:
    """parity's block check with the lazy port, and the floor, as whole processes."""
    (work / "lazy_block.py").write_text(LAZY_BLOCK)
    c = json.loads((folder / "config.json").read_text())
    floor = [python, "-c", FLOOR, str(folder), str(c["n_routed_experts"]), str(c["hidden_size"]),
             str(tokens_per_expert(c))]
    return {"parity --block": [python, "-m", "parity", str(folder), "--target", "lazy_block:LazyDeepSeekBlock",
                               "--block", "--json", str(work / "moe.json")],
            "floor": [*floor, "float32"], "floor float64+float32": [*floor, "float64", "float32"]}


def port_seconds(work: Path) -> list[float]:
    """The port's own seconds per forward in parity's last run (written by LAZY_BLOCK at exit)."""
    path = work / "port_seconds.json"
    return json.loads(path.read_text()) if path.is_file() else []


def block_verdict(work: Path) -> dict:
    """What parity's check of the block concluded (its JSON report): a time measured on a run that did not judge the
    block (unverifiable, or an error) is no time of a check."""
    path = work / "moe.json"
    if not path.is_file():
        return {"passed": False, "said": "no report written"}
    report = json.loads(path.read_text())
    layers = report.get("layers") or [{}]
    return {"passed": bool(report.get("passed")), "unverifiable": layers[0].get("unverifiable"),
            "max_abs_diff": layers[0].get("max_abs_diff"), "tolerance": layers[0].get("tolerance"),
            "coverage": {k: v for k, v in (layers[0].get("coverage") or {}).items() if k != "tokens_per_expert"}}


def print_moe(results: dict) -> None:
    """Peak RSS against one expert's float32 size, and time against the floor of a check (the experts read twice:
    the reference's reads and the port's own), each goal said met or not with its measured ratio, in wall seconds
    and in CPU seconds (which a shared machine's load distorts least), from the same run."""
    c = DEEPSEEK_V3_LAYER
    expert = 3 * c["hidden_size"] * c["moe_intermediate_size"] * 4
    rows = results["moe"]
    parity, floor = rows["parity --block"], rows["floor"]
    port = sum(results.get("moe_port", []))
    print(f"\n(i) one MoE block of the DeepSeek-V3 shape (256 experts, bfloat16 on disk: "
          f"{256 * expert / 2 / 1e9:.1f} GB); one expert in float32: {expert / GIB:.2f} GiB")
    for name, r in rows.items():
        print(f"{name:<24}{r['wall_s']:8.1f}s ({r.get('cpu_s', float('nan')):.1f} s CPU){r['peak_rss'] / GIB:9.2f} GiB"
              f"  = {r['peak_rss'] / expert:.1f} x one expert's float32 size")
    summary = {"peak_rss_over_expert": parity["peak_rss"] / expert,
               "peak_within_goal": parity["peak_rss"] <= 4 * expert + GIB,
               "time_over_check_floor": parity["wall_s"] / (2 * floor["wall_s"]),
               "port_s": port, "parity_own_s": parity["wall_s"] - port,
               "parity_own_over_floor": (parity["wall_s"] - port) / floor["wall_s"]}
    summary["time_within_goal"] = summary["time_over_check_floor"] <= 1.3
    if "cpu_s" in parity:
        summary["cpu_over_check_floor"] = parity["cpu_s"] / (2 * floor["cpu_s"])
        summary["cpu_within_goal"] = summary["cpu_over_check_floor"] <= 1.3
    if "floor float64+float32" in rows:  # the floor of a check whose reference computes in float64 and float32
        truth = rows["floor float64+float32"]
        summary["parity_own_over_float64_floor"] = summary["parity_own_s"] / truth["wall_s"]
        summary["time_over_truth_floor"] = parity["wall_s"] / (floor["wall_s"] + truth["wall_s"])
        if "cpu_s" in parity:
            summary["cpu_over_truth_floor"] = parity["cpu_s"] / (floor["cpu_s"] + truth["cpu_s"])
    results["moe_summary"] = summary
    verdict = results.get("moe_verdict", {})
    print(f"the check's verdict: {'PASS' if verdict.get('passed') else 'NOT a pass'} (max|Δ| "
          f"{verdict.get('max_abs_diff')}, tolerance {verdict.get('tolerance')}"
          + (f"; unverifiable: {verdict['unverifiable']}" if verdict.get("unverifiable") else "") + ")")
    said = {True: "met", False: "NOT met"}
    print(f"goal: time <= 1.3 x twice the floor (the reference's reads and the port's): "
          f"{summary['time_over_check_floor']:.2f} x wall, {said[summary['time_within_goal']]}" + (
              f"; {summary['cpu_over_check_floor']:.2f} x CPU, {said[summary['cpu_within_goal']]}"
              if "cpu_over_check_floor" in summary else ""))
    if "time_over_truth_floor" in summary:
        print(f"  against the floor plus the float64+float32 floor (a reference computing its truth in float64): "
              f"{summary['time_over_truth_floor']:.2f} x wall" + (
                  f", {summary['cpu_over_truth_floor']:.2f} x CPU" if "cpu_over_truth_floor" in summary else ""))
    print(f"  the port's own runs in parity's process: {port:.1f} s; parity's own part: "
          f"{summary['parity_own_s']:.1f} s = {summary['parity_own_over_floor']:.2f} x the floor" + (
              f", {summary['parity_own_over_float64_floor']:.2f} x the float64+float32 floor"
              if "parity_own_over_float64_floor" in summary else ""))
    print(f"goal: peak RSS <= 4 x one expert's float32 size + 1 GiB: {parity['peak_rss'] / GIB:.2f} GiB, "
          f"{said[summary['peak_within_goal']]}")


def broken_run(folder: Path, work: Path, python: str) -> dict:
    """parity's block check of BIASED_LAZY_BLOCK as a whole process: wall and CPU seconds, peak RSS, and what the
    report concluded (its verdict and the mistake it names)."""
    import os
    import subprocess
    import tempfile
    import time

    (work / "biased_block.py").write_text(BIASED_LAZY_BLOCK)
    cmd = [python, "-m", "parity", str(folder), "--target", "biased_block:LazyDeepSeekBlock", "--block", "--json",
           str(work / "broken.json")]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), PARITY_BENCH_MOE=str(folder))
    with tempfile.NamedTemporaryFile("r", suffix=".time") as stats:
        started = time.perf_counter()
        code = subprocess.run(["/usr/bin/time", "-o", stats.name, "-f", "%M %U %S", *cmd], env=env, cwd=work,
                              stdout=subprocess.DEVNULL).returncode
        wall = time.perf_counter() - started
        peak_kib, user, system = stats.read().split()[-3:]
    layer = (json.loads((work / "broken.json").read_text()).get("layers") or [{}])[0] \
        if (work / "broken.json").is_file() else {}
    return {"exit": code, "wall_s": wall, "cpu_s": float(user) + float(system), "peak_rss": int(peak_kib) * 1024,
            "passed": layer.get("passed"), "diagnosis": (layer.get("diagnosis") or {}).get("id"),
            "port_s": sum(port_seconds(work))}


if __name__ == "__main__":  # PYTHONPATH=$PWD python scripts/bench_moe.py [FOLDER]: the broken port's row
    import sys
    import tempfile

    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/parity-bench/deepseek-v3-moe-layer")
    with tempfile.TemporaryDirectory() as tmp:
        row = broken_run(target, Path(tmp), sys.executable)
    expert = 3 * DEEPSEEK_V3_LAYER["hidden_size"] * DEEPSEEK_V3_LAYER["moe_intermediate_size"] * 4
    print(json.dumps(row))
    print(f"bias in the weights: exit {row['exit']}, {row['diagnosis']}; {row['wall_s']:.1f} s ({row['cpu_s']:.1f} "
          f"s CPU; the port's runs {row['port_s']:.1f} s), peak {row['peak_rss'] / GIB:.2f} GiB against the goal's "
          f"{(4 * expert + GIB) / GIB:.2f} GiB")
