"""Config conventions shared by every openprime component.

Each component owns one attrs class built with `@config`: frozen, keyword-only and validated, each
field declared with `field(default, doc=...)` so that its one-line docstring is available to error
messages and to `openprime run --set`. Validators raise `ConfigError` naming the class and field.
Cross-field rules live in `__attrs_post_init__` and also raise `ConfigError` with the fix.

`override` applies a `dotted.key=value` string to a config tree (the `--set` of the command line),
and `to_dict` gives the plain dict that every run writes next to its metrics.
"""

from __future__ import annotations

import difflib
import enum
import math
import pathlib
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs

from openprime.core.errors import ConfigError

T = TypeVar("T")
_DOC = "openprime.doc"


def config(cls: type[T]) -> type[T]:
    """Class decorator: a frozen, keyword-only attrs class (the house style for every config)."""
    return attrs.frozen(kw_only=True)(cls)


def field(default: Any = attrs.NOTHING, *, doc: str, validator: Callable | None = None,
          factory: Callable | None = None) -> Any:
    """An attrs field with a one-line docstring (`doc`) and an optional validator."""
    if factory is not None:
        return attrs.field(factory=factory, validator=validator, metadata={_DOC: doc})
    return attrs.field(default=default, validator=validator, metadata={_DOC: doc})


def field_doc(cls: type, name: str) -> str:
    """The one-line docstring of field `name` of config class `cls`."""
    return attrs.fields_dict(cls)[name].metadata.get(_DOC, "")


# ---------------------------------------------------------------- validators


def _where(instance: Any, attribute: attrs.Attribute) -> str:
    return f"{type(instance).__name__}.{attribute.name}"


def at_least(lo: float) -> Callable:
    """Validator: value >= lo."""

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not value >= lo:  # `not >=`: NaN fails it (`value < lo` let NaN through to a traceback at run time)
            raise ConfigError(f"{_where(instance, attribute)} must be >= {lo}, got {value!r}")

    return check


def greater_than(lo: float) -> Callable:
    """Validator: value > lo."""

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not value > lo:
            raise ConfigError(f"{_where(instance, attribute)} must be > {lo}, got {value!r}")

    return check


def in_range(lo: float, hi: float) -> Callable:
    """Validator: lo <= value <= hi."""

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not lo <= value <= hi:
            raise ConfigError(f"{_where(instance, attribute)} must be in [{lo}, {hi}], got {value!r}")

    return check


def instance_of(*types_: type) -> Callable:
    """Validator: isinstance(value, types_); ints are accepted where floats are expected."""
    accepted = types_ + ((int,) if float in types_ else ())

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not isinstance(value, accepted) or (isinstance(value, bool) and bool not in types_):
            names = " or ".join(t.__name__ for t in types_)
            raise ConfigError(f"{_where(instance, attribute)} must be {names}, got {value!r}")

    return check


def all_of(*validators: Callable) -> Callable:
    """Validator: every one of `validators`, in order (type checks first)."""

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        for v in validators:
            v(instance, attribute, value)

    return check


def multiple_of(step: int) -> Callable:
    """Validator: an int that is a multiple of `step` (the message names the nearest ones)."""

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value % step:
            below, above = value - value % step, value - value % step + step
            raise ConfigError(f"{_where(instance, attribute)} must be a multiple of {step}, got {value!r}: use "
                              f"{below or above}" + (f" or {above}" if below else ""))

    return check


def positive_int() -> Callable:
    """Validator: an int >= 1 (counts, sizes)."""
    return all_of(instance_of(int), at_least(1))


def non_negative_int() -> Callable:
    """Validator: an int >= 0."""
    return all_of(instance_of(int), at_least(0))


def finite() -> Callable:
    """Validator: not inf (NaN fails every bound already). `--set timeouts.connect_s=inf` passed the bounds and
    ended the launch in a traceback (OverflowError in the rendezvous store), its run directory written."""

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if math.isinf(value):
            raise ConfigError(f"{_where(instance, attribute)} must be finite, got {value!r}")

    return check


def below(hi: float) -> Callable:
    """Validator: value < hi."""

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not value < hi:
            raise ConfigError(f"{_where(instance, attribute)} must be < {hi}, got {value!r}")

    return check


def positive_float() -> Callable:
    """Validator: a finite number > 0 (rates, learning rates, timeouts)."""
    return all_of(instance_of(float), greater_than(0), finite())


def non_negative_float() -> Callable:
    """Validator: a finite number >= 0."""
    return all_of(instance_of(float), at_least(0), finite())


def unit_interval() -> Callable:
    """Validator: a number in [0, 1] (momenta, fractions)."""
    return all_of(instance_of(float), in_range(0.0, 1.0))


def half_open_unit_interval() -> Callable:
    """Validator: a number in [0, 1) (AdamW's betas: torch refuses 1)."""
    return all_of(instance_of(float), at_least(0.0), below(1.0))


def one_of_enum(enum_cls: type[enum.Enum]) -> Callable:
    """Validator: a member of `enum_cls`."""
    return instance_of(enum_cls)


# ---------------------------------------------------------------- overrides and serialisation


def config_keys(cfg: Any, prefix: str = "") -> list[str]:
    """Every dotted key of a config tree that `override` accepts, in declaration order."""
    keys = []
    for a in attrs.fields(type(cfg)):
        value = getattr(cfg, a.name)
        if attrs.has(type(value)):
            keys.extend(config_keys(value, f"{prefix}{a.name}."))
        else:
            keys.append(f"{prefix}{a.name}")
    return keys


def _parse(raw: str, tp: Any, key: str) -> Any:
    """Convert the command-line string `raw` into a value of the annotated type `tp`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = [t for t in typing.get_args(tp) if t is not type(None)]
        if raw.lower() in ("none", "null") and len(options) < len(typing.get_args(tp)):
            return None
        errors = []
        for option in options:
            try:
                return _parse(raw, option, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError("; ".join(errors))
    if origin is tuple:
        (item, *_rest) = typing.get_args(tp)
        return tuple(_parse(p.strip(), item, key) for p in raw.split(",") if p.strip())
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        for member in tp:
            if raw in (str(member.value), member.name, member.name.lower()):
                return member
        valid = ", ".join(str(m.value) for m in tp)
        raise ConfigError(f"{key}: {raw!r} is not one of: {valid}")
    if tp is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{key}: expected true or false, got {raw!r}")
    if tp in (int, float):
        try:
            return tp(raw)
        except ValueError:
            raise ConfigError(f"{key}: expected {tp.__name__}, got {raw!r}") from None
    if tp in (str, pathlib.Path):
        return tp(raw)
    # Said with the fix: "fields of type <class '...WeightedSource'> cannot be set" named a class and no way out.
    raise ConfigError(f"{key} holds {getattr(tp, '__name__', tp)} values, which --set cannot write: change it in "
                      f"the recipe")


def override(cfg: T, key: str, raw: str) -> T:
    """Return `cfg` with the field at dotted `key` set from the string `raw` (validated).

    Raises ConfigError naming the key; an unknown key lists the valid ones.
    """
    valid = config_keys(cfg)
    section = [k for k in valid if k.startswith(f"{key}.")]
    if section:  # `--set diloco=...`, `--set model=debug`: a whole section was "unknown", with no suggestion
        # (found 2026-12-07 by review); say that it is a section and list its keys
        raise ConfigError(f"unknown config key {key!r}: it is a section, not one setting; --set one of its keys, e.g. "
                          f"--set {section[0]}=VALUE; its keys are: {', '.join(section)}")
    if key not in valid:
        listing = "\n  ".join(valid)
        close = difflib.get_close_matches(key, valid, n=3, cutoff=0.6)  # first, for a typo: the list is long
        guess = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
        raise ConfigError(f"unknown config key {key!r}{guess}; valid keys are:\n  {listing}")
    return _set(cfg, key.split("."), raw, key)


def split_overrides(items: Sequence[str], example: str = "diloco.num_inner_steps=10") -> list[tuple[str, str]]:
    """`key=value` strings (`--set`) as (key, value) pairs; ConfigError for one without `=` or key."""
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set takes key=value, got {item!r} (e.g. --set {example})")
        pairs.append((key.strip(), value.strip()))
    return pairs


def override_all(cfg: T, items: Sequence[tuple[str, str]]) -> T:
    """`cfg` with every (key, raw) override applied, the last of a repeated key winning.

    Each override is validated as it is applied (its errors name it). Overrides that break a cross-field rule only
    until the others are applied too (H and the checkpoint interval changed together, where each alone is not a
    multiple of the other's old value) are then applied together, each config object evolved once with all of its
    changes, and validated as a whole; what fails that way raises the first one's error.
    """
    pending = list(dict(items).items())  # one per key, the last value, in the order of their last occurrence
    while pending:
        failed = []
        for key, raw in pending:
            try:
                cfg = override(cfg, key, raw)
            except ConfigError as e:
                failed.append((key, raw, e))
        if len(failed) == len(pending):
            valid = set(config_keys(cfg))
            if any(key not in valid for key, _, _ in failed):
                raise next(e for key, _, e in failed if key not in valid)  # a typo: its own error, with the keys
            # A value that does not parse is said as such: failed[0]'s error told of a rule broken by another value
            # alone, naming the key the user had already set (--set checkpoint.interval_steps=4O, a letter O, read
            # as "interval 20 is not a multiple of H 40 ... use 40").
            for key, raw, _ in failed:
                _parsed(cfg, key, raw)
            try:
                return _set_together(cfg, [(key, raw) for key, raw, _ in failed])
            except ConfigError:
                raise failed[0][2] from None
        pending = [(key, raw) for key, raw, _ in failed]
    return cfg


def _parsed(cfg: Any, key: str, raw: str) -> Any:
    """`raw` parsed as the type of the field `key` names (ConfigError if it does not parse)."""
    *path, name = key.split(".")
    for part in path:
        cfg = getattr(cfg, part)
    return _parse(raw, typing.get_type_hints(type(cfg))[name], key)


def _set_together(cfg: T, items: Sequence[tuple[str, str]]) -> T:
    """`cfg` with all of `items` applied at once: every config object on their paths is evolved (and validated) once."""
    changes: dict[str, Any] = {}
    for key, raw in items:
        *path, name = key.split(".")
        node = changes
        for part in path:
            node = node.setdefault(part, {})
        node[name] = (key, raw)

    def apply(obj: Any, tree: dict[str, Any]) -> Any:
        hints = typing.get_type_hints(type(obj))
        values = {name: apply(getattr(obj, name), sub) if isinstance(sub, dict) else _parse(sub[1], hints[name], sub[0])
                  for name, sub in tree.items()}
        return attrs.evolve(obj, **values)

    return apply(cfg, changes)


def _set(cfg: T, parts: list[str], raw: str, key: str) -> T:
    head, rest = parts[0], parts[1:]
    if rest:
        value = _set(getattr(cfg, head), rest, raw, key)
    else:
        value = _parse(raw, typing.get_type_hints(type(cfg))[head], key)
    try:
        return attrs.evolve(cfg, **{head: value})
    except ConfigError as e:
        raise ConfigError(f"{key}={raw}: {e}") from None


def to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-ready dict of a config tree (enums by value, paths as strings)."""

    def convert(_inst: Any, _field: Any, value: Any) -> Any:
        if isinstance(value, enum.Enum):
            return value.value
        if isinstance(value, pathlib.PurePath):
            return str(value)
        return value

    return attrs.asdict(cfg, value_serializer=convert)
