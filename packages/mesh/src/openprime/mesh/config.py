"""Every interval and timeout of the membership protocol, declared once and derived from each other.

INTELLECT-1's ElasticDeviceMesh sent a heartbeat every 2 s and evicted a node silent for 6 s (paper,
section 2.2). Here the eviction timeout is `num_missed_heartbeats` heartbeat intervals, a request to
the coordinator waits one interval before it is sent again, and a restarted coordinator listens for
one eviction timeout before it rebuilds the view from what the nodes report (its state is soft).
"""

from __future__ import annotations

from openprime.core.config import (
    config,
    field,
    instance_of,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from openprime.core.errors import ConfigError


@config
class MeshConfig:
    """Membership: heartbeats, eviction, the outer-step barrier and retries of a failed all-reduce."""

    heartbeat_interval_s: float = field(2.0, doc="a node reports to the coordinator this often",
                                        validator=positive_float())
    num_missed_heartbeats: int = field(3, doc="a node silent for this many intervals is evicted",
                                       validator=positive_int())
    sync_timeout_s: float = field(7200.0, doc="longest wait at the outer-step barrier for the slowest node",
                                  validator=positive_float())
    straggler_factor: float = field(
        1.0, doc="a member this many outer steps' compute time behind the first at the barrier is evicted "
                 "(0: only at the bound sync_timeout_s sets)", validator=non_negative_float())
    min_straggler_s: float = field(60.0, doc="no member is evicted as a straggler sooner than this after the first "
                                             "member reached the barrier", validator=positive_float())
    num_all_reduce_tries: int = field(3, doc="tries of one outer step's all-reduce before it is skipped",
                                      validator=positive_int())
    num_join_tries: int = field(5, doc="registrations a newcomer evicted while waiting may try",
                                validator=positive_int())
    min_nodes: int = field(1, doc="the first view forms once this many nodes have joined", validator=positive_int())
    max_nodes: int = field(64, doc="data is split into this many shards; a node takes a free one",
                           validator=positive_int())
    probe_bytes: int = field(4 << 20, doc="size of the bandwidth probe between members (0: no probing)",
                             validator=non_negative_int())
    reorder_gain: float = field(1.2, doc="re-order the ring only if its slowest link gets this much faster",
                                validator=positive_float())
    max_message_bytes: int = field(1 << 20, doc="coordinator messages above this size are refused",
                                   validator=positive_int())
    run_id: str = field("openprime", doc="name of the run; messages of another run are refused",
                        validator=instance_of(str))
    secret_file: str | None = field(None, doc="shared secret that signs every message (None: unsigned)")

    def __attrs_post_init__(self) -> None:
        if self.min_nodes > self.max_nodes:
            raise ConfigError(f"mesh.min_nodes {self.min_nodes} is more than mesh.max_nodes {self.max_nodes}, the "
                              f"data slots (one a node): the first view would never form. Set mesh.min_nodes="
                              f"{self.max_nodes} or less, or mesh.max_nodes={self.min_nodes}")
        if self.sync_timeout_s < 3 * self.eviction_timeout_s:
            raise ConfigError(f"mesh.sync_timeout_s {self.sync_timeout_s:g} is under three eviction timeouts "
                              f"(mesh.heartbeat_interval_s x mesh.num_missed_heartbeats = "
                              f"{self.eviction_timeout_s:g} s): the members would give up on the barrier before a "
                              f"dead node is evicted and the others go on without it. Set mesh.sync_timeout_s="
                              f"{3 * self.eviction_timeout_s:g} or more")

    @property
    def eviction_timeout_s(self) -> float:
        """A node silent this long is evicted (INTELLECT-1: 3 x 2 s)."""
        return self.heartbeat_interval_s * self.num_missed_heartbeats

    @property
    def straggler_timeout_s(self) -> float:
        """The longest a member alive by its heartbeats may be missing from the outer-step barrier after the first
        member reached it before it is evicted (e.g. one of its local ranks hung): two eviction timeouts before
        the members' own wait (`sync_timeout_s`) ends, so that they go on without it instead of giving up."""
        return max(self.sync_timeout_s - 2 * self.eviction_timeout_s, self.eviction_timeout_s)

    def straggler_deadline_s(self, compute_s: float | None) -> float:
        """How long after the first member the barrier waits for the others, given `compute_s`, the time the members
        took for recent outer steps (from one commit to the first arrival at the next barrier; None: not known).

        Waiting longer than one outer step's compute for a member costs the others more than going on without
        it (it rejoins and gets the state live). INTELLECT-1's outer steps took about 38 minutes, so a hung
        process held the run 38 minutes rather than the two hours of `sync_timeout_s`. Never sooner than
        `min_straggler_s` (a busy machine, a slow save) and never later than `straggler_timeout_s`."""
        if compute_s is None or self.straggler_factor == 0:
            return self.straggler_timeout_s
        return min(self.straggler_timeout_s, max(self.min_straggler_s, self.straggler_factor * compute_s))

    @property
    def abort_poll_s(self) -> float:
        """Every process reads this often whether its current try is doomed (a member lost: openprime.mesh.abort),
        so a frozen or cut-off member holds the others one eviction timeout plus this, not their deadlines."""
        return self.heartbeat_interval_s

    @property
    def request_timeout_s(self) -> float:
        """A request without an answer this long is sent again (the coordinator may have restarted)."""
        return self.heartbeat_interval_s

    @property
    def coordinator_silence_warning_s(self) -> float:
        """A node whose coordinator has not answered this long says so (then after twice as long, and so on):
        as long as the coordinator waits before it evicts a silent node."""
        return self.eviction_timeout_s

    @property
    def recovery_window_s(self) -> float:
        """A restarted coordinator waits this long for nodes to report before it rebuilds the view."""
        return self.eviction_timeout_s
