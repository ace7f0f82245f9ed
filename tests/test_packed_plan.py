"""The plan with packed documents (plan.documents, docs/parallelism.md §24): the corpus's length
histogram read from meta.json, the balance and K/V share of each load balance, and the search's
choice following the corpus. References: the layout's counts on the same rows, and the
formulas at share 1 (one document per sequence)."""

import dataclasses
import json

import numpy as np
import pytest

from lctrain.config.compose import compose
from lctrain.data.shards import ShardWriter
from lctrain.layout.packed import split_cost
from lctrain.planning.documents import ROWS, histogram_rows, packed_documents
from lctrain.planning.hardware import hardware_for
from lctrain.planning.search import search
from lctrain.planning.traffic import cp_step_bytes
from lctrain.prepare.checks import with_corpus
from tests.helpers import run_cli, tiny_config

WEB = [[2 ** k, 100, 75 * 2 ** k] for k in range(7, 13)]  # 128 to 4K tokens: short documents
LONG = [[2 ** k, 10, 7 * 2 ** k] for k in range(15, 18)]  # 32K to 128K tokens


def with_documents(cfg, histogram, **parallel):
    return dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, documents=histogram),
                               parallel=dataclasses.replace(cfg.parallel, **parallel))


def test_histogram_rows_follow_the_buckets_and_predictions_match_their_splits():
    rows = histogram_rows(tuple(map(tuple, WEB)), 16384, 6)
    assert all(int(r.sum()) == 16384 for r in rows)
    lengths = np.concatenate(rows)
    assert lengths.max() <= 4096 and np.median(lengths) > 128
    cfg = with_documents(tiny_config(data={"document_masking": True},
                                     train={"seq_len": 16384}), WEB, cp=4, attention="ring")
    got = packed_documents(cfg)
    costs = [split_cost(r, 4, "documents") for r in histogram_rows(
        tuple(map(tuple, WEB)), 16384, ROWS * cfg.train.micro_batch)]
    assert got.known and got.balance == pytest.approx(np.mean([c.max_over_mean for c in costs]))
    zigzag = packed_documents(cfg, "zigzag")
    assert got.balance < 1.02 < zigzag.balance and got.share < 1
    # the K/V traffic the plan predicts scales by the share; Ulysses' does not
    full = cp_step_bytes(dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan,
                                                                           documents=None)), 4)
    part = cp_step_bytes(cfg, 4)
    assert part["ring_kv_fwd"] == pytest.approx(full["ring_kv_fwd"] * got.share)
    ulysses = with_documents(cfg, WEB, attention="ulysses")
    assert cp_step_bytes(ulysses, 4) == cp_step_bytes(with_documents(ulysses, None), 4)


def test_search_choice_follows_the_corpus():
    """8 GPUs on 8 nodes at 128K tokens: with long documents every token travels and the ring
    wins; with short ones little travels, the attention is small, and the choice changes."""
    base = compose(["+recipe=llama-256k", "model.init_from=null", "data.path=x",
                    "data.tokenizer=x", "data.document_masking=true", "slurm.nodes=8",
                    "slurm.gpus_per_node=1", "train.seq_len=131072", "train.global_batch=1",
                    "parallel.tp=1", "parallel.cp=8", "parallel.dp=1", "parallel.pp=1"]).cfg
    hw = hardware_for(base, gpu_available=True)
    fixed = {"parallel.cp": 8, "parallel.tp": 1, "parallel.pp": 1, "parallel.dp_engine": "fsdp",
             "train.activation_checkpointing": "full"}
    best = {name: search(with_documents(base, hist), 8, hw, fixed=fixed).ranked[0]
            for name, hist in (("long", LONG), ("web", WEB))}
    assert best["long"].overrides["parallel.attention"] == "ring"
    assert best["web"].overrides["parallel.attention"] != "ring"
    assert best["web"].step.total_s < best["long"].step.total_s


def test_plan_reads_meta_json_and_prints_each_load_balance(tmp_path, capsys):
    writer = ShardWriter(tmp_path / "tok", "uint32", 10_000)
    writer.add(np.arange(4000, dtype=np.uint32), np.array([100] * 40))
    by_length = [[128, 40, 4000]]
    writer.commit({"vocab_size": 4000, "summary": {"by_length": by_length}})
    cfg = tiny_config(data={"source": "tokens", "path": str(tmp_path / "tok"),
                            "document_masking": True})
    assert with_corpus(cfg).plan.documents == by_length
    assert with_corpus(dataclasses.replace(cfg, plan=dataclasses.replace(
        cfg.plan, documents=[[8, 1, 8]]))).plan.documents == [[8, 1, 8]]  # set: kept
    code, out, _ = run_cli(["plan", "+recipe=tiny", "data.source=tokens",
                            f"data.path={tmp_path / 'tok'}", "model.vocab_size=4000",
                            "--json"], capsys)
    assert code == 0
    plan = json.loads(out)
    assert plan["load_balance"] == "documents"
    table = plan["packed_documents"]
    assert set(table) == {"zigzag", "documents"}
    assert table["documents"]["balance"] <= table["zigzag"]["balance"]
    assert 0 < table["documents"]["attention_fraction"] < 1
