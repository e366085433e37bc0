"""What a target's constructor is called with: the checkpoint's config (or parity's read-only view of it, or an
instance of the project's own config class built from it), the mapping's [target].args, the values its
parameters' names ask for (``bind_by_name``), or projection modules; and the facts about the checkpoint's FFN
that answer them (d_ff, biases, activation).  ``parity.engine.check.build`` calls the constructor with what this
chooses.
"""

from __future__ import annotations

import inspect
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from parity.definitions.aliases import load_aliases
from parity.definitions.families import TANH_GELUS, config_dff, configured_activation, declares
from parity.definitions.mapping import NONE, ConfigValue, Mapping, TensorRoute
from parity.engine.check.config_view import COMPUTE_DTYPE_NAMES
from parity.errors import TargetError

if TYPE_CHECKING:  # annotations only: the frameworks' registry is build.py's to import
    from parity.targets import Framework


def config_view_of(mapping: Mapping, config: Any, framework: Framework | None = None):
    """parity's read-only view of the checkpoint's config (config_view.py), answering from aliases.toml; its
    ``dtype`` is the target framework's float32."""
    from parity.engine.check.config_view import config_view

    float32 = framework.float32() if framework is not None else None
    return config_view(config, load_aliases().config_fields, checkpoint_facts(mapping, config), float32)


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
    return {"ffn_bias": checkpoint_ffn_bias(mapping, config),
            "ffn_width": checkpoint_ffn_width(config, mapping),
            "ffn_activation": (activation, source) if activation else None,
            "gelu_approximate": (("tanh" if activation in TANH_GELUS else "none"), source) if activation else None,
            "head_dim": (head_dim, f"{type(config).__name__}: head_dim, or hidden size / attention heads")
            if isinstance(head_dim, int) else None,
            "rope_theta": (rope_theta, f"{type(config).__name__}.rope_parameters['rope_theta']")
            if isinstance(rope_theta, (int, float)) else None}


def unit_width(mapping: Mapping) -> int | None:
    """The d_ff of a derived layout's unit (an expert, a shared expert, a dense layer of an MoE model), which the
    config's intermediate_size need not be; None for a mapping file's layout."""
    width = (mapping.width or mapping.target_args.get("hidden_dim")) if mapping.derived else None
    return width if isinstance(width, int) and not isinstance(width, bool) else None


def unit_widths(named: list[inspect.Parameter], mapping: Mapping, config: Any) -> dict[str, int]:
    """For a constructor that takes the config (transformers' own ``MLP(config, intermediate_size=None)``): its
    optional d_ff parameters, set to a derived unit's own width where the config's field of that name says another
    (an expert's, a shared expert's); empty otherwise."""
    width = unit_width(mapping)
    facts = load_aliases().config_fields.facts
    return {p.name: width for p in named if width is not None and facts.get(p.name) == "ffn_width"
            and p.default is not inspect.Parameter.empty and getattr(config, p.name, None) != width}


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
        if parameter.kind not in NAMED:
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
        built = call_constructor(cls, values)
    except Exception as exc:  # noqa: BLE001 - the project's own validation: said in its terms
        raise TargetError(f"cannot build the target's config {label} from the checkpoint's {view.config_name} with "
                          f"{values}: {type(exc).__name__}: {exc}") from None
    shown = ", ".join(f"{k}={v!r}" for k, v in values.items())
    return built, [f"target config: built {label}({shown}) from the checkpoint's {view.config_name}",
                   *view.notes()]


_UNANSWERED = object()


def checkpoint_ffn_width(config: Any, mapping: Mapping | None = None) -> tuple[int, str] | None:
    """d_ff as transformers builds the MLP from this config: its intermediate_size (n_inner), or 4 x the hidden
    size where a GPT config leaves n_inner unset; a derived layout's unit its own (an expert's); None where the
    config states neither."""
    unit = unit_width(mapping) if mapping is not None else None
    if unit is not None:
        return unit, "this unit's d_ff in transformers' module"
    width = config_dff(config)
    if isinstance(width, int) and not isinstance(width, bool):
        field = "n_inner" if hasattr(config, "n_inner") else "intermediate_size"
        return width, f"{type(config).__name__}.{field}"
    hidden = getattr(config, "hidden_size", None)
    if hasattr(config, "n_inner") and isinstance(hidden, int):
        return 4 * hidden, f"{type(config).__name__}.n_inner is unset: transformers builds 4 x hidden size"
    if not declares(config, "intermediate_size") and isinstance(hidden, int):
        return 4 * hidden, f"{type(config).__name__} states no d_ff: transformers builds 4 x hidden size"
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


def spelled(key: str, mapping: Mapping, config: Any) -> tuple[str, Any, str] | None:
    """How a constructor parameter named ``key`` is answered from the checkpoint's config, spelled for a factory
    (Python) and for a mapping's [target].args (TOML), and why: the config's own field ('config.dim'), an alias
    of one ('config.hidden_size'), a fact about the checkpoint's FFN (d_ff, biases, activation) or a switch's one
    right value (aliases.toml [config_fields]); None when nothing answers it."""
    fields = load_aliases().config_fields
    owner = type(config).__name__
    width = unit_width(mapping) if fields.facts.get(key) == "ffn_width" else None
    if width is not None and getattr(config, key, None) != width:
        return str(width), width, "this unit's d_ff in transformers' module"
    # a d_ff key config.json carries but the config's class does not declare (a GPT-2 config's stray
    # intermediate_size) sizes no module of transformers: the checkpoint's d_ff answers it instead
    stray = fields.facts.get(key) == "ffn_width" and not declares(config, key)
    if hasattr(config, key) and not callable(getattr(config, key)) and not stray:
        value = getattr(config, key)
        return (f"config.{key}", f"config.{key}", f"{owner}.{key}") if value is not None else \
            ("None", NONE, f"{owner}.{key} is None")
    if key in fields.aliases and getattr(config, fields.aliases[key], None) is not None:
        own = fields.aliases[key]
        return f"config.{own}", f"config.{own}", f"{owner}.{own}"
    fact = fields.facts.get(key)
    known = checkpoint_facts(mapping, config).get(fact) if fact else None
    if fact == "ffn_width" and known is not None:
        if getattr(config, "intermediate_size", None) == known[0] and declares(config, "intermediate_size"):
            return "config.intermediate_size", "config.intermediate_size", f"{owner}.intermediate_size"
        return str(known[0]), known[0], "the checkpoint's d_ff"
    if known is not None:
        return repr(known[0]), known[0], known[1]
    if key in fields.values:
        value, why = fields.values[key]
        return repr(value), value, why
    return None


def admits_none(parameter: inspect.Parameter) -> bool:
    """An annotation such as Optional[float] (Meta's ffn_dim_multiplier): None is a value it was written for."""
    hint = parameter.annotation
    if isinstance(hint, str):
        return hint.startswith("Optional[") or hint.replace(" ", "").endswith("|None")
    return type(None) in typing.get_args(hint)


def bind_by_name(factory: Any, named: list[inspect.Parameter], mapping: Mapping,
                 config: Any) -> tuple[dict, dict, list[str]] | None:
    """A constructor that takes plain values (Meta's ``FeedForward(dim, hidden_dim, multiple_of,
    ffn_dim_multiplier)``, llama2.c's, ``Mlp(in_features, hidden_features)``): each parameter bound by its name
    through the same table as a config's fields (``spelled``), a ``config`` one to the config itself
    (``Cfg(config, hidden_dim)``); a required ``Optional[...]`` one nobody answers is
    None, and one annotated with the project's own class that needs no arguments gets that class's defaults
    (flax's gemma FeedForward(shd_config: ShardingConfig)).  Returns the arguments as a mapping spells them (an
    instance is not spelled: a saved mapping binds it again), their values and one note per argument; None when a
    required parameter is unanswered, or nothing is answered at all (its defaults are then all there is)."""
    raw, values, notes = {}, {}, []
    for parameter in named:
        key = parameter.name
        required = parameter.default is parameter.empty
        if not required and not isinstance(parameter.default, (bool, int, float, str, type(None))):
            continue  # a default that is a framework's object (jnp.float32, an initializer) is the module's own
        if key in COMPUTE_DTYPE_NAMES:
            continue  # parity builds in float32 (a --dtype run casts after): the config's dtype is not the module's
        if key in load_aliases().config_names:  # Cfg(config, hidden_dim): the config beside plain values
            raw[key], values[key] = "config", config
            notes.append(f"target constructor: {key}=the checkpoint's {type(config).__name__}")
            continue
        answer = spelled(key, mapping, config)
        if answer is None and required and admits_none(parameter):
            answer = ("None", NONE, f"nothing in the checkpoint's {type(config).__name__} states it")
        if answer is None and required:
            instance = default_instance(factory, key)
            if instance is None:
                return None
            values[key] = instance
            notes.append(f"target constructor: {key}={type(instance).__qualname__}() (its defaults: nothing in the "
                         f"checkpoint's {type(config).__name__} states it)")
            continue
        if answer is None:
            continue
        raw[key] = answer[1]
        values[key] = ConfigValue(config, mapping.path)(answer[1], f"target.args.{key}")
        notes.append(f"target constructor: {key}={values[key]!r} ({answer[2]})")
    return (raw, values, notes) if raw else None


def default_instance(factory: Any, parameter: str) -> Any | None:
    """An instance of the project's own class ``factory``'s ``parameter`` is annotated with, built with its
    defaults when its constructor needs no argument; None otherwise (or when building it fails)."""
    cls = config_class(factory, parameter)
    if cls is None:
        return None
    try:
        if any(p.default is p.empty and p.kind in NAMED for p in inspect.signature(cls).parameters.values()):
            return None
        return cls()
    except Exception:  # noqa: BLE001 - a class that cannot be built with its defaults is no default
        return None


# Parameters parity binds by name; a positional-only one (``def __init__(self, dim, hidden_dim, /)``) is bound by its
# name too and passed positionally (``call_constructor``), as a printed factory passes it (``spell_call``).
NAMED = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def split_call(signature: inspect.Signature, kwargs: dict) -> tuple[list, dict]:
    """Arguments by parameter name -> (the positional-only ones, in order, up to the first not given; the rest by
    keyword): how a call passes them."""
    positional = [p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.POSITIONAL_ONLY]
    given = []
    for key in positional:
        if key not in kwargs:
            break
        given.append(key)
    return [kwargs[key] for key in given], {k: v for k, v in kwargs.items() if k not in given}


def call_constructor(factory: Any, kwargs: dict) -> Any:
    """``factory`` called with arguments chosen by parameter name, positional-only ones passed positionally."""
    signature = signature_or_none(factory)
    args, rest = split_call(signature, kwargs) if signature is not None else ([], kwargs)
    return factory(*args, **rest)


def signature_or_none(factory: Any) -> inspect.Signature | None:
    """``constructor_signature``, or None where the factory has none to read (a builtin, None itself)."""
    try:
        return constructor_signature(factory) if factory is not None else None
    except (TypeError, ValueError):
        return None


def spell_call(target: str, signature: inspect.Signature | None, spelled_args: dict[str, str]) -> str:
    """``Name(arg, key=value)``: a call, as a printed factory writes it, of arguments already spelled as Python,
    positional-only ones positionally (in their order), every other one by keyword."""
    if signature is None:
        return f"{target}({', '.join(f'{k}={v}' for k, v in spelled_args.items())})"
    args, rest = split_call(signature, spelled_args)
    return f"{target}({', '.join([*args, *(f'{k}={v}' for k, v in rest.items())])})"


def kwargs_read(factory: Any) -> list[str] | None:
    """The names a constructor that takes ``**kwargs`` reads from it (``kwargs.get("dim", 96)``,
    ``kwargs["hidden_dim"]``, ``kwargs.pop(...)``, ``"bias" in kwargs``), from its source; [] where it has no
    ``**kwargs``; None where what it reads cannot be known: its source cannot be read, or it hands ``**kwargs`` on
    (``super().__init__(**kwargs)``)."""
    import ast
    import textwrap

    function = factory.__init__ if inspect.isclass(factory) else factory
    try:
        var = next((p.name for p in inspect.signature(function).parameters.values()
                    if p.kind is inspect.Parameter.VAR_KEYWORD), None)
        tree = ast.parse(textwrap.dedent(inspect.getsource(function))) if var else None
    except (OSError, TypeError, ValueError, SyntaxError):
        return None
    found: list[str] = []

    def is_var(node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id == var

    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.keyword) and node.arg is None and is_var(node.value):
            return None  # handed on: what the callee reads is not in this source
        key = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_var(node.func.value) \
                and node.func.attr in ("get", "pop", "setdefault") and node.args:
            key = node.args[0]
        elif isinstance(node, ast.Subscript) and is_var(node.value):
            key = node.slice
        elif isinstance(node, ast.Compare) and len(node.comparators) == 1 and is_var(node.comparators[0]):
            key = node.left
        if isinstance(key, ast.Constant) and isinstance(key.value, str) and key.value not in found:
            found.append(key.value)
    return found


def constructor_args(factory: Any, mapping: Mapping, config: Any, framework: Framework | None = None, *,
                     layer: int | None = None) -> tuple[dict, dict, list[str]]:
    """The constructor's arguments, as a mapping spells them and evaluated: the checkpoint's transformers config
    for a parameter named `config` (aliases.toml [constructor]) whenever the signature has one, whatever else it
    accepts; else the mapping's [target].args when the constructor takes them (or its signature cannot be
    read); else the config for a factory's one required parameter (``lambda c: MLP(c.n_embd)``); else none,
    when every parameter has a default; else the mapping's args, and the constructor's error says what to
    change.  ``framework``: the target's, when not PyTorch; its constructors' own arguments (Flax NNX's rngs)
    are added to what is chosen, and so is ``layer`` for a parameter that asks which layer it is
    (``Gemma3nTextMLP(config, layer_idx)``, whose width and sparsity are the layer's)."""
    try:
        signature = constructor_signature(factory)
    except (TypeError, ValueError):
        signature = None
    extras = framework.constructor_extras(dict(signature.parameters)) if framework and signature else {}
    at_layer = {p.name: layer for p in signature.parameters.values() if p.kind in NAMED
                and p.name in load_aliases().layer_names} if signature is not None and layer is not None else {}
    extras = {**extras, **at_layer}
    chosen = _constructor_args(factory, signature, extras, mapping, config, framework)
    notes = [*chosen[2], *(f"target constructor: {key} = the index of the layer checked" for key in at_layer)]
    return chosen[0], {**extras, **chosen[1]}, notes


def _constructor_args(factory: Any, signature: inspect.Signature | None, extras: dict, mapping: Mapping,
                      config: Any, framework: Framework | None = None) -> tuple[dict, dict, list[str]]:
    """constructor_args' choice, with ``extras`` bound beside each candidate."""
    raw = mapping.target_args

    def binds(kwargs: dict) -> bool:
        return _binds(signature, {**extras, **kwargs})

    if signature is not None:
        names = load_aliases().config_names
        named = [p for p in signature.parameters.values() if p.kind in NAMED and p.name not in extras]
        taker = next((p.name for p in named if p.name in names), None)
        if taker is not None and binds({taker: config}):
            widths = unit_widths(named, mapping, config)  # MLP(config, intermediate_size=None) for an expert
            if widths and binds({taker: config, **widths}):
                return ({taker: "config", **widths}, {taker: config, **widths},
                        [f"target constructor: {key}={width} (this unit's d_ff in transformers' module)"
                         for key, width in widths.items()])
            return {taker: "config"}, {taker: config}, []
        if not (raw and binds(raw)):
            required = [p.name for p in named if p.default is inspect.Parameter.empty]
            if len(required) == 1 and binds({required[0]: config}) and not inspect.isclass(factory):
                return {required[0]: "config"}, {required[0]: config}, []
            projections = projection_modules(required, mapping, config,
                                             [p.name for p in named if p.default is None], framework)
            if projections is not None and binds(projections):
                return {}, projections, []  # a mapping without args repeats this: the modules are built again
            by_name = bind_by_name(factory, named, mapping, config)
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


def projection_modules(required: list[str], mapping: Mapping, config: Any, optional: list[str] = (),
                       framework: Framework | None = None) -> dict[str, Any] | None:
    """For a builder that takes its projections as modules (``FeedForward(gate_proj=..., down_proj=...,
    up_proj=None)``, torchtune's style): an nn.Linear per required parameter whose name plays a projection role
    (aliases.toml), and per ``optional`` one (a default of None) of the same kind (torchtune's up_proj beside a
    gate_proj), sized from the checkpoint's config (d, d_ff) and with biases as its FFN has them; a framework's own
    projection where it has one (a NumPy class taking arrays: llama3.np's ``FeedForward(up_weight, ...)``).  None
    when a required parameter is no projection name, or the sizes are unknown."""
    aliases = load_aliases()
    width, hidden = checkpoint_ffn_width(config, mapping), getattr(config, "hidden_size", None)
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
        size = (hidden, width[0]) if sides == {"in"} else (width[0], hidden)
        own = framework.projection(*size, bias) if framework is not None else None
        built[key] = own if own is not None else nn.Linear(*size, bias=bias)
    return built


def _binds(signature: inspect.Signature, kwargs: dict) -> bool:
    args, rest = split_call(signature, kwargs)
    try:
        signature.bind(*args, **rest)
    except TypeError:
        return False
    return True
