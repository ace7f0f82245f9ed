"""The distributed runtime: the rank's process group, meshes and groups (runtime), local process
launch (launch), each rank's progress record and the stall report (progress), and THE build
order of a training model (parallelize): tensor + sequence parallelism (tensor), activation
checkpointing (checkpointing), FSDP/DDP (data_parallel); plus the activation-memory measurement
on that layout (memory)."""
