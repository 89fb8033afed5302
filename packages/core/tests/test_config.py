"""Config conventions: validation names the field, overrides parse types, unknown keys list valid ones."""

import enum

import pytest

from openprime.core.config import (
    config,
    config_keys,
    field,
    field_doc,
    non_negative_float,
    one_of_enum,
    override,
    override_all,
    positive_float,
    positive_int,
    to_dict,
    unit_interval,
)
from openprime.core.errors import ConfigError


class Mode(enum.Enum):
    FAST = "fast"
    SAFE = "safe"


@config
class Inner:
    num_steps: int = field(3, doc="how many steps", validator=positive_int())
    lr: float = field(0.1, doc="learning rate", validator=positive_float())
    momentum: float = field(0.9, doc="momentum", validator=unit_interval())
    mode: Mode = field(Mode.FAST, doc="the mode", validator=one_of_enum(Mode))
    note: str | None = field(None, doc="optional note")
    betas: tuple[float, ...] = field((0.9, 0.95), doc="betas")


@config
class Outer:
    inner: Inner = field(factory=Inner, doc="the inner part")
    name: str = field("run", doc="name")


def test_defaults_and_docs():
    cfg = Outer()
    assert cfg.inner.num_steps == 3
    assert field_doc(Inner, "lr") == "learning rate"
    assert config_keys(cfg) == ["inner.num_steps", "inner.lr", "inner.momentum", "inner.mode", "inner.note",
                                "inner.betas", "name"]


def test_frozen_and_keyword_only():
    with pytest.raises(TypeError):
        Inner(5)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        Inner().lr = 1.0  # type: ignore[misc]


def test_validators_name_class_and_field():
    with pytest.raises(ConfigError, match=r"Inner.num_steps must be >= 1, got 0"):
        Inner(num_steps=0)
    with pytest.raises(ConfigError, match=r"Inner.lr must be > 0"):
        Inner(lr=-0.5)
    with pytest.raises(ConfigError, match=r"Inner.num_steps must be int"):
        Inner(num_steps=2.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"Inner.num_steps must be int"):
        Inner(num_steps=True)


def test_nan_is_refused_by_every_bound():
    """`--set optim.weight_decay=nan` passed `value < 0` (False for NaN) and every node died in torch at its start
    (review of 2026-12-07); each bound is now written so that NaN fails it."""

    @config
    class Decay:
        weight_decay: float = field(0.0, doc="weight decay", validator=non_negative_float())

    nan = float("nan")
    with pytest.raises(ConfigError, match=r"Decay.weight_decay must be >= 0, got nan"):
        Decay(weight_decay=nan)
    with pytest.raises(ConfigError, match=r"Inner.lr must be > 0, got nan"):
        Inner(lr=nan)
    with pytest.raises(ConfigError, match=r"Inner.momentum must be in \[0.0, 1.0\], got nan"):
        Inner(momentum=nan)
    with pytest.raises(ConfigError, match=r"Inner.lr must be > 0, got nan"):
        override(Outer(), "inner.lr", "nan")


def test_override_parses_each_type():
    cfg = Outer()
    assert override(cfg, "inner.num_steps", "7").inner.num_steps == 7
    assert override(cfg, "inner.lr", "3e-4").inner.lr == 3e-4
    assert override(cfg, "inner.mode", "safe").inner.mode is Mode.SAFE
    assert override(cfg, "inner.note", "hello").inner.note == "hello"
    assert override(cfg, "inner.note", "none").inner.note is None
    assert override(cfg, "inner.betas", "0.8,0.99").inner.betas == (0.8, 0.99)
    assert override(cfg, "name", "x").name == "x"
    assert cfg.inner.num_steps == 3  # the original is untouched


def test_override_errors_name_the_key():
    cfg = Outer()
    with pytest.raises(ConfigError, match=r"inner.num_steps=0: Inner.num_steps must be >= 1"):
        override(cfg, "inner.num_steps", "0")
    with pytest.raises(ConfigError, match=r"inner.num_steps: expected int, got 'many'"):
        override(cfg, "inner.num_steps", "many")
    with pytest.raises(ConfigError, match=r"'fastest' is not one of: fast, safe"):
        override(cfg, "inner.mode", "fastest")
    with pytest.raises(ConfigError) as e:
        override(cfg, "inner.nope", "1")
    assert "unknown config key 'inner.nope'" in str(e.value) and "inner.lr" in str(e.value)
    with pytest.raises(ConfigError, match="unknown config key 'inner'"):
        override(cfg, "inner", "1")


def test_to_dict_is_json_ready():
    import json

    d = to_dict(Outer())
    assert d["inner"]["mode"] == "fast"
    assert json.loads(json.dumps(d)) == d | {"inner": d["inner"] | {"betas": [0.9, 0.95]}}


@config
class Steps:
    every: int = field(20, doc="inner steps per outer step", validator=positive_int())
    save_every: int = field(20, doc="steps between saves", validator=positive_int())

    def __attrs_post_init__(self) -> None:
        if self.save_every % self.every:
            raise ConfigError(f"save_every {self.save_every} is not a multiple of every {self.every}")


@config
class Run:
    steps: Steps = field(factory=Steps, doc="steps")
    name: str = field("run", doc="name")


def test_overrides_that_are_valid_only_together_are_applied_together():
    # 20/20 -> 30/30: each alone breaks the rule (30 % 20, 20 % 30), in either order. Before: always refused.
    for items in ([("steps.every", "30"), ("steps.save_every", "30")],
                  [("steps.save_every", "30"), ("steps.every", "30")]):
        cfg = override_all(Run(), items)
        assert (cfg.steps.every, cfg.steps.save_every) == (30, 30)
    # One valid on its own after another: applied in turn (20/20 -> 10/30 needs `every` first).
    assert override_all(Run(), [("steps.save_every", "30"), ("steps.every", "10")]).steps.save_every == 30
    # The last of a repeated key wins; a rule still broken at the end names the first override that broke it.
    assert override_all(Run(), [("name", "a"), ("name", "b")]).name == "b"
    with pytest.raises(ConfigError, match=r"steps.save_every=50: save_every 50 is not a multiple of every 20"):
        override_all(Run(), [("steps.save_every", "50"), ("name", "x")])
    with pytest.raises(ConfigError, match=r"unknown config key 'steps.evry' \(did you mean 'steps.every'"):
        override_all(Run(), [("steps.save_every", "30"), ("steps.evry", "30")])


def test_a_stream_transport_s_chunks_hold_whole_numbers():
    """ZeroMQ adds the chunks of an fp32 message into the receiver's accumulator as they come: with chunk_bytes not a
    multiple of 4 every uncompressed all-reduce over it failed ("not aligned to 4 bytes"), at run time, on every
    try (review of 2026-12-07). It is refused at config time, with the nearest sizes that work."""
    from openprime.core.streams import StreamTransportConfig

    with pytest.raises(ConfigError, match=r"StreamTransportConfig.chunk_bytes must be a multiple of 8, got 1000001: "
                                          r"use 1000000 or 1000008"):
        StreamTransportConfig(chunk_bytes=1_000_001)
    with pytest.raises(ConfigError, match="must be a multiple of 8, got 3: use 8$"):
        StreamTransportConfig(chunk_bytes=3)
    assert StreamTransportConfig(chunk_bytes=1_000_000).chunk_bytes == 1_000_000
