"""What every node of a run must agree on, stated when it joins: the coordinator refuses a node that differs.

Nodes of one run are started by hand on machines far apart, each from its own copy of the recipe and its own
copy of the data. A node with another model raises errors in the all-reduce; one with another learning rate,
H, compression or tokenizer trains along and quietly makes the replicas mean different things (its
pseudo-gradients are averaged with the others' all the same). So each node states these terms when it
joins (`MeshClient.join(terms=...)`) and the coordinator refuses one whose terms differ from the run's,
naming the first difference.

Terms are the fields that shape the replicas' arithmetic or the bytes on the wire: the model, the inner
optimizer and its schedule, the batch shape, the seed, DiLoCo's settings, the local-rank layout, the
transport kind, its run id and which shared secret it holds (a fingerprint, not the secret: a node with another
secret was admitted and then refused by every peer's ring connections, which failed every outer step of the
whole run), the number of data slots, and the data by content (each source's token-stream digest, which covers
the tokenizer, and its weight), not by name or path: machines keep their files in different places.
Left out, as each machine's own: micro-batch size (memory), the device of the pseudo-gradient, the number of
CPU threads, logging and evaluation, checkpoint places and intervals, timeouts, and the transport's address,
connections and shaping.
"""

from __future__ import annotations

import json
from typing import Any

from openprime.core.config import to_dict
from openprime.mesh.protocol import SLOTS_TERM
from openprime.train.config import RunConfig
from openprime.train.data import PreparedData

TRAIN_TERMS = ("num_steps", "seq_len", "batch_size", "seed", "strategy", "z_loss_weight")
OWN_DILOCO_FIELDS = ("pseudo_gradient_device",)


def _flat(prefix: str, tree: dict[str, Any], out: dict[str, str]) -> None:
    for key, value in tree.items():
        if isinstance(value, dict):
            _flat(f"{prefix}{key}.", value, out)
        else:
            out[f"{prefix}{key}"] = _term(value)


def _term(value: Any) -> str:
    """A term's JSON, a whole float as an int: a recipe that wrote `max_grad_norm=1` held the same config as one
    with 1.0 (they compare equal), and its nodes were refused as disagreeing ("1 there, 1.0 in the run")."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return json.dumps(value, sort_keys=True)


def run_terms(cfg: RunConfig, prepared: PreparedData) -> dict[str, str]:
    """The run's terms as name -> JSON value; `prepared` is this machine's data for `cfg.data`."""
    tree = to_dict(cfg)
    terms: dict[str, str] = {}
    for section in ("model", "optim", "schedule"):
        _flat(f"{section}.", tree[section], terms)
    _flat("diloco.", {k: v for k, v in tree["diloco"].items() if k not in OWN_DILOCO_FIELDS}, terms)
    _flat("train.", {k: tree["train"][k] for k in TRAIN_TERMS}, terms)
    terms["fsdp.num_local_ranks"] = json.dumps(cfg.fsdp.num_local_ranks)
    terms["transport.kind"] = json.dumps(cfg.transport.kind.value)
    auth = cfg.transport.options.auth
    terms["transport.auth.run_id"] = json.dumps(auth.run_id)
    terms["transport.auth.secret_fingerprint"] = json.dumps(auth.fingerprint())
    terms[SLOTS_TERM] = json.dumps(cfg.mesh.max_nodes)  # the number of data slots the data is cut into
    terms["data.seed"] = json.dumps(cfg.data.seed)
    terms["data.val_fraction"] = json.dumps(cfg.data.val_fraction)
    # The weights are relative (DataConfig): 0.5 and 0.5 are 1 and 1.
    total = sum(entry.weight for entry in cfg.data.mixture)
    for i, (entry, source) in enumerate(zip(cfg.data.mixture, prepared.sources, strict=True)):
        terms[f"data.source[{i}]"] = json.dumps({"weight": entry.weight / total, "tokens_sha256": source.tokens_sha256})
    return terms
