"""Typed channels between executors: Python objects over point-to-point messages of a process group.

Each message is a header (payload length) and a pickled payload, sent with a per-channel tag so that
prompts, rollouts and control messages never mix. Sends do not block (buffers are kept until the transfer
completes). Receives block; `poll` never blocks: it starts a listener thread that receives into a queue
(gloo's receive handles report completion only once waited on, so they cannot be polled directly).
"""

from __future__ import annotations

import pickle
import queue
import threading
from typing import Any

import torch

# The run's two channels over the sync group: controller -> generators (requests, weight versions, stop) and
# generators -> controller (finished rollouts, a group's together).
TAG_CONTROL, TAG_ROLLOUTS = 11, 12


class Channel:
    def __init__(self, group, tag: int, last_kind: str | None = None):
        """`last_kind`: a listener thread ends after a message `(last_kind, ...)` (so that no receive is left
        pending when the process group is destroyed)."""
        self.group, self.tag, self.last_kind = group, tag, last_kind
        self._queues: dict[int | None, queue.Queue] = {}
        self._sent: queue.Queue | None = None

    def send(self, obj: Any, dst: int) -> None:
        """Never blocks: a sender thread waits for each message's completion and then frees its buffers.
        (Blocking here could deadlock: the receiver may itself be waiting for this rank elsewhere.)"""
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        header = torch.tensor([payload.numel()], dtype=torch.int64)
        if self._sent is None:
            self._sent = queue.Queue()
            threading.Thread(target=self._complete_sends, daemon=True, name=f"channel-{self.tag}-sender").start()
        self._sent.put((self.group.send([header], dst, self.tag), header))
        self._sent.put((self.group.send([payload], dst, self.tag), payload))

    def _complete_sends(self) -> None:
        while True:
            work, _buffer = self._sent.get()
            work.wait()
            self._sent.task_done()

    def flush(self) -> None:
        """Wait until every message sent so far was received."""
        if self._sent is not None:
            self._sent.join()

    def _receive(self, src: int | None) -> tuple[Any, int]:
        header = torch.zeros(1, dtype=torch.int64)
        if src is None:
            work = self.group.recv_anysource([header], self.tag)
        else:
            work = self.group.recv([header], src, self.tag)
        work.wait()
        sender = work.source_rank() if src is None else src
        payload = torch.empty(int(header[0]), dtype=torch.uint8)
        self.group.recv([payload], sender, self.tag).wait()
        return pickle.loads(payload.numpy().tobytes()), sender

    def recv(self, src: int | None = None) -> tuple[Any, int]:
        """Block for the next message (from `src`, or from anyone); returns (object, sender)."""
        if src in self._queues:  # a listener thread receives from `src`: take its next message
            return self._queues[src].get()
        return self._receive(src)

    def poll(self, src: int | None = None) -> tuple[Any, int] | None:
        """The next message if one has arrived, else None."""
        try:
            return self._listener(src).get_nowait()
        except queue.Empty:
            return None

    def _listener(self, src: int | None) -> queue.Queue:
        """The queue a listener thread receives messages from `src` into (started on first use)."""
        if src not in self._queues:
            q: queue.Queue = queue.Queue()
            self._queues[src] = q

            def listen():
                while True:
                    message = self._receive(src)
                    q.put(message)
                    if isinstance(message[0], tuple) and message[0] and message[0][0] == self.last_kind:
                        return

            threading.Thread(target=listen, daemon=True, name=f"channel-{self.tag}-listener").start()
        return self._queues[src]
