"""The run's terms at the coordinator: what every node of a run agrees to, and the data slots they state.

A node joins with its terms (openprime.train.terms: the recipe's fields that must be equal on every node, among
them `SLOTS_TERM`, the number of data slots its data is cut into). The first node to join a coordinator with no
node sets the run's terms; a node whose terms differ is refused with the first field that differs. These are
the coordinator's pure rules on them; what it keeps (the run's terms, who set them) stays in coordinator.py.
"""

from __future__ import annotations

import json
from typing import Any

from openprime.mesh.protocol import SLOTS_TERM


def stated_slots(terms: Any) -> int | None:
    """The number of data slots that terms state (`SLOTS_TERM`), or None when they state none readable."""
    stated = terms.get(SLOTS_TERM) if isinstance(terms, dict) else None
    try:
        return int(json.loads(stated)) if stated else None
    except (TypeError, ValueError):
        return None


def num_slots(terms: Any, max_nodes: int) -> int:
    """The data slots nodes may take: the coordinator's max_nodes, or the number the run's nodes cut their data
    into when that is fewer (a `mesh serve` left at its default of 64 under a recipe of 8). Before, such a
    coordinator granted slot 8 to a ninth node, whose data loader then failed on a slot outside its 8."""
    stated = stated_slots(terms)
    return min(max_nodes, stated) if stated else max_nodes


def full(num_slots: int, max_nodes: int) -> str:
    """Why a join is refused when every slot is taken, with the fix."""
    if num_slots < max_nodes:
        return (f"the run is full: every one of the {num_slots} data slots its nodes cut the data into "
                f"({SLOTS_TERM}={num_slots} in their recipe) is taken; to train on more nodes, resume the run with "
                f"a higher {SLOTS_TERM} and --set data.on_layout_change=restart")
    return (f"the run is full: this coordinator's max_nodes={max_nodes} slots are taken; restart it "
            f"with --set max_nodes=N for more")


def too_few_slots(terms: Any, max_nodes: int) -> str | None:
    """Why a coordinator of `max_nodes` cannot serve these terms: their data is cut into more slots than it grants,
    so some slots' data would never be read (None: it can)."""
    wanted = stated_slots(terms)
    if wanted is None or wanted <= max_nodes:
        return None
    return (f"the node cuts its data into {SLOTS_TERM}={wanted} slots but this coordinator grants at most "
            f"{max_nodes} (its max_nodes): the data of slots {max_nodes}-{wanted - 1} would never be read; start the "
            f"coordinator with --set max_nodes={wanted}, or give the run --set {SLOTS_TERM}={max_nodes}")


def disagreement(run_terms: dict[str, str], run_node: str, node: str, terms: dict[str, str]) -> str | None:
    """Why `node` may not join a run of `run_terms` (set when `run_node` joined) with its `terms` (None: it may)."""
    differing = sorted(k for k in run_terms.keys() | terms.keys() if run_terms.get(k) != terms.get(k))
    if not differing:
        return None
    key = differing[0]
    more = f" (and {len(differing) - 1} more: {', '.join(differing[1:4])}{', ...' if len(differing) > 4 else ''})"
    return (f"node {node} does not agree with the run on {key}: {terms.get(key, 'nothing')} there, "
            f"{run_terms.get(key, 'nothing')} in the run (as node {run_node} joined it)"
            f"{more if len(differing) > 1 else ''}; every node of a run must train the same recipe on the same data")
