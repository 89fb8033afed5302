"""Recipes: Python files that define a run. A recipe defines `config() -> RunConfig`.

A variant loads its base with `load_recipe(path)` and `attrs.evolve`s the result, so every number is
written once. Every recipe file loaded while building a run is remembered, so that the run directory
gets a copy of each source next to the resolved config.
"""

from __future__ import annotations

import importlib.util
import pathlib
import traceback
import types
from collections.abc import Callable
from typing import TypeVar

from openprime.core.config import override_all, split_overrides
from openprime.core.errors import ConfigError
from openprime.train.config import RunConfig

_loaded: list[pathlib.Path] = []
T = TypeVar("T")


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
    module = _recipe_code(path, lambda: load_recipe(path))
    build = getattr(module, "config", None)
    if not callable(build):
        raise ConfigError(f"recipe {path} defines no run config: add `def config() -> RunConfig:` to it")
    cfg = _recipe_code(path, build)
    if not isinstance(cfg, RunConfig):
        raise ConfigError(f"recipe {path}: config() returned {type(cfg).__name__}, not a RunConfig")
    return override_all(cfg, split_overrides(overrides))


def _recipe_code(path: str | pathlib.Path, run: Callable[[], T]) -> T:
    """Run a recipe's own code (its import, its config()); an error in it is a ConfigError whose message is the
    traceback from the recipe's first frame on (a SyntaxError: its line and caret), without the frames of the
    `openprime` command that called it."""
    try:
        return run()
    except ConfigError as e:
        # A value the recipe set that its config class refuses (`TrainConfig(num_steps=0)`): the message names the
        # field and its rule, but said nothing of the recipe, nor of which of its lines set it (found 2026-12-08 by
        # review). The innermost line of a recipe comes with it; an error of the openprime command's own stays bare.
        recipes = {str(p) for p in _loaded}
        lines = [frame for frame in traceback.extract_tb(e.__traceback__) if frame.filename in recipes]
        if not lines:
            raise
        where = "".join(traceback.format_list(lines[-1:])).rstrip()
        raise ConfigError(f"recipe {path}: {e}\n{where}") from e
    except SystemExit as e:  # not an Exception: a recipe that exits (a script's argparse, sys.exit) ended the
        # command silently with its code, or with argparse's usage of the recipe (found 2026-12-07 by review)
        raise ConfigError(f"recipe {path} exited (sys.exit({e.code!r})) instead of giving its config: a recipe "
                          f"only defines config(); put script code under `if __name__ == \"__main__\":`") from None
    except Exception as e:
        error = traceback.TracebackException.from_exception(e)
        recipes = {str(p) for p in _loaded}
        first = next((i for i, frame in enumerate(error.stack) if frame.filename in recipes), len(error.stack))
        error.stack = traceback.StackSummary.from_list(error.stack[first:])
        raise ConfigError(f"recipe {path} failed:\n{''.join(error.format()).rstrip()}") from e


def loaded_recipe_files() -> list[pathlib.Path]:
    """Every recipe file loaded in this process, in load order."""
    return list(_loaded)


