"""Site files: the settings that belong to where a run happens rather than to the experiment.

`openprime run RECIPE --network site.toml` reads a TOML file (Python's tomllib, the standard library's
copy of tomli) with two tables:

    [transport]                 # kind and every StreamTransportConfig field
    kind = "tcp"
    hostname = "203.0.113.7"   # where the other machines reach this one
    listen_host = "0.0.0.0"     # behind NAT: the public hostname is on no interface here
    num_connections = 8
    [transport.shaping]         # simulate a WAN on one machine
    rate_bps = 1e9
    latency_s = 0.04
    [transport.auth]
    run_id = "intellect-1"
    secret_file = "~/.openprime/secret"

    [timeouts]                  # every deadline of the run
    connect_s = 120

Each value becomes a `--set` override (`transport.options.hostname=...`), so it is validated exactly
like one, and the resolved config records it.
"""

from __future__ import annotations

import pathlib
import tomllib
from typing import Any

from openprime.core.errors import ConfigError

SITE_TABLES = ("transport", "timeouts")


def _flatten(table: dict[str, Any], prefix: str) -> list[tuple[str, Any]]:
    items = []
    for key, value in table.items():
        if isinstance(value, dict):
            items.extend(_flatten(value, f"{prefix}{key}."))
        else:
            items.append((f"{prefix}{key}", value))
    return items


def _as_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def _toml_kind(value: Any) -> str:
    if isinstance(value, list):
        return "an array" + (" of tables ([[...]])" if value and all(isinstance(v, dict) for v in value) else "")
    return f"the value {value!r}"


def site_overrides(path: str | pathlib.Path) -> list[str]:
    """The `key=value` overrides a site file stands for, in file order."""
    path = pathlib.Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"site file not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"site file {path} is not valid TOML: {e}") from None
    unknown = sorted(set(data) - set(SITE_TABLES))
    if unknown:
        raise ConfigError(f"site file {path}: unknown table(s) {unknown}; a site file holds only "
                          f"{list(SITE_TABLES)} (experiment settings belong in the recipe)")
    for table in SITE_TABLES:
        # `transport = "tcp"` or `[[timeouts]]` (an array of tables) is no table of settings: _flatten ended the
        # command in an AttributeError traceback instead of saying so (found 2026-12-08 by review).
        if not isinstance(data.get(table, {}), dict):
            example = "[transport]\nkind = \"tcp\"" if table == "transport" else "[timeouts]\nconnect_s = 120"
            raise ConfigError(f"site file {path}: {table!r} must be a table of settings, got "
                              f"{_toml_kind(data[table])}; write it as\n{example}")
    overrides = []
    for key, value in _flatten(data.get("transport", {}), ""):
        overrides.append(f"transport.{key if key == 'kind' else 'options.' + key}={_as_text(value)}")
    for key, value in _flatten(data.get("timeouts", {}), "timeouts."):
        overrides.append(f"{key}={_as_text(value)}")
    return overrides
