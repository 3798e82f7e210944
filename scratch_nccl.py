import os, sys, torch, torch.distributed as dist, time
def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device("cuda", rank); torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    a = torch.full((4,), float(rank), device=dev)
    mode = sys.argv[1]
    t0 = time.time()
    if rank == 0:
        if mode == "grouped":
            w = dist.batch_isend_irecv([dist.P2POp(dist.isend, a, 1), dist.P2POp(dist.isend, a + 1, 1), dist.P2POp(dist.irecv, c := torch.empty(4, device=dev), 1)])
        else:
            w = dist.batch_isend_irecv([dist.P2POp(dist.isend, a, 1)]) + dist.batch_isend_irecv([dist.P2POp(dist.isend, a + 1, 1), dist.P2POp(dist.irecv, c := torch.empty(4, device=dev), 1)])
        w[-1].wait(); torch.cuda.synchronize(); print("rank0 got", c.tolist(), time.time() - t0, flush=True)
    else:
        r = torch.empty(4, device=dev)
        dist.batch_isend_irecv([dist.P2POp(dist.irecv, r, 0)])[-1].wait(); torch.cuda.synchronize()
        print("rank1 got first", r.tolist(), flush=True)
        r2 = torch.empty(4, device=dev)
        w = dist.batch_isend_irecv([dist.P2POp(dist.isend, r * 10, 0), dist.P2POp(dist.irecv, r2, 0)])
        w[-1].wait(); torch.cuda.synchronize(); print("rank1 got second", r2.tolist(), flush=True)
    dist.destroy_process_group()
main()
