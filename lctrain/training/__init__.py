"""Training: the loop (loop), optimizer and schedule (optim), checkpoints (checkpoint), metrics
and logging (metrics), the held-out loss (heldout) and retrieval evals (evals), preemption
(preemption), each rank's progress record (progress), `lctrain eval`'s scoring (scoring), and
the step measured (measure) or traced at full size on fake tensors (trace). The run dir's file
names, writers and readers are the room of their own, `lctrain.rundir`."""
