"""The module under test: built from the mapping's [target], filled through [tensors], and run.

Everything here calls the user's code, so what that code raises (even SystemExit) becomes a
TargetError naming it, and the module runs on its own copy of the inputs.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from parity.engine.compare import input_change
from parity.errors import MappingError, MissingTensorError, ParityError, ShapeMismatchError, TargetError
from parity.spec.aliases import load_aliases
from parity.spec.families import config_dff
from parity.spec.mapping import ConfigValue, Mapping, TensorRoute, unknown_route_names
from parity.spec.mistakes import MistakeId


def import_object(spec: str, what: str = "--target") -> Any:
    """'package.module:Name' -> the object (a class or a factory callable)."""
    if not spec.strip():
        raise TargetError(f"{what} is empty; give the module to check as 'package.module:ClassOrFunction'")
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise TargetError(f"{what} {spec!r}: expected 'package.module:ClassOrFunction'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise TargetError(f"{what} {spec!r}: cannot import module '{module_name}': {type(exc).__name__}: {exc}. "
                          "Is it installed or on PYTHONPATH?") from None
    obj = module
    for part in attr.split("."):
        if part.startswith("__") or not hasattr(obj, part):
            raise TargetError(f"{what} {spec!r}: module '{module_name}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    check_constructible(obj, spec, what)
    return obj


def check_constructible(obj: Any, spec: str, what: str) -> None:
    """A target is imported code, as trusted as a conftest.py; still, parity calls only what can build a
    module: an nn.Module subclass, or a function written in Python (a factory).  ``os:system``,
    ``builtins:exec`` or ``subprocess:Popen`` are refused before anything is called."""
    if inspect.isclass(obj):
        if issubclass(obj, nn.Module):
            return
        raise TargetError(f"{what} {spec!r}: is the class {obj.__module__}.{obj.__qualname__}, not a torch.nn.Module "
                          "subclass; name the module class (or a function that builds it)")
    function = obj.__func__ if inspect.ismethod(obj) else obj
    if inspect.isfunction(function):
        return
    kind = "a built-in function" if inspect.isbuiltin(obj) else f"a {type(obj).__name__}"
    raise TargetError(f"{what} {spec!r}: is {kind}, not an nn.Module class or a Python function that builds one; "
                      "parity does not call it")


def target_label(spec: Any) -> str:
    """How reports name a target: 'pkg.module:Name' (for an instance, its class)."""
    if isinstance(spec, str):
        return spec
    if isinstance(spec, nn.Module):
        spec = type(spec)
    name = getattr(spec, "__qualname__", None) or getattr(spec, "__name__", None) or type(spec).__name__
    return f"{getattr(spec, '__module__', None) or '?'}:{name}"


@contextlib.contextmanager
def cwd_importable() -> Iterator[None]:
    """The working directory importable (first on sys.path, as the `parity` command has it) while a check
    resolves its target: 'mymodel:MLP' means the same in a shell, in Python and under pytest."""
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
        importlib.invalidate_caches()
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def build_target(mapping: Mapping, config: Any,
                 target: str | Any | None = None) -> tuple[nn.Module, str, dict | None, list[str]]:
    """Construct the target: the mapping's [target].class, or ``target``: 'pkg.module:Name', a class, a factory,
    or an nn.Module instance (deep-copied: the caller's instance is never modified).  Returns the module, its
    name, its constructor arguments as a mapping file spells them (None for an instance) and notes.

    A constructor given the checkpoint's transformers config that reads a field the config lacks (nanoGPT's
    ``config.bias``) is called once more with a read-only view of the config that answers it from aliases.toml
    [config_fields] (``parity.engine.config_view``); each field the view supplied is one of the notes."""
    spec = target if target is not None else mapping.target_class
    name = target_label(spec)
    if isinstance(spec, nn.Module):
        return copy.deepcopy(spec), name, None, []
    what = "--target" if target is not None else f"{mapping.path}: target.class"
    factory = import_object(spec, what) if isinstance(spec, str) else spec
    if not callable(factory):
        raise TargetError(f"target {name}: a {type(spec).__name__} is not a class, a factory or an nn.Module")
    raw, kwargs = constructor_args(factory, mapping, config)
    notes: list[str] = []
    try:
        module = factory(**kwargs)
    except AttributeError as exc:
        if not any(value is config for value in kwargs.values()):
            raise construction_error(factory, name, kwargs, config, exc) from None
        module, notes = build_with_view(factory, name, kwargs, mapping, config)
    except Exception as exc:
        raise construction_error(factory, name, kwargs, config, exc) from None
    if not isinstance(module, nn.Module):
        raise TargetError(f"target {name} returned {type(module).__name__}, not a torch.nn.Module")
    return module, name, raw, notes


def build_with_view(factory: Any, name: str, kwargs: dict, mapping: Mapping, config: Any) -> tuple[Any, list[str]]:
    """The constructor called with parity's read-only view in place of the transformers config (config_view.py);
    the built module and one note per field the view supplied."""
    from parity.engine.config_view import config_view

    facts = {"ffn_bias": checkpoint_ffn_bias(mapping, config), "ffn_width": checkpoint_ffn_width(config)}
    view = config_view(config, load_aliases().config_fields, facts)
    viewed = {key: view if value is config else value for key, value in kwargs.items()}
    try:
        module = factory(**viewed)
    except Exception as exc:
        raise construction_error(factory, name, viewed, config, exc) from None
    return module, view.notes()


def checkpoint_ffn_width(config: Any) -> tuple[int, str] | None:
    """d_ff as transformers builds the MLP from this config: its intermediate_size (n_inner), or 4 x the hidden
    size where a GPT config leaves n_inner unset; None where the config states neither."""
    width = config_dff(config)
    if isinstance(width, int) and not isinstance(width, bool):
        field = "intermediate_size" if getattr(config, "intermediate_size", None) else "n_inner"
        return width, f"{type(config).__name__}.{field}"
    hidden = getattr(config, "hidden_size", None)
    if hasattr(config, "n_inner") and isinstance(hidden, int):
        return 4 * hidden, f"{type(config).__name__}.n_inner is unset: transformers builds 4 x hidden size"
    return None


def checkpoint_ffn_bias(mapping: Mapping, config: Any) -> tuple[bool, str]:
    """Whether the checkpoint's FFN has bias tensors, and why parity says so: the mapping's own [target].args.bias
    when it has one (LLaMA's reads config.mlp_bias), else its bias routes (GPT-2 routes c_fc.bias and c_proj.bias;
    a check reads them, so the checkpoint has them), optional ones following config.mlp_bias."""
    if "bias" in mapping.target_args:
        value = ConfigValue(config, mapping.path)(mapping.target_args["bias"], "target.args.bias")
        if isinstance(value, bool):
            return value, (f"the checkpoint has {'' if value else 'no '}FFN biases: mapping '{mapping.name}' "
                           "target.args.bias")
    required = [r.source for r in mapping.tensors if r.target.endswith("bias") and not r.optional]
    if required:
        return True, f"the checkpoint has FFN biases: {', '.join(required)}"
    optional = [r.source for r in mapping.tensors if r.target.endswith("bias")]
    flag = getattr(config, "mlp_bias", None)
    if optional and isinstance(flag, bool):
        return flag, f"the checkpoint has {'' if flag else 'no '}FFN biases: {type(config).__name__}.mlp_bias"
    return False, f"the checkpoint has no FFN biases: mapping '{mapping.name}' routes none"


def construction_error(factory: Any, name: str, kwargs: dict, config: Any, exc: Exception) -> TargetError:
    """What failed, the constructor's signature and how to give it what it needs (a mapping's args or a factory);
    for a config field neither the config nor aliases.toml [config_fields] has, that field's name."""
    short = name.split(":")[-1]
    try:
        parameters = inspect.signature(factory).parameters
        signature = f"{short}{inspect.signature(factory)}"
    except (TypeError, ValueError):
        parameters, signature = {}, name
    call = ", ".join(f"{p}=..." for p, v in parameters.items() if v.default is v.empty and v.kind in _NAMED)
    shown = {k: (type(config).__name__ if k == "config" or v is config or _is_view(v) else v)
             for k, v in kwargs.items()}
    field = getattr(exc, "name", None) if isinstance(exc, AttributeError) else None
    if field and any(v is config or _is_view(v) for v in kwargs.values()) and not hasattr(config, field):
        return TargetError(
            f"cannot construct target {name} with {shown}: it reads config.{field}, which the checkpoint's "
            f"{type(config).__name__} does not have and aliases.toml [config_fields] does not supply. Supply "
            f"'{field}' through a factory: --target mymodel:make_ffn with def make_ffn(config): return "
            f"{short}(YourConfig({field}=..., ...)), the values read from the checkpoint's transformers config; or, "
            f"for a constructor that takes plain values, [target].args in a mapping file (--mapping). Its signature "
            f"is {signature}."
        )
    return TargetError(
        f"cannot construct target {name} with {shown}: {type(exc).__name__}: {exc}. "
        f"Its signature is {signature}; set [target].args in a mapping file (--mapping) to match it, "
        f"or pass a factory as --target: def make_ffn(config): return {short}({call}), with the values "
        "read from the checkpoint's transformers config."
    )


def _is_view(value: Any) -> bool:
    from parity.engine.config_view import ConfigView

    return isinstance(value, ConfigView)


_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def constructor_args(factory: Any, mapping: Mapping, config: Any) -> tuple[dict, dict]:
    """The constructor's arguments, as a mapping spells them and evaluated: the checkpoint's transformers config
    for a parameter named `config` (aliases.toml [constructor]) whenever the signature has one, whatever else it
    accepts; else the mapping's [target].args when the constructor takes them (or its signature cannot be
    read); else the config for a factory's one required parameter (``lambda c: MLP(c.n_embd)``); else none,
    when every parameter has a default; else the mapping's args, and the constructor's error says what to
    change."""
    raw = mapping.target_args
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        signature = None
    if signature is not None:
        names = load_aliases().config_names
        named = [p for p in signature.parameters.values() if p.kind in _NAMED]
        taker = next((p.name for p in named if p.name in names), None)
        if taker is not None and _binds(signature, {taker: config}):
            return {taker: "config"}, {taker: config}
        if not (raw and _binds(signature, raw)):
            required = [p.name for p in named if p.default is inspect.Parameter.empty]
            if len(required) == 1 and _binds(signature, {required[0]: config}) and not inspect.isclass(factory):
                return {required[0]: "config"}, {required[0]: config}
            if _binds(signature, {}):
                return {}, {}
    value = ConfigValue(config, mapping.path)
    return raw, {key: value(spec, f"target.args.{key}") for key, spec in raw.items()}


def _binds(signature: inspect.Signature, kwargs: dict) -> bool:
    try:
        signature.bind(**kwargs)
    except TypeError:
        return False
    return True


def route_tensor(route: TensorRoute, stored: torch.Tensor) -> torch.Tensor:
    """Apply a route's chunk and transform to the stored tensor."""
    tensor = stored
    if route.chunk is not None:
        index, count = route.chunk
        if tensor.shape[0] % count:
            raise ShapeMismatchError(
                f"tensor '{route.source}' {tuple(tensor.shape)}: dim 0 is not divisible into {count} chunks"
            )
        tensor = tensor.chunk(count, dim=0)[index]
    if route.transform == "transpose":
        tensor = tensor.t()
    return tensor


def fill_target(module: nn.Module, mapping: Mapping, tensors: dict[str, torch.Tensor], config: Any = None) -> list[str]:
    """Copy routed checkpoint tensors (names relative to the layer) into the target's parameters.

    Biases are the one thing a module may legitimately lack or leave unloaded: a bias route
    to a module built without that bias is skipped and an unrouted projection bias is zeroed, both noted,
    so the comparison itself shows whether that matters (diagnosis ``bias_dropped``).  Any other
    route to a name the target lacks is a mapping error (it would route nothing), and so is any
    other unrouted parameter (it would hold arbitrary values).
    """
    params = dict(module.named_parameters())
    skipped = check_target_routes(module, mapping, params)
    routed, notes = set(), []
    for route in mapping.tensors:
        if route in skipped:
            if not route.optional:
                notes.append(f"the target has no parameter '{route.target}': "
                             f"checkpoint tensor '{route.source}' is not used")
            continue
        param = params[route.target]
        if route.source not in tensors:  # an optional route whose tensor the checkpoint lacks
            raise MissingTensorError(
                f"the target {type(module).__name__} has parameter '{route.target}', but the checkpoint has no "
                f"tensor '{route.source}' for it (mapping {mapping.path.name}); build the target without it "
                "(e.g. bias=False) or use a checkpoint that has it"
            )
        value = route_tensor(route, tensors[route.source])
        if tuple(value.shape) != tuple(param.shape):
            message, mistake = shape_message(route, tuple(value.shape), tuple(param.shape), config)
            error = ShapeMismatchError(message)
            error.mistake_id = mistake
            raise error
        with torch.no_grad():
            param.copy_(value)
        routed.add(route.target)
    unrouted = [name for name in params if name not in routed]
    for name in [n for n in unrouted if is_projection_bias(n, params, routed)]:
        with torch.no_grad():
            params[name].zero_()
        notes.append(f"target parameter '{name}' gets no checkpoint tensor: set to zero")
    unrouted = [n for n in unrouted if not is_projection_bias(n, params, routed)]
    if unrouted:
        raise MappingError(
            f"{mapping.where('tensors')}: the target's parameters {', '.join(unrouted)} get no checkpoint tensor; "
            "route each in [tensors] (they would keep arbitrary initial values)"
        )
    return notes


def is_projection_bias(name: str, params: dict[str, Any], routed: set[str]) -> bool:
    """A projection's bias: the ``bias`` of a submodule whose ``weight`` the routes fill (an nn.Linear built with
    bias=True on a bias-free checkpoint).  The only parameter parity may set to zero unasked: anything else
    without a tensor (a ``gain_bias`` of a (1 + g) scale, a bias of an unrouted module) is a route error."""
    owner, _, leaf = name.rpartition(".")
    return leaf == "bias" and bool(owner) and f"{owner}.weight" in routed and f"{owner}.weight" in params


def check_target_routes(module: nn.Module, mapping: Mapping, params: dict[str, nn.Parameter]) -> list[TensorRoute]:
    """Every key of [tensors] must name a parameter of the target; returns the routes to skip.

    Skipped (not an error): an optional route, or a route to a ``bias``, whose owning submodule
    exists but has no such parameter: a module built with bias=False.  A route whose owner does
    not exist either is a misspelt or foreign name, and routing nothing would go unnoticed.
    """
    owners = dict(module.named_modules())
    skipped, missing = [], []
    for route in mapping.tensors:
        if route.target in params:
            continue
        owner, _, leaf = route.target.rpartition(".")
        if (route.optional or leaf == "bias") and owner in owners:
            skipped.append(route)
        else:
            missing.append(route.target)
    if missing:
        raise MappingError(
            unknown_route_names(mapping, "tensors", missing, list(params), f"the target {type(module).__name__}")
            + ". Write the target's parameter names on the left of [tensors] and the checkpoint's tensor names "
              "on the right (a --target with other names than the mapping's needs its own --mapping FILE.toml)."
        )
    return skipped


def shape_message(route: TensorRoute, found: tuple[int, ...], expected: tuple[int, ...],
                  config: Any) -> tuple[str, str]:
    """Say which tensor, both shapes, and the likely cause; and the diagnosis id of that cause."""
    message = (f"checkpoint tensor '{route.source}' has shape {list(found)} after the mapping's transform, "
               f"but target parameter '{route.target}' has shape {list(expected)}")
    hints = []
    mistake = MistakeId.SHAPE_MISMATCH
    if len(found) == 2 and found[::-1] == expected:
        mistake = MistakeId.MISSING_TRANSPOSE
        hints.append("the shapes are transposed: the mapping's transform for this tensor is probably wrong "
                     "(Conv1D weights are stored [in, out] and need transform = \"transpose\")")
    d_ff = config_dff(config)
    d = getattr(config, "hidden_size", None)
    if d and len(found) == len(expected) and found != expected and found[::-1] != expected:
        target_dff = [s for s in expected if s != d]
        ckpt_dff = [s for s in found if s != d]
        if target_dff and ckpt_dff and target_dff != ckpt_dff:
            t, c = target_dff[0], ckpt_dff[0]
            mistake = MistakeId.INTERMEDIATE_SIZE_MISMATCH
            cause = f"the target's d_ff is {t} but the checkpoint's is {c}"
            if t == 4 * d:
                cause += " (the target uses the 4*d default: pass hidden_dim = config.intermediate_size)"
            elif t == 2 * c:
                cause += " (the target doubles d_ff: Gemma's published size sums gate and up)"
            elif t < c:
                cause += " (rounded down instead of up to multiple_of, as llama_intermediate_size must?)"
            hints.append(cause)
    if d_ff and not hints:
        hints.append(f"the checkpoint's config says d={d}, d_ff={d_ff}")
    return message + (": " + "; ".join(hints) if hints else ""), mistake


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
    naming it, never a parity crash or an exit code of its choosing.  Ctrl-C stays Ctrl-C.
    ``exceptions=False`` where parity's own code runs too: only SystemExit and the like are the target's."""
    try:
        yield
    except (KeyboardInterrupt, ParityError):
        raise
    except BaseException as exc:  # noqa: BLE001 - SystemExit(0) from a target must not end parity with 0
        if isinstance(exc, Exception) and not exceptions:
            raise
        raise TargetError(f"{what}: {type(exc).__name__}: {exc}") from exc


def run_target(module: nn.Module, name: str, x: torch.Tensor, expected: torch.Size,
               notes: list[str] | None = None) -> tuple[torch.Tensor, str | None]:
    """``run_module`` on the target's own copy of ``x``; returns the output and what the target did to
    that copy (None: nothing).  Its failures are the user's to fix, not a parity crash."""
    fed = x.to(device=module_device(module, x.device), dtype=module_dtype(module, x.dtype), copy=True)
    before = fed.clone()
    with user_code(f"target {name} failed on an input of shape {list(x.shape)}"):
        out = run_module(module, fed, notes)
    if tuple(out.shape) != tuple(expected):
        raise TargetError(f"target {name}: forward on an input of shape {list(x.shape)} returned shape "
                          f"{list(out.shape)}; the reference returns {list(expected)}")
    return out.detach(), input_change(before, fed)  # a module that turned grad mode on must not leak a graph
