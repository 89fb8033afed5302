"""Recipes: Python files that define a run. A recipe defines `config() -> RunConfig`.

A variant loads its base with `load_recipe(path)` and `attrs.evolve`s the result, so every number is
written once. Every recipe file loaded while building a run is remembered, so that the run directory
gets a copy of each source next to the resolved config.
"""

from __future__ import annotations

import importlib.util
import pathlib
import types

from openprime.core.config import override_all, split_overrides
from openprime.core.errors import ConfigError
from openprime.train.config import RunConfig

_loaded: list[pathlib.Path] = []


def load_recipe(path: str | pathlib.Path) -> types.ModuleType:
    """Import the recipe file at `path` as a module (not added to sys.modules)."""
    path = pathlib.Path(path).resolve()
    if not path.is_file():
        raise ConfigError(f"recipe not found: {path} (give the path of a .py file, e.g. recipes/debug.py)")
    spec = importlib.util.spec_from_file_location(f"openprime_recipe_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"cannot import recipe {path}: not a Python file?")
    module = importlib.util.module_from_spec(spec)
    if path not in _loaded:
        _loaded.append(path)
    spec.loader.exec_module(module)
    return module


def recipe_config(path: str | pathlib.Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """The RunConfig defined by the recipe at `path`, with `key=value` overrides applied and validated."""
    module = load_recipe(path)
    build = getattr(module, "config", None)
    if not callable(build):
        raise ConfigError(f"recipe {path} defines no run config: add `def config() -> RunConfig:` to it")
    cfg = build()
    if not isinstance(cfg, RunConfig):
        raise ConfigError(f"recipe {path}: config() returned {type(cfg).__name__}, not a RunConfig")
    return override_all(cfg, split_overrides(overrides))


def loaded_recipe_files() -> list[pathlib.Path]:
    """Every recipe file loaded in this process, in load order."""
    return list(_loaded)


