"""Window layers' counts against the formulas derived in docs/parallelism.md §25: the halo each
rank sends (zigzag and contiguous, windows inside a chunk and across chunks) and a window
layer's attention FLOPs (the visible pairs of the explicit mask)."""

import pytest
import torch

from lctrain.config import ModelConfig
from lctrain.config.compose import compose
from lctrain.config.model_size import attention_flops
from lctrain.layout.halo import halo_tokens
from lctrain.planning.estimate import build_plan


def zigzag_halo(S: int, P: int, W: int) -> list[tuple[int, int]]:
    """§25's count, chunk by chunk: chunk i sends chunk i + t its last clip(W - 1 - (t - 1) c,
    0, c) tokens when another rank owns it, each token once per receiving rank."""
    c = S // (2 * P)
    owner = [min(i, 2 * P - 1 - i) for i in range(2 * P)]
    sent, received = [0] * P, [0] * P
    for i in range(2 * P):
        reach: dict[int, int] = {}  # receiving rank -> tokens of chunk i it needs (the most)
        for t in range(1, 2 * P - i):
            n = min(max(W - 1 - (t - 1) * c, 0), c)
            if n and owner[i + t] != owner[i]:
                reach[owner[i + t]] = max(reach.get(owner[i + t], 0), n)
        for r, n in reach.items():
            sent[owner[i]] += n
            received[r] += n
    return list(zip(sent, received))


@pytest.mark.parametrize("P", [2, 3, 4, 8])
def test_zigzag_halo_is_the_chunk_boundaries(P):
    S = 48 * P  # chunks of 24
    for W in (1, 2, 9, 25, 30, 60, 100):
        got = halo_tokens(S, P, W, "zigzag")
        assert got == zigzag_halo(S, P, W), (P, W)
        if W - 1 <= S // (2 * P):  # the closed form: ([r >= 1] + [r <= P - 2]) (W - 1) each way
            boundaries = [(r >= 1) + (r <= P - 2) for r in range(P)]
            assert got == [(n * (W - 1), n * (W - 1)) for n in boundaries], (P, W)


def test_contiguous_halo_is_one_boundary():
    S, P = 96, 4  # 24 tokens per rank
    for W in (5, 24, 25, 40):
        reach = min(W - 1, 24)  # from the previous rank; W > 25 reaches two ranks back
        back2 = min(max(W - 1 - 24, 0), 24)
        got = halo_tokens(S, P, W, "none")
        for r, (sent, received) in enumerate(got):
            assert sent == (r < P - 1) * reach + (r < P - 2) * back2, (W, r)
            assert received == (r >= 1) * reach + (r >= 2) * back2, (W, r)


def test_window_flops_count_the_visible_pairs():
    m = ModelConfig(dim=32, n_heads=4, n_kv_heads=2)
    S = 64
    q, k = torch.arange(S)[:, None], torch.arange(S)[None, :]
    for W in (1, 7, 32, 63, 64, 1000):
        pairs = int(((k <= q) & (k > q - W)).sum())
        per_token = attention_flops(m, S, W)
        # 3 (fwd + bwd) x 2 matmuls x 2 FLOPs per multiply-add x Hd per visible pair
        want = 3 * 4 * m.q_dim * (pairs if W < S else S * S / 2) / S
        assert per_token == pytest.approx(want), W


def test_the_plan_says_when_a_window_covers_the_sequence():
    """Gemma 3's 512-token window over 256 tokens: every layer is full, and the plan says why
    (it showed only {'full': 26})."""
    cfg = compose(["+recipe=tiny", "model=gemma3-1b"]).cfg
    plan = build_plan(cfg, 4)
    assert plan["shapes"]["layers_by_window"] == {"full": 26}
    assert any("model.sliding_window=512 covers train.seq_len=256" in n for n in plan["notes"])
    longer = compose(["+recipe=tiny", "model=gemma3-1b", "train.seq_len=1024"]).cfg
    assert not any("covers" in n for n in build_plan(longer, 4)["notes"])
