"""Training: the loop (loop), optimizer and schedule (optim), checkpoints (checkpoint), the run
dir's files written whole or not at all (files), metrics and logging (metrics), retrieval evals
(evals), preemption (preemption) and one job per run dir (run_lock)."""
