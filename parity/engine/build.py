"""Building the module under test: importing the user's class or factory and calling its constructor with
the mapping's [target].args, or the checkpoint's config (through a read-only view of it when the constructor
reads a field the config lacks).  Construction runs the user's code: what it raises becomes a TargetError
naming it, with the constructor's signature and what was passed.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import os
import sys
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from parity.definitions.aliases import load_aliases
from parity.definitions.families import TANH_GELUS, config_dff, configured_activation
from parity.definitions.mapping import NONE, ConfigValue, Mapping, TensorRoute
from parity.engine.frames import user_frame
from parity.errors import TargetError
from parity.targets import FRAMEWORKS, CheckpointFacts, Framework, foreign, framework_importing, framework_of


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
                              f"pip install 'parity[{missing.extra}]'") from None
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
        if issubclass(obj, nn.Module) or framework_of(obj) is not None:
            return
        raise TargetError(f"{what} {import_path!r}: is the class {obj.__module__}.{obj.__qualname__}, which derives "
                          "from none of torch.nn.Module, mlx.nn.Module or flax.nnx.Module; name the module class, a "
                          "function that builds it, a NumPy function def ffn(x, <one parameter per projection>) or "
                          "an .onnx file")
    function = obj.__func__ if inspect.ismethod(obj) else obj
    if inspect.isfunction(function):
        return
    kind = "a built-in function" if inspect.isbuiltin(obj) else f"a {type(obj).__name__}"
    raise TargetError(f"{what} {import_path!r}: is {kind}, not an nn.Module class or a Python function that builds "
                      "one; parity does not call it")


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


def build_target(mapping: Mapping, config: Any,
                 target: str | Any | None = None) -> tuple[nn.Module, str, dict | None, list[str]]:
    """Construct the target: the mapping's [target].class, or ``target``: 'pkg.module:Name', a class, a factory,
    or an nn.Module instance (deep-copied: the caller's instance is never modified).  Returns the module, its
    name, its constructor arguments as a mapping file spells them (None for an instance) and notes.

    A constructor given the checkpoint's transformers config that reads a field the config lacks (nanoGPT's
    ``config.bias``) is called once more with a read-only view of the config that answers it from aliases.toml
    [config_fields] (``parity.engine.config_view``); each field the view supplied is one of the notes."""
    chosen = target if target is not None else mapping.target_class
    name = target_label(chosen)
    if isinstance(chosen, nn.Module):
        return copy.deepcopy(chosen), name, None, []
    framework = framework_of(chosen)
    if framework is not None and (framework.owns(chosen) and not inspect.isclass(chosen)):
        framework.require()  # an instance, a function or a file: nothing to construct
        opened = framework.fills is False or inspect.isfunction(chosen)  # a graph or a function: nothing built
        native = framework.open(chosen) if opened else framework.copy(chosen)
        return (foreign_target(framework, native, mapping, config), name, {} if opened else None,
                framework_notes(framework))
    what = "--target" if target is not None else f"{mapping.path}: target.class"
    factory = import_object(chosen, what) if isinstance(chosen, str) else chosen
    if not callable(factory):
        raise TargetError(f"target {name}: a {type(chosen).__name__} is not a class, a factory or an nn.Module")
    framework = framework_of(factory)
    if framework is not None and inspect.isfunction(factory):  # a NumPy function named by import path
        framework.require()
        return (foreign_target(framework, framework.open(factory), mapping, config), name, {},
                framework_notes(framework))
    if framework is not None:
        framework.require()
    raw, kwargs, notes = constructor_args(factory, mapping, config, framework)
    by_name = bool(notes)  # only arguments bound by parameter name come with notes
    built_config = None  # the project's own config class, built from the checkpoint's config
    for key, value in list(kwargs.items()):  # a config parameter annotated with the project's own config class
        own = config_class(factory, key) if value is config else None
        if own is not None:
            call = TargetCall(name.split(":")[-1], key, {k: v for k, v in kwargs.items() if k != key}, framework)
            kwargs[key], notes = project_config(own, config_view_of(mapping, config), mapping, config, call)
            built_config = f"its {own.__qualname__} built from the checkpoint's {type(config).__name__}"
    try:
        module = factory(**kwargs)
    except (AttributeError, TypeError, KeyError) as exc:  # a field the config lacks; a dict config (cfg["emb_dim"])
        if not any(value is config for value in kwargs.values()):
            raise construction_error(factory, name, kwargs, mapping, config, exc, by_name=by_name,
                                     framework=framework, built_config=built_config) from None
        module, notes = build_with_view(factory, name, kwargs, mapping, config)
    except Exception as exc:
        raise construction_error(factory, name, kwargs, mapping, config, exc, by_name=by_name,
                                     framework=framework, built_config=built_config) from None
    built = framework or framework_of(module)  # a class of a framework, or a factory returning its module
    if built is not None and not isinstance(module, nn.Module):
        built.require()
        module = foreign_target(built, module, mapping, config)
        notes = [*notes, *framework_notes(built)]
    if not isinstance(module, nn.Module):
        raise TargetError(f"target {name} returned {type(module).__name__}, not a torch.nn.Module (nor a module "
                          f"of {', '.join(f.name for f in FRAMEWORKS)})")
    if by_name:
        check_built_size(module, factory if built is None else None, name, kwargs, raw, config)
    return module, name, raw, notes


def foreign_target(framework: Framework, native: Any, mapping: Mapping, config: Any) -> nn.Module:
    """A framework's module, function or graph behind a torch module (parity.targets.proxy), sized, where it
    lists no parameters of its own (a NumPy function), from the checkpoint's d, d_ff and biases."""
    hidden, width = getattr(config, "hidden_size", None), checkpoint_ffn_width(config)
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


def config_view_of(mapping: Mapping, config: Any):
    """parity's read-only view of the checkpoint's config (config_view.py), answering from aliases.toml."""
    from parity.engine.config_view import config_view

    return config_view(config, load_aliases().config_fields, checkpoint_facts(mapping, config))


def checkpoint_facts(mapping: Mapping, config: Any) -> dict[str, tuple[Any, str] | None]:
    """What parity knows about the checkpoint's FFN, each with why (aliases.toml [config_fields.facts] names
    the fields modules read them under): its biases, d_ff, activation (transformers' name, as TransformerLens'
    act_fn spells it too), whether a GELU is the tanh form (litgpt's gelu_approximate) and the attention head
    size (a config class may require it: TransformerLens' d_head)."""
    activation = configured_activation(config)
    source = f"the checkpoint's {type(config).__name__} says {activation!r}"
    heads, hidden = getattr(config, "num_attention_heads", None), getattr(config, "hidden_size", None)
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        head_dim = hidden // heads
    rope = getattr(config, "rope_parameters", None)
    rope_theta = rope.get("rope_theta") if isinstance(rope, dict) else getattr(config, "rope_theta", None)
    return {"ffn_bias": checkpoint_ffn_bias(mapping, config), "ffn_width": checkpoint_ffn_width(config),
            "ffn_activation": (activation, source) if activation else None,
            "gelu_approximate": (("tanh" if activation in TANH_GELUS else "none"), source) if activation else None,
            "head_dim": (head_dim, f"{type(config).__name__}: head_dim, or hidden size / attention heads")
            if isinstance(head_dim, int) else None,
            "rope_theta": (rope_theta, f"{type(config).__name__}.rope_parameters['rope_theta']")
            if isinstance(rope_theta, (int, float)) else None}


def config_class(factory: Any, parameter: str) -> type | None:
    """The class ``factory``'s config parameter is annotated with, when it is the project's own (a dataclass, an
    attrs or pydantic model, a plain class); None for a transformers config, a dict, Any, or no annotation."""
    function = factory.__init__ if inspect.isclass(factory) else factory
    try:
        hint = typing.get_type_hints(function).get(parameter)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve says nothing
        return None
    # Union[Dict, HookedTransformerConfig] (TransformerLens): the one member that is a project's own class
    members = [m for m in typing.get_args(hint) if _own_class(m)] if typing.get_origin(hint) is not None else []
    if len(members) == 1:
        return members[0]
    return hint if _own_class(hint) else None


def _own_class(hint: Any) -> bool:
    """A class a project wrote for its config: not a builtin container or scalar, not a transformers config."""
    if not inspect.isclass(hint) or hint in (object, dict, type(None)) or issubclass(hint, (dict, str, int, float)):
        return False
    return not any(base.__name__ == "PretrainedConfig" for base in hint.__mro__)


@dataclass(frozen=True)
class TargetCall:
    """How the target is called with its config class, for a factory parity prints: the target's name, the
    parameter taking the config, its other arguments and its framework (whose own arguments it spells)."""

    target: str
    parameter: str
    others: dict
    framework: Framework | None

    def spelled(self, config_call: str) -> str:
        spelling = self.framework.extra_spelling if self.framework else {}
        others = [f"{k}={spelling.get(k, repr(v))}" for k, v in self.others.items()]
        return f"{self.target}({', '.join([f'{self.parameter}={config_call}', *others])})"


def project_config(cls: type, view: Any, mapping: Mapping, config: Any, call: TargetCall) -> tuple[Any, list[str]]:
    """An instance of the project's own config class built from the checkpoint's config through the view: each
    constructor parameter it can answer (the config's own fields, aliases.toml [config_fields]) is passed, the
    others keep their defaults.  A required one nobody answers is a TargetError naming it, with the factory to
    write: every answered field spelled from the config, the others as <name> (not Python: copied unfilled,
    it fails)."""
    try:
        parameters = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return view, []
    values, missing = {}, []
    for key, parameter in parameters.items():
        if parameter.kind not in _NAMED:
            continue
        value = view.get(key, _UNANSWERED)
        if value is not _UNANSWERED:
            values[key] = value
        elif parameter.default is parameter.empty:
            missing.append(key)
    label = f"{cls.__module__}.{cls.__qualname__}"
    if missing:
        fields = [f"{k}={(spelled(k, mapping, config) or (repr(v),))[0]}" for k, v in values.items()]
        fields += [f"{m}=<{m}>" for m in missing]
        factory = call.spelled(f"{cls.__qualname__}({', '.join(fields)})")
        raise TargetError(f"cannot build the target's config {label} from the checkpoint's {view.config_name}: its "
                          f"parameters {', '.join(missing)} have no default and neither the config nor aliases.toml "
                          f"[config_fields] answers them. Write a factory and pass it as --target mymodel:make_ffn: "
                          f"def make_ffn(config): return {factory}")
    try:
        built = cls(**values)
    except Exception as exc:  # noqa: BLE001 - the project's own validation: said in its terms
        raise TargetError(f"cannot build the target's config {label} from the checkpoint's {view.config_name} with "
                          f"{values}: {type(exc).__name__}: {exc}") from None
    shown = ", ".join(f"{k}={v!r}" for k, v in values.items())
    return built, [f"target config: built {label}({shown}) from the checkpoint's {view.config_name}",
                   *view.notes()]


_UNANSWERED = object()


def build_with_view(factory: Any, name: str, kwargs: dict, mapping: Mapping, config: Any) -> tuple[Any, list[str]]:
    """The constructor called with parity's read-only view in place of the transformers config (config_view.py);
    the built module and one note per field the view supplied."""
    view = config_view_of(mapping, config)
    viewed = {key: view if value is config else value for key, value in kwargs.items()}
    try:
        module = factory(**viewed)
    except Exception as exc:
        raise construction_error(factory, name, viewed, mapping, config, exc) from None
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
    leaves = load_aliases()

    def is_bias(route: TensorRoute) -> bool:  # "c_fc.bias", and a NumPy target's "c_fc.b"
        return leaves.leaf_kind(route.target.rpartition(".")[2]) == "bias" and route.reads

    required = [r.source for r in mapping.tensors if is_bias(r) and not r.optional]
    if required:
        return True, f"the checkpoint has FFN biases: {', '.join(required)}"
    optional = [r.source for r in mapping.tensors if is_bias(r)]
    flag = getattr(config, "mlp_bias", None)
    if optional and isinstance(flag, bool):
        return flag, f"the checkpoint has {'' if flag else 'no '}FFN biases: {type(config).__name__}.mlp_bias"
    return False, f"the checkpoint has no FFN biases: mapping '{mapping.name}' routes none"


def construction_error(factory: Any, name: str, kwargs: dict, mapping: Mapping, config: Any, exc: Exception, *,
                       by_name: bool = False, framework: Framework | None = None,
                       built_config: str | None = None) -> TargetError:
    """What failed, the constructor's signature and how to give it what it needs (a mapping's args or a factory);
    for a config field neither the config nor aliases.toml [config_fields] has, that field's name.  ``by_name``:
    ``kwargs`` were bound by the constructor's own parameter names (bind_by_name), not a mapping's."""
    short = name.split(":")[-1]
    try:
        parameters = constructor_signature(factory).parameters
        signature = f"{short}{constructor_signature(factory)}"
    except (TypeError, ValueError):
        parameters, signature = {}, name
    call = ", ".join(f"{p}=<{p}>" for p, v in parameters.items() if v.default is v.empty and v.kind in _NAMED)
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
        call = written
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
        f"or pass a factory as --target: def make_ffn(config): return {short}({call}), with the values "
        "read from the checkpoint's transformers config."
    )


class _Spelled(str):
    """A value shown as the Python that makes it (``nnx.Rngs(0)``), not as its repr."""

    def __repr__(self) -> str:
        return str(self)


def factory_call(parameters: Any, mapping: Mapping, config: Any, own: dict[str, str] | None = None) -> str | None:
    """The call a factory would make, in the constructor's own parameter names, each answered from the checkpoint's
    config where the config or aliases.toml [config_fields] can ('dim=config.hidden_size'); a placeholder that is
    not Python where not ('quant=<quant>': copied as it is, it fails instead of passing Ellipsis).  None when the
    signature has no required parameter."""
    parts = []
    for key, parameter in parameters.items():
        if parameter.kind not in _NAMED or parameter.default is not parameter.empty:
            continue
        answer = (own[key],) if own and key in own else spelled(key, mapping, config)
        if answer is None and _admits_none(parameter):
            answer = "None", NONE
        parts.append(f"{key}={answer[0] if answer else f'<{key}>'}")
    return ", ".join(parts) if parts else None


def spelled(key: str, mapping: Mapping, config: Any) -> tuple[str, Any, str] | None:
    """How a constructor parameter named ``key`` is answered from the checkpoint's config, spelled for a factory
    (Python) and for a mapping's [target].args (TOML), and why: the config's own field ('config.dim'), an alias
    of one ('config.hidden_size'), a fact about the checkpoint's FFN (d_ff, biases, activation) or a switch's one
    right value (aliases.toml [config_fields]); None when nothing answers it."""
    fields = load_aliases().config_fields
    owner = type(config).__name__
    if hasattr(config, key) and not callable(getattr(config, key)):
        value = getattr(config, key)
        return (f"config.{key}", f"config.{key}", f"{owner}.{key}") if value is not None else \
            ("None", NONE, f"{owner}.{key} is None")
    if key in fields.aliases and getattr(config, fields.aliases[key], None) is not None:
        own = fields.aliases[key]
        return f"config.{own}", f"config.{own}", f"{owner}.{own}"
    fact = fields.facts.get(key)
    known = checkpoint_facts(mapping, config).get(fact) if fact else None
    if fact == "ffn_width" and known is not None:
        if getattr(config, "intermediate_size", None) == known[0]:
            return "config.intermediate_size", "config.intermediate_size", f"{owner}.intermediate_size"
        return str(known[0]), known[0], "the checkpoint's d_ff"
    if known is not None:
        return repr(known[0]), known[0], known[1]
    if key in fields.values:
        value, why = fields.values[key]
        return repr(value), value, why
    return None


def _admits_none(parameter: inspect.Parameter) -> bool:
    """An annotation such as Optional[float] (Meta's ffn_dim_multiplier): None is a value it was written for."""
    hint = parameter.annotation
    if isinstance(hint, str):
        return hint.startswith("Optional[") or hint.replace(" ", "").endswith("|None")
    return type(None) in typing.get_args(hint)


def bind_by_name(named: list[inspect.Parameter], mapping: Mapping,
                 config: Any) -> tuple[dict, dict, list[str]] | None:
    """A constructor that takes plain values (Meta's ``FeedForward(dim, hidden_dim, multiple_of,
    ffn_dim_multiplier)``, llama2.c's, ``Mlp(in_features, hidden_features)``): each parameter bound by its name
    through the same table as a config's fields (``spelled``), a required ``Optional[...]`` one nobody answers to
    None.  Returns the arguments as a mapping spells them, their values and one note per argument; None when a
    required parameter is unanswered, or nothing is answered at all (its defaults are then all there is)."""
    raw, values, notes = {}, {}, []
    for parameter in named:
        key = parameter.name
        answer = spelled(key, mapping, config)
        if answer is None and parameter.default is parameter.empty and _admits_none(parameter):
            answer = ("None", NONE, f"nothing in the checkpoint's {type(config).__name__} states it")
        if answer is None:
            if parameter.default is parameter.empty:
                return None
            continue
        raw[key] = answer[1]
        values[key] = ConfigValue(config, mapping.path)(answer[1], f"target.args.{key}")
        notes.append(f"target constructor: {key}={values[key]!r} ({answer[2]})")
    return (raw, values, notes) if values else None


def check_built_size(module: nn.Module, factory: Any, name: str, kwargs: dict, raw: dict, config: Any) -> None:
    """A module built from values parity bound by name must have the checkpoint's sizes before anything is judged:
    a width argument the constructor reduces (Meta's hidden_dim, of which it keeps 2/3) builds a smaller module,
    and that is parity's guess gone wrong, not the user's mistake.  Exit 2 naming the argument, with the factory
    that builds the right size, in the user's own parameter names (the width found by building the module on the
    meta device, which allocates nothing)."""
    hidden, width = getattr(config, "hidden_size", None), checkpoint_ffn_width(config)
    if not isinstance(hidden, int) or width is None:
        return
    d_ff = width[0]
    shapes = {n: tuple(p.shape) for n, p in module.named_parameters() if p.dim() == 2}
    if not shapes or all(set(shape) <= {hidden, d_ff, 2 * d_ff} for shape in shapes.values()):
        return
    facts = load_aliases().config_fields.facts
    key = next((k for k in kwargs if facts.get(k) == "ffn_width"), None)
    solved = solve_width(factory, kwargs, key, hidden, d_ff) if key and factory is not None else None
    short = name.split(":")[-1]
    built = ", ".join(f"{n} {list(shape)}" for n, shape in shapes.items())
    given = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    text = (f"target {name}, built as {short}({given}) from the checkpoint's {type(config).__name__} by parameter "
            f"name, has {built}; the checkpoint's FFN is d={hidden}, d_ff={d_ff}.")
    if solved is None:
        raise TargetError(f"{text} Its constructor computes its sizes in its own way: write a factory that passes "
                          f"what it expects: --target mymodel:make_ffn with def make_ffn(config): return "
                          f"{short}(...)")
    call = ", ".join(f"{k}={solved if k == key else _python(raw.get(k), kwargs[k])}" for k in kwargs)
    raise TargetError(f"{text} {key}={kwargs[key]!r} most likely means something else to it (Meta's FeedForward "
                      f"takes 4 x dim and keeps 2/3 of it); {key}={solved} builds d_ff={d_ff}. Write a factory and "
                      f"pass it as --target mymodel:make_ffn: def make_ffn(config): return {short}({call})")


def solve_width(factory: Any, kwargs: dict, key: str, hidden: int, d_ff: int) -> str | None:
    """The value of the width argument ``key`` that makes the constructor build ``d_ff`` (its other arguments kept):
    Meta's convention first (hidden_dim = 4 x dim, facebookresearch/llama model.py's TransformerBlock), else the
    smallest value that builds it, by bisection on the width the constructor builds (a size only: the verdict is
    still judged after).  None when no value does."""
    import torch

    def built(value: int) -> int | None:
        try:
            with torch.device("meta"):
                module = factory(**{**kwargs, key: value})
        except Exception:  # noqa: BLE001 - a value the constructor refuses builds nothing
            return None
        dims = {dim for p in module.parameters() if p.dim() == 2 for dim in p.shape} - {hidden}
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
    return spelling if isinstance(spelling, str) and spelling.startswith("config.") else repr(value)


def _is_view(value: Any) -> bool:
    from parity.engine.config_view import ConfigView

    return isinstance(value, ConfigView)

_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def constructor_args(factory: Any, mapping: Mapping, config: Any,
                     framework: Framework | None = None) -> tuple[dict, dict, list[str]]:
    """The constructor's arguments, as a mapping spells them and evaluated: the checkpoint's transformers config
    for a parameter named `config` (aliases.toml [constructor]) whenever the signature has one, whatever else it
    accepts; else the mapping's [target].args when the constructor takes them (or its signature cannot be
    read); else the config for a factory's one required parameter (``lambda c: MLP(c.n_embd)``); else none,
    when every parameter has a default; else the mapping's args, and the constructor's error says what to
    change.  ``framework``: the target's, when not PyTorch; its constructors' own arguments (Flax NNX's rngs)
    are added to what is chosen."""
    try:
        signature = constructor_signature(factory)
    except (TypeError, ValueError):
        signature = None
    extras = framework.constructor_extras(dict(signature.parameters)) if framework and signature else {}
    chosen = _constructor_args(factory, signature, extras, mapping, config)
    return chosen[0], {**extras, **chosen[1]}, chosen[2]


def _constructor_args(factory: Any, signature: inspect.Signature | None, extras: dict, mapping: Mapping,
                      config: Any) -> tuple[dict, dict, list[str]]:
    """constructor_args' choice, with ``extras`` bound beside each candidate."""
    raw = mapping.target_args

    def binds(kwargs: dict) -> bool:
        return _binds(signature, {**extras, **kwargs})

    if signature is not None:
        names = load_aliases().config_names
        named = [p for p in signature.parameters.values() if p.kind in _NAMED and p.name not in extras]
        taker = next((p.name for p in named if p.name in names), None)
        if taker is not None and binds({taker: config}):
            return {taker: "config"}, {taker: config}, []
        if not (raw and binds(raw)):
            required = [p.name for p in named if p.default is inspect.Parameter.empty]
            if len(required) == 1 and binds({required[0]: config}) and not inspect.isclass(factory):
                return {required[0]: "config"}, {required[0]: config}, []
            projections = projection_modules(required, mapping, config,
                                             [p.name for p in named if p.default is None])
            if projections is not None and binds(projections):
                return {}, projections, []  # a mapping without args repeats this: the modules are built again
            by_name = bind_by_name(named, mapping, config)
            if by_name is not None and binds(by_name[1]):
                return by_name
            if binds({}):
                return {}, {}, []
    value = ConfigValue(config, mapping.path)
    return raw, {key: value(written, f"target.args.{key}") for key, written in raw.items()}, []


def constructor_signature(factory: Any) -> inspect.Signature:
    """The parameters a class's constructor takes: its ``__init__``'s where a metaclass hides them behind
    ``(*args, **kwargs)`` (Flax NNX's modules), else ``inspect.signature``'s."""
    signature = inspect.signature(factory)
    kinds = {p.kind for p in signature.parameters.values()}
    if inspect.isclass(factory) and kinds == {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}:
        own = inspect.signature(factory.__init__)
        return own.replace(parameters=list(own.parameters.values())[1:])  # without self
    return signature


def projection_modules(required: list[str], mapping: Mapping, config: Any,
                       optional: list[str] = ()) -> dict[str, nn.Module] | None:
    """For a builder that takes its projections as modules (``FeedForward(gate_proj=..., down_proj=...,
    up_proj=None)``, torchtune's style): an nn.Linear per required parameter whose name plays a projection role
    (aliases.toml), and per ``optional`` one (a default of None) of the same kind (torchtune's up_proj beside a
    gate_proj), sized from the checkpoint's config (d, d_ff) and with biases as its FFN has them; None when a
    required parameter is no projection name, or the sizes are unknown."""
    aliases = load_aliases()
    width, hidden = checkpoint_ffn_width(config), getattr(config, "hidden_size", None)
    if not required or width is None or not isinstance(hidden, int):
        return None
    bias = checkpoint_ffn_bias(mapping, config)[0]
    built, kinds = {}, set()
    for key in [*required, *optional]:
        roles = {aliases.roles[role] for role, kind in aliases.roles_of(key) if kind == "weight"}
        sides = {role.side for role in roles if not role.fuses}
        if key in optional and (len(sides) != 1 or {role.kind for role in roles} - kinds):
            continue
        if len(sides) != 1:
            return None
        kinds |= {role.kind for role in roles}
        built[key] = (nn.Linear(hidden, width[0], bias=bias) if sides == {"in"}
                      else nn.Linear(width[0], hidden, bias=bias))
    return built


def _binds(signature: inspect.Signature, kwargs: dict) -> bool:
    try:
        signature.bind(**kwargs)
    except TypeError:
        return False
    return True
