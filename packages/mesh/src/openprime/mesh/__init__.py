"""openprime.mesh: elastic membership (INTELLECT-1 paper, section 2.2: the ElasticDeviceMesh).

A standalone coordinator with soft state, a membership client per node (heartbeats, deathrattle,
joins at outer steps), views with epochs, the outer-step barrier and commit that keep every replica
identical when nodes fail mid all-reduce, and the bandwidth-aware ring order.
"""

from openprime.mesh.client import Evicted, JoinRefused, MeshClient, View, new_node_id
from openprime.mesh.config import MeshConfig
from openprime.mesh.coordinator import Coordinator
from openprime.mesh.elastic import ElasticDeviceMesh
from openprime.mesh.ring_order import best_ring, ring_bottleneck

__all__ = ["Coordinator", "ElasticDeviceMesh", "Evicted", "JoinRefused", "MeshClient", "MeshConfig", "View",
           "best_ring", "new_node_id", "ring_bottleneck"]
