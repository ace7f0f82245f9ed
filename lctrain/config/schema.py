"""The typed configuration schema: every key lctrain reads, its default, and its allowed values.

The dataclasses are registered as Hydra structured configs (``base_config``); YAML under
conf/ and recipes/ only sets values. The sections about launching and planning are in
`lctrain.config.schema_launch`, those about data, evals and preprocessing in
`lctrain.config.schema_data`. Allowed values live beside their fields (`one_of`, `at_least`
metadata, `lctrain.config.fields`), and `lctrain.config.validation` loops over them, so no second list of choices exists.
Quantities that follow from a config and a world size are in `lctrain.config.derived`, never
written back: the config describes the model and the layout, not the shards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lctrain.config.cp_algorithms import CP_ALGORITHMS
from lctrain.config.fields import at_least, one_of
from lctrain.config.kernel_backends import KERNEL_BACKENDS, LINEAR_KERNELS
from lctrain.config.load_balances import LOAD_BALANCES
from lctrain.config.model_families import MODEL_FAMILIES
from lctrain.config.schema_data import DataConfig, EvalConfig, PreprocessConfig
from lctrain.config.schema_launch import LaunchConfig, PlanConfig, SlurmConfig

SLIDING, FULL, LINEAR = "sliding_attention", "full_attention", "linear_attention"
"""The layer types (model.layer_types), transformers' names: attention over a window, over the
whole causal context, and a linear-attention (Gated DeltaNet) layer."""


@dataclass
class ModelConfig:
    name: str = "tiny"
    """Preset name, for logs only."""
    family: str = one_of(registry=MODEL_FAMILIES, default="llama")
    """Model family (config.json's model_type): one of the registry in
    lctrain/config/model_families.py (`lctrain keys` lists each with what its blocks add). The
    blocks differ; the layouts do not."""
    vocab_size: int = at_least(1, 512)
    """Vocabulary size (rows of the embedding and of the output layer)."""
    dim: int = at_least(1, 128)
    """Model (hidden) dimension D."""
    n_layers: int = at_least(1, 4)
    """Number of transformer blocks."""
    n_heads: int = at_least(1, 8)
    """Query heads H."""
    n_kv_heads: int = at_least(1, 2)
    """Key/value heads (GQA). Equal to n_heads for MHA, 1 for MQA."""
    head_dim: int | None = at_least(1, None)
    """Dims per head d; null: dim / n_heads. Qwen3 sets it (H x d need not be dim)."""
    ffn_dim: int = at_least(1, 384)
    """SwiGLU hidden size (w1/w3 output, w2 input)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_type: str = one_of("default", "linear", "llama3", "yarn")
    """RoPE scaling for context extension: default | linear | llama3 | yarn (as transformers)."""
    rope_factor: float = 1.0
    """Context extension factor (linear, llama3, yarn)."""
    rope_low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max / low_freq_factor are divided by the factor."""
    rope_high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max / high_freq_factor are kept."""
    rope_original_max_position: int = 8192
    """llama3, yarn: context length the model was pretrained with."""
    rope_beta_fast: float = 32.0
    """yarn: rotations bounding the extrapolated (kept) dimensions."""
    rope_beta_slow: float = 1.0
    """yarn: rotations bounding the interpolated dimensions."""
    rope_truncate: bool = True
    """yarn: round the range of partly interpolated dimensions out to whole dimensions
    (transformers' default; GPT-OSS sets truncate false)."""
    tie_embeddings: bool = False
    """Share the input embedding with the output layer."""
    init_std: float = 0.02
    """Std of the normal init of linear and embedding weights (output projections scaled by depth)."""
    max_position_embeddings: int = at_least(1, 8192)
    """Context length the model declares (config.json's max_position_embeddings on export)."""
    sliding_window: int | None = at_least(1, None)
    """Keys a sliding-window layer attends to (its own position and the window - 1 before it,
    as transformers counts), in the families that have one (mistral, qwen2 and qwen3 with
    use_sliding_window, gemma3); null: no window. A window at least train.seq_len long is the
    whole causal context."""
    layer_types: list[str] | None = None
    """Token mixer of each layer, full_attention | sliding_attention | linear_attention
    (config.json's layer_types, or from its sliding_window_pattern, max_window_layers or
    full_attention_interval); null: every layer sliding when model.sliding_window is set, else
    every layer full. linear_attention layers (Gated DeltaNet) are in the families that have
    them (qwen3_5_text)."""
    rotary_fraction: float = 1.0
    """Share of each head's dimensions RoPE rotates, the first ones (config.json's
    partial_rotary_factor: Qwen3.5 0.25); the others carry no position."""
    linear_key_heads: int = at_least(1, 16)
    """Gated DeltaNet layers: key (and query) heads (linear_num_key_heads)."""
    linear_value_heads: int = at_least(1, 32)
    """Gated DeltaNet layers: value heads (linear_num_value_heads), a multiple of the key
    heads; each has its own state, decay and gate."""
    linear_key_dim: int = at_least(1, 128)
    """Gated DeltaNet layers: dims per key head d_k (linear_key_head_dim)."""
    linear_value_dim: int = at_least(1, 128)
    """Gated DeltaNet layers: dims per value head d_v (linear_value_head_dim); the state of a
    head is d_k x d_v."""
    linear_conv_kernel: int = at_least(1, 4)
    """Gated DeltaNet layers: width of the causal convolution over Q, K, V
    (linear_conv_kernel_dim)."""
    rope_local_theta: float | None = None
    """RoPE base of the sliding layers, without scaling (Gemma 3: 10000, its full layers 1M);
    null: the full layers' RoPE."""
    query_pre_attn_scalar: int | None = at_least(1, None)
    """Attention scores scaled by query_pre_attn_scalar^-1/2 (Gemma); null: head_dim^-1/2."""
    n_experts: int = at_least(0, 0)
    """Experts of each mixture-of-experts layer, in a family that has them (qwen3_moe,
    mixtral); 0: a dense model."""
    experts_per_token: int = at_least(1, 2)
    """Experts each token is routed to (top-k; config.json's num_experts_per_tok)."""
    expert_ffn_dim: int | None = at_least(1, None)
    """Hidden width of each expert's gated MLP (Qwen3-MoE's moe_intermediate_size); null:
    model.ffn_dim (Mixtral's experts are as wide as its intermediate_size)."""
    shared_expert_ffn_dim: int | None = at_least(1, None)
    """Hidden width of the shared expert of each mixture-of-experts layer, in a family that has
    one (Qwen3.5-MoE, Qwen3-Next's shared_expert_intermediate_size): a gated MLP every token
    runs through besides its k experts, its output scaled by sigmoid of a learned gate per
    token; null in the other families."""
    moe_layers: list[int] | None = None
    """The layers whose MLP is a mixture of experts (from Qwen3-MoE's decoder_sparse_step and
    mlp_only_layers); null: every layer when model.n_experts > 0. The others keep a dense MLP
    of model.ffn_dim."""
    norm_topk_prob: bool = True
    """Renormalise each token's top-k routing probabilities to sum to 1 (Mixtral always;
    Qwen3-MoE's norm_topk_prob)."""
    router_aux_loss_coef: float = 0.0
    """Weight of the load-balancing loss added to the training loss, defined as transformers
    does (docs/parallelism.md §28); 0: none."""
    swiglu_limit: float = 7.0
    """GPT-OSS experts: the gate clamped to at most this, the up projection to +-this."""
    swiglu_alpha: float = 1.702
    """GPT-OSS experts: the gate's activation g * sigmoid(alpha g)."""
    init_from: str | None = None
    """Hugging Face directory (config.json + *.safetensors) of a model of a registered family
    (model.family) to start from, in any layout. Its config.json decides every model field it
    defines; see model.hf_overrides."""
    hf_overrides: list[str] = field(default_factory=list)
    """With model.init_from: the model fields whose value from this config (recipe, preset or
    command line) replaces config.json's on purpose, e.g. [rope_theta, rope_type, rope_factor]
    to extend the context; printed at start, kept in config.yaml and in an exported
    config.json. Shape fields cannot be listed: the weights fix them."""

    @property
    def d_head(self) -> int:
        """Dims per head: head_dim, or dim / n_heads when it is null."""
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    @property
    def q_dim(self) -> int:
        """Width of the queries and of the attention output, H x d (dim unless head_dim is set
        otherwise)."""
        return self.n_heads * self.d_head

    @property
    def kv_dim(self) -> int:
        """Width of the keys (and of the values), H_kv x d."""
        return self.n_kv_heads * self.d_head

    @property
    def expert_dim(self) -> int:
        """Hidden width of one expert (expert_ffn_dim, or ffn_dim when it is null)."""
        return self.expert_ffn_dim if self.expert_ffn_dim is not None else self.ffn_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer`'s MLP is a mixture of experts (see moe_layers)."""
        if self.n_experts == 0:
            return False
        return self.moe_layers is None or layer in self.moe_layers

    @property
    def moe_layer_ids(self) -> list[int]:
        """The blocks whose MLP is a mixture of experts, in order."""
        return [i for i in range(self.n_layers) if self.is_moe_layer(i)]

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each head RoPE rotates (rotary_fraction of d, even)."""
        return int(self.d_head * self.rotary_fraction) // 2 * 2

    @property
    def linear_conv_channels(self) -> int:
        """A linear-attention layer's convolution channels: its Q, K and V side by side,
        2 H_k d_k + H_v d_v."""
        return 2 * self.linear_key_heads * self.linear_key_dim + (
            self.linear_value_heads * self.linear_value_dim)

    def is_linear_layer(self, layer: int) -> bool:
        """Whether block `layer` is a linear-attention layer."""
        return self.layer_type(layer) == LINEAR

    def layer_type(self, layer: int) -> str:
        """full_attention | sliding_attention | linear_attention of block `layer` (see
        layer_types)."""
        if self.layer_types is not None:
            return self.layer_types[layer]
        return SLIDING if self.sliding_window is not None else FULL

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of block `layer`; None for a full-attention layer."""
        return self.sliding_window if self.layer_type(layer) == SLIDING else None


@dataclass
class ParallelConfig:
    tp: int = at_least(1, 1)
    """Tensor-parallel size (Megatron column/row split of the block matmuls)."""
    sp: bool = False
    """Megatron sequence parallelism inside the TP group (no extra device dimension)."""
    cp: int = at_least(1, 1)
    """Context-parallel size: ranks holding different token slices of the same sequences."""
    pp: int = at_least(1, 1)
    """Pipeline-parallel size (layers split into pp x pp_virtual_stages stages)."""
    pp_schedule: str = one_of("1f1b", "gpipe", "interleaved_1f1b", "zero_bubble", "zbv")
    """Pipeline schedule (pp > 1): 1f1b | gpipe (one stage per rank) | interleaved_1f1b |
    zero_bubble (interleaved, weight gradients deferred into the bubbles) | zbv (zero bubble,
    two stages per rank in a V). The pipeline micro-batches are the accumulation micro-batches."""
    pp_virtual_stages: int = at_least(1, 1)
    """Stages per pipeline rank: 1 for gpipe and 1f1b, 2 for zbv, any for the interleaved ones
    (rank r holds stages r, r + pp, r + 2 pp, ...)."""
    pp_layers: list[int] | None = None
    """Layers of each stage, in order (pp x pp_virtual_stages numbers summing to
    model.n_layers); None balances them by cost, counting the embedding and the output layer."""
    dp: int = -1
    """Data-parallel size; -1 derives it as world_size / (tp * cp * pp)."""
    attention: str = one_of(registry=CP_ALGORITHMS, default="ring")
    """Context-parallel attention: one of the registry in lctrain/config/cp_algorithms.py
    (`lctrain keys` lists each with its summary; ignored when cp = 1)."""
    ulysses_degree: int = at_least(1, 1)
    """Ulysses degree inside usp; the ring degree is cp / ulysses_degree."""
    load_balance: str = one_of("auto", registry=LOAD_BALANCES)
    """Sequence split across cp ranks: auto (documents with data.document_masking, else zigzag)
    or a split of the registry in lctrain/config/load_balances.py (`lctrain keys` lists each
    with its summary)."""
    linear_cp: str = one_of("state", "heads")
    """Context parallelism of the linear-attention layers (model.layer_types linear_attention):
    state (each rank runs its own tokens and the ranks pass the recurrent state and the
    convolution's halo: the same bytes at any sequence length) | heads (an all-to-all gives
    each rank every token of its share of the heads, Megatron's way: bytes grow with the
    sequence; the key heads must divide cp). `lctrain plan` prints both's traffic per layer;
    plan.search and parallel.auto try both and keep the faster."""
    ep: int = at_least(1, 1)
    """Expert parallelism: the experts of every mixture-of-experts layer split over ep of the
    dp x cp x tp ranks (ep divides dp x cp x tp and model.n_experts; the attention's layout is
    unchanged; under TP+SP each TP rank routes its own sequence shard), the tokens carried to
    their experts and back by all-to-all; FSDP shards each rank's experts over the
    dp x cp x tp / ep ranks holding the same ones (DDP averages their gradients there)."""
    dp_engine: str = one_of("fsdp", "ddp", "deepspeed")
    """Data-parallel engine over dp x cp: fsdp (FSDP2, parameters sharded) | ddp | deepspeed
    (a ZeRO engine: deepspeed.*)."""
    offload_state: str = one_of("none", "optimizer", "optimizer+params")
    """Training state kept in host memory instead of on the device, at any dp (1 included):
    none | optimizer (AdamW's moments and the optimizer step on the host, lctrain's host AdamW:
    the device keeps the weights and gradients; any engine but deepspeed) | optimizer+params
    (FSDP2's CPUOffloadPolicy, even at dp x cp = 1: the fp32 weights, gradients and moments
    live sharded in pinned host memory, the step runs on the host, and the device holds only
    the gathered weights of the blocks computing; parallel.dp_engine=fsdp). The DeepSpeed
    engine offloads through deepspeed.offload_optimizer and deepspeed.offload_param."""
    auto: bool = False
    """`lctrain train` and `lctrain submit`: search every layout for the run's world
    (plan.search's ranking), print the winner and the runner-up, and train with the winner.
    parallel.*, deepspeed.zero_stage and the train.* keys the search chooses that the command
    line sets stay as set (constraints of the search)."""


@dataclass
class StageConfig:
    seq_len: int = at_least(1, 256)
    """The stage's sequence length."""
    steps: int = at_least(1, 100)
    """Optimizer steps of the stage."""


@dataclass
class TrainConfig:
    steps: int = at_least(1, 100)
    """Optimizer steps to run."""
    stages: list[StageConfig] = field(default_factory=list)
    """Staged context extension in one run, e.g. '[{seq_len: 8192, steps: 1000}, {seq_len:
    32768, steps: 500}, {seq_len: 131072, steps: 500}]': the stages' steps add up to
    train.steps, the last one's seq_len is train.seq_len, and every stage trains as many tokens
    per step as the last (train.global_batch and train.micro_batch, which are the last stage's,
    scaled by train.seq_len / the stage's). The data continues across stages, the learning-rate
    schedule spans them all, and a checkpoint ends every stage. Empty: one stage."""
    seed: int = 0
    """Seed for weights, data order and dropout-free RNG streams."""
    seq_len: int = at_least(1, 256)
    """Tokens per sequence (the global, unsplit context length)."""
    micro_batch: int = at_least(1, 1)
    """Sequences per data-parallel rank per forward/backward."""
    global_batch: int = at_least(1, 8)
    """Sequences per optimizer step over all dp ranks; accumulation = global / (micro * dp)."""
    dtype: str = one_of("fp32", "bf16")
    """Compute dtype: fp32 | bf16 (autocast; FSDP gathers bf16 weights and reduces gradients in
    fp32; master weights and the optimizer stay fp32)."""
    device: str = one_of("auto", "cpu", "cuda")
    """auto (cuda if available, else cpu) | cpu | cuda."""
    on_nan: str = one_of("stop", "skip")
    """A non-finite loss or gradient norm: stop (fail the run, naming the step) | skip (drop the
    step's update, log it, and go on)."""
    loss_chunk: int = at_least(0, 0)
    """Tokens per chunk of the sequence-tiled loss: the output layer and the cross-entropy run
    chunk by chunk and are recomputed in the backward, so no rank holds [S/cp, V/tp] logits
    (0 = off)."""
    mlp_chunk: int = at_least(0, 0)
    """Tokens per chunk of the tiled MLP: each block's SwiGLU runs chunk by chunk in its own
    checkpoint, so [S/cp, ffn/tp] intermediates exist one chunk at a time (0 = off)."""
    offload_activations: bool = False
    """With activation_checkpointing=full on CUDA: keep what the backward needs (the block
    inputs) in pinned host memory and bring it back for the backward. On the CPU it changes
    nothing."""
    compile: bool = False
    """torch.compile each transformer block, and the loss head without TP (the vocab-parallel
    loss stays eager)."""
    deterministic: bool = False
    """A bit-reproducible training step on CUDA (slower): torch's deterministic algorithms on
    for the whole step (with cuBLAS's deterministic workspace), and flash-attn's deterministic
    backward when it runs attention. Attention then runs lctrain's kernel layer, never SDPA.
    CPU kernels are deterministic anyway."""
    attention_kernel: str = one_of("auto", registry=KERNEL_BACKENDS)
    """Attention kernels under lctrain's attention layer (context parallelism, packed documents,
    deterministic): auto (on its device, the installed backend `auto` ranks first: flash_attn,
    then torch on CUDA; cpu on the CPU) or a backend of the registry in
    lctrain/config/kernel_backends.py (`lctrain keys` lists each with its summary). Anything but
    auto also routes plain local attention through lctrain's kernels instead of SDPA."""
    linear_kernel: str = one_of("auto", registry=LINEAR_KERNELS)
    """The gated delta rule of the linear-attention layers (model.layer_types linear_attention):
    auto (of the kernels that run on the device and import, the one auto ranks first: fla on
    CUDA, else torch) or a kernel of the registry in lctrain/config/kernel_backends.py: torch
    (lctrain's chunked rule in plain torch, any device) | fla (flash-linear-attention's Triton
    kernels, the `gpu` extra; CUDA only)."""
    activation_checkpointing: str = one_of("none", "selective", "full")
    """none | selective (save matmul and attention outputs, recompute the rest) | full (whole
    blocks recomputed in backward)."""


@dataclass
class OptimConfig:
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = at_least(0, 10)
    """Linear warmup steps from 0 to lr."""
    schedule: str = one_of("cosine", "constant")
    """cosine | constant (after warmup)."""
    weight_decay: float = at_least(0, 0.1)
    """AdamW decay for matrices; norms and embeddings are never decayed."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = at_least(0, 1.0)
    """Global gradient-norm clip over all shards; 0 disables clipping (the norm is still logged)."""


@dataclass
class CheckpointConfig:
    every: int = at_least(0, 0)
    """Save every N optimizer steps and after the last one (0 = never)."""
    dir: str | None = None
    """Where checkpoints go; null = <run dir>/checkpoints."""
    keep: int = at_least(0, 3)
    """Newest complete checkpoints to keep (0 = all)."""
    async_save: bool = False
    """Stage the tensors in memory and write them in the background while training goes on
    (the key cannot be `async`: that is a Python keyword)."""
    resume: str = one_of("none", "auto")
    """none | auto (the newest complete checkpoint in checkpoint.dir; a damaged one is skipped
    with a warning for the one before it; none found = start at step 0)."""
    load: str | None = None
    """A checkpoint directory to start from (takes the place of resume=auto; it must be
    complete and undamaged)."""
    load_model_only: bool = False
    """With checkpoint.load / resume: take only the weights (fine-tuning): fresh optimizer,
    step 0, data from the start."""
    verify: bool = True
    """Check every file's sha256 against the manifest before loading (sizes are always checked)."""
    export_hf: str | None = None
    """Write the final weights here as a Hugging Face directory of the model's family
    (config.json + safetensors)."""


@dataclass
class LoggingConfig:
    log_every: int = at_least(1, 1)
    """Log (console, metrics.jsonl, W&B) every N steps; the last step is always logged."""
    progress: bool = True
    """Show a progress bar on rank 0 (plain lines when the output is not a terminal)."""
    wandb: bool = False
    """Log to Weights & Biases (rank 0)."""
    wandb_project: str = "lctrain"
    """W&B project."""
    wandb_mode: str = one_of("online", "offline", "disabled", default="offline")
    """W&B mode: online | offline | disabled. A restarted run continues the W&B run whose id
    is stored in the run dir (`wandb_run_id`)."""
    tensorboard: bool = False
    """Also write the logged scalars for TensorBoard into RUN_DIR/tensorboard (rank 0; the
    `tensorboard` extra: pip install 'lctrain[tensorboard]')."""
    peak_tflops: float | None = None
    """Peak TFLOP/s of one rank, the denominator of the logged MFU; null = the datasheet value
    of a known GPU in the run's dtype (dense), or on the CPU this machine's fp32 matmul rate,
    measured at the start (docs/parallelism.md §14)."""


@dataclass
class DeepSpeedConfig:
    """The ZeRO engine of parallel.dp_engine=deepspeed (the `deepspeed` extra)."""

    zero_stage: int = at_least(1, 1)
    """ZeRO stage 1 (optimizer state sharded over dp x cp), 2 (+ gradients) or 3 (+ weights)."""
    offload_optimizer: str = one_of("none", "cpu")
    """Keep the optimizer state (and its step) in host memory."""
    offload_param: str = one_of("none", "cpu")
    """Keep the weights in host memory between uses (zero_stage=3 only)."""
    config: dict[str, Any] = field(default_factory=dict)
    """Further DeepSpeed JSON keys, merged over the ones lctrain sets; a key that contradicts
    one of lctrain's (batch sizes, ZeRO stage, offload, precision, clipping, optimizer,
    scheduler) is refused."""


@dataclass
class LctrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
