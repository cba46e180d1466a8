"""A diagnosis for each failure: the first signature that an error matches gives a short remedy and where
that advice comes from (the engine's own message or docs). Every error kind has a fallback.

A signature looks at the error's kind, at its class, message and chain (and for some, the log lines around
it: the frames that say a CUDA graph was being captured), and at the phase the run was in when it failed.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple


class Signature(NamedTuple):
    name: str
    kinds: tuple[str, ...]  # error kinds it applies to; () for any
    pattern: re.Pattern[str]
    hint: str
    source: str
    phases: tuple[str, ...] = ()  # phases it applies to; () for any
    context: bool = False  # the lines around the error count too, not only its class, message and chain
    device: str = ""  # 'cpu' or 'gpu': only for an engine on that device ('' for any)
    exception: re.Pattern[str] | None = None  # the error's class must be one of these


def sig(name: str, kinds: str, pattern: str, hint: str, source: str, phases: str = "",
        context: bool = False, device: str = "", exception: str | None = None) -> Signature:
    return Signature(name, tuple(kinds.split()), re.compile(pattern, re.IGNORECASE), hint, source,
                     tuple(phases.split()), context, device, re.compile(exception) if exception else None)


# vLLM's CPU backend sizes its KV cache from VLLM_CPU_KVCACHE_SPACE (GiB) or --kv-cache-memory-bytes, and reads
# --gpu-memory-utilization as the share of the host's RAM: GPU advice (nvidia-smi, more GPUs) does not apply.
_CPU_KV = "VLLM_CPU_KVCACHE_SPACE (GiB) or --kv-cache-memory-bytes"
_VLLM_CPU = "vLLM's message; vLLM docs, CPU installation"


_SGLANG_GRAPHS = "SGLang's own message on a failed CUDA graph capture"
SIGNATURES: list[Signature] = [
    sig("engine_core_killed", "killed", r"engine core exited unexpectedly",
        "vLLM's engine core process was killed (SIGKILL: the kernel's OOM killer, or a person): the tracebacks "
        "after it are its consequence; check dmesg and the host's free memory", "vLLM's warning 'engine core "
        "exited unexpectedly'"),
    sig("sglang_mem_fraction", "", r"Not enough memory\. Please try to increase --mem-fraction-static",
        "the KV cache got no memory: increase --mem-fraction-static (or free the GPUs)", "SGLang's message"),
    sig("kv_cache_blocks", "", r"No available memory for the cache blocks",
        "no memory left for the KV cache after the weights: raise --gpu-memory-utilization, lower "
        "--max-model-len or use more GPUs", "vLLM's message", device="gpu"),
    sig("startup_free_memory", "", r"on startup is less than|Externally held weights",
        "other processes hold GPU memory: free the GPUs (nvidia-smi) or lower --gpu-memory-utilization",
        "vLLM's message 'Decrease GPU memory utilization or reduce GPU memory used by other processes'",
        device="gpu"),
    sig("max_model_len_derived", "", r"is greater than the derived max_model_len",
        "--max-model-len exceeds the model's context: lower it, or set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 if "
        "you mean it", "vLLM's message"),
    sig("cpu_kv_cache_blocks", "", r"No available memory for the cache blocks",
        f"no memory left for the KV cache: give it some with {_CPU_KV}", _VLLM_CPU, device="cpu"),
    sig("cpu_startup_memory", "", r"on startup is less than|Externally held weights",
        f"the host has less free RAM than vLLM asks for: lower --gpu-memory-utilization (on the CPU the share of "
        f"RAM), or size the KV cache with {_CPU_KV}; stop other processes that hold memory", _VLLM_CPU,
        device="cpu"),
    sig("cpu_kv_cache_too_small", "config_error", r"max seq len|KV cache|max_model_len",
        f"max_model_len is larger than the KV cache holds: lower --max-model-len, or give the KV cache more "
        f"with {_CPU_KV}", _VLLM_CPU, device="cpu"),
    sig("cpu_oom", "cuda_oom", r".",
        f"memory ran out: lower --max-model-len or --max-num-seqs, or size the KV cache with {_CPU_KV}",
        _VLLM_CPU, device="cpu"),
    sig("kv_cache_too_small", "config_error", r"max seq len|KV cache|max_model_len",
        "max_model_len is larger than the KV cache holds: lower --max-model-len, or raise "
        "--gpu-memory-utilization / the tensor parallel size", "vLLM's message"),
    sig("oom_capture", "cuda_oom",
        r"Capture (?:[\w -]+ )?cuda graph failed[^\n]*(?:out of memory|OutOfMemory)|capture_end|cuda_graph"
        r"|graph capture",
        "out of memory while capturing CUDA graphs: lower --cuda-graph-max-bs (SGLang) or --max-num-seqs / "
        "--gpu-memory-utilization (vLLM), lower --mem-fraction-static, or disable graphs to confirm "
        "(--disable-cuda-graph; vLLM --enforce-eager)", _SGLANG_GRAPHS + "; vLLM docs, conserving memory",
        context=True),
    sig("oom_during_capture", "cuda_oom", r".",
        "out of memory while capturing CUDA graphs: lower --cuda-graph-max-bs "
        "(SGLang) or --max-num-seqs (vLLM), or --mem-fraction-static / --gpu-memory-utilization",
        _SGLANG_GRAPHS, phases="capturing"),
    sig("prefill_graph_failed", "", r"Capture prefill CUDA graph failed",
        "prefill CUDA graph capture failed: set --cuda-graph-backend-prefill=disabled, or lower "
        "--mem-fraction-static", "SGLang 0.5.23's message on a failed prefill capture"),
    sig("graph_capture_failed", "", r"Capture (?:[\w -]+ )?(?:cuda|cpu) graph failed",
        "CUDA graph capture failed: lower --mem-fraction-static or --cuda-graph-max-bs; disabling graphs "
        "(--disable-cuda-graph) tells whether the graphs are the cause", _SGLANG_GRAPHS),
    sig("oom_loading", "cuda_oom", r"Failed to load model - not enough GPU memory|load_weights|load_model"
        r"|weight_loader|checkpoint shards",
        "out of memory while loading the weights: more GPUs (--tp-size / --tensor-parallel-size), a quantised"
        " "
        "checkpoint, or less memory held by other processes", "vLLM's message 'Failed to load model - not "
        "enough GPU memory'", context=True),
    sig("oom_loading_phase", "cuda_oom", r".", "out of memory while loading the weights: more GPUs "
        "(--tp-size / --tensor-parallel-size) or a quantised checkpoint", "vLLM docs, conserving memory",
        phases="loading starting"),
    sig("oom_serving", "cuda_oom", r"Prefill out of memory|Decode out of memory",
        "out of memory while serving: lower --max-running-requests or --chunked-prefill-size, or "
        "--mem-fraction-static", "SGLang's message; SGLang docs, hyperparameter tuning", context=True),
    sig("oom_host", "killed", r"oom-kill|oom_kill|Out of memory: Kill|invoked oom-killer|oom_kill event",
        "the kernel's OOM killer ended it: host RAM ran out, not GPU memory: fewer loader workers or "
        "processes per node, or more memory for the job (--mem)", "the kernel's log (dmesg)"),
    sig("scheduler_sigkill", "", r"exit code(?: is|:)? -9\b",
        "a process was SIGKILLed, commonly by the OS OOM killer: check dmesg and the host's free memory",
        "SGLang's message on a scheduler that died during initialization"),
    sig("nccl_system", "nccl", r"unhandled system error|ncclSystemError",
        "NCCL hit a system error: rerun with NCCL_DEBUG=INFO; check NCCL_P2P_DISABLE / NCCL_IB_DISABLE, the "
        "network interfaces (NCCL_SOCKET_IFNAME) and /dev/shm size in containers",
        "NCCL docs, troubleshooting"),
    sig("nccl_watchdog", "nccl timeout",
        r"Watchdog caught collective operation timeout|watchdog thread terminated"
        r"|collective operation timeout",
        "a collective timed out: one rank stopped or died first, so look for the earliest error of another "
        "rank; if the step is only slow, raise the timeout (--dist-timeout, NCCL_TIMEOUT)",
        "PyTorch ProcessGroupNCCL's watchdog message"),
    sig("nccl_cuda", "nccl", r"unhandled cuda error|ncclUnhandledCudaError",
        "a CUDA failure inside NCCL: check the GPUs (nvidia-smi, Xid errors in dmesg) and rerun with "
        "NCCL_DEBUG=INFO", "NCCL docs, troubleshooting"),
    sig("nccl_other", "nccl", r".", "an NCCL error: rerun with NCCL_DEBUG=INFO to see which rank and link "
        "failed", "NCCL's message 'run with NCCL_DEBUG=INFO for details'"),
    sig("illegal_memory", "", r"illegal memory access",
        "a kernel read or wrote out of bounds: rerun with CUDA_LAUNCH_BLOCKING=1 to find it; try another "
        "attention backend or disabling CUDA graphs", "PyTorch's message on asynchronous CUDA errors"),
    sig("device_assert", "", r"device-side assert",
        "a device-side assert (often an index out of range: token ids beyond the vocabulary, a tokenizer that"
        " "
        "does not match the model): rerun with CUDA_LAUNCH_BLOCKING=1", "PyTorch's message"),
    sig("cublas", "", r"CUBLAS_STATUS_\w+|CUDNN_STATUS_\w+",
        "a cuBLAS/cuDNN call failed: often memory pressure or a dtype the GPU does not support; rerun with "
        "CUDA_LAUNCH_BLOCKING=1 and check that torch's CUDA build matches the driver", "PyTorch's message"),
    sig("trust_remote_code", "", r"trust_remote_code=True|--trust-remote-code|contains custom code",
        "the model's code lives in its repository: pass --trust-remote-code", "transformers' message"),
    sig("missing_module", "import_error", r"No module named",
        "a module is missing from the job's environment: install it there (pip install ...) or fix the "
        "version pin", "Python's message"),
    sig("import_error", "import_error", r".", "an import failed: the installed packages do not fit together "
        "(check the engine's and torch's versions)", "Python's message"),
    sig("port_in_use", "", r"Address already in use|address already in use|port \d+ is (?:already )?in use"
        r"|Errno 98",
        "the port is taken: stop the old server or choose another --port", "the operating system's message"),
    sig("sglang_watchdog", "timeout", r"watchdog timeout \((?:self\.)?watchdog_timeout=",
        "the scheduler made no progress for --watchdog-timeout seconds (a hung collective or kernel): the py-spy "
        "dump logged before it shows where it waited; raise --watchdog-timeout only if a step is just slow",
        "SGLang's watchdog message"),
    sig("signal_from_outside", "killed", r"death signal|got signal: ?(?:1|2|15)\b",
        "the job was stopped by a signal sent from outside (SIGTERM or SIGINT: a scheduler's preemption or time "
        "limit, a person, a stop): not a failure of its own; the scheduler's or the host's log says who sent it",
        "torch elastic's message 'death signal, shutting down workers'"),
    sig("slurm_time_limit", "timeout", r"DUE TO TIME LIMIT",
        "Slurm's time limit ended the job: ask for more (--time) or resume from a checkpoint",
        "slurmstepd's message"),
    sig("batch_time_limit", "timeout", r"PBS: job killed: (?:walltime|cput)|TERM_RUNLIMIT",
        "the scheduler's time limit ended the job: ask for more (PBS -l walltime, LSF -W) or resume from a "
        "checkpoint", "the scheduler's message"),
    sig("batch_memory_limit", "killed", r"PBS: job killed: v?mem|TERM_MEMLIMIT",
        "the scheduler killed the job at its memory limit: ask for more memory (PBS -l mem, LSF -M) or load "
        "less at once", "the scheduler's message"),
    sig("slurm_node_failure", "killed", r"srun: error: Node failure on",
        "a node of the job failed: rerun (excluding it, --exclude) and tell the cluster's admins",
        "srun's message"),
    # srun's 'Job step aborted' is its word for the same cancellation, which slurmstepd's line may follow
    sig("slurm_cancelled", "killed", r"\*\*\* (?:JOB|STEP) [\d._]+ ON \S+ CANCELLED|srun: Job step aborted",
        "Slurm cancelled the job (scancel, preemption or a node failure): `sacct -j JOBID` says which",
        "Slurm's message"),
    sig("slurm_task_killed", "killed", r"srun: error: .*Killed",
        "srun's task was killed: look for the first failing rank above; `sacct -j JOBID` shows the state",
        "srun's message"),
    sig("patch_failed", "",
        r"Hunk #\d+ FAILED|patch does not apply|does not apply cleanly|can't find file to patch",
        "a patch no longer applies to this engine version: pin the version the patch set was made for, or "
        "update the patch set", "patch's message"),
    sig("engine_core_init", "", r"Engine core initialization failed|EngineCore failed to start",
        "the engine core failed to start: the root cause is logged above this line (by the engine core or a "
        "worker)", "vLLM's message 'See root cause above'"),
    sig("engine_ready_timeout", "", r"VLLM_ENGINE_READY_TIMEOUT_S|Timed out waiting for engine core",
        "the engine took too long to start (slow weight loading): raise VLLM_ENGINE_READY_TIMEOUT_S",
        "vLLM's message"),
    # A local path that is not there: huggingface_hub then reads it as a hub id and refuses its shape.
    sig("model_dir_missing", "", r"Repo id must (?:be in the form|use alphanumeric).*: '(?:/|\.{1,2}/|~)"
        r"|Repo id must be in the form.*: '[^']*/[^']*/|Invalid repository ID or local directory specified",
        "no such model directory: the path given as the model does not exist on the host (a path that is not "
        "there is read as a model hub id); check it", "huggingface_hub's HFValidationError"),
    sig("hf_offline", "", r"couldn't connect to 'https://huggingface\.co'|LocalEntryNotFoundError"
        r"|Max retries exceeded with url|Temporary failure in name resolution",
        "the host cannot reach the model hub: pass a local path (--model-path, --dataset-path) or set "
        "HF_HUB_OFFLINE=1 with a filled cache", "huggingface_hub's message"),
    sig("hf_gated", "", r"gated repo|401 Client Error|Access to model .* is restricted",
        "the model is gated: log in (huggingface-cli login) or set HF_TOKEN for the job", "huggingface_hub's "
        "message"),
    # The data generation client's own bug (a script that does not match the installed speculators): the
    # server answered, the client could not use the answer.
    sig("speculators_client_error", "", r"consecutive samples errored out|Data generation failed|speculators",
        "the data generation client failed on its own (the server answered): a script that does not match the "
        "installed speculators version; use the package's own CLI (speculators generate-offline-data) or its "
        "matching scripts", "the traceback of the client", context=True,
        exception=r"(?:^|\.)(?:TypeError|AttributeError|KeyError|IndexError|NameError|AssertionError)$"),
    sig("speculators_unreachable", "", r"consecutive samples errored out",
        "the vLLM server did not answer: check its log, the --endpoint, and that --model equals the served "
        "model id", "speculators' message 'The vLLM server may be unreachable'"),
    sig("warmup_failed", "", r"warmup error",
        "the server started but its first request failed: the traceback in the message says why",
        "SGLang's message", context=True),
    sig("crash_below_python", "", r"Segmentation fault|core dumped|Fatal Python error|terminate called",
        "a crash below Python: the engine's compiled kernels do not match torch, CUDA or the driver;"
        " reinstall "
        "matching versions", "the process's own message"),
    sig("child_failed", "", r"ChildFailedError",
        "torchrun reports a failed rank: its own traceback, above, is the cause", "torchrun's summary",
        context=True),
    sig("file_not_found", "", r"FileNotFoundError|No such file or directory",
        "a file is missing: check the model, data and output paths the job was given", "Python's message"),
]

# One for every kind, when no signature fits.
FALLBACK = {
    "cuda_oom": (("GPU memory ran out: lower the batch or cache size (--mem-fraction-static, "
                  "--gpu-memory-utilization, --max-num-seqs) or use more GPUs"), "PyTorch's message"),
    "nccl": ("an NCCL error: rerun with NCCL_DEBUG=INFO", "NCCL docs, troubleshooting"),
    "killed": ("the process was SIGKILLed: the OOM killer (check dmesg) or the scheduler (sacct) did it",
               "the shell's 'Killed'"),
    "config_error": ("the settings cannot work together: the message names the one to change",
                     "the engine's message"),
    "timeout": ("something waited too long: the message names what; raise that timeout or find what stalled",
                "the exception's message"),
    "import_error": ("an import failed: install the module or fix the package versions", "Python's message"),
    "python_exception": ("an uncaught exception: the traceback's last frames and message say where and why",
                         "the traceback"),
    "other": ("the process gave up: the lines before this one hold the cause", "the engine's message"),
}


def signature_of(kind: str, own: str, around: str, phase: str | None = None, cpu: bool = False,
                 exception: str | None = None) -> Signature | None:
    """The first signature an error of `kind` fits: `own` is its class, message and chain, `around` the log
    lines around it; `cpu`: the engine runs on the CPU."""
    for s in SIGNATURES:
        if s.kinds and kind not in s.kinds:
            continue
        if s.phases and phase not in s.phases:
            continue
        if s.device and s.device != ("cpu" if cpu else "gpu"):
            continue
        if s.exception is not None and not s.exception.search(exception or ""):
            continue
        if s.pattern.search(own) or (s.context and s.pattern.search(around)):
            return s
    return None


def hint_of(err: Any, phase: str | None = None, cpu: bool = False) -> str:
    """'remedy (source: ...)' for a LogError; `phase` is the run's phase when it failed, `cpu` whether the
    engine runs on the CPU."""
    own = "\n".join([f"{err.exception or ''}: {err.message}", *err.chain])
    found = signature_of(err.kind, own, "\n".join(err.context), phase, cpu, err.exception)
    if found is not None:
        return f"{found.hint} (source: {found.source})"
    advice, source = FALLBACK.get(err.kind, FALLBACK["other"])
    return f"{advice} (source: {source})"
