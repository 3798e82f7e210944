"""The expert-parallel collectives between the processes of one host over Unix stream sockets.

Why not gloo for these: an EP rank of a DeepSeek-V3 MoE layer issues six collectives per layer and microbatch
(dispatch and combine all-to-alls, the shard all-gathers, forward and backward) on tensors of a few KiB, and
gloo spends ~280 us of CPU on an ``all_to_all_single`` and ~450 us on an ``all_gather`` of two such processes
(its Python checks, its work queue thread, its TCP event loop: measured on 2 AMD EPYC cores, torch 2.13); a
socket exchange is two system calls per peer.  The bits moved are the same: both are copies.

Used by `model.expert_parallel.ExpertParallel` when every rank of the EP group is a CPU rank forked on this host
(the harness's fork launcher; `transport.Transport.host_channel_store`); torchrun and CUDA keep torch.distributed.

Peers exchange pairwise in rounds ``partner = rank XOR d`` (d = 1 .. n-1, so n must be a power of two; each
round pairs every rank with one other, so a rank only ever waits on its partner of the round).  Within a pair a
message that fits the socket's buffer is sent before receiving by both; a larger one goes lower rank first, the
higher rank receiving first: no two processes both wait to send, whatever the size.
Each message carries its length (8 bytes), checked against what the receiver expects: a peer that computed
other split sizes fails the rank with both numbers instead of desynchronising the stream.  A peer that is gone
(closed socket) or silent for ``timeout_s`` raises `ChannelError` (the rank fails; the harness reaps the run).
"""
from __future__ import annotations

import socket
import struct
import uuid

import torch

_LEN = struct.Struct("<q")
#: a message of at most a quarter of the socket's send buffer (Linux: ~208 KiB by default), and at most this, is
#: sent before receiving by both partners: it fits the buffer, so neither waits for the other to read, and each
#: finds the other's message already there more often (one wake-up per exchange instead of two, 2.5x less CPU
#: measured); a larger one goes lower rank first
_EAGER_MAX = 64 * 1024


class ChannelError(RuntimeError):
    """A peer of the EP group closed its end, sent another length than expected, or was silent too long."""


def usable(size: int) -> bool:
    """Whether a group of `size` ranks can use the channel: the pairwise rounds need a power of two >= 2."""
    return size >= 2 and size & (size - 1) == 0


def _bytes(t: torch.Tensor) -> memoryview:
    """The bytes of contiguous CPU tensor `t` (any dtype, bf16 included), without a copy (a copy would take a
    received message and drop it: refused)."""
    if not t.is_contiguous():
        raise ValueError(f"host channel: a non-contiguous tensor {tuple(t.shape)} / {t.stride()}")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class HostChannel:
    """Socket connections of one rank to every other rank of its group (``rank`` of ``size``), made collectively.

    Build with `connect`; `all_to_all_single` and `all_gather` mirror ``torch.distributed``'s on CPU tensors
    (contiguous, every rank calling in the same order with consistent split sizes)."""

    def __init__(self, rank: int, size: int, peers: dict[int, socket.socket], timeout_s: float):
        self.rank, self.size, self.peers, self.timeout_s = rank, size, peers, timeout_s
        self.eager_bytes = min([_EAGER_MAX] + [s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 4
                                               for s in peers.values()])

    @classmethod
    def connect(cls, store, key: str, rank: int, size: int, timeout_s: float) -> "HostChannel":
        """Connect the `size` ranks of a group, every pair (`connect_peers`).  `key` names the group, the same
        string on its ranks and unique among the run's groups.  Raises `ChannelError` when a peer does not arrive
        within `timeout_s`."""
        if not usable(size):
            raise ValueError(f"a host channel needs a power-of-two group size >= 2, not {size}")
        peers = connect_peers(store, key, rank, set(range(size)) - {rank}, timeout_s, f"EP rank {rank}")
        return cls(rank, size, peers, timeout_s)

    def close(self) -> None:
        for s in self.peers.values():
            s.close()
        self.peers = {}

    def _exchange(self, partner: int, send: torch.Tensor, recv: torch.Tensor) -> None:
        """Send all of `send` to `partner` and fill all of `recv` from it: both send first when the message fits
        ``eager_bytes``, else the lower rank sends first."""
        s, payload = self.peers[partner], _bytes(send)
        try:
            if self.rank < partner or len(payload) <= self.eager_bytes:
                _send(s, payload)
                self._receive(s, partner, recv)
            else:
                self._receive(s, partner, recv)
                _send(s, payload)
        except socket.timeout as e:
            raise ChannelError(f"EP rank {self.rank}: EP rank {partner} silent for {self.timeout_s:g} s") from e
        except OSError as e:
            raise ChannelError(f"EP rank {self.rank}: EP rank {partner} is gone ({e})") from e

    def _receive(self, s: socket.socket, partner: int, recv: torch.Tensor) -> None:
        view, who = _bytes(recv), f"EP rank {self.rank}: EP rank {partner}"
        (n,) = _LEN.unpack(_recv_exact(s, _LEN.size, who))
        if n != len(view):
            raise ChannelError(f"{who} sent {n} bytes where {len(view)} were expected (the ranks disagree on the "
                               "split sizes)")
        _fill(s, view, who)

    def all_to_all_single(self, out: torch.Tensor, src: torch.Tensor, out_splits: list[int],
                          in_splits: list[int]) -> None:
        """``dist.all_to_all_single(out, src, out_splits, in_splits)``: rows ``in_splits[j]`` of `src` (in order)
        to rank j; `out` receives ``out_splits[i]`` rows from rank i, in rank order.  src [sum(in_splits), ...],
        out [sum(out_splits), ...], contiguous, same dtype."""
        sent, received = src.split(in_splits), out.split(out_splits)
        received[self.rank].copy_(sent[self.rank])
        for d in range(1, self.size):
            partner = self.rank ^ d
            self._exchange(partner, sent[partner], received[partner])

    def all_gather(self, parts: list[torch.Tensor], src: torch.Tensor) -> None:
        """``dist.all_gather(parts, src)``: ``parts[i]`` <- rank i's `src` (every rank's of the same shape)."""
        parts[self.rank].copy_(src)
        for d in range(1, self.size):
            partner = self.rank ^ d
            self._exchange(partner, src, parts[partner])


def connect_peers(store, key: str, rank: int, peers: set[int], timeout_s: float, who: str) -> dict[int, socket.socket]:
    """A stream socket to each of `peers` (ids in one numbering with `rank`; every peer names this rank among its
    own), made collectively: each rank listens on an abstract Unix address (no file, gone with the process)
    published under ``<key>/<rank>`` in `store` (the process group's store), then connects to every lower peer and
    accepts every higher one.  The sockets block, with `timeout_s`.  Raises `ChannelError` (`who` names this rank)
    when a peer does not arrive within `timeout_s`, or one that is not among `peers` does."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    address = f"\0bitparity-{uuid.uuid4().hex}"
    listener.bind(address)
    listener.listen(max(1, len(peers)))
    listener.settimeout(timeout_s)
    store.set(f"{key}/{rank}", address)
    out: dict[int, socket.socket] = {}
    try:
        for lower in sorted(p for p in peers if p < rank):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(timeout_s)
            s.connect(store.get(f"{key}/{lower}").decode())
            s.sendall(_LEN.pack(rank))
            out[lower] = s
        for _ in [p for p in peers if p > rank]:
            s, _ = listener.accept()
            s.settimeout(timeout_s)
            (higher,) = _LEN.unpack(_recv_exact(s, _LEN.size, "a joining peer"))
            if higher not in peers or higher in out:
                raise ChannelError(f"{who}: rank {higher} joined group {key!r}, which expects {sorted(peers)}")
            out[higher] = s
    except socket.timeout as e:
        raise ChannelError(f"{who}: a peer of group {key!r} did not connect within {timeout_s:g} s") from e
    finally:
        listener.close()
    return out


def _send(s: socket.socket, payload: memoryview) -> None:
    """The length and the payload, in one system call when the socket takes them whole (``sendmsg`` may send
    part: the rest goes with ``sendall``)."""
    header = _LEN.pack(len(payload))
    sent = s.sendmsg([header, payload])
    if sent < len(header):
        s.sendall(header[sent:])
        s.sendall(payload)
    elif sent < len(header) + len(payload):
        s.sendall(payload[sent - len(header):])


def _fill(s: socket.socket, view: memoryview, who: str) -> None:
    """Receive exactly ``len(view)`` bytes into `view`; `who` names the peer if it closes first."""
    got = 0
    while got < len(view):
        k = s.recv_into(view[got:])
        if k == 0:
            raise ChannelError(f"{who} closed the connection")
        got += k


def _recv_exact(s: socket.socket, n: int, who: str) -> bytes:
    buf = bytearray(n)
    _fill(s, memoryview(buf), who)
    return bytes(buf)
