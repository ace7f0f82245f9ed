"""Training: the loop (loop), optimizer and schedule (optim), checkpoints (checkpoint), metrics
and logging (metrics), retrieval evals (evals) and preemption (preemption). The run dir's file
names and writers are the room of their own, `lctrain.rundir`."""
