"""A receive from any rank that times out (a peer node gone silent: no connection closes, so gloo's error names no
address) names the ranks that send on the channel: the controller's rollout channel is how node 0 waits for the
generators, and without this a lost generator node was reported as "any rank"."""

import datetime
import threading

import pytest
import torch.distributed as dist

from megatron_rl.runtime.channels import Channel
from megatron_rl.runtime.multinode import LostPeer, lost_peer


def _gloo_pair(timeout_s: float = 1.0) -> dict:
    """A real gloo group of 2 ranks in this process, rank -> its ProcessGroup (each connects in a thread of its
    own, since each blocks until the other is there); every wait on it times out after `timeout_s`."""
    store, groups = dist.HashStore(), {}

    def connect(rank):
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=timeout_s))

    threads = [threading.Thread(target=connect, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return groups


def test_a_silent_sender_is_named_when_a_receive_from_any_rank_times_out(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one rank per node: rank 1 is on node 1
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    groups = _gloo_pair()
    with pytest.raises(LostPeer, match=r"^lost contact with rank 1 on node 1 of 2: receiving from it failed \("):
        Channel(groups[0], 12, senders=[1]).recv()  # rank 1 sends nothing
    monkeypatch.setenv("GROUP_WORLD_SIZE", "4")  # several senders: which one fell silent is not known
    error = lost_peer("receiving from", None, RuntimeError("timed out"), senders=[1, 3])
    assert str(error).startswith("lost contact with one of rank 1 on node 1 of 4, rank 3 on node 3 of 4 (")


def test_keep_alives_let_two_idle_ranks_outwait_the_group_timeout(monkeypatch):
    """Rank 0 has nothing to send for 2.5 timeouts; its `KeepAlive` sends "keep-alive", rank 1 answers "alive" (as a
    generator leader does), and neither side's 1 s receive times out."""
    from megatron_rl.runtime.channels import TAG_CONTROL, TAG_ROLLOUTS
    from megatron_rl.runtime.keep_alive import KeepAlive

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    groups = _gloo_pair()
    received, errors = [], []

    def idle_generator():
        control, rollouts = Channel(groups[1], TAG_CONTROL), Channel(groups[1], TAG_ROLLOUTS)
        try:
            while (message := control.recv(0)[0])[0] != "stop":
                received.append(message[0])
                rollouts.send(("alive", None), 0)
            rollouts.flush()
        except LostPeer as e:
            errors.append(e)

    generator = threading.Thread(target=idle_generator)
    generator.start()
    control, rollouts = Channel(groups[0], TAG_CONTROL), Channel(groups[0], TAG_ROLLOUTS)
    keep_alive = KeepAlive(0.4, lambda: control.last_sent, lambda: control.send(("keep-alive", None), 1))
    answers = [rollouts.recv(1)[0] for _ in range(6)]  # each within 0.5 s of the last: no 1 s timeout
    keep_alive.stop()
    control.send(("stop", None), 1)
    control.flush()
    generator.join(30)
    assert not errors and answers == [("alive", None)] * 6 and received[:6] == ["keep-alive"] * 6
