"""Training: the loop (loop), optimizer and schedule (optim), checkpoints (checkpoint), the run
dir's files written whole or not at all (files), metrics and logging (metrics), retrieval evals
(evals) and preemption (preemption)."""
