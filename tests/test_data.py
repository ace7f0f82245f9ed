"""Packing, the dp x cp loader, resume, mixtures and the built-in sources (no processes).

The token audit builds a corpus whose every token is unique (its global index), so the loader's
output can be traced back to the exact (document, offset) it came from. The references are the
corpus itself and the sequence split, never the loader's own earlier output.
"""

import numpy as np
import pytest
import torch

from lctrain.config import DataConfig
from lctrain.data.batch import IGNORE_INDEX, array_window, build_micro_batch
from lctrain.data.loader import DataLoader
from lctrain.data.packing import Mixture, PackedTokens
from lctrain.data.shards import ShardWriter, TokenStore
from lctrain.data.synthetic import EOS, SyntheticLM
from lctrain.data.tasks import KEY, QUERY, Passkey, Recall, eval_examples
from lctrain.layout import sequence


def unique_corpus(path, lengths, shard_tokens=1000):
    """A dataset whose token t is the global index t, documents of the given lengths."""
    writer = ShardWriter(path, "uint32", shard_tokens)
    writer.add(np.arange(sum(lengths), dtype=np.uint32), np.asarray(lengths))
    writer.commit({"vocab_size": int(sum(lengths))})
    return TokenStore(path)


def rank_loaders(source, seq_len, dp, cp, micro, accum, lb="zigzag", seed=0):
    return {(d, c): DataLoader(source, seq_len, dp_rank=d, dp=dp, cp_rank=c, cp=cp,
                               load_balance=lb, micro_batch=micro, grad_accum=accum,
                               document_masking=True, seed=seed)
            for d in range(dp) for c in range(cp)}


def run_steps(group, steps):
    """{global sample: (inputs, labels, positions, doc ids)} over `steps` steps of every rank,
    the cp parts merged back with the inverse of the split."""
    dp = 1 + max(d for d, _ in group)
    cp = 1 + max(c for _, c in group)
    lb = group[(0, 0)].load_balance
    out = {}
    for _ in range(steps):
        for d in range(dp):
            indices = group[(d, 0)].indices()
            assert all(group[(d, c)].indices() == indices for c in range(cp))
            parts = [group[(d, c)].next_step() for c in range(cp)]
            for m, idx in enumerate(indices):
                docs = parts[0][m].doc_ids
                assert all(torch.equal(p[m].doc_ids, docs) for p in parts)
                merged = {f: sequence.merge([getattr(p[m], f) for p in parts], 1, lb,
                                            doc_ids=docs) for f in ("inputs", "labels",
                                                                    "positions")}
                for b, g in enumerate(idx):
                    assert g not in out, f"sample {g} served twice"
                    out[g] = (merged["inputs"][b], merged["labels"][b], merged["positions"][b],
                              docs[b])
    return out


@pytest.mark.parametrize("lb", ["zigzag", "none", "documents"])
def test_token_audit_one_epoch_dp2_cp2(tmp_path, lb):
    seq_len = 16
    lengths = np.random.default_rng(0).integers(1, 3 * seq_len, size=40)
    total = int(lengths.sum())
    store = unique_corpus(tmp_path / "corpus", lengths, shard_tokens=97)
    assert len(store.meta["shards"]) > 3
    packed = PackedTokens(store, seq_len, seed=3)
    n = packed.samples_per_epoch
    assert n == -(-(total - 1) // seq_len)
    samples = run_steps(rank_loaders(packed, seq_len, dp=2, cp=2, micro=2, accum=2, lb=lb),
                        -(-n // 8))
    doc_of = np.repeat(np.arange(len(lengths)), lengths)
    inputs, targets = [], []
    for g in range(n):
        tok, lab, pos, docs = (x.numpy() for x in samples[g])
        valid = lab != IGNORE_INDEX
        assert valid.all() or g == n - 1, "only the last window of the epoch is padded"
        real = np.arange(seq_len) < valid.sum() + (0 if valid.all() else 1)  # padding after
        inputs += tok[valid].tolist()
        targets += lab[valid].tolist()
        assert np.array_equal(lab[:-1][valid[:-1]], tok[1:][valid[:-1]])  # labels are shifted
        if g + 1 < n:
            assert lab[-1] == samples[g + 1][0][0]  # windows overlap by one token
        # each masked document is a contiguous piece of ONE corpus document, positions restart
        # with it, and it ends exactly where the corpus document changes
        for d in np.unique(docs[real]):
            where = np.flatnonzero((docs == d) & real)
            assert (doc_of[tok[where]] == doc_of[tok[where[0]]]).all()
            assert (np.diff(tok[where]) == 1).all()
            assert pos[where].tolist() == list(range(len(where)))
        change = doc_of[tok[real][1:]] != doc_of[tok[real][:-1]]
        assert (change == (docs[real][1:] != docs[real][:-1])).all()
    # every token of the corpus was the input of a target exactly once (but the stream's last)
    # and a target exactly once (but the stream's first)
    assert len(inputs) == len(targets) == total - 1
    assert len(set(inputs)) == len(set(targets)) == total - 1
    first, last = set(range(total)) - set(targets), set(range(total)) - set(inputs)
    assert first == {samples[0][0][0].item()} and len(last) == 1


def test_loader_matches_the_split_and_reads_only_its_chunks():
    seq_len, cp = 24, 3
    tokens = np.arange(100, 100 + seq_len + 1)
    lengths = np.array([5, 11, 9])
    reads = []
    window = array_window(tokens, lengths, seq_len + 1)
    full_read = window.read
    window.read = lambda lo, hi: (reads.append((lo, hi)), full_read(lo, hi))[1]
    # reference, written out by hand: inputs, shifted labels, ids and per-document positions
    ref_docs = torch.tensor([0] * 5 + [1] * 11 + [2] * 8)
    ref_pos = torch.tensor(list(range(5)) + list(range(11)) + list(range(8)))
    ref_in, ref_lab = torch.from_numpy(tokens[:-1]), torch.from_numpy(tokens[1:])
    for lb in ("zigzag", "none", "documents"):
        for r in range(cp):
            reads.clear()
            mb = build_micro_batch([window], seq_len, r, cp, lb, document_masking=True)
            split = (lambda x, r=r, lb=lb: sequence.split(  # noqa: E731
                x[None], 1, r, cp, lb, doc_ids=ref_docs[None])[0])
            assert torch.equal(mb.global_positions[0], split(torch.arange(seq_len)))
            assert torch.equal(mb.inputs[0], split(ref_in))
            assert torch.equal(mb.labels[0], split(ref_lab))
            assert torch.equal(mb.positions[0], split(ref_pos))
            assert torch.equal(mb.doc_ids[0], ref_docs)
            # only this rank's chunks, plus one token each for the shifted labels
            assert sum(hi - lo for lo, hi in reads) == seq_len // cp + len(reads)
    plain = build_micro_batch([window], seq_len, 1, cp, "zigzag", document_masking=False)
    assert plain.doc_ids is None
    assert torch.equal(plain.positions[0], sequence.positions(seq_len, 1, cp, "zigzag"))


@pytest.mark.parametrize("lb,seq", [("zigzag", 8), ("documents", 32)])
def test_resume_equals_uninterrupted_and_reshards_across_dp(tmp_path, lb, seq):
    store = unique_corpus(tmp_path / "c", np.random.default_rng(1).integers(1, 5 * seq,
                                                                             size=60))
    packed = PackedTokens(store, seq, seed=0)
    straight = run_steps(rank_loaders(packed, seq, dp=2, cp=2, micro=1, accum=2, lb=lb), 7)
    before = rank_loaders(packed, seq, dp=2, cp=2, micro=1, accum=2, lb=lb)
    first = run_steps(before, 3)
    state = before[(1, 1)].state_dict()
    assert all(x.state_dict() == state for x in before.values())
    for dp, cp, micro, accum in [(2, 2, 1, 2), (4, 1, 1, 1), (1, 4, 2, 2)]:  # same global batch
        after = rank_loaders(packed, seq, dp=dp, cp=cp, micro=micro, accum=accum, lb=lb)
        for loader in after.values():
            loader.load_state_dict(state)
        rest = run_steps(after, 4)
        assert first.keys().isdisjoint(rest.keys())
        both = {**first, **rest}
        assert both.keys() == straight.keys()  # none lost, none twice
        for g, fields in both.items():
            for got, want in zip(fields, straight[g]):
                assert torch.equal(got, want), (dp, cp, g)
    other = rank_loaders(PackedTokens(store, 2 * seq, seed=0), 2 * seq, dp=1, cp=1, micro=1,
                         accum=1)
    with pytest.raises(ValueError, match=f"seq_len: saved {seq}, now {2 * seq}"):
        other[(0, 0)].load_state_dict(state)


def test_long_documents_dropped_and_counted(tmp_path):
    lengths = [3, 30, 5, 9, 40, 2]
    store = unique_corpus(tmp_path / "c", lengths)
    packed = PackedTokens(store, 8, seed=0, long_docs="drop")
    assert packed.dropped == 3 and packed.tokens == 10
    seen = set()
    for i in range(packed.samples_per_epoch):
        w = packed.window(i)
        seen |= set(w.read(0, w.valid).tolist())
    kept = [range(0, 3), range(33, 38), range(87, 89)]
    assert seen == {t for r in kept for t in r}
    with pytest.raises(ValueError, match="fewer than one sequence"):
        PackedTokens(store, 100, seed=0, long_docs="drop")


def test_mixture_keeps_every_prefix_within_one_sample_of_its_weights():
    cfg = DataConfig(doc_len_min=4, doc_len_max=12)
    sources = [SyntheticLM(cfg, 64, 16, 0), Passkey(cfg, 64, 16, 0), Recall(cfg, 64, 16, 0)]
    weights = [0.5, 0.3, 0.2]
    mix = Mixture(sources, [5, 3, 2])
    counts = np.zeros(3)
    for g in range(3000):
        k, j = mix.locate(g)
        assert j == counts[k]  # each source's samples in order, none skipped
        counts[k] += 1
        assert np.abs(counts - np.array(weights) * (g + 1)).max() <= 1
    w = mix.window(7)
    k, j = mix.locate(7)
    assert np.array_equal(w.read(0, 17), sources[k].window(j).read(0, 17))


def test_synthetic_windows_are_deterministic_and_structured():
    ds = SyntheticLM(DataConfig(doc_len_min=8, doc_len_max=20), 100, 64, 0)
    a, b = ds.window(7), ds.window(7)
    tokens = a.read(0, 65)
    assert np.array_equal(tokens, b.read(0, 65)) and a.valid == 65
    assert not np.array_equal(tokens, ds.window(8).read(0, 65))
    ends = np.cumsum(a.lengths)
    assert (tokens[ends[:-1] - 1] == EOS).all()  # every whole document ends with EOS
    doc = tokens[: ends[0] - 1].tolist()
    half = len(doc) // 2
    for x, y in zip(doc[: half - 1], doc[1:half]):
        assert y in ds.chain.successors[x]
    assert doc[half:] == doc[: len(doc) - half]  # the second half repeats the first


@pytest.mark.parametrize("vocab", [32, 101, 50000])
def test_tasks_place_needles_by_depth_in_any_vocabulary(vocab):
    cfg = DataConfig(doc_len_min=40, doc_len_max=80, answer_len=2, recall_pairs=3)
    q = vocab // 4
    for task in (Passkey(cfg, vocab, 128, 0), Recall(cfg, vocab, 128, 0)):
        examples = eval_examples(task, [40, 100], [0.0, 0.5, 1.0], 3, seed=1)
        assert len(examples) == 18
        for ex in examples:
            tokens = ex.window.read(0, ex.length)
            assert ex.window.valid == ex.length + 1 and (tokens < vocab).all()
            pos, answer = ex.targets[:, 0], ex.targets[:, 1]
            assert (pos == np.arange(ex.length - 3, ex.length - 1)).all()
            assert np.array_equal(tokens[pos + 1], answer)
            assert ((answer >= 3 * q) & (answer < vocab)).all()
            needle = np.flatnonzero(tokens == KEY)
            queries = np.flatnonzero(tokens == QUERY)
            assert len(needle) == (1 if task.name == "passkey" else 3) == len(queries)
            hit = needle[[np.array_equal(tokens[k + 1 + (task.name == "recall"):][:2], answer)
                          for k in needle]]
            assert len(hit) == 1  # the scored needle holds the answer
            filler_before = hit[0] - (2 + cfg.answer_len) * np.sum(needle < hit[0])
            span = ex.length - task.min_length()
            assert abs(filler_before - ex.depth * span) <= 1
        training = task.window(5)
        assert training.valid == 129 and (training.read(0, 129) < vocab).all()


def test_validation_of_sources_against_the_model(tmp_path):
    from lctrain.config import MixtureEntry
    from lctrain.prepare.checks import preflight
    from tests.helpers import tiny_config

    small = unique_corpus(tmp_path / "small", [10, 12]).path  # 22 tokens, ids up to 21
    big = tmp_path / "big"
    unique_corpus(big, [100, 200])  # 300 ids > model.vocab_size=128

    def problems(**data):
        return preflight(tiny_config(data=data), 1)

    assert problems(source="tokens", path=str(small)) == [
        f"data.path: {small} holds 22 tokens, fewer than one sequence of train.seq_len + 1 = 33; "
        "use a larger corpus or train.seq_len <= 21"]
    (msg,) = problems(source="tokens", path=str(big))
    assert "was tokenized with 300 tokens, more than model.vocab_size=128" in msg
    (msg,) = problems(source="tokens", path=str(tmp_path))
    assert "is not a preprocessed token dataset (no meta.json)" in msg and "lctrain preprocess" in msg
    mix = [MixtureEntry("passkey", 1.0), MixtureEntry(str(big), 0.0)]
    assert problems(mixture=mix)[0].startswith("data.mixture is set but data.source=synthetic")
    got = problems(source="mixture", mixture=mix)
    assert any("data.mixture[1].weight=0.0 must be > 0" in p for p in got)
    assert any(p.startswith(f"data.mixture[1].source={big} was tokenized with 300") for p in got)
    assert problems(source="mixture")[0].startswith("data.source=mixture needs data.mixture")
    assert problems(source="mixture", mixture=[MixtureEntry("passkey", 1.0),
                                               MixtureEntry("synthetic", 2.0)]) == []


def _train(cfg, run_dir):
    from lctrain.training.loop import train

    return train(cfg, run_dir)


def test_training_on_token_shards_is_the_same_on_every_layout(tmp_path):
    from tests.helpers import on_ranks, tiny_config

    rng = np.random.default_rng(5)
    lengths = rng.integers(3, 50, size=60)
    writer = ShardWriter(tmp_path / "tok", "uint16", 300)
    writer.add(rng.integers(1, 128, size=int(lengths.sum())).astype(np.uint16), lengths)
    writer.commit({"vocab_size": 128})
    data = {"source": "tokens", "path": str(tmp_path / "tok"), "document_masking": True}
    base = tiny_config(data=data, train={"steps": 3, "global_batch": 4, "micro_batch": 4})
    ref = on_ranks(_train, 1, base, str(tmp_path / "ref"))[0]
    layout = tiny_config(data=data, parallel={"cp": 2, "dp": 2, "attention": "ring"},
                         train={"steps": 3, "global_batch": 4, "micro_batch": 1})
    for history in on_ranks(_train, 4, layout, str(tmp_path / "cp2dp2")):
        for got, want in zip(history, ref):
            for key in ("loss", "grad_norm", "valid_tokens"):
                assert got[key] == pytest.approx(want[key], rel=2e-5), key
