"""trainer.catch_up with two local ranks (fsdp.num_local_ranks=2) whose state transfers end differently.

Two nodes of two local ranks run as four threads: each local rank is one DiLoCo over its own ring (rank r of
every node), and a scripted membership lists a node as new while any of its local ranks lacks the state, as
ElasticDeviceMesh does. The donor's background send to the joiner's local rank 1 fails once (non-blocking
recovery). Before 2026-12-07 each local rank looped on its own `has_state`: rank 0 left catch_up one outer step
before rank 1, and the node's ranks then met in different collectives (a hang, or one shard counting the node as
a contributor and the other not).
"""

from __future__ import annotations

import threading
import types

import pytest
import torch

from openprime.core.errors import PeerFailure
from openprime.core.membership import Membership, Round
from openprime.core.testing import local_group
from openprime.core.timeouts import Timeouts
from openprime.diloco import DiLoCo, DiLoCoConfig, RecoveryMode
from openprime.train import trainer

H = 5
WAIT_S = 20


class NodeMembership(Membership):
    """Local rank `local_rank` of node `node`: the node is new while any of its local ranks reports no state."""

    def __init__(self, transport, node: int, local_rank: int, shared: dict) -> None:
        self.transport, self.node, self.local_rank, self.shared = transport, node, local_rank, shared

    def begin(self, step, attempt, *, state_hash, hash_step) -> Round:
        s = self.shared
        s["hash"][self.node, self.local_rank], s["step"][self.node, self.local_rank] = state_hash, step
        s["barrier"].wait(WAIT_S)
        stateless = {n for n in range(2) if any(s["hash"][n, r] is None for r in range(2))}
        run_step = max(s["step"][n, self.local_rank] for n in range(2) if n not in stateless)
        s["barrier"].wait(WAIT_S)
        return Round(transport=self.transport, step=run_step, attempt=attempt, new_ranks=tuple(sorted(stateless)),
                     donor_rank=0)

    def commit(self, step, attempt, ok) -> bool:
        return ok

    def abandon(self) -> None:
        pass

    def close(self) -> None:
        pass


class LocalSums:
    """`local_sum` over a node's local ranks (what `local_any` sums), here threads: each node's ranks meet at a
    barrier of their own."""

    def __init__(self) -> None:
        self.barriers = {node: threading.Barrier(2) for node in range(2)}
        self.values: dict[tuple[int, int], list[float]] = {}

    def __call__(self, values, mesh):
        node, local_rank = mesh
        self.values[node, local_rank] = list(values)
        self.barriers[node].wait(WAIT_S)
        total = [sum(v) for v in zip(self.values[node, 0], self.values[node, 1], strict=True)]
        self.barriers[node].wait(WAIT_S)
        return total


def test_the_local_ranks_of_a_joiner_leave_catch_up_together_when_one_transfer_breaks(monkeypatch):
    sums = LocalSums()
    monkeypatch.setattr(trainer, "local_any", lambda flag, mesh: sums([float(flag)], mesh)[0] > 0)
    config = DiLoCoConfig(num_inner_steps=H, recovery=RecoveryMode.NON_BLOCKING)
    timeouts = Timeouts(op_s=0.5)
    shared = {"hash": {}, "step": {}, "barrier": threading.Barrier(4)}
    rings = [local_group(2), local_group(2)]  # one ring per local rank, over the two nodes
    theta0 = [torch.randn(64, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    dilocos = {}
    for r in range(2):
        dilocos[0, r] = DiLoCo([torch.nn.Parameter(theta0[r].clone())], config=config, timeouts=timeouts,
                               membership=NodeMembership(rings[r][0], 0, r, shared))
        dilocos[0, r].num_outer_steps_done, dilocos[0, r].num_inner_steps_done = 2, 10
        dilocos[1, r] = DiLoCo([torch.nn.Parameter(torch.zeros(64))], config=config, timeouts=timeouts,
                               membership=NodeMembership(rings[r][1], 1, r, shared), joining=True)
    recovery, send, failed = dilocos[0, 1].recovery, dilocos[0, 1].recovery._send, []

    def send_failing_once(t, rank, offer, timeouts):
        if threading.current_thread().name == "diloco-donate" and not failed:
            failed.append(rank)
            raise PeerFailure(rank, "injected: the link to the joiner's local rank 1 broke")
        return send(t, rank, offer, timeouts)

    recovery._send = send_failing_once
    out, errors = {}, []

    def donor(r):
        d = dilocos[0, r]
        out["donor", r] = [next(res for _ in range(H) if (res := d.step()) is not None).num_contributors
                           for _ in range(4)]

    def joiner(r):
        d = dilocos[1, r]
        cfg = types.SimpleNamespace(mesh=types.SimpleNamespace(num_join_tries=1))
        trainer.catch_up(cfg, "", d, types.SimpleNamespace(node_id=f"node-1/{r}", local_rank=r), rejoin=False,
                         local_mesh=(1, r))
        out["caught up", r] = (d.num_outer_steps_done, d.num_inner_steps_done, d.behind)
        result = next(res for _ in range(H) if (res := d.step()) is not None)  # trains to the next outer step
        out["trained", r] = (result.outer_step, result.num_contributors, result.contributed)

    def guarded(f, r):
        try:
            f(r)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(f, r)) for f in (donor, joiner) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert failed == [1]
    assert out["caught up", 0] == out["caught up", 1]  # the same outer and inner step, and both back in step
    assert out["trained", 0] == out["trained", 1] == (6, 2, True)  # outer steps are counted from 1 in results
    # Outer step 2: the joiner is new (rank 1's transfer breaks); 3: new again, both ranks take the state after
    # the commit; 4: it sits out with a zero pseudo-gradient; 5: it contributes on both rings.
    assert out["caught up", 0] == (5, 25, False)
    assert out["donor", 0] == out["donor", 1] == [1, 1, 1, 2]
    assert torch.equal(dilocos[1, 0].state.theta, dilocos[0, 0].state.theta)
    assert torch.equal(dilocos[1, 1].state.theta, dilocos[0, 1].state.theta)


def test_a_node_evicted_and_rejoined_asks_for_its_slot_and_goes_on_with_its_data(monkeypatch):
    """After an eviction the node registers again: it asks for the data slot it had and, granted it, keeps reading
    where it was. Before 2026-12-07 it asked for none and rebuilt its batches, reading its slot from the start."""
    import pathlib

    from openprime.train.recipe import recipe_config

    root = pathlib.Path(__file__).resolve().parents[3]
    cfg = recipe_config(str(root / "recipes" / "debug.py"), ["checkpoint.mode=off"])
    asked = []

    def join_mesh(cfg, coordinator, *, slot=-1, local_rank=0, local_mesh=None):
        asked.append(slot)
        return _mesh(granted[0], local_rank=local_rank)

    class Synced:
        has_state, behind = True, False
        num_inner_steps_done = 60

        def rejoin(self, mesh):
            pass

        def sync(self, *, contribute):
            return types.SimpleNamespace(bytes_sent=0, bytes_received=0, received_state=True, total_s=0.0,
                                         all_reduce_s=0.0)

    monkeypatch.setattr(trainer, "join_mesh", join_mesh)
    monkeypatch.setattr(trainer, "follow_schedule", lambda sched, step: None)
    monkeypatch.setattr(trainer.attrs, "evolve", lambda result, **changes: result)
    node = trainer.Node.__new__(trainer.Node)
    node.cfg, node.coordinator, node.ckpt, node.sched, node.local_mesh = cfg, "", None, None, None
    node.diloco, node.mesh = Synced(), _mesh(1)
    node._open_slot()
    for _ in range(60):
        next(node.batches)
    position = node.batches.state_dict()
    granted = [1]
    node.catch_up(rejoin=True)
    assert asked == [1] and node.batches.state_dict() == position  # the same slot: its data goes on
    granted = [2]
    node.catch_up(rejoin=True)
    assert asked == [1, 1] and node.batches.slot == 2 and node.batches.batch == 0  # another slot: from its start


def test_catching_up_over_several_outer_steps_counts_the_time_and_bytes_of_each():
    """A non-blocking joiner waits one outer step for the state, a second that it finishes, and sits out a third:
    its one record holds all three's seconds and bytes. It held the last one's seconds only, so its compute
    utilisation counted the transfer as training (0.7 where it was 0.1)."""
    from openprime.diloco import OuterStepResult

    def result(outer_step, received):
        return OuterStepResult(outer_step=outer_step, num_contributors=1, num_members=2, num_tries=1, skipped=False,
                               received_state=received, contributed=False, state_hash="h", bytes_sent=100,
                               bytes_received=1000 * received, all_reduce_s=2.0, total_s=30.0)

    class Joining:
        has_state, behind = False, True

        def __init__(self):
            self.results = iter([result(3, False), result(4, True)])

        def sync(self, *, contribute):
            r = next(self.results)
            self.has_state = r.received_state
            return r

        def sit_out(self):
            return result(5, False)

    cfg = types.SimpleNamespace(mesh=types.SimpleNamespace(num_join_tries=1))
    mesh = types.SimpleNamespace(node_id="node-1", local_rank=0)
    _, r = trainer.catch_up(cfg, "", Joining(), mesh, rejoin=False, local_mesh=None)
    assert (r.outer_step, r.received_state) == (5, True)
    assert (r.total_s, r.all_reduce_s, r.bytes_sent, r.bytes_received) == (90.0, 6.0, 300, 1000)


def test_a_rejoin_counts_the_failing_outer_step_and_the_registration_as_outer_time(monkeypatch):
    """After an eviction, the outer step that failed (its timeouts, here 5 s before the catch-up) and the
    registration again (0.2 s) are network time, like the outer step the node then takes part in (1 s): the record's
    total_s holds all of them. It held that last outer step's second only, and the compute utilisation counted a
    rejoin's timeouts as training."""
    import time

    from openprime.diloco import OuterStepResult

    def join_mesh(cfg, coordinator, *, slot=-1, local_rank=0, local_mesh=None):
        time.sleep(0.2)
        return types.SimpleNamespace(node_id="node-1", local_rank=local_rank, slot=slot, close=lambda: None)

    class Rejoining:
        has_state, behind = True, False

        def rejoin(self, mesh):
            pass

        def sync(self, *, contribute):
            return OuterStepResult(outer_step=4, num_contributors=2, num_members=2, num_tries=1, skipped=False,
                                   received_state=True, contributed=False, state_hash="h", bytes_sent=0,
                                   bytes_received=10, all_reduce_s=0.5, total_s=1.0)

    monkeypatch.setattr(trainer, "join_mesh", join_mesh)
    cfg = types.SimpleNamespace(mesh=types.SimpleNamespace(num_join_tries=1))
    mesh = types.SimpleNamespace(node_id="node-1", local_rank=0, slot=1, close=lambda: None)
    before = time.monotonic()
    _, r = trainer.catch_up(cfg, "", Rejoining(), mesh, rejoin=True, local_mesh=None, started=before - 5.0)
    assert 5.2 <= r.total_s <= time.monotonic() - before + 5.0
    assert r.all_reduce_s == 0.5
    _, r = trainer.catch_up(cfg, "", Rejoining(), mesh, rejoin=True, local_mesh=None)  # a joiner: from its call
    assert 1.0 <= r.total_s < 2.0


def _mesh(slot, *, local_rank=0, inherited=None, reported=None):
    """A stand-in ElasticDeviceMesh: its data slot, what the join handed over of it, where its reports go."""
    return types.SimpleNamespace(slot=slot, local_rank=local_rank, close=lambda: None, inherited_slot_state=inherited,
                                 report_slot_state=[].append if reported is None else reported.append)


def test_a_node_granted_a_slot_another_node_held_goes_on_where_that_node_left_it():
    """The coordinator hands a node the position the slot's previous node last reported (at its outer-step barrier):
    it goes on from there, and reports its own from then on. A replacement read the slot again from the start."""
    import pathlib

    from openprime.train.recipe import recipe_config

    root = pathlib.Path(__file__).resolve().parents[3]
    cfg = recipe_config(str(root / "recipes" / "debug.py"), ["checkpoint.mode=off"])
    node = trainer.Node.__new__(trainer.Node)
    node.cfg, node.ckpt, node.local_rank, node.node = cfg, None, 0, 3
    before = trainer.build_batches(cfg, 2)
    for _ in range(25):
        next(before)
    reported = []
    node.mesh = _mesh(2, inherited=before.state_dict(), reported=reported)
    node._open_slot()
    assert node.batches.state_dict() == before.state_dict()
    assert torch.equal(next(node.batches)[0], next(before)[0])  # the batch the node before would have read next
    assert reported == [node.batches.state_dict]  # its own position, at its syncs from now on
    node.mesh = _mesh(1, inherited=before.state_dict())  # another slot's position: it does not fit, and is not used
    node._open_slot()
    assert node.batches.batch == 0 and node.batches.slot == 1


def test_members_all_evicted_at_once_keep_the_inner_training_of_the_outer_step_they_rejoin_in(monkeypatch):
    """Every member is evicted at once at the end of an outer step's inner steps (the coordinator's own link down
    longer than the eviction timeout); each rejoins through catch_up, as run_node does, and the coordinator lists none
    as new (they hold the run's state). Before 2026-12-07 every node then sent a zero pseudo-gradient: the global
    weights stayed where they were and that outer step's inner training was lost on every node."""
    import time

    from openprime.core.testing import run_threads
    from openprime.mesh import Coordinator, ElasticDeviceMesh, Evicted, MeshClient, MeshConfig
    from openprime.train.config import TransportConfig, TransportKind
    from openprime.train.transports import transport_factory

    mesh_cfg = MeshConfig(heartbeat_interval_s=0.1, num_missed_heartbeats=3, sync_timeout_s=10, min_nodes=2,
                          probe_bytes=0)
    timeouts = Timeouts(connect_s=5, op_s=5)
    factory = transport_factory(TransportConfig(kind=TransportKind.TCP), timeouts)
    coordinator = Coordinator(mesh_cfg).start()

    def mesh(name):
        client = MeshClient(coordinator.address, mesh_cfg, node_id=name)
        client.join()
        return ElasticDeviceMesh(client, transport_factory=factory, run_id=mesh_cfg.run_id, abort_poll_s=0.1,
                                 connect_timeout_s=5)

    monkeypatch.setattr(trainer, "join_mesh", lambda cfg, address, *, slot, local_rank, local_mesh:
                        mesh(f"again-{slot}"))
    cfg = types.SimpleNamespace(mesh=types.SimpleNamespace(num_join_tries=2))
    meshes = [mesh("node-0"), mesh("node-1")]
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(2)]
    replicas = [DiLoCo([params[i]], config=DiLoCoConfig(num_inner_steps=H, outer_lr=1.0, outer_momentum=0.0),
                       timeouts=timeouts, membership=meshes[i]) for i in range(2)]

    def inner_steps(i, value):
        with torch.no_grad():
            params[i].add_(value)  # what H inner steps did to this replica
        return next(r for _ in range(H) if (r := replicas[i].step()) is not None)

    try:
        first = run_threads([lambda i=i: inner_steps(i, i + 1.0) for i in range(2)])
        assert first[0].num_contributors == 2
        theta = replicas[0].state.theta.clone()
        for m in meshes:  # the coordinator hears nobody for an eviction timeout
            m.client._stop.set()
            m.client._heartbeats.join()
        while coordinator.nodes:
            time.sleep(0.02)

        def node(i):
            with pytest.raises(Evicted):
                inner_steps(i, 10.0 * (i + 1))  # the sync at the end of these inner steps finds the node evicted
            meshes[i], result = trainer.catch_up(cfg, coordinator.address, replicas[i], meshes[i], rejoin=True,
                                                 local_mesh=None, contribute=True)
            return result

        results = run_threads([lambda i=i: node(i) for i in range(2)])
        assert [r.num_contributors for r in results] == [2, 2] and not any(r.received_state for r in results)
        # Plain averaging (outer lr 1, no momentum): the global weights move by the mean of the inner updates.
        assert torch.allclose(replicas[0].state.theta, theta + 15.0)
        assert torch.equal(replicas[0].state.theta, replicas[1].state.theta)
    finally:
        for m in meshes:
            m.close()
        coordinator.stop()
