"""The pipeline's point-to-point messages between the CPU ranks of one host over Unix stream sockets.

Why not gloo for these: a DeepSeek-V3 step of a 16-stage interleaved run crosses a stage boundary ~2,000 times
(forward activations and backward gradients of every microbatch) with messages of a few KiB, and gloo spends ~84 us
of CPU on each send or receive in the rank (``batch_isend_irecv``, its work objects) plus its event-loop thread
(``gloo_tcp_loop``: 7.4 % of all the CPU of such a run, ``perf record -e cpu-clock``); a socket exchange is a few
system calls (measured on 2 AMD EPYC cores, torch 2.13: 167 us against 20 us of CPU per send + receive pair).
The bits moved are the same: both are copies.

Used by `transport.Transport.batch` when every rank was forked on this host (the harness's fork launcher) and the
device is the CPU; torchrun and CUDA keep torch.distributed.  A rank links to its ring neighbours (pipeline ranks
p - 1 and p + 1 mod P of its EP column: stage i lives on pipeline rank i mod P, so every boundary is between
neighbours, the interleaved schedules' wrap from the last rank to the first included).

Messages are tagged (the executor's (direction, sender stage, microbatch) tag, as under gloo), so a receive can
only ever take its own message: whatever arrives first is kept by (peer, tag) until its receive is posted, and
messages of one peer and tag are received in the order they were sent (as gloo and MPI match them).  Sends
never block: what the socket does not take at once stays queued and goes out while this rank waits for anything
(a receive, or a send's `wait`), and a waiting rank reads every peer's messages as they come; so no two ranks can
wait on each other's full buffers, whatever the message size.  Each message carries its tag and length, checked
against the receive's: a peer that sent another shape fails the rank with both sizes.  A peer that is gone
(closed socket) or silent for ``timeout_s`` raises `host_channel.ChannelError` (the rank fails; the harness reaps
the run).
"""
from __future__ import annotations

import selectors
import socket
import struct
import time
from collections import deque

import torch

from .host_channel import ChannelError, _bytes, connect_peers

_HEADER = struct.Struct("<qq")      # tag, payload bytes
_IOV = 16                           # buffers handed to one sendmsg (Linux takes up to 1024)


def ring_neighbours(pp_rank: int, pipeline_size: int) -> set[int]:
    """The pipeline ranks `pp_rank` exchanges boundary tensors with: p - 1 and p + 1 mod P (none when P = 1)."""
    return {(pp_rank - 1) % pipeline_size, (pp_rank + 1) % pipeline_size} - {pp_rank}


class _Inbound:
    """The message being read from one peer: its header, then its payload into a fresh uint8 tensor; `view` is
    the bytes being filled (``got`` of them so far)."""

    def __init__(self):
        self.header, self.got, self.tag, self.payload = bytearray(_HEADER.size), 0, None, None
        self.view = memoryview(self.header)


class HostPipe:
    """Tagged messages between this rank (`rank`, a global rank) and its `peers` ({global rank: socket}).

    Build with `connect`; `send` queues a contiguous CPU tensor's bytes and returns a handle whose ``wait()``
    returns once they are all in the socket; `recv` returns the matching message as a tensor."""

    def __init__(self, rank: int, peers: dict[int, socket.socket], timeout_s: float):
        self.rank, self.peers, self.timeout_s = rank, peers, timeout_s
        self.selector = selectors.DefaultSelector()
        self.outbox: dict[int, deque] = {p: deque() for p in peers}     # memoryviews still to write, per peer
        self.written = dict.fromkeys(peers, 0)      # buffers fully written to each peer, ever
        self.inbound = {p: _Inbound() for p in peers}
        self.arrived: dict[tuple[int, int], deque] = {}     # (peer, tag) -> payloads, in the order they came
        self.closed: set[int] = set()               # peers whose end is closed (read to the end)
        for p, s in peers.items():
            s.setblocking(False)
            self.selector.register(s, selectors.EVENT_READ, p)

    @classmethod
    def connect(cls, store, key: str, rank: int, peers: set[int], timeout_s: float) -> "HostPipe":
        """Link `rank` to each of `peers` (global ranks, every peer naming this rank among its own) through
        `store` (`host_channel.connect_peers`; `key` unique among the run's groups)."""
        return cls(rank, connect_peers(store, key, rank, peers, timeout_s, f"rank {rank}"), timeout_s)

    def close(self) -> None:
        self.selector.close()
        for s in self.peers.values():
            s.close()
        self.peers = {}

    def send(self, t: torch.Tensor, peer: int, tag: int) -> "_Sent":
        """Queue contiguous CPU tensor `t` for `peer` under `tag` and write what the socket takes now; `t` must
        stay unchanged until the handle's ``wait()`` has returned."""
        payload = _bytes(t)
        queue = self.outbox[self._neighbour(peer)]
        was_idle = not queue
        queue.extend((memoryview(_HEADER.pack(tag, len(payload))), payload))
        last = self.written[peer] + len(queue)      # this message is out once that many buffers are
        if was_idle:
            self._write(peer)
        return _Sent(self, peer, last)

    def recv(self, shape: tuple, dtype: torch.dtype, peer: int, tag: int) -> torch.Tensor:
        """`peer`'s message `tag` as a new CPU tensor of `shape` and `dtype` (its bytes, no copy), waiting for it
        (meanwhile writing the queued sends and reading every peer).  Raises `ChannelError` when it has another
        length, or the peer is gone or silent for ``timeout_s``."""
        key = (self._neighbour(peer), tag)
        self._progress(lambda: key in self.arrived, peer)
        queue = self.arrived[key]
        payload = queue.popleft()
        if not queue:
            del self.arrived[key]
        out = torch.empty(0, dtype=dtype)
        nbytes = out.element_size() * torch.Size(shape).numel()
        if payload.numel() != nbytes:
            raise ChannelError(f"rank {self.rank}: rank {peer} sent {payload.numel()} bytes under tag {tag} where "
                               f"{nbytes} ({list(shape)}, {dtype}) were expected")
        return out.set_(payload.untyped_storage(), 0, shape)

    def _neighbour(self, peer: int) -> int:
        if peer not in self.peers:
            raise ChannelError(f"rank {self.rank}: rank {peer} is not linked to it (its neighbours: {sorted(self.peers)})")
        return peer

    def _write(self, peer: int) -> None:
        """Write the queue of `peer` until it is empty or the socket is full (then wait for it to drain)."""
        queue, s = self.outbox[peer], self.peers[peer]
        try:
            while queue:
                n = s.sendmsg([queue[i] for i in range(min(len(queue), _IOV))])
                while queue and n >= len(queue[0]):     # empty payloads are done as soon as they are first
                    n -= len(queue.popleft())
                    self.written[peer] += 1
                if n:
                    queue[0] = queue[0][n:]
        except BlockingIOError:
            pass
        except OSError as e:
            raise ChannelError(f"rank {self.rank}: rank {peer}: Connection closed by peer ({e})") from e
        if peer in self.closed:     # read to its end (unregistered): what is left fails the next write
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if queue else 0)
        if self.selector.get_key(s).events != events:
            self.selector.modify(s, events, peer)

    def _read(self, peer: int) -> None:
        """Read what `peer` has sent, completing messages into ``arrived``."""
        s, msg = self.peers[peer], self.inbound[peer]
        while True:
            try:
                n = s.recv_into(msg.view[msg.got:])
            except BlockingIOError:
                return
            except OSError as e:
                raise ChannelError(f"rank {self.rank}: rank {peer}: Connection closed by peer ({e})") from e
            if n == 0:                  # the peer has finished (or died): an error only if this rank waits for it
                if msg.got:
                    raise ChannelError(f"rank {self.rank}: rank {peer}: Connection closed by peer mid-message")
                self.selector.unregister(s)
                self.closed.add(peer)
                return
            msg.got += n
            if msg.got < len(msg.view):
                continue
            if msg.payload is None:
                msg.tag, size = _HEADER.unpack(msg.header)
                msg.payload, msg.got = torch.empty(size, dtype=torch.uint8), 0
                msg.view = _bytes(msg.payload)
                if size:
                    continue
            self.arrived.setdefault((peer, msg.tag), deque()).append(msg.payload)
            self.inbound[peer] = msg = _Inbound()

    def _progress(self, done, waiting_for: int) -> None:
        """Move every queued byte in and out until `done()`; `waiting_for` is named if nothing moves for
        ``timeout_s``."""
        last = time.monotonic()
        while not done():
            if waiting_for in self.closed:
                raise ChannelError(f"rank {self.rank}: rank {waiting_for}: Connection closed by peer")
            events = self.selector.select(timeout=min(1.0, self.timeout_s))
            for key, mask in events:
                if mask & selectors.EVENT_READ:
                    self._read(key.data)
                if mask & selectors.EVENT_WRITE:
                    self._write(key.data)
            if events:
                last = time.monotonic()
            elif time.monotonic() - last > self.timeout_s:
                raise ChannelError(f"rank {self.rank}: rank {waiting_for} silent for {self.timeout_s:g} s")


class _Sent:
    """A queued send: ``wait()`` returns once its bytes are all in the socket (the tensor may then change)."""

    def __init__(self, pipe: HostPipe, peer: int, last: int):
        self.pipe, self.peer, self.last = pipe, peer, last

    def wait(self) -> None:
        self.pipe._progress(lambda: self.pipe.written[self.peer] >= self.last, self.peer)
