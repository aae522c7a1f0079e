"""Typed channels between executors: Python objects over point-to-point messages of a process group.

Each message is a header (payload length) and a pickled payload, sent with a per-channel tag so that
prompts, rollouts and control messages never mix. Sends do not block (buffers are kept until the transfer
completes). Receives block; `poll` never blocks: it starts a listener thread that receives into a queue
(gloo's receive handles report completion only once waited on, so they cannot be polled directly).

A transfer that fails (the peer's node died, or it was silent for the process group's timeout,
--distributed-timeout-minutes) is raised as `multinode.LostPeer` naming the peer's rank and node (for a receive
from any rank, the channel's `senders`), in the caller's thread: by `recv`/`poll` for a listener's receive, by the
next `send`/`flush` for a send. A helper thread never dies silently, which would leave its caller waiting forever.
"""

from __future__ import annotations

import pickle
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from megatron_rl.runtime.multinode import lost_peer

# The run's two channels over the sync group: controller -> generators (requests, weight versions, stop) and
# generators -> controller (finished rollouts, a group's together).
TAG_CONTROL, TAG_ROLLOUTS = 11, 12


class Channel:
    def __init__(self, group, tag: int, last_kind: str | None = None, senders: Sequence[int] = ()):
        """`last_kind`: a listener thread ends after a message `(last_kind, ...)` (so that no receive is left
        pending when the process group is destroyed). `senders`: the ranks that send on this channel, named when a
        receive from any rank fails."""
        self.group, self.tag, self.last_kind, self.senders = group, tag, last_kind, tuple(senders)
        self._queues: dict[int | None, queue.Queue] = {}
        self._sent: queue.Queue | None = None
        self._send_error: BaseException | None = None  # the first failed send, raised by send() and flush()
        self._send_lock = threading.Lock()  # a message's header and payload go out together, whatever the thread
        self.last_sent = time.monotonic()  # when the last message was sent (for a `KeepAlive`)

    def send(self, obj: Any, dst: int) -> None:
        """Never blocks: a sender thread waits for each message's completion and then frees its buffers.
        (Blocking here could deadlock: the receiver may itself be waiting for this rank elsewhere.)"""
        self._raise_send_error()
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        header = torch.tensor([payload.numel()], dtype=torch.int64)
        with self._send_lock:
            if self._sent is None:
                self._sent = queue.Queue()
                threading.Thread(target=self._complete_sends, daemon=True, name=f"channel-{self.tag}-sender").start()
            self._sent.put((self.group.send([header], dst, self.tag), header, dst))
            self._sent.put((self.group.send([payload], dst, self.tag), payload, dst))
            self.last_sent = time.monotonic()

    def _complete_sends(self) -> None:
        """Wait for each send in order; a failure is kept for the caller (and the queue still drained, so that
        `flush` returns)."""
        while True:
            work, _buffer, dst = self._sent.get()
            try:
                work.wait()
            except RuntimeError as e:
                if self._send_error is None:
                    self._send_error = lost_peer("sending to", dst, e)
            finally:
                self._sent.task_done()

    def _raise_send_error(self) -> None:
        if self._send_error is not None:
            raise self._send_error

    def flush(self) -> None:
        """Wait until every message sent so far was received (or raise why one was not)."""
        if self._sent is not None:
            self._sent.join()
        self._raise_send_error()

    def _receive(self, src: int | None) -> tuple[Any, int]:
        sender = src
        try:
            header = torch.zeros(1, dtype=torch.int64)
            if src is None:
                work = self.group.recv_anysource([header], self.tag)
            else:
                work = self.group.recv([header], src, self.tag)
            work.wait()
            sender = work.source_rank() if src is None else src
            payload = torch.empty(int(header[0]), dtype=torch.uint8)
            self.group.recv([payload], sender, self.tag).wait()
        except RuntimeError as e:  # gloo: connection closed by the peer, or the process group's timeout
            raise lost_peer("receiving from", sender, e, self.senders) from e
        return pickle.loads(payload.numpy().tobytes()), sender

    def recv(self, src: int | None = None) -> tuple[Any, int]:
        """Block for the next message (from `src`, or from anyone); returns (object, sender)."""
        if src in self._queues:  # a listener thread receives from `src`: take its next message
            return _take(self._queues[src], block=True)
        return self._receive(src)

    def poll(self, src: int | None = None) -> tuple[Any, int] | None:
        """The next message if one has arrived, else None."""
        try:
            return _take(self._listener(src), block=False)
        except queue.Empty:
            return None

    def _listener(self, src: int | None) -> queue.Queue:
        """The queue a listener thread receives messages from `src` into (started on first use)."""
        if src not in self._queues:
            q: queue.Queue = queue.Queue()
            self._queues[src] = q

            def listen():
                while True:
                    try:
                        message = self._receive(src)
                    except BaseException as e:  # noqa: BLE001 - handed to the reader, raised by recv/poll
                        q.put(e)
                        return
                    q.put(message)
                    if isinstance(message[0], tuple) and message[0] and message[0][0] == self.last_kind:
                        return

            threading.Thread(target=listen, daemon=True, name=f"channel-{self.tag}-listener").start()
        return self._queues[src]


def _take(q: queue.Queue, block: bool):
    """The next message of a listener's queue; the exception that ended the listener is raised instead, and stays
    in the queue so that every later read raises it too (nothing will arrive after it)."""
    item = q.get(block=block)
    if isinstance(item, BaseException):
        q.put(item)
        raise item
    return item
