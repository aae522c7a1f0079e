"""What a launch across nodes needs beyond torchrun: naming the node a peer rank runs on when contact with it is
lost, so that a node whose peers died fails with a message saying which node vanished.

torchrun numbers global ranks node by node (node k holds ranks [k * L, (k + 1) * L) for L = --nproc-per-node,
the same on every node in examples/launch_common.sh), and every rank has MASTER_ADDR / MASTER_PORT, the address of
node 0's rendezvous store. Every wait on a peer is bounded by --distributed-timeout-minutes: torchrun's rendezvous
(examples/launch_common.sh), the process groups and their store (roles.init_roles), and the channels' receives
(channels.py), whose failures are raised as `LostPeer` in the thread that waits for the message.
"""

from __future__ import annotations

import os
from collections.abc import Sequence


class LostPeer(RuntimeError):
    """A message to or from a peer rank failed: the peer's process or node died, or it was silent for the
    process-group timeout (--distributed-timeout-minutes)."""


def master_address() -> str:
    """MASTER_ADDR:MASTER_PORT, node 0's rendezvous store, as torchrun gave it to this rank."""
    return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"


def node_of(rank: int) -> int | None:
    """The node (torchrun's node rank) that global `rank` runs on; None outside torchrun."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    return rank // per_node if per_node > 0 else None


def describe_rank(rank: int | None) -> str:
    """`rank 0 on node 0 (MASTER_ADDR 10.0.0.1:29500)`; `rank 5 on node 2 of 4`; `any rank` for None."""
    if rank is None:
        return "any rank (the address in the error below is the peer's)"
    node = node_of(rank)
    if node is None:
        return f"rank {rank}"
    nodes = os.environ.get("GROUP_WORLD_SIZE")
    where = f"rank {rank} on node {node}" + (f" of {nodes}" if nodes else "")
    return where + (f" (MASTER_ADDR {master_address()})" if node == 0 else "")


def lost_peer(action: str, rank: int | None, error: BaseException, senders: Sequence[int] = ()) -> LostPeer:
    """The error to raise when `action` ("receive from", "send to") `rank` failed with `error`. A receive from any
    rank (`rank` None) names `senders`, the ranks that send to it: a timeout names no address, so without them a
    node that vanished (nothing answers, nothing closes a connection) would go unnamed."""
    if rank is None and len(senders) == 1:
        who = describe_rank(senders[0])
    elif rank is None and senders:
        who = f"one of {', '.join(map(describe_rank, senders))} (an address in the error below is the peer's)"
    else:
        who = describe_rank(rank)
    return LostPeer(f"lost contact with {who}: {action} it failed ({error}); its node died, its "
                    f"process exited, or it sent nothing within --distributed-timeout-minutes")
