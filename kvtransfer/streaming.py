"""`LayerStreamer`: push one request's KV to a decode worker layer chunk by layer chunk, behind prefill.

The prefill worker creates one per request (after decode reserved `remote_ids`), calls `layers_done(n)`
each time the first n layers of the request's blocks are computed (on CUDA: right after *launching* them;
the write waits on the device for the caller's stream), and `finish()` once all layers are done. Each
call pushes the newly completed layers as one write (one message or copy per chunk of blocks); the
notification is sent once every write succeeded, so the decode side sees it only when all layers landed.
"""

from __future__ import annotations

from collections.abc import Sequence

from .agent import KVAgent
from .errors import TransferError
from .handle import TransferHandle


class LayerStreamer:
    def __init__(self, agent: KVAgent, remote: str, local_ids: Sequence[int], remote_ids: Sequence[int],
                 num_layers: int, notify: bytes | None = None, timeout: float | None = None) -> None:
        self._agent = agent
        self._remote = remote
        self._local = list(local_ids)
        self._remote_ids = list(remote_ids)
        self._num_layers = num_layers
        self._notify = notify
        self._timeout = timeout
        self._sent = 0  # layers [0, _sent) have been handed to writes
        self.handles: list[TransferHandle] = []

    def layers_done(self, upto: int) -> TransferHandle | None:
        """Layers [0, upto) are computed (or queued on the caller's stream): push the new ones."""
        if not self._sent < upto <= self._num_layers:
            if upto == self._sent:
                return None
            raise ValueError(f"layers_done({upto}) after {self._sent} of {self._num_layers} layers")
        h = self._agent.write(self._remote, self._local, self._remote_ids, layers=(self._sent, upto),
                              timeout=self._timeout)
        self._sent = upto
        self.handles.append(h)
        if upto == self._num_layers and self._notify is not None:
            self.handles.append(self._agent.notify_after(self._remote, self._notify, list(self.handles),
                                                         timeout=self._timeout))
        return h

    def finish(self) -> None:
        """Push what is left; the notification goes with the last write."""
        self.layers_done(self._num_layers)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every write; raise the first failure (TransferError)."""
        errors: list[TransferError] = []
        for h in self.handles:
            try:
                h.wait(timeout)
            except TransferError as e:
                errors.append(e)
        if errors:
            raise errors[0]
