"""A real torch.distributed job for tests, started by torchrun on one or more nodes (gloo, CPU only).

Every rank joins the group torchrun describes in its environment (RANK, WORLD_SIZE, MASTER_ADDR, ...),
all-reduces (sums) the tensor [rank + 1], prints what it got, and states the result as an `orch-metric`
line, which orch records for any job. Each rank checks the sum it got against world_size * (world_size +
1) / 2 and exits 1 when it differs.

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 --master-addr HEAD --master-port P allreduce_job.py
"""

import os
import sys

import torch
import torch.distributed as dist


def main() -> int:
    dist.init_process_group("gloo")  # env:// from torchrun's variables
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        node = os.environ.get("GROUP_RANK", "?")  # torchrun's node rank
        tensor = torch.tensor([float(rank + 1)])
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        result = tensor.item()
        expected = world * (world + 1) / 2
        print(f"rank {rank} of world size {world} on node {node}: all_reduce sum = {result:g}", flush=True)
        print(f"orch-metric allreduce_sum={result:g} world_size={world} rank={rank}", flush=True)
        dist.barrier()  # no rank leaves (and tears down the store) before all have reduced
        if result != expected:
            print(f"rank {rank}: expected {expected:g}", file=sys.stderr, flush=True)
            return 1
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
