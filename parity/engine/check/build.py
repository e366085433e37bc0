"""Building the module under test: importing the user's class or factory and calling its constructor with what
``parity.engine.check.arguments`` chooses (the mapping's [target].args, the checkpoint's config or a read-only view of
it, values bound by parameter name), then checking the built sizes; a target of another framework is put behind
a torch module (``parity.targets``).  Construction runs the user's code: what it raises becomes a TargetError
naming it, with the constructor's signature and what was passed.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import sys
from collections.abc import Iterator
from typing import Any

from torch import nn

from parity.definitions.aliases import load_aliases
from parity.definitions.mapping import NONE, ConfigValue, Mapping
from parity.engine.check.arguments import (
    NAMED,
    TargetCall,
    admits_none,
    call_constructor,
    checkpoint_ffn_bias,
    checkpoint_ffn_width,
    config_class,
    config_view_of,
    constructor_args,
    constructor_signature,
    kwargs_read,
    project_config,
    signature_or_none,
    spell_call,
    spelled,
)
from parity.engine.frames import user_frame
from parity.errors import TargetError
from parity.targets import (
    FRAMEWORKS,
    CheckpointFacts,
    Framework,
    foreign,
    framework_importing,
    framework_of,
    unserved,
)


def import_object(import_path: str, what: str = "--target") -> Any:
    """'package.module:Name' -> the object (a class or a factory callable)."""
    if not import_path.strip():
        raise TargetError(f"{what} is empty; give the module to check as 'package.module:ClassOrFunction'")
    module_name, _, attr = import_path.partition(":")
    if not module_name or not attr:
        raise TargetError(f"{what} {import_path!r}: expected 'package.module:ClassOrFunction'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        if isinstance(exc, SyntaxError):
            raise TargetError(f"{what} {import_path!r}: module '{module_name}' has a syntax error: {exc.msg} "
                              f"({exc.filename}, line {exc.lineno})") from None
        missing = framework_importing(exc.name) if isinstance(exc, ModuleNotFoundError) else None
        if missing is not None and missing.extra:
            raise TargetError(f"{what} {import_path!r}: module '{module_name}' imports {exc.name}, which is not "
                              f"installed here: it is a {missing.name} target; install {missing.name} with "
                              f"{missing.install_command()}") from None
        raise TargetError(f"{what} {import_path!r}: cannot import module '{module_name}': {type(exc).__name__}: {exc}. "
                          "Is it installed or on PYTHONPATH?") from None
    obj = module
    for part in attr.split("."):
        if part.startswith("__") or not hasattr(obj, part):
            raise TargetError(f"{what} {import_path!r}: module '{module_name}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    check_constructible(obj, import_path, what)
    return obj


def check_constructible(obj: Any, import_path: str, what: str) -> None:
    """A target is imported code, as trusted as a conftest.py; still, parity calls only what can build a
    module: an nn.Module subclass, or a function written in Python (a factory).  ``os:system``,
    ``builtins:exec`` or ``subprocess:Popen`` are refused before anything is called."""
    if inspect.isclass(obj):
        refuse_unserved(obj, f"{what} {import_path!r}")
        if issubclass(obj, nn.Module) or framework_of(obj) is not None:
            return
        raise TargetError(f"{what} {import_path!r}: is the class {obj.__module__}.{obj.__qualname__}, which derives "
                          "from none of torch.nn.Module, mlx.nn.Module or flax.nnx.Module and is no NumPy class (one "
                          "holding its weights as NumPy arrays, called as __call__(self, x)); name the module class, a "
                          "function that builds it, a NumPy function def ffn(x, <one parameter per projection>) or "
                          "an .onnx file")
    function = obj.__func__ if inspect.ismethod(obj) else obj
    if inspect.isfunction(function):
        return
    kind = "a built-in function" if inspect.isbuiltin(obj) else f"a {type(obj).__name__}"
    raise TargetError(f"{what} {import_path!r}: is {kind}, not an nn.Module class or a Python function that builds "
                      "one; parity does not call it")


def refuse_unserved(obj: Any, what: str, label: str | None = None) -> None:
    """A module of a framework parity does not serve (flax.linen, tinygrad, Keras, ...) is exit 2 naming that
    framework and the way to one parity serves, not 'derives from none of ...'."""
    said = unserved(obj)
    if said is not None:
        if label is None:
            label = (f"{obj.__module__}.{obj.__qualname__}" if inspect.isclass(obj)
                     else f"a {type(obj).__module__}.{type(obj).__qualname__} instance")
        raise TargetError(f"{what}: {label} {said}")


def target_label(target: Any) -> str:
    """How reports name a target: 'pkg.module:Name' (for an instance, its class)."""
    if isinstance(target, str):
        return target
    if isinstance(target, nn.Module):
        target = type(target)
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or type(target).__name__
    return f"{getattr(target, '__module__', None) or '?'}:{name}"


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


def build_target(mapping: Mapping, config: Any, target: str | Any | None = None,
                 layer: int | None = None) -> tuple[nn.Module, str, dict | None, list[str]]:
    """Construct the target: the mapping's [target].class, or ``target``: 'pkg.module:Name', a class, a factory,
    or an nn.Module instance (deep-copied: the caller's instance is never modified); ``layer``: the layer it is
    built for, given to a constructor parameter that asks for it (aliases.toml [constructor] layer).  Returns the
    module, its name, its constructor arguments as a mapping file spells them (None for an instance) and notes.

    A constructor given the checkpoint's transformers config that reads a field the config lacks (nanoGPT's
    ``config.bias``) is called once more with a read-only view of the config that answers it from aliases.toml
    [config_fields] (``parity.engine.check.config_view``); each field the view supplied is one of the notes."""
    chosen = target if target is not None else mapping.target_class
    name = target_label(chosen)
    if isinstance(chosen, nn.Module):  # an instance of parity's own kind: a copy is checked, never the caller's
        return framework_of(chosen).copy(chosen), name, None, []
    framework = None if inspect.isclass(chosen) else framework_of(chosen)
    if not isinstance(chosen, str) and framework is None:
        refuse_unserved(chosen, f"target {name}")
    if framework is not None:  # an instance, a function, a file: nothing to construct
        module, args, notes = unconstructed(framework, chosen, mapping, config)
        return module, name, args, notes
    what = "--target" if target is not None else f"{mapping.path}: target.class"
    factory = import_object(chosen, what) if isinstance(chosen, str) else chosen
    if not callable(factory):
        raise TargetError(f"target {name}: a {type(chosen).__name__} is not a class, a factory or an nn.Module")
    framework = framework_of(factory)
    if framework is not None and inspect.isfunction(factory):  # a NumPy function named by import path
        module, args, notes = unconstructed(framework, factory, mapping, config)
        return module, name, args, notes
    if framework is not None:
        framework.require()
    raw, kwargs, notes = constructor_args(factory, mapping, config, framework, layer=layer)
    by_name = bool(notes)  # only arguments bound by parameter name come with notes
    defaults = left_to_defaults(factory, kwargs, framework)
    built_config, notes = own_config_arguments(factory, name, kwargs, notes, mapping, config, framework)
    try:
        module = call_constructor(factory, kwargs)
    except (AttributeError, TypeError, KeyError) as exc:  # a field the config lacks; a dict config (cfg["emb_dim"])
        if not any(value is config for value in kwargs.values()):
            raise construction_error(factory, name, kwargs, mapping, config, exc, by_name=by_name,
                                     framework=framework, built_config=built_config) from None
        module, notes = build_with_view(factory, name, kwargs, mapping, config, framework)
    except Exception as exc:
        raise construction_error(factory, name, kwargs, mapping, config, exc, by_name=by_name,
                                     framework=framework, built_config=built_config) from None
    built = framework or framework_of(module)  # a class of a framework, or a factory returning its module
    if built is not None and not built.native and not isinstance(module, nn.Module):
        module = foreign_target(built, module, mapping, config)
        notes = [*notes, *framework_notes(built)]
    if not isinstance(module, nn.Module):
        refuse_unserved(module, f"target {name}", f"what it returned, a {type(module).__qualname__},")
        raise TargetError(f"target {name} returned {type(module).__name__}, not a torch.nn.Module (nor a module "
                          f"of {', '.join(f.name for f in FRAMEWORKS)})")
    if by_name or defaults:
        check_built_size(module, factory if built is None or built.native else None, name, kwargs, raw, config,
                         mapping=mapping, defaults=None if by_name else defaults)
    return module, name, raw, notes


def own_config_arguments(factory: Any, name: str, kwargs: dict, notes: list[str], mapping: Mapping, config: Any,
                         framework: Framework | None) -> tuple[str | None, list[str]]:
    """A config parameter annotated with the project's own config class gets an instance of it built from the
    checkpoint's config (``kwargs`` changed in place).  Returns how to say what it was given (None: no such
    parameter) and the notes."""
    built_config = None
    for key, value in list(kwargs.items()):
        own = config_class(factory, key) if value is config else None
        if own is not None:
            call = TargetCall(name.split(":")[-1], key, {k: v for k, v in kwargs.items() if k != key}, framework)
            kwargs[key], notes = project_config(own, config_view_of(mapping, config, framework), mapping, config, call)
            built_config = f"its {own.__qualname__} built from the checkpoint's {type(config).__name__}"
    return built_config, notes


def unconstructed(framework: Framework, obj: Any, mapping: Mapping, config: Any) -> tuple[nn.Module, dict | None,
                                                                                       list[str]]:
    """A target of another framework that parity does not construct: an instance (a copy of it is checked), a
    NumPy function or an ONNX graph (opened; a mapping spells their arguments as {}).  The module, its arguments
    as a mapping spells them, notes."""
    framework.require()
    opened = not framework.fills or inspect.isfunction(obj)
    native = framework.open(obj) if opened else framework.copy(obj)
    return foreign_target(framework, native, mapping, config), {} if opened else None, framework_notes(framework)


def foreign_target(framework: Framework, native: Any, mapping: Mapping, config: Any) -> nn.Module:
    """A framework's module, function or graph behind a torch module (parity.targets.proxy), sized, where it
    lists no parameters of its own (a NumPy function), from the checkpoint's d, d_ff and biases."""
    hidden, width = getattr(config, "hidden_size", None), checkpoint_ffn_width(config, mapping)
    facts = (CheckpointFacts(hidden, width[0], checkpoint_ffn_bias(mapping, config)[0])
             if isinstance(hidden, int) and width is not None else None)
    return foreign(framework, native, facts)


def framework_notes(framework: Framework) -> list[str]:
    """What the report says about a target of another framework than PyTorch."""
    notes = [f"target framework: {framework.label()}"]
    if framework.immutable_arrays:
        notes.append(f"{framework.name} arrays are immutable: the target cannot change its input, so input "
                     "mutation is not checked")
    return notes


def build_with_view(factory: Any, name: str, kwargs: dict, mapping: Mapping, config: Any,
                    framework: Framework | None = None) -> tuple[Any, list[str]]:
    """The constructor called with parity's read-only view in place of the transformers config (config_view.py);
    the built module and one note per field the view supplied."""
    view = config_view_of(mapping, config, framework)
    viewed = {key: view if value is config else value for key, value in kwargs.items()}
    try:
        module = call_constructor(factory, viewed)
    except Exception as exc:
        raise construction_error(factory, name, viewed, mapping, config, exc) from None
    return module, view.notes()


def construction_error(factory: Any, name: str, kwargs: dict, mapping: Mapping, config: Any, exc: Exception, *,
                       by_name: bool = False, framework: Framework | None = None,
                       built_config: str | None = None) -> TargetError:
    """What failed, the constructor's signature and how to give it what it needs (a mapping's args or a factory);
    for a config field neither the config nor aliases.toml [config_fields] has, that field's name.  ``by_name``:
    ``kwargs`` were bound by the constructor's own parameter names (bind_by_name), not a mapping's."""
    short = name.split(":")[-1]
    try:
        own_signature = constructor_signature(factory)
        parameters, signature = own_signature.parameters, f"{short}{own_signature}"
    except (TypeError, ValueError):
        own_signature, parameters, signature = None, {}, name
    call = spell_call(short, own_signature, {p: f"<{p}>" for p, v in parameters.items()
                                             if v.default is v.empty and v.kind in NAMED})
    own = framework.extra_spelling if framework else {}
    shown = {k: (type(config).__name__ if k == "config" or v is config or _is_view(v) else
                 _Spelled(own[k]) if k in own else v) for k, v in kwargs.items()}
    field = getattr(exc, "name", None) if isinstance(exc, AttributeError) else None
    if field and any(v is config or _is_view(v) for v in kwargs.values()) and not hasattr(config, field):
        return TargetError(
            f"cannot construct target {name} with {shown}: it reads config.{field}, which the checkpoint's "
            f"{type(config).__name__} does not have and aliases.toml [config_fields] does not supply. Supply "
            f"'{field}' through a factory: --target mymodel:make_ffn with def make_ffn(config): return "
            f"{short}(YourConfig({field}=<{field}>, ...)), the values read from the checkpoint's transformers "
            f"config; or, for a constructor that takes plain values, [target].args in a mapping file (--mapping). "
            f"Its signature is {signature}."
        )
    written = factory_call(parameters, mapping, config, own)
    if written is not None:
        call = spell_call(short, own_signature, written)
    got_config = any(v is config or _is_view(v) for v in kwargs.values())
    if (got_config or by_name or built_config) and not isinstance(exc, TypeError):  # its own code failed
        given = (f"the checkpoint's {type(config).__name__}" if got_config else built_config if built_config
                 else f"{shown} (bound by its parameter names from the checkpoint's {type(config).__name__})")
        return TargetError(f"target {name} failed in its constructor, given {given}: "
                           f"{type(exc).__name__}: {exc}{user_frame(exc)}")
    given = (f"with {shown}" if got_config or not kwargs else
             f"with {shown} (bound by its parameter names)" if by_name
             else f"with the mapping's [target].args {shown} (written for the mapping's own class, not yours)")
    return TargetError(
        f"cannot construct target {name} {given}: {type(exc).__name__}: {exc}. "
        f"Its signature is {signature}; set [target].args in a mapping file (--mapping) to match it, "
        f"or pass a factory as --target: def make_ffn(config): return {call}, with the values "
        "read from the checkpoint's transformers config."
    )


class _Spelled(str):
    """A value shown as the Python that makes it (``nnx.Rngs(0)``), not as its repr."""

    def __repr__(self) -> str:
        return str(self)


def factory_call(parameters: Any, mapping: Mapping, config: Any,
                 own: dict[str, str] | None = None) -> dict[str, str] | None:
    """The arguments a factory would pass, by the constructor's own parameter names, each spelled from the
    checkpoint's config where the config or aliases.toml [config_fields] can ('config.hidden_size'); a placeholder
    that is not Python where not ('<quant>': copied as it is, it fails instead of passing Ellipsis); ``spell_call``
    writes the call.  None when the signature has no required parameter."""
    parts = {}
    for key, parameter in parameters.items():
        if parameter.kind not in NAMED or parameter.default is not parameter.empty:
            continue
        answer = ((own[key],) if own and key in own else ("config",) if key in load_aliases().config_names
                  else spelled(key, mapping, config))
        if answer is None and admits_none(parameter):
            answer = "None", NONE
        parts[key] = answer[0] if answer else f"<{key}>"
    return parts or None


def check_built_size(module: nn.Module, factory: Any, name: str, kwargs: dict, raw: dict, config: Any, *,
                     mapping: Mapping | None = None, defaults: list[str] | None = None) -> None:
    """A module built from values parity bound by name must have the checkpoint's sizes before anything is judged:
    a width argument the constructor reduces (Meta's hidden_dim, of which it keeps 2/3) builds a smaller module,
    and that is parity's guess gone wrong, not the user's mistake.  So is a module parity built with its own
    defaults (``defaults``, the parameters or ``**kwargs`` names it was left to decide: ``left_to_defaults``), sized
    for another model.  Exit 2 naming the size that differs (d or d_ff) with both values, and the factory that builds
    the right size, in the user's own parameter names (found by building the module on the meta device, which
    allocates nothing)."""
    hidden, width = getattr(config, "hidden_size", None), checkpoint_ffn_width(config, mapping)
    if not isinstance(hidden, int) or width is None:
        return
    d_ff = width[0]
    shapes = {n: tuple(p.shape) for n, p in module.named_parameters() if p.dim() == 2}
    if not shapes or all(set(shape) <= {hidden, d_ff, 2 * d_ff} for shape in shapes.values()):
        return
    short, signature = name.split(":")[-1], signature_or_none(factory)
    built = ", ".join(f"{n} {list(shape)}" for n, shape in shapes.items())
    given = spell_call(short, signature, {k: type(v).__name__ if v is config else repr(v) for k, v in kwargs.items()})
    passed = [k for k in kwargs if k not in _extras(kwargs)]
    how = (f"from the checkpoint's {type(config).__name__} by parameter name" if not defaults else
           f"with its own defaults for {', '.join(defaults)} (parity bound none of its parameters by name)"
           if not passed else f"with its own defaults for {', '.join(defaults)}, which its **kwargs reads and the "
           f"arguments parity passed ({', '.join(passed)}: the mapping's [target].args) do not hold")
    text = (f"target {name}, built as {given} {how}, has {built}: {differing_size(shapes, hidden, d_ff)}; the "
            f"checkpoint's FFN is d={hidden}, d_ff={d_ff}.")
    if defaults:
        raise TargetError(f"{text} {defaults_advice(factory, short, signature, mapping, config, hidden, d_ff)}")
    facts = load_aliases().config_fields.facts
    key = next((k for k in kwargs if facts.get(k) == "ffn_width"), None)
    solved = solve_width(factory, kwargs, key, hidden, d_ff) if key and factory is not None else None
    if solved is None:
        raise TargetError(f"{text} Its constructor computes its sizes in its own way: write a factory that passes "
                          f"what it expects: --target mymodel:make_ffn with def make_ffn(config): return "
                          f"{short}(<the arguments that build d={hidden}, d_ff={d_ff}>)")
    call = spell_call(short, signature, {k: solved if k == key else _python(raw.get(k), kwargs[k]) for k in kwargs})
    raise TargetError(f"{text} {key}={kwargs[key]!r} most likely means something else to it (Meta's FeedForward "
                      f"takes 4 x dim and keeps 2/3 of it); {key}={solved} builds d_ff={d_ff}. Write a factory and "
                      f"pass it as --target mymodel:make_ffn: def make_ffn(config): return {call}")


def differing_size(shapes: dict[str, tuple[int, ...]], hidden: int, d_ff: int) -> str:
    """Which of the FFN's two sizes the built weights differ in, with both values: 'its d is 96, the checkpoint's
    is 64 (its d_ff, 224, is the checkpoint's)'."""
    dims = {n for shape in shapes.values() for n in shape}
    widths = {d_ff, 2 * d_ff} & dims
    if widths and hidden not in dims:
        others = ", ".join(map(str, sorted(dims - widths)))
        return f"its d is {others}, the checkpoint's is {hidden} (its d_ff, {d_ff}, is the checkpoint's)"
    if hidden in dims and not widths:
        others = ", ".join(map(str, sorted(dims - {hidden})))
        return f"its d_ff is {others}, the checkpoint's is {d_ff} (its d, {hidden}, is the checkpoint's)"
    return (f"its sizes are {', '.join(map(str, sorted(dims)))}, where the checkpoint's d is {hidden} and its d_ff "
            f"{d_ff}")


def defaults_advice(factory: Any, short: str, signature: inspect.Signature | None, mapping: Mapping | None,
                    config: Any, hidden: int, d_ff: int) -> str:
    """For a module built with its defaults: the factory passing the checkpoint's sizes under the names its
    ``**kwargs`` is read with (``kwargs.get("dim", 96)``), when answering those names from the config builds the
    checkpoint's sizes (tried on the meta device); else what such a factory must pass."""
    names = kwargs_read(factory) if factory is not None and mapping is not None else []
    answers = {k: a for k in names if (a := spelled(k, mapping, config)) is not None}
    if answers and builds_size(factory, {k: ConfigValue(config, mapping.path)(a[1], f"target.args.{k}")
                                         for k, a in answers.items()}, hidden, d_ff):
        call = spell_call(short, signature, {k: a[0] for k, a in answers.items()})
        return (f"Its constructor reads {', '.join(names)} from its **kwargs; pass them with a factory: --target "
                f"mymodel:make_ffn with def make_ffn(config): return {call}")
    return (f"Pass the checkpoint's sizes under the names its constructor takes them, with a factory: --target "
            f"mymodel:make_ffn with def make_ffn(config): return {short}(<d = config.hidden_size, d_ff = "
            f"{d_ff}, under its own names>)")


def builds_size(factory: Any, kwargs: dict, hidden: int, d_ff: int) -> bool:
    """``factory(**kwargs)`` builds weights of exactly the checkpoint's sizes, d and d_ff (on the meta device)."""
    dims = meta_weight_sizes(factory, kwargs)
    return bool(dims) and all(d <= {hidden, d_ff, 2 * d_ff} for d in dims) and {hidden, d_ff} <= set().union(*dims)


def meta_weight_sizes(factory: Any, kwargs: dict) -> list[set[int]] | None:
    """The sizes of each 2-D weight ``factory`` builds from ``kwargs``, built on the meta device (nothing is
    allocated); None when the constructor refuses these arguments."""
    import torch

    try:
        with torch.device("meta"):
            module = call_constructor(factory, kwargs)
        return [set(p.shape) for p in module.parameters() if p.dim() == 2]
    except Exception:  # noqa: BLE001 - a constructor refusing these arguments builds nothing
        return None


def _extras(kwargs: dict) -> set[str]:
    """The framework's own arguments among ``kwargs`` (Flax NNX's rngs): not sizes."""
    from parity.targets import FRAMEWORKS

    return {k for k in kwargs if any(k in f.extra_spelling for f in FRAMEWORKS)}


def left_to_defaults(factory: Any, kwargs: dict, framework: Framework | None) -> list[str] | None:
    """What the constructor takes that parity did not pass, so that its own defaults decide it: every parameter,
    where nothing could be bound to their names (beyond its framework's own arguments, Flax's rngs), or the names
    a ``**kwargs`` reads that the arguments passed (the built-in mapping's [target].args, written for parity's own
    class) do not hold (``kwargs.get("dim", 96)`` given emb_size).  The sizes it builds from those are another
    model's: parity's guess, not the user's module.  None where parity's arguments decide it."""
    own = set(framework.extra_spelling) if framework is not None else set()
    signature = signature_or_none(factory)
    if signature is None:
        return None
    parameters = [p for p in signature.parameters.values() if p.name not in own]
    passed = set(kwargs) - own
    if not passed:
        left = [p.name for p in parameters if p.kind in NAMED] + (kwargs_read(factory) or [])
        takes = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
        return left or (["**kwargs"] if takes else None)
    read = kwargs_read(factory)
    left = [name for name in read or () if name not in passed]
    return left or None


def solve_width(factory: Any, kwargs: dict, key: str, hidden: int, d_ff: int) -> str | None:
    """The value of the width argument ``key`` that makes the constructor build ``d_ff`` (its other arguments kept):
    Meta's convention first (hidden_dim = 4 x dim, facebookresearch/llama model.py's TransformerBlock), else the
    smallest value that builds it, by bisection on the width the constructor builds (a size only: the verdict is
    still judged after).  None when no value does."""
    def built(value: int) -> int | None:
        sizes = meta_weight_sizes(factory, {**kwargs, key: value})
        dims = set().union(*sizes) - {hidden} if sizes is not None else set()
        return dims.pop() if len(dims) == 1 else None

    if built(4 * hidden) == d_ff:
        return "4 * config.hidden_size"
    low, high = 1, 8 * d_ff
    while low < high:
        middle = (low + high) // 2
        width = built(middle)
        if width is None:
            return None
        low, high = (middle + 1, high) if width < d_ff else (low, middle)
    return str(low) if built(low) == d_ff else None


def _python(spelling: Any, value: Any) -> str:
    """A mapping's spelling of an argument as Python: 'config.hidden_size' stays, { none = true } is None."""
    if spelling == NONE:
        return "None"
    if spelling == "config":  # the factory's own parameter
        return "config"
    return spelling if isinstance(spelling, str) and spelling.startswith("config.") else repr(value)


def _is_view(value: Any) -> bool:
    from parity.engine.check.config_view import ConfigView

    return isinstance(value, ConfigView)


