"""A read-only view of the checkpoint's transformers config, for targets written against their own config class.

Why it exists: a module whose constructor takes a config reads that config's fields under its own names.
nanoGPT's ``MLP(config)`` reads ``config.n_embd``, ``config.bias`` and ``config.dropout``; transformers'
``GPT2Config`` has ``n_embd`` but neither ``bias`` nor ``dropout``, so building the module verbatim from the
checkpoint's config raises AttributeError, and every such user had to write a factory.  When that happens,
``parity.engine.check.build.build_target`` builds the target once more with this view instead of the config:

- a field the config has is the config's own (attribute_map included: ``GPT2Config.hidden_size`` is
  ``n_embd``); the view never overrides the checkpoint's config;
- a field it lacks is answered from ``[config_fields]`` in ``mappings/aliases.toml`` (data, not code): an
  alias of one of the config's own fields (``dim`` -> ``hidden_size``), a fact about the checkpoint's FFN
  (``bias``: whether the layer has bias tensors) or a switch with one right value in a check
  (``dropout = 0.0``: parity runs the module in eval mode);
- a field in neither raises AttributeError naming it, as the config itself would.

Every field the view answered is recorded (``supplied``) and becomes a note in the report: a value parity
chose for the user's module is never silent.  The view is read-only: it answers, it never changes the
config a module was given.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the caller passes the table in: this module imports nothing of parity (a leaf)
    from parity.definitions.aliases import ConfigFields


@dataclass(frozen=True)
class Supplied:
    """One field the view answered: its name, the value and why that value."""

    field: str
    value: Any
    why: str


# PretrainedConfig's own methods that change it: through the view they would change the checkpoint's config
_WRITERS = frozenset({"update", "update_from_string", "register_for_auto_class"})


class ConfigView:
    """The config's own fields, plus ``answers`` (name -> (value, why)) for the names it lacks.

    Read-only for real: no instance ``__dict__`` (``__slots__``), the answers behind a ``MappingProxyType``,
    ``__setattr__`` / ``__delattr__`` refused, and neither dunder names (``view.__dict__`` would be the config's
    own, writable dict) nor the config's writer methods are handed through to the config."""

    __slots__ = ("_parity_config", "_parity_answers", "_parity_supplied", "_parity_table", "_parity_overrides")

    def __init__(self, config: Any, answers: dict[str, tuple[Any, str]], table: str = "aliases.toml [config_fields]",
                 overrides: dict[str, tuple[Any, str]] | None = None):
        object.__setattr__(self, "_parity_config", config)
        object.__setattr__(self, "_parity_answers", MappingProxyType(dict(answers)))
        object.__setattr__(self, "_parity_overrides", MappingProxyType(dict(overrides or {})))
        object.__setattr__(self, "_parity_supplied", {})
        object.__setattr__(self, "_parity_table", table)

    def __getattr__(self, name: str) -> Any:  # only for names the view itself does not have
        return self._parity_lookup(name)

    def _parity_lookup(self, name: str) -> Any:
        """The config's own field, else the table's answer, else AttributeError naming both."""
        config = object.__getattribute__(self, "_parity_config")
        overrides = object.__getattribute__(self, "_parity_overrides")
        if name in overrides:  # what the module must be built with whatever the config says (its dtype)
            value, why = overrides[name]
            object.__getattribute__(self, "_parity_supplied")[name] = Supplied(name, value, why)
            return value
        if name.startswith("__") and name.endswith("__"):  # __dict__, __setstate__, ...: the view's own, or none
            raise AttributeError(f"parity's read-only view of {type(config).__name__} has no attribute '{name}'",
                                 name=name, obj=self)
        if name in _WRITERS and hasattr(config, name):
            raise AttributeError(f"parity's view of the checkpoint's {type(config).__name__} is read-only: "
                                 f"'{name}' would change it", name=name, obj=self)
        try:
            return getattr(config, name)
        except AttributeError:
            pass
        answers = object.__getattribute__(self, "_parity_answers")
        if name.startswith("__") or name not in answers:
            table = object.__getattribute__(self, "_parity_table")
            raise AttributeError(f"'{type(config).__name__}' object has no attribute '{name}', and {table} does not "
                                 "supply it", name=name, obj=self)
        value, why = answers[name]
        object.__getattribute__(self, "_parity_supplied")[name] = Supplied(name, value, why)
        return value

    # -- a dict config too: cfg["emb_dim"], cfg.get("drop_rate", 0.0), "qkv_bias" in cfg, iteration ---------------
    def __getitem__(self, key: str) -> Any:
        if not isinstance(key, str):
            raise KeyError(key)
        try:
            return self._parity_lookup(key)
        except AttributeError as exc:
            raise KeyError(str(exc)) from None

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get(key, _ABSENT) is not _ABSENT

    def keys(self) -> list[str]:
        config = object.__getattribute__(self, "_parity_config")
        own = list(config.to_dict()) if hasattr(config, "to_dict") else list(vars(config))
        extra = [*object.__getattribute__(self, "_parity_answers"), *object.__getattribute__(self, "_parity_overrides")]
        return list(dict.fromkeys([*own, *extra]))

    def __iter__(self):
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def items(self) -> list[tuple[str, Any]]:
        return [(key, self.get(key)) for key in self.keys()]

    def values(self) -> list[Any]:
        return [self.get(key) for key in self.keys()]

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"parity's view of the checkpoint's {self.config_name} is read-only: cannot set '{name}'")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"parity's view of the checkpoint's {self.config_name} is read-only: cannot delete "
                             f"'{name}'")

    def __copy__(self) -> ConfigView:
        """Nothing in the view can change, so a copy is the view itself (a module that keeps its config and is
        deep-copied keeps one view, and what it supplied stays reported)."""
        return self

    def __deepcopy__(self, memo: dict) -> ConfigView:
        return self

    def __repr__(self) -> str:
        return f"<parity's read-only view of {self.config_name}>"

    @property
    def config_name(self) -> str:
        return type(object.__getattribute__(self, "_parity_config")).__name__

    @property
    def supplied(self) -> list[Supplied]:
        """The fields answered from the table, in the order first read."""
        return list(object.__getattribute__(self, "_parity_supplied").values())

    def notes(self) -> list[str]:
        """One report note per supplied field."""
        return [f"target config: `{s.field}` not in {self.config_name}, supplied {s.value!r} ({s.why})"
                for s in self.supplied]


_ABSENT = object()
# What a module is built in, whatever the checkpoint's config says: parity builds the target in float32 (a --dtype
# run casts it after), and code that calls .to(cfg["dtype"]) or nn.Linear(..., dtype=cfg["dtype"]) gets a torch.dtype.
COMPUTE_DTYPE_NAMES = ("dtype", "torch_dtype")


def config_view(config: Any, fields: ConfigFields, facts: dict[str, tuple[Any, str] | None],
                float32: Any = None) -> ConfigView:
    """The view of ``config`` answering the names of ``fields`` (aliases.toml [config_fields]) the config lacks;
    ``float32``: the target framework's float32 (``mx.float32``, ``jnp.float32``; default torch's);
    ``facts``: fact name -> (value, why parity says so) or None when unknown (``parity.engine.check.build``:
    ``ffn_bias``, whether the checkpoint's FFN has bias tensors; ``ffn_width``, its d_ff)."""
    answers: dict[str, tuple[Any, str]] = {}
    for name, own in fields.aliases.items():
        value = getattr(config, own, None)
        if value is not None:
            answers[name] = (value, f"{type(config).__name__}.{own}; alias in aliases.toml [config_fields]")
    answers.update({name: facts[fact] for name, fact in fields.facts.items() if facts.get(fact) is not None})
    answers.update(fields.values)
    if float32 is None:
        import torch  # only here: the view itself is plain Python

        float32 = torch.float32
    why = "parity builds the module in float32; a --dtype run casts it after"
    return ConfigView(config, answers, overrides={name: (float32, why) for name in COMPUTE_DTYPE_NAMES})
