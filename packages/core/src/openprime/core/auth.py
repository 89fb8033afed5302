"""Mutual HMAC-SHA256 challenge-response for every connection of a run (DESIGN.md: site secret file).

When a site names a shared secret, a connecting node and the node it connects to each prove that
they know it without sending it: each side sends a fresh random nonce, and the other answers with

    HMAC-SHA256(secret, "openprime/1|" + role + "|" + run_id + "|" + rank + "|" + nonce)

where role is "server" or "client" (so an answer cannot be reflected back) and rank is the client's.
A peer without the secret, or of another run (run id), is refused and the refusal is logged with its
address. Without a secret only the run id is checked.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import pathlib

from openprime.core.config import config, field, instance_of
from openprime.core.errors import ConfigError, OpenPrimeError

log = logging.getLogger("openprime.auth")
NONCE_BYTES = 16


@config
class AuthConfig:
    """Who may connect: peers of the same run that hold the site's shared secret."""

    run_id: str = field("openprime", doc="name of the run; peers of another run are refused",
                        validator=instance_of(str))
    secret_file: str | None = field(None, doc="file holding the shared secret (None: no authentication)")

    def load_secret(self, setting: str = "AuthConfig.secret_file") -> bytes | None:
        """The secret's bytes (stripped of surrounding whitespace), or None; errors name `setting` (the key the user
        set it with, e.g. mesh.secret_file)."""
        if self.secret_file is None:
            return None
        path = pathlib.Path(self.secret_file).expanduser()
        try:
            secret = path.read_bytes().strip()
        except OSError as e:
            raise ConfigError(f"{setting}: cannot read {path}: {e.strerror}") from None
        if len(secret) < 16:
            raise ConfigError(f"{setting}: the secret in {path} is {len(secret)} bytes; use at "
                              "least 16 (e.g. `openssl rand -hex 32 > FILE`)")
        return secret

    def fingerprint(self) -> str | None:
        """Which secret this is, without what it is: 16 hex digits of a domain-separated SHA-256 (None: no secret).
        Nodes compare it when they join, so that one with another secret is refused at once, not at every ring
        connection of every outer step."""
        secret = self.load_secret()
        return None if secret is None else hashlib.sha256(b"openprime/secret-fingerprint|" + secret).hexdigest()[:16]


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def answer(secret: bytes, *, role: str, run_id: str, rank: int, nonce: bytes) -> bytes:
    """The proof that the answering side knows `secret`, bound to the challenger's nonce."""
    message = f"openprime/1|{role}|{run_id}|{rank}|".encode() + nonce
    return hmac.new(secret, message, hashlib.sha256).digest()


def check(secret: bytes, proof: object, *, role: str, run_id: str, rank: int, nonce: bytes) -> bool:
    """Constant-time comparison of `proof` against the expected answer."""
    if not isinstance(proof, bytes):
        return False
    return hmac.compare_digest(proof, answer(secret, role=role, run_id=run_id, rank=rank, nonce=nonce))


# ---------------------------------------------------------------- the connection handshake
#
#   client -> server  {"op": "hello", "run", "rank", "to", "conn", "incarnation", "generation", "nonce"}
#   server -> client  {"op": "challenge", "nonce", "proof"}  (with a secret)  or  {"op": "ok"}
#   client -> server  {"op": "auth", "proof"}                                   (with a secret)
#   server -> client  {"op": "ok"}  or, at any point,  {"op": "refused", "reason"}


class Refused(OpenPrimeError):
    """A connection was refused by the handshake; the reason says why (logged with the address)."""


def hello(auth: AuthConfig, *, rank: int, to: int, conn: int, incarnation: str, generation: int,
          nonce: bytes) -> dict:
    return {"op": "hello", "run": auth.run_id, "rank": rank, "to": to, "conn": conn,
            "incarnation": incarnation, "generation": generation, "nonce": nonce}


def server_reply(msg: object, *, auth: AuthConfig, secret: bytes | None, my_rank: int,
                 world_size: int) -> tuple[dict, bytes | None]:
    """Check a hello; return the reply to send and the server's nonce (None: no secret, accepted)."""
    if not isinstance(msg, dict) or msg.get("op") != "hello":
        raise Refused(f"expected a hello, got {str(msg)[:100]}")
    if msg.get("run") != auth.run_id:
        raise Refused(f"peer belongs to run {msg.get('run')!r}, this is run {auth.run_id!r}")
    rank, to = msg.get("rank"), msg.get("to")
    if not isinstance(rank, int) or not 0 <= rank < world_size or rank == my_rank:
        raise Refused(f"peer claims an invalid rank {rank!r} in a group of {world_size}")
    if to != my_rank:
        raise Refused(f"peer wanted rank {to!r} but reached rank {my_rank} (a stale address?)")
    if not all(isinstance(msg.get(k), t) for k, t in
               (("conn", int), ("incarnation", str), ("generation", int), ("nonce", bytes))):
        raise Refused("hello is missing fields or has fields of the wrong type")
    if secret is None:
        return {"op": "ok"}, None
    nonce = new_nonce()
    proof = answer(secret, role="server", run_id=auth.run_id, rank=rank, nonce=msg["nonce"])
    return {"op": "challenge", "nonce": nonce, "proof": proof}, nonce


def client_answer(reply: object, *, auth: AuthConfig, secret: bytes | None, rank: int, nonce: bytes) -> dict | None:
    """Handle the server's first reply: the auth message to send next, or None when accepted."""
    if not isinstance(reply, dict):
        raise Refused(f"peer answered the hello with {str(reply)[:100]}")
    if reply.get("op") == "refused":
        raise Refused(f"peer refused the connection: {reply.get('reason')}")
    if reply.get("op") == "ok":
        if secret is not None:
            raise Refused("peer accepted without proving it knows the shared secret; is secret_file set there?")
        return None
    if reply.get("op") != "challenge":
        raise Refused(f"unexpected handshake reply {str(reply)[:100]}")
    if secret is None:
        raise Refused("peer requires the run's shared secret; set secret_file in the site file")
    if not check(secret, reply.get("proof"), role="server", run_id=auth.run_id, rank=rank, nonce=nonce):
        raise Refused("peer's proof of the shared secret is wrong (a different secret?)")
    server_nonce = reply.get("nonce")
    if not isinstance(server_nonce, bytes):
        raise Refused("peer's challenge has no nonce")
    return {"op": "auth", "proof": answer(secret, role="client", run_id=auth.run_id, rank=rank, nonce=server_nonce)}


def server_check(msg: object, *, auth: AuthConfig, secret: bytes, client_rank: int, server_nonce: bytes) -> None:
    """Check the client's proof; raises Refused when it does not hold the secret."""
    proof = msg.get("proof") if isinstance(msg, dict) and msg.get("op") == "auth" else None
    if not check(secret, proof, role="client", run_id=auth.run_id, rank=client_rank, nonce=server_nonce):
        raise Refused("wrong or missing proof of the shared secret")
