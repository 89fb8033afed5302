"""What the coordinator says when it refuses or evicts a node: what happened, and what to do about it.

A refused node gets the reason in its JoinRefused and exits with it (openprime.train); an evicted one finds it in
the coordinator's log. Each reason names the setting to change or the command to run, because the person reading
it is often looking at one machine of a run spread over three continents. The decisions themselves (who is late,
who nobody reaches) are made in coordinator.py, stragglers.py and blame.py; these are only their words.
"""

from __future__ import annotations

from collections.abc import Sequence

from openprime.mesh.blame import Culprit

#: Every eviction of a live node ends so: it is not lost for the run.
REJOINS = "It rejoins as a new node"
_CHECK_ADDRESS = ("Check that the other machines can reach this one at its transport address "
                  "(transport.options.hostname, its ports, firewalls, NAT)")


def straggler(deadline_s: float, *, retry: bool, known_compute: str, straggler_factor: float,
              min_straggler_s: float) -> str:
    """A member alive by its heartbeats that stayed away from the barrier `deadline_s` after the first member
    (the deadline from the mesh config's `straggler_factor` and `min_straggler_s`)."""
    why = (f"the barrier of a retry, which has no inner steps to compute: a process of it hung; "
           f"mesh.min_straggler_s={min_straggler_s:g}" if retry else
           f"a straggler: a process of it hung, or it computes far slower; recent outer steps' compute "
           f"{known_compute}, mesh.straggler_factor={straggler_factor:g}, "
           f"mesh.min_straggler_s={min_straggler_s:g}; raise the factor for machines of different speeds")
    return f"alive but not at the outer-step barrier {deadline_s:.0f}s after the first member ({why}). {REJOINS}"


def silent_in_commit(step: int, waited_s: float) -> str:
    """A member alive by its heartbeats that did not report on its all-reduce `waited_s` after the first member."""
    return (f"alive but did not report on the all-reduce of outer step {step} {waited_s:.0f}s after the first "
            f"member did (a process of it hung after the barrier). {REJOINS}")


def no_state_left(step: int, epoch: int, num_waiting: int) -> str:
    """The nodes at the barrier joined without the run's state, and no node that holds it is left."""
    seen = (f"the run reached outer step {step + 1}; its nodes are gone" if epoch else
            "this coordinator (re)started after the run's nodes were gone, and has seen none of its outer steps")
    return (f"no node holding the run's state is left ({seen}) and the {num_waiting} node(s) waiting joined it "
            f"without that state: continue the run by starting its machines again with `--resume latest` (each "
            f"from its own checkpoints), or restart the coordinator (`openprime mesh serve`) to start a new run")


def ahead(node_step: int, run_step: int) -> str:
    """A joiner holds the run's state at a later outer step than the live run."""
    return (f"this node holds the run's state at outer step {node_step + 1}, but the run at this coordinator is at "
            f"outer step {run_step + 1}: joining would replace the newer state with that older one. The run here is "
            f"another one (begun after the nodes of this node's run were gone: a restarted coordinator, nodes started "
            f"without a checkpoint) or one rolled back. Stop it and start every machine again with `--resume latest` "
            f"(`openprime mesh serve --min-nodes M` for M machines, so that the first outer step waits for them), or "
            f"resume this node from the checkpoint the others resumed")


def unproven(step: int, num_tries: int) -> str:
    """Joiners admitted to a ring that worked without them, after which every try of an outer step failed."""
    return (f"the all-reduce of outer step {step} failed on all {num_tries} tries after this node was admitted, "
            f"where the run's other members had succeeded without it: they could not exchange data with it. "
            f"{_CHECK_ADDRESS} and that it uses the run's site file; the run goes on without it")


def unreachable(culprit: Culprit, live_members: Sequence[str], num_tries: int) -> str:
    """The node that the others could not connect to on every try of one outer step, or of several in a row."""
    everyone = set(culprit.unreached) == set(live_members) - {culprit.node}
    who = "the other members" if everyone else ", ".join(culprit.unreached)
    steps = " and ".join(map(str, culprit.steps))
    why = (", whatever the ring order" if len(culprit.steps) == 1 else
           f", and no ring of the {len(live_members)} members goes round that: the node on the most of those "
           f"links leaves (of equals, the one that joined last), so that the others sync again (else every outer "
           f"step of the run would be skipped and the replicas would drift apart)")
    return (f"no connection between it and {who} on all {num_tries} tries of outer step"
            f"{'s' if len(culprit.steps) > 1 else ''} {steps}{why}. {_CHECK_ADDRESS}. {REJOINS}")
