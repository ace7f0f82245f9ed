"""The schema's sections about where a run's ranks start and what the planner assumes of the
hardware: slurm.* (`lctrain submit`), launch.* (local processes, rendezvous, timeouts) and
plan.* (`lctrain plan`). Part of the schema (`lctrain.config.schema` assembles the sections);
`lctrain keys` reads the docstrings here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lctrain.config.fields import at_least, one_of


@dataclass
class SlurmConfig:
    """What `lctrain submit` asks Slurm for and how the batch script starts the ranks: one srun
    task per node, each a torchrun over the node's ranks."""

    nodes: int = at_least(1, 1)
    """Nodes to request."""
    gpus_per_node: int = at_least(0, 8)
    """GPUs (= ranks) per node; 0 for a CPU partition: no GPU is requested and each node runs
    launch.nproc / slurm.nodes gloo ranks (launch.nproc defaults to tp*cp*pp*dp)."""
    cpus_per_gpu: int = at_least(1, 8)
    """CPU cores per GPU rank (GPU partitions: --cpus-per-task = gpus_per_node x this)."""
    cpus_per_task: int | None = at_least(1, None, hint="slurm.cpus_per_task=null")
    """CPU cores of the one task per node (--cpus-per-task); default gpus_per_node x
    cpus_per_gpu, or on a CPU partition one per rank."""
    partition: str | None = None
    """SLURM partition (-p)."""
    account: str | None = None
    """SLURM account (-A)."""
    qos: str | None = None
    """SLURM QoS."""
    time: str = "24:00:00"
    """Wall-clock limit."""
    job_name: str = "lctrain"
    """Job name."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run before srun (module load, ...)."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables the batch script exports before srun, e.g. NCCL_SOCKET_IFNAME, NCCL_IB_HCA,
    GLOO_SOCKET_IFNAME; MASTER_ADDR here replaces the head node's resolved address."""
    python: str | None = None
    """The Python that runs torchrun and lctrain on the nodes; default the submitter's own
    (sys.executable), whatever PATH the batch shell gets."""
    requeue: bool = True
    """Let Slurm requeue the job (--requeue) and requeue it from the batch script when the
    USR1 warning stopped training early; the requeued job resumes from its checkpoint."""
    signal_before_s: int = at_least(10, 300)
    """Seconds before the time limit at which Slurm sends USR1 (checkpoint and stop)."""


@dataclass
class LaunchConfig:
    nproc: int | None = at_least(1, None, hint="launch.nproc=null (= tp*cp*pp*dp)")
    """Local processes when started plainly; default tp*cp*pp*dp (dp=-1 counts as 1)."""
    backend: str = one_of("auto", "gloo", "nccl")
    """auto (nccl on CUDA, else gloo) | gloo | nccl."""
    start_method: str = one_of("auto", "fork", "spawn")
    """How local ranks start: auto (spawn when CUDA is in play, else fork) | fork (fast; CPU
    only: a forked process cannot use CUDA) | spawn."""
    master_port: int = 0
    """Rendezvous port for local launches; 0 picks a free one."""
    timeout_s: int = at_least(1, 600)
    """Collective timeout in seconds: a rank waiting this long in one collective fails, and the
    job ends with a stall report naming the ranks behind (RUN_DIR/stall-report.txt)."""
    stall_s: int = at_least(0, 1800)
    """End the job with a stall report when no rank has advanced (step, micro-step or any
    collective) for this long; 0 = never. Keep it above the longest stretch without a
    collective (a checkpoint save, the first step's compilation)."""


@dataclass
class PlanConfig:
    format: str = one_of("text", "json")
    """text | json (same as `lctrain plan --json`)."""
    max_rank_rows: int = 64
    """Rank-table rows printed in text format (all rows in json)."""
    gpu_memory_gib: float = at_least(0.1, 80.0, hint="plan.gpu_memory_gib=80")
    """Memory of one accelerator, GiB: the plan's FITS / DOES NOT FIT verdict compares each
    rank's itemised total (allocator allowance included) with it."""
    device_tflops: float = at_least(1e-9, 989.0, hint="plan.device_tflops=989.0")
    """Step-time model: peak dense TFLOP/s of one GPU in the run's dtype (989: H100 SXM bf16)."""
    matmul_efficiency: float = at_least(1e-9, 0.6, hint="plan.matmul_efficiency=0.6")
    """Step-time model: fraction of plan.device_tflops the matmuls (linear layers) reach."""
    attention_efficiency: float = at_least(1e-9, 0.4, hint="plan.attention_efficiency=0.4")
    """Step-time model: fraction of plan.device_tflops the attention kernel reaches."""
    intra_node_gbps: float = at_least(1e-9, 450.0, hint="plan.intra_node_gbps=450.0")
    """Step-time model: GB/s one rank sends inside a node (450: H100 NVLink, one direction)."""
    inter_node_gbps: float = at_least(1e-9, 50.0, hint="plan.inter_node_gbps=50.0")
    """Step-time model: GB/s one rank sends across nodes (50: one 400 Gb/s InfiniBand NIC)."""
    host_memory_gib: float = at_least(0.1, 2048.0, hint="plan.host_memory_gib=2048")
    """Host memory of one node, GiB: the host verdict compares what the node's ranks keep
    there (offloaded state, offloaded activations) with it (2048: a DGX H100's 2 TiB)."""
    pcie_gbps: float = at_least(1e-9, 25.0, hint="plan.pcie_gbps=25.0")
    """Step-time model: GB/s one rank copies between host and device (25: a conservative
    share of a PCIe Gen5 x16 link's 64 GB/s peak per direction)."""
    host_adam_gparams_per_s: float = at_least(1e-9, 1.0, hint="plan.host_adam_gparams_per_s=1")
    """Step-time model: billions of parameters per second one rank's host AdamW step updates
    (parallel.offload_state); a CPU run uses the rate `lctrain plan --calibrate` measured."""
    trace: bool = False
    """Also trace one training step of each rank role at full size (same as `lctrain plan
    --trace`): the model built as training builds it, run on fake tensors and a fake process
    group of the real world size (no GPU, nothing computed), and its peak memory and parts
    printed beside the plan's (docs/parallelism.md §29)."""
    calibration: str = "~/.cache/lctrain/calibration.json"
    """`lctrain plan --calibrate` writes this machine's matmul rate, gloo bandwidth and latency
    and the training step's fixed costs here; the step-time model uses them for CPU runs
    (train.device=cpu, or slurm.gpus_per_node=0) when the file exists."""
    documents: list[list[int]] | None = None
    """The corpus's document lengths for packed documents (data.document_masking): rows
    [max_len, documents, tokens] of a length histogram, as preprocess writes them in meta.json
    (summary.by_length). The plan samples packed rows from it and predicts each load balance's
    causal work per rank, the travelling share of the K/V and the attention time
    (docs/parallelism.md §24). null: `lctrain plan`, `plan.search` and `parallel.auto` read
    data.path's meta.json (data.source=tokens) or draw the built-in source's documents; without
    one the plan assumes one document per sequence (every token travels)."""
    search: bool = False
    """Instead of one plan: enumerate every valid layout (tp, sp, cp, attention, Ulysses degree,
    pp, schedule, dp, engine, checkpointing, tiling) for slurm.nodes x slurm.gpus_per_node
    ranks, drop those that do not fit plan.gpu_memory_gib, rank the rest by predicted
    tokens/s and print the best plan.top with the overrides that select each."""
    top: int = at_least(1, 10, hint="plan.top=10")
    """Rows of the plan.search table."""
