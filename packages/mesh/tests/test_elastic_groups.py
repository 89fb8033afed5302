"""ElasticDeviceMesh builds each try's group: a group that cannot be built fails the try, never the process."""

from __future__ import annotations

import pytest
import torch

from openprime.core.errors import PeerFailure
from openprime.mesh import ElasticDeviceMesh, MeshClient, MeshConfig
from openprime.mesh.client import View


@pytest.mark.parametrize("error", [RuntimeError("DistNetworkError: failed to connect to 127.0.0.1:9"),
                                   ConnectionRefusedError(111, "Connection refused"), PeerFailure(1, "no answer"),
                                   OSError()],
                         ids=["store unreachable", "socket refused", "peer failure", "no message"])
def test_a_group_that_cannot_be_built_fails_the_try_not_the_node(error):
    """The tcp and zmq transports reach the rendezvous store (in the coordinator) in their constructor; a store that
    is down, the coordinator having restarted after it sent the view, raised torch's DistNetworkError (a
    RuntimeError) out of begin() and the node process died, where a PeerFailure failed only the try."""
    def factory(rendezvous, rank, world_size):
        raise error

    client = MeshClient("127.0.0.1:9", MeshConfig(), node_id="node-0")  # never started: no socket is opened
    mesh = ElasticDeviceMesh(client, transport_factory=factory, run_id="run", abort_poll_s=1.0, connect_timeout_s=1.0)
    view = View(epoch=2, members=("node-0", "node-1"), new=(), step=5, attempt=0, skip=False,
                slots=(("node-0", 0), ("node-1", 1)))
    try:
        mesh._rebuild(view, 0, "127.0.0.1:9")
        with pytest.raises(PeerFailure, match="group not built"):
            mesh._transport.isend(1, 0, [torch.zeros(1)], deadline=0.0)
    finally:
        client.close(leave=False)


def test_the_links_are_probed_once_the_caller_is_done_with_the_group_not_at_the_commit():
    """DiLoCo counts the traffic of its hashes' comparison after the commit, on the same transport: a probe started in
    commit() moved bytes there that the outer step counted and the next round counted again (`_probed`)."""
    client = MeshClient("127.0.0.1:9", MeshConfig(), node_id="node-0")  # never started: no socket is opened
    mesh = ElasticDeviceMesh(client, transport_factory=None, run_id="run", abort_poll_s=1.0, connect_timeout_s=1.0,
                             probe_bytes=1 << 10)
    mesh.view = View(epoch=2, members=("node-0", "node-1", "node-2"), new=(), step=5, attempt=0, skip=False,
                     slots=(("node-0", 0), ("node-1", 1), ("node-2", 2)))
    mesh._epoch = 2
    started = []
    mesh._start_probe = lambda: started.append(mesh._epoch)
    mesh._on_rank0 = lambda call: True  # the coordinator applies the try
    try:
        assert mesh.commit(5, 0, True) and started == []
        mesh.idle()
        mesh.idle()
        assert started == [2]  # once, when told
        mesh._probed_epoch = -1  # not yet measured (the stand-in did not record it): due again at the next commit
        assert mesh.commit(6, 0, True)
        mesh.abandon()  # the hashes' comparison failed: the group is closed, nothing to probe
        mesh.idle()
        assert started == [2]
    finally:
        client.close(leave=False)
