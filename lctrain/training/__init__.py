"""Training: the loop (loop), optimizer and schedule (optim), checkpoints (checkpoint), metrics
and logging (metrics), retrieval evals (evals) and preemption (preemption)."""
