"""Messages between nodes and the coordinator: msgpack maps, signed when the run has a secret.

Every message is an envelope {"run": run id, "body": msgpack bytes, "mac": HMAC-SHA256(secret, body)
or nil}. The coordinator checks size, envelope, run id and signature before it reads the body, and
the body's fields before it acts on them; a bad message is refused and logged, and it never stops the
coordinator serving everyone else (DESIGN.md: PRIME's coordinator was a TCPStore in rank 0).

Node -> coordinator (every message also carries the node's belief: epoch, members, step, slot, and the nodes the
view admitted and whether it was applied (new, applied), so a restarted coordinator rebuilds its state from what
the nodes report):
    join       {node, incarnation}                                 -> joined {slot, slot_state} | refused {reason}
    heartbeat  {node, incarnation}                                 -> ok | evicted
    sync       {node, incarnation, step, attempt, hash, compute_s, -> view {epoch, members, new, step, attempt, skip}
                slot_state (what the node reports of its data slot: its data position, handed to the next node
                granted the slot in `joined`)}
    commit     {node, incarnation, step, attempt, ok, compute_s,   -> decision {apply}
                unreachable (the members it could not connect to)}
    leave      {node, incarnation}                                 -> ok          (the deathrattle)
    status     {}                                                  -> status {...} (tools and tests)

Every request also carries `waited_s`, the seconds since the node first sent it (it resends a request until
answered): a coordinator restarted while nodes wait at the barrier or for a decision times its straggler
deadlines from when they came, not from its restart (stragglers.py).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import msgpack

from openprime.core.errors import OpenPrimeError

REQUEST_OPS = ("join", "heartbeat", "sync", "commit", "leave", "status")
_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "join": {"node": str, "incarnation": str},
    "heartbeat": {"node": str, "incarnation": str},
    "sync": {"node": str, "incarnation": str, "step": int, "attempt": int},
    "commit": {"node": str, "incarnation": str, "step": int, "attempt": int, "ok": bool},
    "leave": {"node": str, "incarnation": str},
    "status": {},
}
_BELIEF: dict[str, type | tuple[type, ...]] = {"epoch": int, "members": list, "step": int, "slot": int}
MAX_COUNTER = 1 << 62  # epochs, steps, attempts and slots stay far below (a msgpack int is 64 bits)


class BadMessage(OpenPrimeError):
    """A message the coordinator (or a node) refuses: it says what was wrong."""


def _mac(secret: bytes, body: bytes) -> bytes:
    return hmac.new(secret, body, hashlib.sha256).digest()


# The term in which nodes state how many data slots their data is cut into (their MeshConfig.max_nodes): the
# coordinator grants no slot beyond it, whatever its own max_nodes (`Coordinator.num_slots`).
SLOTS_TERM = "mesh.max_nodes"


def pack(message: dict[str, Any], *, run_id: str, secret: bytes | None) -> bytes:
    body = msgpack.packb(message)
    return msgpack.packb({"run": run_id, "body": body, "mac": _mac(secret, body) if secret else None})


def unpack(data: bytes, *, run_id: str, secret: bytes | None, max_bytes: int) -> dict[str, Any]:
    """Open an envelope; raise BadMessage unless it is well formed, of this run, and signed if it must be."""
    if len(data) > max_bytes:
        raise BadMessage(f"message of {len(data)} bytes exceeds max_message_bytes={max_bytes}")
    try:
        envelope = msgpack.unpackb(data, raw=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise BadMessage(f"not a msgpack envelope ({type(e).__name__})") from None
    if not isinstance(envelope, dict) or not isinstance(envelope.get("body"), bytes):
        raise BadMessage("not an openprime envelope")
    if envelope.get("run") != run_id:
        raise BadMessage(f"message of run {envelope.get('run')!r}, this is run {run_id!r}")
    if secret is not None:
        mac = envelope.get("mac")
        if not isinstance(mac, bytes) or not hmac.compare_digest(mac, _mac(secret, envelope["body"])):
            raise BadMessage("wrong or missing signature (a different shared secret?)")
    try:
        message = msgpack.unpackb(envelope["body"], raw=False)
    except Exception as e:
        raise BadMessage(f"body is not msgpack ({type(e).__name__})") from None
    if not isinstance(message, dict):
        raise BadMessage("body is not a map")
    return message


def check_request(message: dict[str, Any]) -> str:
    """Validate a request's op and fields; return the op."""
    op = message.get("op")
    if op not in REQUEST_OPS:
        raise BadMessage(f"unknown message type {op!r}; known: {', '.join(REQUEST_OPS)}")
    if not isinstance(message.get("req"), int):
        raise BadMessage("request has no integer 'req' id")
    for name, kind in {**_FIELDS[op], **(_BELIEF if op != "status" else {})}.items():
        if not isinstance(message.get(name), kind) or (kind is int and isinstance(message.get(name), bool)):
            raise BadMessage(f"{op}: field {name!r} missing or not {getattr(kind, '__name__', kind)}")
    if op != "status" and not all(isinstance(m, str) for m in message["members"]):
        raise BadMessage(f"{op}: members must be node ids")
    if op != "status" and len(set(message["members"])) != len(message["members"]):
        raise BadMessage(f"{op}: members must be distinct node ids")
    for name in ("epoch", "step", "attempt", "slot", "hash_step"):
        # An epoch of 2**64 - 1, adopted, overflowed msgpack in the next view's reply and ended the serve loop.
        value = message.get(name)
        if isinstance(value, int) and not -1 <= value < MAX_COUNTER:
            raise BadMessage(f"{op}: {name} {value} is outside [-1, {MAX_COUNTER})")
    for name in ("new", "unreachable"):  # optional: the nodes the view admitted; those a member could not reach
        nodes = message.get(name)
        if nodes is not None and not (isinstance(nodes, list) and all(isinstance(m, str) for m in nodes)):
            raise BadMessage(f"{op}: {name} must be a list of node ids")
    if message.get("donor") is not None and not isinstance(message["donor"], str):
        raise BadMessage(f"{op}: donor must be a node id")
    if message.get("applied") is not None and not isinstance(message["applied"], bool):
        raise BadMessage(f"{op}: applied must be true or false")
    bandwidth = message.get("bw")
    if bandwidth is not None and not (isinstance(bandwidth, dict) and all(
            isinstance(k, str) and isinstance(v, int | float) and v >= 0 for k, v in bandwidth.items())):
        raise BadMessage(f"{op}: bw must map node ids to non-negative rates")
    for name in ("compute_s", "waited_s"):
        seconds = message.get(name)
        if seconds is not None and not (isinstance(seconds, int | float) and not isinstance(seconds, bool)
                                        and 0 <= seconds < float("inf")):
            raise BadMessage(f"{op}: {name} must be a non-negative number of seconds")
    terms = message.get("terms")
    if terms is not None and not (isinstance(terms, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in terms.items())):
        raise BadMessage(f"{op}: terms must map names to strings")
    return op
