"""The checks of tools/gpu_check.py, one module per family: each `check_*(ctx[, run_dir]) ->
dict` returns its status (PASS / FAIL / SKIP), a detail line and its figures, and runs in a
process of its own that the runner starts."""
