import os

# Tests stay offline and quiet; one intra-op thread so that forked ranks never inherit a
# running OpenMP pool (and 2 cores are shared by many ranks).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

torch.set_num_threads(1)

# Two tiers (README, "Tests"): `pytest -m "not slow"` runs every test without the `slow` marker,
# `pytest tests` runs them all. Each file marks its own slow tests with @pytest.mark.slow.
