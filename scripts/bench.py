#!/usr/bin/env python
"""Speed and memory of parity, measured as whole processes, side by side in one run.

Not a test: timings on a shared machine are noisy, so every figure is the median of
several interleaved runs and the goals are stated as ratios of runs made together.

    PYTHONPATH=$PWD python scripts/bench.py [--quick] [--runs N] [--out bench.json] [--skip ROW ...]

Checkpoints are synthetic (random bfloat16 / float32 values) with real shapes and the
on-disk layout save_pretrained writes; they are built once and cached under --root.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
GIB = 2**30

GPT2_SMALL = dict(model_type="gpt2", n_embd=768, n_layer=12, n_head=12, n_positions=1024, vocab_size=50257,
                  activation_function="gelu_new", torch_dtype="float32")
LLAMA_1B = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=5632,
                num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                rms_norm_eps=1e-5, rope_theta=10000.0, vocab_size=32000, hidden_act="silu",
                tie_word_embeddings=False, torch_dtype="bfloat16")
SWEEP = (4, 8, 16, 22)

# The naive route: the whole model, a hook on the layer's MLP, one forward.  In float32 (what
# a check needs: bf16 cannot tell exact from tanh GELU), and as stored ("auto") for reference.
NAIVE = """
import sys, torch
from transformers import AutoModelForCausalLM
folder, layer, path, dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype if dtype == "auto" else getattr(torch, dtype)).eval()
seen = []
mlp = model.get_submodule(path.format(layer=layer))
mlp.register_forward_hook(lambda m, args, out: seen.append((args[0].detach().clone(), out.detach().clone())))
with torch.no_grad():
    model(torch.arange(16).view(1, 16))
assert seen, "hook did not fire"
print(next(model.parameters()).dtype)
"""
# The compute floor of checking a layer, in one process: read the layer's three FFN tensors from the
# safetensors shards, then transformers' MLP once in float64 and three times in float32 on inputs of
# parity's shape (the reference's float32 noise run, and the target's two determinism runs).
FLOOR = """
import json, sys, torch
from pathlib import Path
from safetensors import safe_open
from transformers import AutoConfig
from transformers.models.llama.modeling_llama import LlamaMLP
folder, layers = Path(sys.argv[1]), int(sys.argv[2])
config = AutoConfig.from_pretrained(folder)
index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
mlp32 = LlamaMLP(config).eval()
mlp64 = LlamaMLP(config).double().eval()
x = torch.randn(3, 16, config.hidden_size)
with torch.no_grad():
    for layer in range(layers):
        names = [f"model.layers.{layer}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        tensors = {}
        for name in names:
            with safe_open(folder / index[name], "pt") as handle:
                tensors[name.split(".mlp.")[1]] = handle.get_tensor(name)
        mlp64.load_state_dict({k: v.double() for k, v in tensors.items()})
        mlp32.load_state_dict({k: v.float() for k, v in tensors.items()})
        mlp64(x.double())
        for _ in range(3):
            mlp32(x)
"""
IMPORTS = {"gpt2": "import torch, transformers.models.gpt2.modeling_gpt2",
           "llama": "import torch, transformers.models.llama.modeling_llama"}
MLP_PATH = {"gpt2": "transformer.h.{layer}.mlp", "llama": "model.layers.{layer}.mlp"}


# -- checkpoints -------------------------------------------------------------------------
def build_checkpoint(folder: Path, raw_config: dict, per_layer_shards: bool) -> Path:
    """config.json + safetensors with every tensor of the full model (random values, stored dtype)."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    kwargs = {k: v for k, v in raw_config.items() if k not in ("model_type", "torch_dtype")}
    config = AutoConfig.for_model(raw_config["model_type"], **kwargs)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    dtype = getattr(torch, raw_config["torch_dtype"])
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    generator = torch.Generator().manual_seed(0)

    def tensor(shape):
        return (torch.randn(shape, generator=generator) * 0.02).to(dtype)

    if not per_layer_shards:
        save_file({n: tensor(s) for n, s in shapes.items()}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
    else:  # one shard per decoder layer, plus one for embeddings / norm / head (shareable by layer-subset folders)
        groups: dict[str, list[str]] = {}
        for name in shapes:
            parts = name.split(".")
            key = f"layer-{int(parts[2]):03d}" if name.startswith("model.layers.") else "rest"
            groups.setdefault(key, []).append(name)
        weight_map = {}
        for key, names in groups.items():
            file_name = f"model-{key}.safetensors"
            save_file({n: tensor(shapes[n]) for n in names}, str(folder / file_name), metadata={"format": "pt"})
            weight_map.update({n: file_name for n in names})
        total = sum(os.path.getsize(folder / f) for f in set(weight_map.values()))
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    config_dict = config.to_dict()
    config_dict["torch_dtype"] = config_dict["dtype"] = raw_config["torch_dtype"]
    (folder / "config.json").write_text(json.dumps(config_dict, indent=1))
    return folder


LLAMA_405B_LAYER = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=16384,
                        intermediate_size=53248, num_hidden_layers=1, num_attention_heads=128, num_key_value_heads=8,
                        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, vocab_size=128256,
                        hidden_act="silu", tie_word_embeddings=False, torch_dtype="bfloat16")


def build_big_layer(folder: Path, raw_config: dict) -> Path:
    """config.json + one safetensors file holding only layer 0's FFN tensors (random bfloat16).

    Written in row blocks straight into the file (the format is an 8-byte header length, a
    JSON header, then the raw bytes), so building 5.2 GB needs no more than a block in memory.
    """
    if (folder / "config.json").is_file():
        return folder
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    d, d_ff = raw_config["hidden_size"], raw_config["intermediate_size"]
    shapes = {"model.layers.0.mlp.gate_proj.weight": (d_ff, d), "model.layers.0.mlp.up_proj.weight": (d_ff, d),
              "model.layers.0.mlp.down_proj.weight": (d, d_ff)}
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (rows, cols) in shapes.items():
        header[name] = {"dtype": "BF16", "shape": [rows, cols], "data_offsets": [offset, offset + rows * cols * 2]}
        offset += rows * cols * 2
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    generator = torch.Generator().manual_seed(0)
    partial = folder / "model.safetensors.partial"
    with open(partial, "wb") as out:
        out.write(len(raw).to_bytes(8, "little") + raw)
        for rows, cols in shapes.values():
            for start in range(0, rows, 1024):
                block = torch.randn(min(1024, rows - start), cols, generator=generator) * (1 / cols**0.5)
                out.write(block.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    partial.rename(folder / "model.safetensors")
    config = {k: v for k, v in raw_config.items()}
    config["dtype"] = config["torch_dtype"]
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def cast_checkpoint(full: Path, folder: Path, dtype: str) -> Path:
    """``full`` (per-layer shards) re-saved with every tensor cast to ``dtype``, shard by shard, same layout and
    index: a faithful conversion for `parity compare` to judge (bfloat16 -> float16: within its rounding)."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True, exist_ok=True)
    index = json.loads((full / "model.safetensors.index.json").read_text())
    for file_name in sorted(set(index["weight_map"].values())):
        tensors = {n: t.to(getattr(torch, dtype)) for n, t in load_file(full / file_name).items()}
        save_file(tensors, str(folder / file_name), metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config = json.loads((full / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = dtype
    (folder / "config.json").write_text(json.dumps(config, indent=1))  # last: a folder without it is rebuilt
    return folder


def layer_subset(full: Path, folder: Path, layers: int) -> Path:
    """The first ``layers`` layers of ``full``: own config and index, shard files symlinked."""
    if (folder / "config.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    index = json.loads((full / "model.safetensors.index.json").read_text())
    keep = {n: f for n, f in index["weight_map"].items()
            if not n.startswith("model.layers.") or int(n.split(".")[2]) < layers}
    for file_name in set(keep.values()):
        (folder / file_name).symlink_to(full / file_name)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": keep}, indent=1))
    config = json.loads((full / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


# -- measuring ---------------------------------------------------------------------------
def measure(cmd: list[str], cwd: Path | None = None) -> tuple[float, float, float]:
    """Run a whole process -> (wall seconds, its peak RSS in bytes, its CPU seconds: user + system, which a shared
    machine's load distorts less than the wall time).

    Through /usr/bin/time: a child forked from this (large) process would report this
    process's RSS as its own peak (ru_maxrss survives fork + exec).
    """
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1")
    with tempfile.NamedTemporaryFile("r", suffix=".time") as stats:
        started = time.perf_counter()
        proc = subprocess.run(["/usr/bin/time", "-o", stats.name, "-f", "%M %U %S", *cmd], env=env, cwd=cwd,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wall = time.perf_counter() - started
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n"
                               f"{proc.stderr.decode(errors='replace')[-2000:]}")
        peak_kib, user, system = stats.read().split()[-3:]
    return wall, int(peak_kib) * 1024.0, float(user) + float(system)


def parity_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "parity", *args]


def run_all(commands: dict[str, list[str]], runs: int, cwd: Path | None = None) -> dict[str, dict]:
    """Every command ``runs`` times, interleaved, -> {name: {wall_s, peak_rss, cpu_s, ...}} (medians)."""
    samples: dict[str, list[tuple[float, float, float]]] = {name: [] for name in commands}
    for i in range(runs):
        for name, cmd in commands.items():
            samples[name].append(measure(cmd, cwd))
            wall, rss, cpu = samples[name][-1]
            print(f"  run {i + 1}/{runs} {name}: {wall:.2f} s ({cpu:.2f} s CPU), {rss / 2**20:.0f} MiB, load "
                  f"{os.getloadavg()[0]:.1f}", file=sys.stderr)
    return {name: {"wall_s": statistics.median(w for w, _, _ in s), "peak_rss": statistics.median(r for _, r, _ in s),
                   "cpu_s": statistics.median(c for _, _, c in s), "wall_runs": [w for w, _, _ in s],
                   "rss_runs": [r for _, r, _ in s], "cpu_runs": [c for _, _, c in s]} for name, s in samples.items()}


# -- the benchmark -----------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one run of each (default: --runs)")
    parser.add_argument("--runs", type=int, default=3, help="runs per command; medians are reported (default 3)")
    parser.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "parity-bench",
                        help="where the synthetic checkpoints are cached")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    parser.add_argument("--skip", action="append", default=[],
                        choices=["compare", "sweep", "startup", "bf16", "405b", "floor", "checkpoints", "frameworks",
                                 "moe", "quantized"])
    args = parser.parse_args()
    runs = 1 if args.quick else args.runs

    print(f"building checkpoints under {args.root} (once)", file=sys.stderr)
    gpt2 = build_checkpoint(args.root / "gpt2-small", GPT2_SMALL, per_layer_shards=False)
    llama = build_checkpoint(args.root / "llama-1b", LLAMA_1B, per_layer_shards=True)
    subsets = {n: layer_subset(llama, args.root / f"llama-1b-{n}L", n) for n in SWEEP if n != 22}
    subsets[22] = llama

    results: dict = {"runs": runs, "python": sys.version.split()[0], "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        if "compare" not in args.skip:
            print("(a) one layer: parity vs the naive route", file=sys.stderr)
            layer = {"gpt2": 5, "llama": 11}
            commands = {}
            for family, folder in (("gpt2", gpt2), ("llama", llama)):
                commands[f"{family}/parity"] = parity_cmd(str(folder), "--layer", str(layer[family]), "--json",
                                                          f"{tmp}/{family}.json")
                commands[f"{family}/naive"] = [sys.executable, "-c", NAIVE, str(folder), str(layer[family]),
                                               MLP_PATH[family], "float32"]
                if family == "llama":  # GPT-2 is stored in float32: "auto" is the same route
                    commands[f"{family}/naive-bf16"] = [*commands[f"{family}/naive"][:-1], "auto"]
                commands[f"{family}/imports"] = [sys.executable, "-c", IMPORTS[family]]
            results["compare"] = run_all(commands, runs)
        if "sweep" not in args.skip:
            print("(b) --layers all, 4 to 22 layers of the 1B shape", file=sys.stderr)
            commands = {f"{n}": parity_cmd(str(subsets[n]), "--layers", "all", "--json", f"{tmp}/sweep{n}.json")
                        for n in SWEEP}
            results["sweep"] = run_all(commands, runs)
        if "floor" not in args.skip:
            print("(f) per-layer cost: parity's sweep against the compute floor, interleaved", file=sys.stderr)
            few, all_ = SWEEP[0], SWEEP[-1]
            commands = {}
            for n in (few, all_):
                commands[f"parity/{n}"] = parity_cmd(str(subsets[n]), "--layers", "all", "--quiet")
                commands[f"floor/{n}"] = [sys.executable, "-c", FLOOR, str(subsets[n]), str(n)]
            results["floor"] = run_all(commands, max(runs, 3))
        if "bf16" not in args.skip:
            print("(d) one layer of the 1B shape computed in bfloat16 vs float32", file=sys.stderr)
            commands = {dtype: parity_cmd(str(llama), "--layer", "11", "--dtype", dtype,
                                          "--json", f"{tmp}/{dtype}.json") for dtype in ("float32", "bfloat16")}
            results["bf16"] = run_all(commands, runs)
        if "405b" not in args.skip:
            print("(e) one layer of the Llama-3.1-405B shape (builds a 5.2 GB file once; one run: minutes)",
                  file=sys.stderr)
            big = build_big_layer(args.root / "llama-405b-layer", LLAMA_405B_LAYER)
            commands = {dtype: parity_cmd(str(big), "--layer", "0", "--dtype", dtype,
                                          "--json", f"{tmp}/405b-{dtype}.json") for dtype in ("float32", "bfloat16")}
            results["405b"] = run_all(commands, 1)
        if "moe" not in args.skip:
            print("(i) a whole MoE block of the DeepSeek-V3 shape (builds a 22.6 GB file once; one run: minutes)",
                  file=sys.stderr)
            from bench_moe import block_verdict, build_moe_layer, moe_commands, port_seconds

            moe = build_moe_layer(args.root / "deepseek-v3-moe-layer")
            os.environ["PARITY_BENCH_MOE"] = str(moe)
            results["moe"] = run_all(moe_commands(moe, Path(tmp), sys.executable), 1, cwd=Path(tmp))
            results["moe_port"] = port_seconds(Path(tmp))
            results["moe_verdict"] = block_verdict(Path(tmp))
        if "checkpoints" not in args.skip:
            results["checkpoints"] = checkpoint_rows(args.root, llama, subsets, runs)
        if "frameworks" not in args.skip:
            results["frameworks"] = framework_rows(llama, max(runs, 3))
        if "quantized" not in args.skip:
            results["quantized"] = quantized_rows(args.root, llama, subsets, runs)
        if "startup" not in args.skip:
            print("(c) start-up", file=sys.stderr)
            commands = {"parity --version": parity_cmd("--version"), "parity list": parity_cmd("list"),
                        "import torch": [sys.executable, "-c", "import torch"],
                        "python": [sys.executable, "-c", "pass"]}
            results["startup"] = run_all(commands, max(runs, 3))
    print_table(results)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


def print_table(results: dict) -> None:
    mib = lambda b: f"{b / 2**20:8.0f} MiB"  # noqa: E731
    print(f"\nmedian of {results['runs']} run(s); peak RSS of the whole process")
    if "compare" in results:
        c = results["compare"]
        print("\n(a) one-layer check vs naive route (from_pretrained whole model + MLP forward hook)")
        print(f"{'shape':<8}{'route':<12}{'wall':>9}{'peak RSS':>14}")
        summary = {}
        for family in ("gpt2", "llama"):
            for route in ("parity", "naive", "naive-bf16", "imports"):
                if f"{family}/{route}" not in c:
                    continue
                r = c[f"{family}/{route}"]
                print(f"{family:<8}{route:<12}{r['wall_s']:8.2f}s{mib(r['peak_rss']):>14}")
            p, n, i = c[f"{family}/parity"], c[f"{family}/naive"], c[f"{family}/imports"]
            # paired: run k of parity against run k of the bare imports, made one after the other
            own = statistics.median(max(a - b, 0.0) for a, b in zip(p["wall_runs"], i["wall_runs"], strict=True))
            share = statistics.median(max(a - b, 0.0) / a
                                      for a, b in zip(p["wall_runs"], i["wall_runs"], strict=True))
            summary[family] = {"rss_ratio": n["peak_rss"] / p["peak_rss"], "speedup": n["wall_s"] / p["wall_s"],
                               "own_work_s": own, "own_work_share": share,
                               "rss_beyond_imports": p["peak_rss"] - i["peak_rss"]}
            s = summary[family]
            if f"{family}/naive-bf16" in c:
                b = c[f"{family}/naive-bf16"]
                s["rss_ratio_bf16"], s["speedup_bf16"] = b["peak_rss"] / p["peak_rss"], b["wall_s"] / p["wall_s"]
                print(f"{family:<8}naive-bf16/parity: {s['rss_ratio_bf16']:.1f}x less peak RSS, "
                      f"{s['speedup_bf16']:.1f}x faster")
            print(f"{family:<8}naive/parity: {s['rss_ratio']:.1f}x less peak RSS, {s['speedup']:.1f}x faster; "
                  f"parity's work beyond imports {s['own_work_s']:.2f} s = "
                  f"{100 * s['own_work_share']:.0f}% of its wall time, "
                  f"{s['rss_beyond_imports'] / 2**20:.0f} MiB above the imports' RSS")
        results["compare_summary"] = summary
    if "sweep" in results:
        s = results["sweep"]
        print("\n(b) --layers all on the 1B shape")
        print(f"{'layers':>7}{'wall':>9}{'per layer':>11}{'peak RSS':>14}")
        for n in SWEEP:
            r = s[str(n)]
            print(f"{n:>7}{r['wall_s']:8.2f}s{r['wall_s'] / n:10.2f}s{mib(r['peak_rss']):>14}")
        results["sweep_rss_spread"] = (max(s[str(n)]["peak_rss"] for n in SWEEP)
                                       / min(s[str(n)]["peak_rss"] for n in SWEEP))
        growth = s[str(SWEEP[-1])]["peak_rss"] / s[str(SWEEP[0])]["peak_rss"]
        results["sweep_rss_growth"] = growth
        per_layer = (s[str(SWEEP[-1])]["wall_s"] - s[str(SWEEP[0])]["wall_s"]) / (SWEEP[-1] - SWEEP[0])
        results["sweep_marginal_s_per_layer"] = per_layer
        print(f"peak RSS {SWEEP[-1]} vs {SWEEP[0]} layers: x{growth:.3f} "
              f"(max/min over the sweep x{results['sweep_rss_spread']:.3f}); "
              f"marginal time per layer {per_layer:.2f} s")
    if "bf16" in results:
        b = results["bf16"]
        print("\n(d) one-layer check (layer 11 of the 1B shape) by compute dtype")
        for dtype in ("float32", "bfloat16"):
            print(f"--dtype {dtype:<10}{b[dtype]['wall_s']:8.2f}s{mib(b[dtype]['peak_rss']):>14}")
        results["bf16_vs_float32"] = {"wall": b["bfloat16"]["wall_s"] / b["float32"]["wall_s"],
                                      "peak_rss": b["bfloat16"]["peak_rss"] / b["float32"]["peak_rss"]}
        print(f"bfloat16/float32: wall x{results['bf16_vs_float32']['wall']:.2f}, "
              f"peak RSS x{results['bf16_vs_float32']['peak_rss']:.2f}")
    if "405b" in results:
        print_big_layer(results)
    if "moe" in results:
        from bench_moe import print_moe

        print_moe(results)
    if "floor" in results:
        print_floor(results)
    if "checkpoints" in results:
        print_checkpoints(results)
    if "frameworks" in results:
        print_frameworks(results)
    if "quantized" in results:
        print_quantized(results)
    if "startup" in results:
        print("\n(c) start-up")
        for name, r in results["startup"].items():
            print(f"{name:<18}{r['wall_s']:8.3f}s{mib(r['peak_rss']):>14}")



def checkpoint_rows(root: Path, llama: Path, subsets: dict[int, Path], runs: int) -> dict:
    """(g) `parity compare A B` of two 1B-shape checkpoints (A bfloat16, B A cast to float16, same shapes and
    layout) against `parity A` alone, on 4 and on 22 layers, interleaved."""
    print("(g) parity compare A B (B: A cast to float16) vs a check of A, 4 and 22 layers of the 1B shape",
          file=sys.stderr)
    cast = cast_checkpoint(llama, root / "llama-1b-f16", "float16")
    return check_beside_compare(subsets, cast, root, "compare", runs)


def check_beside_compare(subsets: dict[int, Path], b: Path, root: Path, key: str, runs: int) -> dict:
    """`parity A --layers all` beside `parity compare A B` (``key``), on 4 and on 22 layers, interleaved; B cut to the
    first 4 layers once, beside it."""
    few, all_ = SWEEP[0], SWEEP[-1]
    cut = {few: layer_subset(b, root / f"{b.name}-{few}L", few), all_: b}
    commands = {}
    for n in (few, all_):
        commands[f"check/{n}"] = parity_cmd(str(subsets[n]), "--layers", "all", "--quiet")
        commands[f"{key}/{n}"] = parity_cmd("compare", str(subsets[n]), str(cut[n]), "--quiet")
    return run_all(commands, runs)


def quantized_checkpoint(full: Path, folder: Path, quantize: Any, stated: dict) -> Path:
    """``full`` (per-layer shards) as a quantized release, shard by shard, same index otherwise: every matrix of the
    decoder layers replaced by the tensors ``quantize(name, tensor)`` returns (under the module's name), and
    ``stated`` as config.json's quantization_config."""
    if (folder / "config.json").is_file():
        return folder
    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True, exist_ok=True)
    index = json.loads((full / "model.safetensors.index.json").read_text())
    weight_map = {n: f for n, f in index["weight_map"].items()}
    for file_name in sorted(set(index["weight_map"].values())):
        out = {}
        for name, tensor in load_file(full / file_name).items():
            if not name.startswith("model.layers.") or tensor.dim() != 2:
                out[name] = tensor
                continue
            del weight_map[name]
            module = name.removesuffix(".weight")
            for part, value in quantize(name, tensor).items():
                out[f"{module}.{part}"] = value
                weight_map[f"{module}.{part}"] = file_name
        save_file(out, str(folder / file_name), metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                                    indent=1))
    config = json.loads((full / "config.json").read_text())
    config["quantization_config"] = stated
    (folder / "config.json").write_text(json.dumps(config, indent=1))  # last: a folder without it is rebuilt
    return folder


def fp8_checkpoint(full: Path, folder: Path, block: tuple[int, int] = (128, 128)) -> Path:
    """``full`` as an FP8 block-quantized release (DeepSeek V3's layout: every matrix of the decoder layers a
    float8_e4m3fn ``weight`` beside a float32 ``weight_scale_inv`` per 128 x 128 block), quantized by
    compressed-tensors (parity's own ``fp8_grid.quantize``)."""
    import torch

    from parity.engine.compare.fp8_grid import quantize

    def fp8(name: str, tensor: Any) -> dict:
        codes, scales = quantize(tensor, block)
        return {"weight": codes.to(torch.float8_e4m3fn), "weight_scale_inv": scales}

    return quantized_checkpoint(full, folder, fp8, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
                                                    "dynamic", "weight_block_size": list(block)})


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's WQLinear_GEMM.from_linear: field i of a word holds column AWQ_ORDER[i]


def awq_checkpoint(full: Path, folder: Path, group: int = 128) -> Path:
    """``full`` as an AutoAWQ GEMM release (int4, zero point, groups of ``group`` along the input, AutoAWQ's default):
    every matrix of the decoder layers as ``qweight`` [in, out / 8], ``qzeros`` [in / group, out / 8] (int32, eight
    4-bit fields each, in AWQ's order) and float16 ``scales`` [in / group, out], rounded to nearest (what AWQ's search
    then scales is the fold, not this row's subject)."""
    import torch

    def pack(codes: Any) -> Any:
        fields = codes.to(torch.int64).reshape(codes.shape[0], -1, 8)[..., list(AWQ_ORDER)]
        words = sum(fields[..., i] << (4 * i) for i in range(8))
        return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()

    def awq(name: str, tensor: Any) -> dict:
        rows, cols = tensor.shape
        groups = tensor.float().reshape(rows, cols // group, group)
        low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        scales = ((high - low) / 15).clamp_min(1e-8).half().float()
        zeros = torch.clamp(torch.round(-low / scales), 0, 15)
        codes = torch.clamp(torch.round(groups / scales[..., None] + zeros[..., None]), 0, 15).reshape(rows, cols)
        return {"qweight": pack(codes.t()), "qzeros": pack(zeros.t()), "scales": scales.t().contiguous().half()}

    return quantized_checkpoint(full, folder, awq, {"quant_method": "awq", "bits": 4, "group_size": group,
                                                   "zero_point": True, "version": "gemm"})


QUANTIZED = {"fp8": ("FP8 e4m3 in 128x128 blocks", fp8_checkpoint),
             "awq": ("AWQ GEMM int4 in groups of 128", awq_checkpoint)}


def quantized_rows(root: Path, llama: Path, subsets: dict[int, Path], runs: int) -> dict:
    """(j) `parity compare A B` where B is a quantized release of the 1B shape (FP8 block-quantized, AWQ; every
    decoder matrix dequantized on read, one tensor at a time) against `parity A` alone, on 4 and on 22 layers,
    interleaved: B's peak RSS stays flat over the sweep."""
    results = {}
    for key, (label, write) in QUANTIZED.items():
        print(f"(j) parity compare A B (B: A as {label}) vs a check of A, 4 and 22 layers of the 1B shape (builds "
              "the quantized copy once)", file=sys.stderr)
        b = write(llama, root / f"llama-1b-{key}")
        results |= check_beside_compare(subsets, b, root, f"compare-{key}", runs)
    return results


def print_quantized(results: dict) -> None:
    """Each quantized compare against the check of A: wall and peak RSS paired run by run, and each route's peak RSS
    over the sweep (22 layers against 4: flat when B is dequantized one tensor at a time)."""
    q, few, all_ = results["quantized"], SWEEP[0], SWEEP[-1]
    summary = {}
    routes = ["check", *(f"compare-{key}" for key in QUANTIZED if f"compare-{key}/{few}" in q)]
    print("\n(j) parity compare A B (1B shape, B = A quantized: " +
          "; ".join(f"{key}: {label}" for key, (label, _) in QUANTIZED.items()) + ") vs parity A, --layers all")
    print(f"{'layers':>7}  {'route':<14}{'wall':>9}{'peak RSS':>14}")
    for n in (few, all_):
        for route in routes:
            r = q[f"{route}/{n}"]
            print(f"{n:>7}  {route:<14}{r['wall_s']:8.2f}s{r['peak_rss'] / 2**20:10.0f} MiB")
        for route in routes[1:]:
            summary[f"{route}_rss_ratio_{n}"] = statistics.median(
                a / b for a, b in zip(q[f"{route}/{n}"]["rss_runs"], q[f"check/{n}"]["rss_runs"], strict=True))
    for route in routes:
        summary[f"{route}_rss_growth"] = q[f"{route}/{all_}"]["peak_rss"] / q[f"{route}/{few}"]["peak_rss"]
    results["quantized_summary"] = summary
    for route in routes[1:]:
        print(f"{route}/check peak RSS: x{summary[f'{route}_rss_ratio_{few}']:.2f} ({few} layers), "
              f"x{summary[f'{route}_rss_ratio_{all_}']:.2f} ({all_}); peak RSS {all_} vs {few} layers: {route} "
              f"x{summary[f'{route}_rss_growth']:.3f}, check x{summary['check_rss_growth']:.3f}")


# (h) one layer of the 1B shape, the same SwiGLU written in each framework (the tests' ports, built from the config)
FRAMEWORK_TARGETS = {"torch": "parity.ffn:SwiGLU", "mlx": "tests.mlx_ports:MLP", "flax.nnx": "tests.nnx_ports:MLP",
                     "numpy": "tests.numpy_ports:swiglu"}


def framework_rows(llama: Path, runs: int) -> dict:
    """(h) The same layer checked with a PyTorch target and with an MLX, Flax NNX and NumPy one, interleaved; a
    framework not installed here is left out (and said)."""
    import importlib.util

    print("(h) one layer of the 1B shape: a PyTorch target against MLX, Flax NNX and NumPy ones", file=sys.stderr)
    needs = {"mlx": "mlx", "flax.nnx": "flax"}
    commands = {}
    for name, target in FRAMEWORK_TARGETS.items():
        if name in needs and importlib.util.find_spec(needs[name]) is None:
            print(f"  {name}: not installed, left out", file=sys.stderr)
            continue
        commands[name] = parity_cmd(str(llama), "--layer", "11", "--target", target, "--quiet")
    return run_all(commands, runs)


def print_frameworks(results: dict) -> None:
    """Each framework's wall time and peak RSS against the PyTorch target's, paired run by run."""
    f = results["frameworks"]
    torch_runs = f["torch"]
    print("\n(h) one layer of the 1B shape (d=2048, d_ff=5632; bfloat16 on disk), the same SwiGLU in each framework")
    print(f"{'target':<10}{'wall':>9}{'peak RSS':>14}{'wall / torch':>15}{'RSS / torch':>14}")
    summary = {}
    for name, r in f.items():
        wall = statistics.median(a / b for a, b in zip(r["wall_runs"], torch_runs["wall_runs"], strict=True))
        rss = statistics.median(a / b for a, b in zip(r["rss_runs"], torch_runs["rss_runs"], strict=True))
        summary[name] = {"wall_ratio": wall, "rss_ratio": rss}
        print(f"{name:<10}{r['wall_s']:8.2f}s{r['peak_rss'] / 2**20:10.0f} MiB{wall:>14.2f}x{rss:>13.2f}x")
    results["frameworks_summary"] = summary


def print_checkpoints(results: dict) -> None:
    """Compare against check: wall and peak RSS, paired run by run (each pair ran one after the other), the
    marginal seconds per layer ((22-layer run - 4-layer run) / 18), and the compare's RSS over the sweep."""
    c, few, all_ = results["checkpoints"], SWEEP[0], SWEEP[-1]

    def paired(key: str, n: int) -> float:
        return statistics.median(a / b for a, b in zip(c[f"compare/{n}"][key], c[f"check/{n}"][key], strict=True))

    def per_layer(route: str) -> float:
        return statistics.median((b - a) / (all_ - few) for a, b in zip(c[f"{route}/{few}"]["wall_runs"],
                                                                      c[f"{route}/{all_}"]["wall_runs"], strict=True))

    summary = {f"wall_ratio_{n}": paired("wall_runs", n) for n in (few, all_)}
    summary.update({f"rss_ratio_{n}": paired("rss_runs", n) for n in (few, all_)})
    summary.update(check_s_per_layer=per_layer("check"), compare_s_per_layer=per_layer("compare"))
    summary["per_layer_ratio"] = summary["compare_s_per_layer"] / summary["check_s_per_layer"]
    summary["compare_rss_growth"] = c[f"compare/{all_}"]["peak_rss"] / c[f"compare/{few}"]["peak_rss"]
    results["checkpoints_summary"] = summary
    print("\n(g) parity compare A B (1B shape, B = A cast bfloat16 -> float16) vs parity A, --layers all")
    print(f"{'layers':>7}  {'route':<9}{'wall':>9}{'peak RSS':>14}")
    for n in (few, all_):
        for route in ("check", "compare"):
            r = c[f"{route}/{n}"]
            print(f"{n:>7}  {route:<9}{r['wall_s']:8.2f}s{r['peak_rss'] / 2**20:10.0f} MiB")
        print(f"{n:>7}  compare/check: wall x{summary[f'wall_ratio_{n}']:.2f}, "
              f"peak RSS x{summary[f'rss_ratio_{n}']:.2f} (paired medians; goal <= 2)")
    print(f"per extra layer: compare {summary['compare_s_per_layer']:.2f} s, check {summary['check_s_per_layer']:.2f} s"
          f" (x{summary['per_layer_ratio']:.2f}); compare's peak RSS {all_} vs {few} layers "
          f"x{summary['compare_rss_growth']:.3f}")


def print_floor(results: dict) -> None:
    """Marginal seconds per layer ((22-layer run - 4-layer run) / 18) of parity and of the floor, paired run by
    run (each pair ran one after the other), and their ratio: the goal is at most 1.1."""
    f, few, all_ = results["floor"], SWEEP[0], SWEEP[-1]
    span = all_ - few

    def per_layer(route: str) -> list[float]:
        return [(b - a) / span for a, b in zip(f[f"{route}/{few}"]["wall_runs"], f[f"{route}/{all_}"]["wall_runs"],
                                               strict=True)]

    mine, floor = per_layer("parity"), per_layer("floor")
    ratios = [m / b for m, b in zip(mine, floor, strict=True) if b > 0]
    summary = {"parity_s_per_layer": statistics.median(mine), "floor_s_per_layer": statistics.median(floor),
               "ratio": statistics.median(ratios) if ratios else None, "ratios": ratios}
    results["floor_summary"] = summary
    print("\n(f) per extra layer of the 1B shape: parity --layers all vs the compute floor (read the three tensors, "
          "one float64 and three float32 MLP runs)")
    print(f"parity {summary['parity_s_per_layer']:.3f} s, floor {summary['floor_s_per_layer']:.3f} s per layer: "
          f"x{summary['ratio']:.2f} the floor (runs: {', '.join(f'{r:.2f}' for r in ratios)}; goal <= 1.1)")


def print_big_layer(results: dict) -> None:
    """Peak RSS of the 405B-shaped layer against its floor: the target's own float32 weights."""
    d, d_ff = LLAMA_405B_LAYER["hidden_size"], LLAMA_405B_LAYER["intermediate_size"]
    floor = 3 * d * d_ff * 4
    goal = 1.25 * floor + GIB
    print(f"\n(e) one layer of the Llama-3.1-405B shape (d={d}, d_ff={d_ff}, bfloat16 on disk: "
          f"{3 * d * d_ff * 2 / 1e9:.1f} GB); the target's float32 weights: {floor / GIB:.2f} GiB, "
          f"goal: peak RSS <= 1.25 x that + 1 GiB = {goal / GIB:.2f} GiB")
    summary = {}
    for dtype, r in results["405b"].items():
        summary[dtype] = {"peak_over_floor": r["peak_rss"] / floor, "within_goal": r["peak_rss"] <= goal}
        print(f"--dtype {dtype:<10}{r['wall_s']:8.1f}s{r['peak_rss'] / GIB:9.2f} GiB  "
              f"= {summary[dtype]['peak_over_floor']:.2f} x the float32 target's weights")
    results["405b_summary"] = summary


if __name__ == "__main__":
    sys.exit(main())
