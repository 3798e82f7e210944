"""The EP collectives over host sockets (reference_impl/host_channel.py): the bytes of torch.distributed's
``all_to_all_single`` / ``all_gather`` on every rank, and a peer that is silent, gone or out of step fails the
rank with one line instead of hanging it or desynchronising the stream.

Each test runs spawned processes that rendezvous through a FileStore, as the fork launcher's ranks do; the
end-to-end EP runs (tests/test_expert_parallel.py, cases/dsv3.yaml's ep2 variants) use the channel too, and
that module's two-process test keeps gloo's path covered.
"""
import json
import time
from pathlib import Path

import pytest
import torch
from conftest import spawn_ranks

from reference_impl.host_channel import ChannelError, HostChannel, usable

DTYPES = (torch.float32, torch.bfloat16, torch.int64)


def _rows(src: int, dst: int, n: int, dtype, width=(3,)) -> torch.Tensor:
    """The rows rank `src` sends to rank `dst`: values that name both, so a misdelivered row shows."""
    base = torch.arange(n * width[0], dtype=torch.float32).view(n, *width) + 1000 * src + 100 * dst
    return base.to(dtype)


def _splits(world: int) -> list[list[int]]:
    """splits[src][dst]: uneven, with zeros (rank 1 sends nothing to rank 0, rank 0 nothing to itself)."""
    return [[(src * 3 + dst * 2 + 1) % 5 if (src, dst) not in ((1, 0), (0, 0)) else 0 for dst in range(world)]
            for src in range(world)]


def _worker(rank: int, world: int, store_path: str, out_path: str, scenario: str) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    res: dict = {}
    timeout = 1.0 if scenario != "equal" else 60.0
    ch = HostChannel.connect(store, "g", rank, world, timeout)
    try:
        if scenario == "equal":
            splits = _splits(world)
            for dtype in DTYPES:
                src = torch.cat([_rows(rank, d, splits[rank][d], dtype) for d in range(world)])
                out = torch.empty(sum(splits[s][rank] for s in range(world)), 3, dtype=dtype)
                ch.all_to_all_single(out, src, [splits[s][rank] for s in range(world)], splits[rank])
                want = torch.cat([_rows(s, rank, splits[s][rank], dtype) for s in range(world)])
                res[f"a2a_{dtype}"] = torch.equal(out, want)
                parts = [torch.empty(2, 3, dtype=dtype) for _ in range(world)]
                ch.all_gather(parts, _rows(rank, 0, 2, dtype))
                res[f"gather_{dtype}"] = all(torch.equal(p, _rows(s, 0, 2, dtype)) for s, p in enumerate(parts))
            # 1 MiB per peer: past the eager size, so the lower rank sends first (no two ranks both blocked sending)
            big = [torch.full((1 << 18,), float(1000 * rank + d)) for d in range(world)]
            out = torch.empty(world << 18)
            ch.all_to_all_single(out, torch.cat(big), [1 << 18] * world, [1 << 18] * world)
            res["big"] = torch.equal(out, torch.cat([torch.full((1 << 18,), float(1000 * s + rank))
                                                     for s in range(world)]))
        elif scenario == "silent":
            if rank == 1:
                time.sleep(3)           # past rank 0's 1 s
            else:
                parts = [torch.empty(2, 3) for _ in range(world)]
                ch.all_gather(parts, torch.zeros(2, 3))
        elif scenario == "gone":
            if rank == 0:
                time.sleep(0.5)         # rank 1 has exited and closed its end
                parts = [torch.empty(2, 3) for _ in range(world)]
                ch.all_gather(parts, torch.zeros(2, 3))
        elif scenario == "mismatch":
            # rank 1 believes it sends 3 rows to rank 0, rank 0 that it receives 1
            out_splits, in_splits = ([1, 1], [1, 1]) if rank == 0 else ([1, 0], [3, 0])
            ch.all_to_all_single(torch.empty(sum(out_splits), 3), torch.zeros(sum(in_splits), 3), out_splits,
                                 in_splits)
    except ChannelError as e:
        res["error"] = str(e)
    finally:
        ch.close()
    Path(out_path).write_text(json.dumps(res))


def _run(tmp_path: Path, world: int, scenario: str) -> list[dict]:
    return spawn_ranks(_worker, tmp_path, world, scenario)


def test_usable_sizes():
    assert [n for n in range(1, 17) if usable(n)] == [2, 4, 8, 16]


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_deliver_every_rows_bytes_to_its_rank(tmp_path, world):
    for r, res in enumerate(_run(tmp_path, world, "equal")):
        assert "error" not in res, (r, res)
        assert res and all(res.values()), (r, res)


def test_a_silent_peer_times_out_and_a_gone_peer_fails(tmp_path):
    for sub in ("s", "g"):
        (tmp_path / sub).mkdir()
    silent = _run(tmp_path / "s", 2, "silent")
    assert "EP rank 1 silent for 1 s" in silent[0]["error"]
    gone = _run(tmp_path / "g", 2, "gone")
    assert "EP rank 1" in gone[0]["error"] and ("closed" in gone[0]["error"] or "gone" in gone[0]["error"])


def test_ranks_that_disagree_on_the_splits_fail_with_both_sizes(tmp_path):
    res = _run(tmp_path, 2, "mismatch")
    assert "EP rank 1 sent 36 bytes where 12 were expected" in res[0]["error"]


def test_the_channel_is_used_by_cpu_ranks_of_the_fork_launcher_in_power_of_two_groups():
    from reference_impl.transport import Transport
    store = object()

    def transport(device="cpu", staged=False, ep=2, host_store=store):
        return Transport("gloo", torch.device(device), staged, {}, expert_model_parallel_size=ep,
                         host_store=host_store)

    assert transport().host_channel_store is store
    assert "host sockets" in transport().description
    assert transport(ep=4).host_channel_store is store
    assert transport(host_store=None).host_channel_store is None                # torchrun: env:// rendezvous
    assert transport(ep=1).host_channel_store is None and transport(ep=3).host_channel_store is None
    assert transport("cuda", staged=True).host_channel_store is None            # CUDA keeps gloo (not measured)
    assert "host sockets" not in transport(host_store=None).description
