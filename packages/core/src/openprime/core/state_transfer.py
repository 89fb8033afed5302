"""Live recovery: a donor sends its state to a joiner in checksummed chunks, resumable from another donor.

INTELLECT-1 brought joining nodes up to date peer to peer (paper, section 2.2); PRIME's transfer broke
when the donor left mid-transfer and nothing checked what arrived. Here the state is a list of named
tensors read as one byte stream and cut into chunks of `chunk_bytes`. The protocol, over any
Transport between the donor and the joiner:

1. donor -> joiner, tag TAG_STATE_OFFER: the offer (msgpack, after its length): the outer step the
   state belongs to, the donor's origin id, the global-state hash, JSON metadata, and the name, dtype,
   shape and `shared` flag of every tensor. Shared tensors (the global weights and outer momentum) are
   identical on every replica after an outer step; the others (the donor's inner optimizer state) are
   its own.
2. joiner -> donor, tag TAG_STATE_WANT: the chunks it still needs (msgpack list), and whether it wants
   the rest later (the non-blocking mode of openprime.diloco).
3. donor -> joiner, tag TAG_STATE: each wanted chunk, in order: an (index, checksum) header and the
   chunk's bytes, received straight into the joiner's tensors, IN_FLIGHT chunks in flight so that the
   checksums overlap the transfer. The checksum is made of the XXH3-64 digests of the chunk's 1 MiB pieces
   (openprime.core.digest: about 13-25 GB/s per core here, where zlib's CRC-32 managed 2.4 GB/s); it
   catches corruption, not forgery (authentication is the transport's). The joiner checks every chunk; a
   chunk that fails is logged and left missing (the transfer still reads every chunk, so the tags stay in
   step), to be fetched again from the next offer.
4. Once every chunk is in, the joiner checks the whole shared state against the offer's state hash (the
   one the mesh agreed on, which the caller may have checked the offer against): the hash is made of the
   same piece digests (`digest.combine`), so this reads nothing again. A mismatch starts the fetch over.

The chunks: the shared bytes and the own bytes are each cut into chunks of `chunk_bytes` (whole pieces)
from their own start, so a shared chunk's pieces are pieces of the shared state's hash. A donor that
hashed its shared state at the outer step passes those digests (`shared_digests`) and reads its shared
tensors only to send them.

A joiner keeps what it received in a `StateFetch` across donors: if its donor dies mid-transfer, the
next donor's offer for the same step lets it keep every chunk of shared tensors and fetch only the
rest; chunks of a donor's own tensors are kept only from the same donor (same origin).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import msgpack
import numpy as np
import torch

from openprime.core import digest
from openprime.core.errors import OpenPrimeError
from openprime.core.transport import Handle, Transport, as_bytes

log = logging.getLogger("openprime.core.state_transfer")
TAG_STATE = 4
TAG_STATE_OFFER = 6
TAG_STATE_WANT = 7
CHUNK_BYTES = 64 << 20  # large enough to stream at full rate; a broken transfer loses at most this much
MIN_CHUNKS = 8  # a smaller state is cut finer: a donor lost mid-transfer then costs at most 1/8 of it
IN_FLIGHT = 3  # chunks posted ahead on each side (64 MiB x 2: tcp 0.67, x 3: 0.72 of p2p on loopback)
PROGRESS_EVERY_S = 60.0  # a transfer that lasts longer says how far it is this often (INTELLECT-1's: 30-60 min)


class StateCorrupt(OpenPrimeError):
    """A chunk whose bytes do not match the donor's checksum, or an offer that makes no sense."""


@attrs.frozen
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    shared: bool

    @property
    def num_bytes(self) -> int:
        return _numel(self.shape) * torch.empty(0, dtype=_dtype(self.dtype)).element_size()


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise StateCorrupt(f"unknown dtype {name!r} in a state offer")
    return dtype


class StateOffer:
    """What a donor offers: named tensors (contiguous CPU) of one outer step, plus JSON-able metadata.

    `state_hash` is `digest.combine` of the shared tensors' piece digests (`piece_bytes` pieces of their
    bytes in order); `shared_digests`, if the donor has them (computed with that hash), spare it reading
    the shared tensors for their checksums. The tensors must not change while they are being sent (the
    caller sends a snapshot, or sends between outer steps when nothing writes them).
    """

    def __init__(self, *, step: int, origin: str, state_hash: str, shared: Mapping[str, torch.Tensor],
                 own: Mapping[str, torch.Tensor] | None = None, meta: Mapping[str, Any] | None = None,
                 chunk_bytes: int | None = None, piece_bytes: int = digest.PIECE_BYTES,
                 shared_digests: np.ndarray | None = None) -> None:
        self.tensors = {**shared, **(own or {})}
        if len(self.tensors) != len(shared) + len(own or {}):
            raise ValueError("a tensor name is both shared and own")
        self.specs = [TensorSpec(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), name in shared)
                      for name, t in self.tensors.items()]
        if chunk_bytes is None:
            chunk_bytes = default_chunk_bytes(sum(s.num_bytes for s in self.specs), piece_bytes)
        self.header = {"step": step, "origin": origin, "state_hash": state_hash, "meta": dict(meta or {}),
                       "chunk_bytes": chunk_bytes, "piece_bytes": piece_bytes,
                       "tensors": [attrs.astuple(s) for s in self.specs]}
        self.layout = _Layout(self.specs, chunk_bytes, piece_bytes)
        if shared_digests is not None and len(shared_digests) != self.layout.num_shared_pieces:
            raise ValueError(f"shared_digests has {len(shared_digests)} digests where the shared tensors have "
                             f"{self.layout.num_shared_pieces} pieces of {piece_bytes} bytes")
        self.shared_digests = shared_digests
        self._views = [as_bytes(t) for t in self.tensors.values()]

    def chunk_views(self, index: int) -> list[torch.Tensor]:
        return self.layout.views(self._views, index)

    def chunk_digests(self, index: int) -> np.ndarray:
        """The digests of chunk `index`'s pieces: from `shared_digests` where they are known, else read."""
        if self.shared_digests is not None and self.layout.is_shared(index):
            return self.shared_digests[self.layout.shared_pieces(index)]
        return _digests(self.chunk_views(index), self.layout.piece_bytes)


def default_chunk_bytes(total: int, piece_bytes: int = digest.PIECE_BYTES) -> int:
    """CHUNK_BYTES, or for a state under MIN_CHUNKS of them, total / MIN_CHUNKS, in whole pieces (at least one).
    The debug model's 29 MB state used to travel as one chunk, so a donor that died during it cost the joiner
    all of it. On loopback its throughput did not change (it is bound by round trips there); for large states
    smaller chunks are slower (measured, 1.6 GB over tcp: 4-16 MiB chunks 0.63-1.18 s, 64-256 MiB 0.57-0.62 s)."""
    share = -(-total // MIN_CHUNKS)
    pieces = max(1, -(-min(CHUNK_BYTES, share) // piece_bytes))
    return pieces * piece_bytes


class _Layout:
    """The shared bytes [0, S) and then the own bytes [S, total) of the tensors' concatenation, each cut into
    chunks of `chunk_bytes` (whole pieces of `piece_bytes`) from its own start; views that never copy."""

    def __init__(self, specs: Sequence[TensorSpec], chunk_bytes: int, piece_bytes: int) -> None:
        if piece_bytes < 1 or chunk_bytes < 1 or chunk_bytes % piece_bytes:
            raise StateCorrupt(f"chunk_bytes {chunk_bytes} must be a positive multiple of piece_bytes {piece_bytes}")
        self.chunk_bytes, self.piece_bytes = chunk_bytes, piece_bytes
        self.starts = [0]
        for s in specs:
            self.starts.append(self.starts[-1] + s.num_bytes)
        self.total = self.starts[-1]
        # Bytes [0, shared_end) belong to shared tensors: offers list them first.
        shared = [s.shared for s in specs]
        if shared != sorted(shared, reverse=True):
            raise StateCorrupt("an offer must list its shared tensors first")
        self.shared_end = self.starts[sum(shared)]
        self.num_shared_pieces = -(-self.shared_end // piece_bytes)
        self.bounds = [(lo, min(lo + chunk_bytes, end)) for start, end in ((0, self.shared_end),
                                                                           (self.shared_end, self.total))
                       for lo in range(start, end, chunk_bytes)]
        self.num_shared_chunks = -(-self.shared_end // chunk_bytes)
        self.num_chunks = len(self.bounds)

    def is_shared(self, index: int) -> bool:
        return index < self.num_shared_chunks

    def num_bytes(self, index: int) -> int:
        lo, hi = self.bounds[index]
        return hi - lo

    def shared_pieces(self, index: int) -> slice:
        """The shared chunk `index`'s pieces among the shared state's pieces."""
        lo, hi = self.bounds[index]
        return slice(lo // self.piece_bytes, -(-hi // self.piece_bytes))

    def views(self, tensor_views: Sequence[torch.Tensor], index: int) -> list[torch.Tensor]:
        lo, hi = self.bounds[index]
        out = []
        for i, view in enumerate(tensor_views):
            a, b = max(lo, self.starts[i]), min(hi, self.starts[i + 1])
            if a < b:
                out.append(view[a - self.starts[i]: b - self.starts[i]])
        return out


class _Progress:
    """Logs (INFO) how far a long transfer is, at most every PROGRESS_EVERY_S."""

    def __init__(self, what: str, total_bytes: int) -> None:
        self.what, self.total, self.done = what, total_bytes, 0
        self.start = self.last = time.monotonic()

    def add(self, num_bytes: int) -> None:
        self.done += num_bytes
        now = time.monotonic()
        if now - self.last < PROGRESS_EVERY_S or self.done >= self.total:
            return
        self.last = now
        rate = self.done / max(now - self.start, 1e-9)
        log.info("%s: %.1f of %.1f MB (%.0f%%) in %.0fs, %.1f MB/s, about %.0fs left", self.what, self.done / 1e6,
                 self.total / 1e6, 100 * self.done / self.total, now - self.start, rate / 1e6,
                 (self.total - self.done) / rate)


def chunk_deadline(deadline: float, op_s: float | None) -> float:
    """The deadline of a chunk posted now: `deadline`, or with `op_s`, IN_FLIGHT x op_s from now (the chunks
    posted before it go first, each one operation)."""
    return deadline if op_s is None else time.monotonic() + IN_FLIGHT * op_s


def num_messages(shared_bytes: int, own_bytes: int, piece_bytes: int = digest.PIECE_BYTES) -> int:
    """The messages of a whole transfer of that much state: the offer and the answer (a length, then the body,
    each) and the chunks, cut as `StateOffer` cuts them."""
    chunk_bytes = default_chunk_bytes(shared_bytes + own_bytes, piece_bytes)
    return 4 + -(-shared_bytes // chunk_bytes) + -(-own_bytes // chunk_bytes)


def _digests(views: Sequence[torch.Tensor], piece_bytes: int) -> np.ndarray:
    """The XXH3-64 digests of a chunk's pieces (its checksum is made of them)."""
    return digest.piece_digests(views, piece_bytes=piece_bytes)


def _send_packed(transport: Transport, peer: int, tag: int, obj: Any, deadline: float) -> None:
    data = msgpack.packb(obj)
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    transport.send(peer, tag, [torch.tensor([len(data)], dtype=torch.int64)], deadline=deadline)
    transport.send(peer, tag, [payload], deadline=deadline)


def _recv_packed(transport: Transport, peer: int, tag: int, deadline: float, max_bytes: int) -> Any:
    size = torch.zeros(1, dtype=torch.int64)
    transport.recv(peer, tag, [size], deadline=deadline)
    if not 0 <= int(size) <= max_bytes:
        raise StateCorrupt(f"peer {peer} announced a {int(size)}-byte state message (limit {max_bytes})")
    data = torch.empty(int(size), dtype=torch.uint8)
    transport.recv(peer, tag, [data], deadline=deadline)
    try:
        return msgpack.unpackb(data.numpy().tobytes(), raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData) as e:
        raise StateCorrupt(f"peer {peer} sent a state message that is not msgpack: {e}") from None


MAX_OFFER_BYTES = 64 << 20  # a 10B model's offer lists a few thousand tensors: far below this


@attrs.frozen
class SendReport:
    """What one `send_state` did."""

    num_chunks: int
    num_bytes: int
    seconds: float
    later: bool  # the joiner asked for the rest after the outer step (non-blocking recovery)


def send_state(transport: Transport, peer: int, offer: StateOffer, *, deadline: float, op_s: float | None = None,
               only_header: bool = False) -> SendReport:
    """Donor side: offer the state, then send the chunks the joiner asks for (IN_FLIGHT of them while the
    next one's checksum is made). `only_header`: offer it, but send no chunk now even if asked.

    `deadline` bounds the offer and the joiner's answer; with `op_s` every chunk then has a deadline of its own
    (`chunk_deadline`), so a transfer that moves is never cut short however long the state takes, and one that
    stalls fails within IN_FLIGHT x op_s. Without `op_s`, `deadline` bounds the whole transfer."""
    start = time.monotonic()
    _send_packed(transport, peer, TAG_STATE_OFFER, offer.header, deadline)
    want = _recv_packed(transport, peer, TAG_STATE_WANT, deadline, MAX_OFFER_BYTES)
    try:
        chunks = [] if only_header else [int(i) for i in want.get("chunks", [])]
        later = bool(want.get("later"))
    except (AttributeError, TypeError, ValueError) as e:  # not {"chunks": [int], "later": bool}: a bad joiner
        raise StateCorrupt(f"peer {peer} answered the state offer with a malformed request ({e})") from None
    if any(not 0 <= i < offer.layout.num_chunks for i in chunks) or len(set(chunks)) != len(chunks):
        raise StateCorrupt(f"peer {peer} asked for a chunk outside [0, {offer.layout.num_chunks}) or twice")
    in_flight: collections.deque[Handle] = collections.deque()
    progress = _Progress(f"sending the state to rank {peer}", sum(offer.layout.num_bytes(i) for i in chunks))
    for i in chunks:
        views = offer.chunk_views(i)
        header = torch.tensor([i, digest.checksum(offer.chunk_digests(i))], dtype=torch.int64)
        if len(in_flight) == IN_FLIGHT:
            in_flight.popleft().wait()
        in_flight.append(transport.isend(peer, TAG_STATE, [header, *views], deadline=chunk_deadline(deadline, op_s)))
        progress.add(offer.layout.num_bytes(i))
    while in_flight:
        in_flight.popleft().wait()
    return SendReport(num_chunks=len(chunks), num_bytes=progress.done, seconds=time.monotonic() - start,
                      later=later)


def _read_offer(offer: dict[str, Any], donor: int) -> tuple[list[TensorSpec], _Layout]:
    """The tensors and chunks an offer describes; StateCorrupt for one that is malformed or lists no shared tensor
    (the global weights: a fetch of nothing would be complete at once, and the joiner left with no state). Shared
    tensors of no element are a state: an FSDP2 rank past a small model's rows holds an empty shard, and its ring's
    joiner must take that empty state (its hash still checked) rather than refuse every offer."""
    try:
        specs = [TensorSpec(str(n), str(d), tuple(int(x) for x in s), bool(sh)) for n, d, s, sh in offer["tensors"]]
        layout = _Layout(specs, int(offer["chunk_bytes"]), int(offer["piece_bytes"]))
    except (KeyError, TypeError, ValueError) as e:
        raise StateCorrupt(f"donor {donor} sent a malformed state offer: {e}") from None
    if not any(spec.shared for spec in specs):
        raise StateCorrupt(f"donor {donor} offered no shared state (no global weights); refused")
    return specs, layout


class StateFetch:
    """Joiner side: receives a donor's state into tensors it owns, keeping its progress across donors.

    `targets` are preallocated tensors for some names (e.g. the DiLoCo host buffers): chunks land in
    them directly. Other tensors are allocated from the offer.
    """

    def __init__(self, targets: Mapping[str, torch.Tensor] | None = None) -> None:
        self.targets = dict(targets or {})
        self.header: dict[str, Any] | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.received: set[int] = set()
        self.num_chunks_fetched = 0  # over all donors, for tests and logs
        self.num_bytes_fetched = 0  # chunk bytes received, over all donors (a corrupt chunk's too)
        self.num_corrupt = 0  # chunks that failed their checksum, and whole states that failed the state hash
        self.asked_later = False  # the last fetch's answer: nothing now, the whole state later (the donor sends it)
        self._layout: _Layout | None = None
        self._shared_digests: dict[int, np.ndarray] = {}  # by shared chunk: its pieces' digests, once checked

    @property
    def complete(self) -> bool:
        return self._layout is not None and len(self.received) == self._layout.num_chunks

    @property
    def step(self) -> int | None:
        return None if self.header is None else int(self.header["step"])

    def shared_digests(self) -> np.ndarray:
        """The piece digests of the shared tensors received (complete fetches only): the offer's state hash is
        `digest.combine` of them, and a DiLoCo joiner keeps them as its own next offer's checksums."""
        if not self.complete:
            raise RuntimeError("shared_digests of an incomplete state")
        parts = [self._shared_digests[i] for i in range(self._layout.num_shared_chunks)]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.uint64)

    def fetch(self, transport: Transport, donor: int, *, deadline: float, op_s: float | None = None,
              later: bool = False, expected_hash: str | None = None) -> bool:
        """Take the donor's offer and the chunks still missing; returns whether the state is complete.

        `deadline` bounds the wait for the offer (the donor may serve other joiners first) and the answer to it;
        with `op_s` each chunk then has a deadline of its own (`chunk_deadline`), as in `send_state`.

        With `later` the joiner asks for nothing now unless it already holds part of this very offer
        (then it finishes it now). An offer whose state hash is not `expected_hash` (the one the members
        agreed on) is refused with StateCorrupt. A state that arrives whole but whose shared tensors do not
        hash to the offer's state hash is logged and fetched again from the start (returns False).
        PeerFailure propagates with the progress kept for the next donor.

        The chunks are received in place, IN_FLIGHT posted at a time. After a fetch that failed, close `transport`
        before the next fetch into these tensors (DiLoCo closes its group then: the failed try, or
        `Membership.abandon`): receives still posted on it are filled if the donor's bytes come after all, in
        chunks the next donor sent and that were checked (found 2026-12-07 over tcp and zmq). Staging each chunk
        and copying it once checked closes that too, but halved the transfer's throughput on loopback (tcp 3.05 to
        1.53 GB/s, 100M state, measured the same day), where it is bound by the CPU.
        """
        offer = _recv_packed(transport, donor, TAG_STATE_OFFER, deadline, MAX_OFFER_BYTES)
        try:
            if expected_hash is not None and offer.get("state_hash") != expected_hash:
                raise StateCorrupt(f"donor {donor} offered a state hashing to {offer.get('state_hash')}, not the "
                                   f"{expected_hash} the members agreed on; refused")
            specs, layout = _read_offer(offer, donor)
        except StateCorrupt:
            self.asked_later = False
            _send_packed(transport, donor, TAG_STATE_WANT, {"chunks": [], "later": False}, deadline)  # not left waiting
            raise
        self._adopt(offer, specs, layout)
        missing = [i for i in range(self._layout.num_chunks) if i not in self.received]
        now = missing if (not later or self.received) else []
        self.asked_later = later and not now
        _send_packed(transport, donor, TAG_STATE_WANT, {"chunks": now, "later": self.asked_later}, deadline)
        views = [as_bytes(t) for t in self.tensors.values()]
        headers = [torch.zeros(2, dtype=torch.int64) for _ in now]
        posted: collections.deque[Handle] = collections.deque()

        def post(k: int) -> None:
            if k < len(now):
                posted.append(transport.irecv(donor, TAG_STATE, [headers[k], *self._layout.views(views, now[k])],
                                              deadline=chunk_deadline(deadline, op_s)))

        progress = _Progress(f"receiving the state from rank {donor}", sum(self._layout.num_bytes(i) for i in now))
        for k in range(IN_FLIGHT):
            post(k)
        for k, i in enumerate(now):
            posted.popleft().wait()
            post(k + IN_FLIGHT)  # keep IN_FLIGHT receives posted while this chunk is checked
            self._check(i, headers[k], views, donor)
            progress.add(self._layout.num_bytes(i))
        # Checked once, when the last chunk arrives; an offer of no chunk at all (empty shards) is complete at once
        # and checked here too, so that an offer whose hash is not that of the empty state is not taken.
        if self.complete and (now or not self._layout.num_chunks):
            got = digest.combine(self.shared_digests())
            if got != self.header["state_hash"]:
                self.num_corrupt += 1
                log.error("the state from donor %d hashes to %s, not the %s it was offered as; fetching it again",
                          donor, got, self.header["state_hash"])
                self.received, self._shared_digests = set(), {}
                return False  # an offer of no chunk would count complete again with nothing received
        return self.complete

    def _adopt(self, offer: dict[str, Any], specs: list[TensorSpec], layout: _Layout) -> None:
        """Keep what still holds from earlier donors; reset the rest."""
        same = self.header is not None and all(self.header[k] == offer[k] for k in (
            "step", "tensors", "chunk_bytes", "piece_bytes", "state_hash"))
        if not same:
            self.received, self._shared_digests = set(), {}
            self.tensors = {s.name: self._tensor(s) for s in specs}
        elif self.header["origin"] != offer["origin"]:
            self.received = {i for i in self.received if layout.is_shared(i)}  # the new donor's own state differs
        self.header, self._layout = offer, layout

    def _tensor(self, spec: TensorSpec) -> torch.Tensor:
        target = self.targets.get(spec.name)
        dtype = _dtype(spec.dtype)
        if target is not None and target.shape == spec.shape and target.dtype == dtype and target.is_contiguous():
            return target
        return torch.empty(spec.shape, dtype=dtype)

    def _check(self, index: int, header: torch.Tensor, views: list[torch.Tensor], donor: int) -> None:
        got_index, checksum = (int(x) for x in header)
        self.num_chunks_fetched += 1
        chunk = self._layout.views(views, index)
        self.num_bytes_fetched += sum(v.numel() for v in chunk)
        digests = _digests(chunk, self._layout.piece_bytes)
        # A header whose index is not the chunk's (flipped on the way) is a corrupt chunk too: its bytes landed in
        # this chunk's place, and its checksum may be another's. The transfer goes on (the tags stay in step).
        if got_index != index or digest.checksum(digests) != checksum:
            self.num_corrupt += 1
            log.warning("chunk %d of the state from donor %d %s; it will be fetched again", index, donor,
                        "does not match its checksum" if got_index == index else f"came labelled {got_index}")
            return
        self.received.add(index)
        if self._layout.is_shared(index):
            self._shared_digests[index] = digests
