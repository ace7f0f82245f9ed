"""The distributed runtime: the rank's process group, meshes and groups (runtime), local process
launch (launch), and THE build order of a training model (parallelize): tensor + sequence
parallelism (tensor), tiling, activation checkpointing (checkpointing), FSDP/DDP
(data_parallel) or DeepSpeed (deepspeed_engine), expert parallelism (experts), and the pipeline
(pipeline)."""
