"""The pipeline's boundary messages over host sockets (reference_impl/host_pipe.py): every tensor's bytes reach the
receive of its (peer, tag), whatever the size (past the socket's buffer, with every rank sending before it
receives) and the order receives are posted in; a peer that has finished does not fail a rank that no longer
needs it, and a peer that is silent, gone or sends another size fails the waiting rank with one line.

The processes are spawned and rendezvous through a FileStore, as the fork launcher's ranks do; the end-to-end
check is tests/test_launchers.py (the fork launcher's runs over these sockets bitwise equal to torchrun's over
gloo) and every multi-stage case of the suite."""
import json
import time
from pathlib import Path

import pytest
import torch
from conftest import spawn_ranks

from reference_impl.host_channel import ChannelError
from reference_impl.host_pipe import HostPipe, ring_neighbours

DTYPES = (torch.float32, torch.bfloat16, torch.int64)
SIZES = (0, 7, 1 << 20)         # 1 Mi elements: 2-8 MiB, past any socket buffer


def _message(src: int, dst: int, dtype, n: int) -> torch.Tensor:
    """What `src` sends `dst`: values naming both, so a misdelivered message shows."""
    return (torch.arange(n, dtype=torch.float64) % 251 + 1000 * src + 100 * dst).to(dtype)


def _tag(src: int, dtype, n: int) -> int:
    return src * 100 + DTYPES.index(dtype) * 10 + SIZES.index(n)


def _worker(rank: int, world: int, store_path: str, out_path: str, scenario: str) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    res: dict = {}
    pipe = HostPipe.connect(store, "pipeline", rank, ring_neighbours(rank, world), 1.0 if scenario != "equal" else 60.0)
    try:
        if scenario == "equal":
            peers = sorted(ring_neighbours(rank, world))
            sent = [pipe.send(_message(rank, q, dtype, n), q, _tag(rank, dtype, n))
                    for q in peers for dtype in DTYPES for n in SIZES]
            # received in the reverse of the order they were sent: each waits for its own tag
            for q in reversed(peers):
                for dtype in reversed(DTYPES):
                    for n in reversed(SIZES):
                        got = pipe.recv((n,), dtype, q, _tag(q, dtype, n))
                        res[f"{q}/{dtype}/{n}"] = torch.equal(got, _message(q, rank, dtype, n))
            for s in sent:
                s.wait()
            if rank == world - 1:       # done: closes its end while the others still talk
                return
            partner = 1 - rank
            # one tag twice (the same boundary of the next step): received in the order sent
            for k in range(2):
                pipe.send(_message(rank, partner, torch.float32, 3 + k), partner, 999)
            res["same_tag_in_order"] = all(torch.equal(pipe.recv((3 + k,), torch.float32, partner, 999),
                                                        _message(partner, rank, torch.float32, 3 + k)) for k in range(2))
            time.sleep(0.3)
            pipe.send(_message(rank, partner, torch.float32, 5), partner, 1).wait()
            res["after_a_peer_finished"] = torch.equal(pipe.recv((5,), torch.float32, partner, 1),
                                                       _message(partner, rank, torch.float32, 5))
        elif scenario == "silent":
            if rank == 1:
                time.sleep(3)           # past rank 0's 1 s
            else:
                pipe.recv((2,), torch.float32, 1, 0)
        elif scenario == "gone":
            if rank == 0:
                time.sleep(0.5)         # rank 1 has exited and closed its end
                pipe.recv((2,), torch.float32, 1, 0)
        elif scenario == "mismatch":
            if rank == 1:
                pipe.send(torch.zeros(3), 0, 5).wait()
            else:
                pipe.recv((1,), torch.float32, 1, 5)
    except ChannelError as e:
        res["error"] = str(e)
    finally:
        pipe.close()
        Path(out_path).write_text(json.dumps(res))


def _run(tmp_path: Path, world: int, scenario: str) -> list[dict]:
    return spawn_ranks(_worker, tmp_path, world, scenario)


def test_ring_neighbours():
    assert [ring_neighbours(p, 4) for p in range(4)] == [{3, 1}, {0, 2}, {1, 3}, {2, 0}]
    assert ring_neighbours(0, 2) == {1} and ring_neighbours(0, 1) == set()


def test_every_message_reaches_the_receive_of_its_tag_whatever_its_size_and_order(tmp_path):
    res = _run(tmp_path, 3, "equal")
    for r in range(3):
        assert "error" not in res[r], (r, res[r])
        assert len(res[r]) == 2 * len(DTYPES) * len(SIZES) + 2 * (r < 2) and all(res[r].values()), (r, res[r])


@pytest.mark.parametrize("scenario, line", [
    ("silent", "rank 0: rank 1 silent for 1 s"),
    ("gone", "rank 0: rank 1: Connection closed by peer"),
    ("mismatch", "rank 0: rank 1 sent 12 bytes under tag 5 where 4 ([1], torch.float32) were expected"),
])
def test_a_silent_gone_or_mismatched_peer_fails_the_waiting_rank(tmp_path, scenario, line):
    assert _run(tmp_path, 2, scenario)[0].get("error") == line
