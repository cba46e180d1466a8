"""Reaching and driving a host: SSH, orch's agent on the host, the backends (an SSH host, this machine, a Slurm cluster), GPUs, leases, patching."""
