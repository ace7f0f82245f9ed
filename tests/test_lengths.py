"""Length-aware data: data.length_mix gives each length bucket its share of an epoch's tokens
(within the rounding of whole documents), best-fit packing keeps every document that fits
whole in one sequence and cuts far fewer tokens than stream packing on a log-uniform corpus,
the loader's resume state names both, training runs on them at cp2 x dp2, and bad settings are
refused by name."""

import numpy as np
import pytest

from lctrain.config.validation import validate
from lctrain.data.lengths import best_fit_bins, bucket_of
from lctrain.data.loader import DataLoader
from lctrain.data.packing import PackedTokens
from lctrain.data.shards import ShardWriter, TokenStore
from tests.helpers import on_ranks, tiny_config, train_each

SEQ = 256


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> TokenStore:
    """1,500 documents of log-uniform length in [8, 2048] tokens."""
    path = tmp_path_factory.mktemp("lengths") / "data"
    rng = np.random.default_rng(0)
    lengths = np.exp(rng.uniform(np.log(8), np.log(2048), 1500)).astype(np.int64)
    writer = ShardWriter(path, "uint16", 1 << 20)
    writer.add(rng.integers(1, 128, int(lengths.sum())).astype(np.uint16), lengths)
    writer.commit({"vocab_size": 128})
    return TokenStore(path)


def _epoch_pieces(source: PackedTokens):
    """(document, start, length) of every piece of one epoch's windows."""
    for i in range(source.samples_per_epoch):
        yield from zip(*source.pieces(i))


MIX = [(128, 0.2), (512, 0.3), (None, 0.5)]


def test_each_bucket_supplies_its_share_of_an_epoch(corpus):
    lengths = corpus.doc_lengths
    natural = np.bincount(bucket_of(lengths, [b for b, _ in MIX]), weights=lengths)
    for packing in ("stream", "best_fit"):
        source = PackedTokens(corpus, SEQ, seed=3, length_mix=MIX, packing=packing)
        tokens = np.zeros(3)
        for doc, _, n in _epoch_pieces(source):
            tokens[bucket_of(lengths[[doc]], [b for b, _ in MIX])[0]] += n
        share = tokens / tokens.sum()
        # whole documents: the share is off by at most about one document's tokens in a bucket
        np.testing.assert_allclose(share, [w for _, w in MIX], atol=0.01)
        assert abs(tokens.sum() - lengths.sum()) / lengths.sum() < 0.01  # about as many tokens
        assert natural[0] / natural.sum() < 0.06  # the short bucket is upsampled ~3.6x
        stats = source.buckets
        assert [b.documents for b in stats] == np.bincount(
            bucket_of(lengths, [b for b, _ in MIX])).tolist()
        assert stats[0].taken_documents > 3 * stats[0].documents  # repeated documents
        assert stats[2].taken_documents < stats[2].documents  # capped
        assert source.fingerprint()["length_mix"][0]["epoch_documents"] == stats[0].taken_documents


def test_best_fit_keeps_documents_whole_and_cuts_fewer_tokens(corpus):
    seq = 1024
    stream = PackedTokens(corpus, seq, seed=3)
    best = PackedTokens(corpus, seq, seed=3, packing="best_fit")
    lengths = corpus.doc_lengths
    seen: dict[int, int] = {}
    for i in range(best.samples_per_epoch):
        docs, starts, sizes = best.pieces(i)
        assert sizes.sum() <= seq + 1
        for doc, start, n in zip(docs, starts, sizes):
            if lengths[doc] <= seq + 1:
                assert start == 0 and n == lengths[doc]  # whole, in one sequence
            seen[int(doc)] = seen.get(int(doc), 0) + int(n)
    assert seen == {i: int(n) for i, n in enumerate(lengths)}  # every token once per epoch
    assert best.cut_fraction == lengths[lengths > seq + 1].sum() / lengths.sum()
    # this corpus (1,500 log-uniform documents of 8-2048 tokens) at S = 1024: stream packing
    # cuts 74% of the tokens' documents, best fit 43% (only the longer ones)
    assert best.cut_fraction < 0.65 * stream.cut_fraction
    fill = lengths.sum() / (best.samples_per_epoch * (seq + 1))
    assert fill > 0.95  # best fit wastes little room in padding
    assert "best_fit packing" in best.report()[0] and best.fingerprint()["packing"] == "best_fit"
    assert best_fit_bins(np.array([5, 3, 3, 2, 7]), 8) == [[(4, 0, 7)], [(0, 0, 5), (1, 0, 3)],
                                                           [(2, 0, 3), (3, 0, 2)]]


def test_resume_state_names_the_length_mix(corpus):
    def loader(**shaping):
        return DataLoader(PackedTokens(corpus, SEQ, seed=3, **shaping), SEQ, dp_rank=0, dp=1,
                          cp_rank=0, cp=1, load_balance="none", micro_batch=1, grad_accum=1,
                          document_masking=True, seed=3)

    state = loader(length_mix=MIX, packing="best_fit").state_dict()
    with pytest.raises(ValueError, match="length_mix: saved"):
        loader(length_mix=[(512, 0.5), (None, 0.5)], packing="best_fit").load_state_dict(state)
    with pytest.raises(ValueError, match="packing: saved 'best_fit', now None"):
        loader(length_mix=MIX).load_state_dict(state)


def _data_cfg(corpus, **data):
    return tiny_config(parallel={"cp": 2, "dp": 2}, train={"steps": 2, "micro_batch": 1,
                                                         "global_batch": 4},
                       data={"source": "tokens", "path": str(corpus.path),
                             "document_masking": True, **data})


@pytest.mark.slow  # 1.7 s: 4 ranks train (the mix and best fit's units stay fast)
def test_training_runs_on_mixed_best_fit_data(corpus):
    from lctrain.config.schema_data import LengthBucket

    mix = [LengthBucket(b, w) for b, w in MIX]
    cfg = _data_cfg(corpus, length_mix=mix, packing="best_fit")
    cfg.train.seq_len = SEQ
    assert validate(cfg, 4) == []
    history = on_ranks(train_each, 4, {"mixed": cfg}, str(corpus.path.parent / "runs"),
                       timeout_s=300)[0]["mixed"]
    assert [h["step"] for h in history] == [1, 2] and all(np.isfinite(h["loss"])
                                                           for h in history)


def test_bad_length_settings_are_refused_by_name(corpus):
    from lctrain.config.schema_data import LengthBucket
    from lctrain.prepare.checks import preflight

    cfg = _data_cfg(corpus, length_mix=[LengthBucket(512, 1.0), LengthBucket(128, 0.0)])
    problems = validate(cfg, 4)
    assert any("data.length_mix[1].weight=0.0 must be > 0" in p for p in problems)
    assert any("last bucket ends at max_len=128; make it open" in p for p in problems)
    cfg = _data_cfg(corpus, length_mix=[LengthBucket(512, 1.0), LengthBucket(128, 1.0),
                                        LengthBucket(None, 1.0)])
    assert any("must be positive and increasing" in p for p in validate(cfg, 4))
    synthetic = tiny_config(data={"packing": "best_fit"})
    assert any("data.source=synthetic has none" in p for p in validate(synthetic, 1))
    empty = _data_cfg(corpus, length_mix=[LengthBucket(4, 1.0), LengthBucket(None, 1.0)])
    assert any("data.length_mix[0] (documents of 1 to 4 tokens) holds no document" in p
               for p in preflight(empty, 4))
