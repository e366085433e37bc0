"""Row (i) of scripts/bench.py: a whole MoE block of the DeepSeek-V3 shape checked in bounded memory.

One MoE layer of DeepSeek V3's shape (d = 7168, 256 routed experts of width 2048, top-8 of 8 groups, one shared
expert; random bfloat16 values, 22.6 GB on disk, written once in row blocks) is checked as a whole block with a port
that reads each expert from the checkpoint when a token needs it (a user's block of this size cannot hold 256
experts either).  Against it: the floor of reading every expert once and computing its tokens, in one process.
Goals (issue 28): parity's peak RSS <= a few x one expert's float32 size + 1 GiB; its time within 1.3 x the floor's
per read of the experts (parity reads them twice: its reference, then the port's own reads).
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
import json, os, torch
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

class LazyDeepSeekBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c, self.gate = config, Router(config)
        self.shared_experts = Expert(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
        self.file = os.path.join(os.environ["PARITY_BENCH_MOE"], "model.safetensors")
        self.header, self.start = read_header(self.file)
    def forward(self, x):
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

# The floor: every expert read once (bfloat16 -> float32) and applied to its share of parity's 3 x 128 tokens.
FLOOR = '''
import json, sys, torch
import torch.nn.functional as F
''' + READER + '''
folder, count, d = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
x = torch.randn(3 * 128 * 8 // count + 1, d)
path = f"{folder}/model.safetensors"
header, start = read_header(path)
for e in range(count):
    w = {p: read_tensor(path, header, start, f"model.layers.0.mlp.experts.{e}.{p}.weight").float()
         for p in ("gate_proj", "up_proj", "down_proj")}
    y = F.linear(F.silu(F.linear(x, w["gate_proj"])) * F.linear(x, w["up_proj"]), w["down_proj"])
print(float(y.abs().max()))
'''


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
    return {"parity --block": [python, "-m", "parity", str(folder), "--target", "lazy_block:LazyDeepSeekBlock",
                               "--block", "--json", str(work / "moe.json")],
            "floor": [python, "-c", FLOOR, str(folder), str(c["n_routed_experts"]), str(c["hidden_size"])]}


def print_moe(results: dict) -> None:
    """Peak RSS against one expert's float32 size, and time against the floor per read of the experts."""
    c = DEEPSEEK_V3_LAYER
    expert = 3 * c["hidden_size"] * c["moe_intermediate_size"] * 4
    rows = results["moe"]
    parity, floor = rows["parity --block"], rows["floor"]
    print(f"\n(i) one MoE block of the DeepSeek-V3 shape (256 experts, bfloat16 on disk: "
          f"{256 * expert / 2 / 1e9:.1f} GB); one expert in float32: {expert / GIB:.2f} GiB")
    for name, r in rows.items():
        print(f"{name:<16}{r['wall_s']:8.1f}s{r['peak_rss'] / GIB:9.2f} GiB  = {r['peak_rss'] / expert:.1f} x one "
              "expert's float32 size")
    per_read = parity["wall_s"] / 2 / floor["wall_s"]
    results["moe_summary"] = {"peak_rss_over_expert": parity["peak_rss"] / expert,
                              "peak_within_goal": parity["peak_rss"] <= 4 * expert + GIB,
                              "time_per_expert_read_over_floor": per_read}
    print(f"parity per read of the experts (its reference, then the port's): {per_read:.2f} x the floor")
