"""Placing and running the module under test: device and dtype, initialisers skipped while it is built,
its forward on its own copy of the inputs, and the user's exceptions turned into TargetError.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Iterator

import torch
from torch import nn

from parity.engine.frames import user_frame
from parity.engine.verdict import input_change
from parity.errors import ParityError, TargetError


@contextlib.contextmanager
def skip_init() -> Iterator[None]:
    """Constructing a 7B-size target should not spend seconds on random init it will overwrite."""
    names = ("uniform_", "normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
             "trunc_normal_", "constant_", "zeros_", "ones_")
    saved = {name: getattr(nn.init, name) for name in names}
    try:
        for name in names:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def module_dtype(module: nn.Module, fallback: torch.dtype) -> torch.dtype:
    param = next(module.parameters(), None)
    return param.dtype if param is not None and param.is_floating_point() else fallback


def module_device(module: nn.Module, fallback: torch.device) -> torch.device:
    param = next(module.parameters(), None)
    return param.device if param is not None else fallback


def run_module(module: nn.Module, x: torch.Tensor, notes: list[str] | None = None) -> torch.Tensor:
    """Run a target on its own device in its own parameter dtype (a bf16 target computes in bf16)
    -> float64 on the CPU (float64 after the move: MPS has no float64).  A tuple's first element is the
    output (a block returning (hidden, aux)); ``notes`` gets a line saying so, since a caller expecting a
    tensor, as transformers' MLP returns, would not take the tuple."""
    out = module(x.to(device=module_device(module, x.device), dtype=module_dtype(module, x.dtype)))
    if isinstance(out, tuple) and out:
        if notes is not None:
            kinds = ", ".join(type(part).__name__ for part in out)
            notes.append(f"the target returns a tuple ({kinds}): its first element is compared; transformers' MLP "
                         "returns a tensor, so a caller expecting one would not take this output")
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"forward returned {type(out).__name__}, not a torch.Tensor")
    return out.cpu().double()


def torch_device(name: str) -> torch.device:
    """A --device value (already valid by ``spec.values.device_value``) that this machine and this torch
    can run on; a UsageError saying why not."""
    from parity.errors import UsageError

    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError(f"--device {name}: no CUDA device is available (torch {torch.__version__}"
                             f"{', built without CUDA' if torch.version.cuda is None else ''}); "
                             "run on a machine with an NVIDIA GPU and a CUDA build of torch, or use --device cpu")
        index = int(name.partition(":")[2] or torch.cuda.current_device())
        if index >= torch.cuda.device_count():
            raise UsageError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s) "
                             f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")
        return torch.device("cuda", index)
    if name == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise UsageError("--device mps: the Apple GPU (MPS) is not available here (it needs macOS 12.3+ on Apple "
                             "silicon and a torch built with MPS); use --device cpu")
        return torch.device("mps")
    return torch.device("cpu")


def place(module: nn.Module, device: torch.device, dtype: torch.dtype | None) -> nn.Module:
    """The target moved to ``device`` and, when ``dtype`` is given, cast to that compute dtype (floating
    parameters and buffers, as ``module.to`` does).  None keeps the module's own dtype: a float32 check
    runs the module as it was built, so one built in bfloat16 is still seen as computing in bfloat16."""
    if device.type != "cpu":
        module.to(device)
    if dtype is not None:
        module.to(dtype)
    return module


@contextlib.contextmanager
def user_code(what: str, exceptions: bool = True) -> Iterator[None]:
    """The module under test is the user's code: what it raises (even SystemExit) is a target error
    naming it, never a parity crash or an exit code of its choosing.  Ctrl-C stays Ctrl-C.  What it prints
    goes to stderr (``prints_to_stderr``).  ``exceptions=False`` where parity's own code runs too: only
    SystemExit and the like are the target's."""
    try:
        with prints_to_stderr():
            yield
    except (KeyboardInterrupt, ParityError):
        raise
    except BaseException as exc:  # noqa: BLE001 - SystemExit(0) from a target must not end parity with 0
        if isinstance(exc, Exception) and not exceptions:
            raise
        raise TargetError(f"{what}: {type(exc).__name__}: {exc}{user_frame(exc)}{transpose_hint(exc)}") from exc


_MATMUL = re.compile(r"mat1 and mat2 shapes cannot be multiplied \((\d+)x(\d+) and (\d+)x(\d+)\)")


def transpose_hint(exc: BaseException) -> str:
    """For torch's matmul shape error where the second matrix fits transposed (``x @ W`` on an nn.Linear weight,
    stored [out, in]): say so, in the terms of the weight parity filled."""
    found = _MATMUL.search(str(exc)) if isinstance(exc, RuntimeError) else None
    if found is None:
        return ""
    _, columns, rows, width = (int(g) for g in found.groups())
    if columns != width or rows == columns:
        return ""
    return (f". A [{rows}, {width}] weight used as x @ W: parity fills each weight as the module declares it "
            f"(nn.Linear's [out, in]), so x @ W needs W.T (or F.linear(x, W)): a missing transpose in the module")


@contextlib.contextmanager
def prints_to_stderr() -> Iterator[None]:
    """While the user's code runs (constructor, fill, forward), its output goes to stderr: stdout may carry a
    report (``--json -``, ``--junit -``), which one print, a 10 MB debug dump or an ``os.write(1, ...)`` would
    break.  Both levels are moved: ``sys.stdout`` (print) and file descriptor 1 (os.write, C extensions), put
    back afterwards, also when the code raised.  Where fd 1 cannot be moved (closed, no fd), sys.stdout still is."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except OSError:
        saved = None
    stdout, sys.stdout = sys.stdout, sys.stderr
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        sys.stdout = stdout
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def config_field_read(error: BaseException | None) -> str | None:
    """The field name when ``error`` is an AttributeError raised by reading a config (a transformers config, or
    parity's view of one) at call time; else None."""
    if not isinstance(error, AttributeError) or not getattr(error, "name", None):
        return None
    owner = getattr(error, "obj", None)
    is_config = type(owner).__name__ == "ConfigView" or hasattr(owner, "model_type") and hasattr(owner, "to_dict")
    return error.name if is_config else None


def run_target(module: nn.Module, name: str, x: torch.Tensor, expected: torch.Size,
               notes: list[str] | None = None) -> tuple[torch.Tensor, str | None]:
    """``run_module`` on the target's own copy of ``x``; returns the output and what the target did to
    that copy (None: nothing).  Its failures are the user's to fix, not a parity crash."""
    fed = x.to(device=module_device(module, x.device), dtype=module_dtype(module, x.dtype), copy=True)
    before = fed.clone()
    try:
        with user_code(f"target {name} failed on an input of shape {list(x.shape)}"):
            out = run_module(module, fed, notes)
    except TargetError as exc:
        field = config_field_read(exc.__cause__)
        if field is None:
            raise
        raise TargetError(
            f"target {name} reads config.{field} in forward, which the checkpoint's {type(exc.__cause__.obj).__name__} "
            f"does not have and aliases.toml [config_fields] does not supply. Supply '{field}' through a factory: "
            f"--target mymodel:make_ffn with def make_ffn(config): return {name.split(':')[-1]}(YourConfig("
            f"{field}=..., ...)), the values read from the checkpoint's transformers config") from None
    if tuple(out.shape) != tuple(expected):
        raise TargetError(f"target {name}: forward on an input of shape {list(x.shape)} returned shape "
                          f"{list(out.shape)}; the reference returns {list(expected)}")
    return out.detach(), input_change(before, fed)  # a module that turned grad mode on must not leak a graph
