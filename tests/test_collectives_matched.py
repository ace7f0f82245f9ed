"""Every rank of small worlds runs a training step under `CollectiveLog` (real gloo ranks), and
`mismatches` proves each process group's ranks issue the same sequence of collectives and every
send meets its receive: cp4 with packed documents and window layers, ep2 x cp2, pp2 x cp2,
tp2 x cp4 USP. The check itself is shown to catch a rank that skips a collective, a wrong
shape and an unmatched send."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from lctrain.parallel.collective_log import Call, CollectiveLog, mismatches
from lctrain.parallel.runtime import setup_distributed
from lctrain.training import loop
from lctrain.training.step import train_step
from tests.helpers import on_ranks, tiny_config

MOE = {"family": "qwen3_moe", "n_experts": 4, "experts_per_token": 2, "expert_ffn_dim": 48}
WINDOW = {"family": "mistral", "sliding_window": 6}
DOCS = {"document_masking": True}
HEADS_8 = {"n_heads": 8, "n_kv_heads": 4}

WORLDS = {
    "cp4 ring, documents split, windows": (4, tiny_config(
        model=WINDOW, data=DOCS, parallel={"cp": 4, "dp": 1, "attention": "ring",
                                           "load_balance": "documents"})),
    "ep2 x cp2": (4, tiny_config(model=MOE, parallel={"cp": 2, "dp": 2, "ep": 2})),
    "pp2 x cp2": (4, tiny_config(parallel={"cp": 2, "pp": 2, "dp": 1},
                                 train={"global_batch": 4, "micro_batch": 1})),
    "tp2 x cp4 usp (ulysses 2 x ring 2)": (8, tiny_config(model=HEADS_8, parallel={
        "tp": 2, "sp": True, "cp": 4, "dp": 1, "attention": "usp", "ulysses_degree": 2})),
}


def _logged_step(cfg) -> list[Call]:
    """One training step of this rank, every collective and send logged."""
    rt = setup_distributed(cfg)
    model, optimizer, scheduler, loader = loop.build_training(cfg, rt)
    batch = loader.next_step()
    with CollectiveLog() as log:
        train_step(model, optimizer, scheduler, batch, cfg, rt)
    return log.calls


def _check(name: str) -> None:
    nproc, cfg = WORLDS[name]
    logs = dict(enumerate(on_ranks(_logged_step, nproc, cfg, timeout_s=300)))
    assert all(logs.values()), "every rank issued collectives"
    assert mismatches(logs) == []


def test_cp4_documents_and_windows_match():
    _check("cp4 ring, documents split, windows")


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in WORLDS if not n.startswith("cp4")])
def test_every_listed_world_matches(name):
    _check(name)


def test_the_check_names_what_does_not_match():
    world = ((0, 1), "0")
    ar = Call("allreduce_", *world, ((4,),), "torch.float32")
    gather = Call("_allgather_base_", *world, ((4,),), "torch.float32")
    a2a = [Call("alltoall_base_", *world, ((n,),), "torch.float32") for n in (3, 5)]
    assert mismatches({0: [ar, a2a[0]], 1: [ar, a2a[1]]}) == []  # uneven all-to-all is fine
    assert "different numbers" in mismatches({0: [ar, ar], 1: [ar]})[0]
    assert "collective 0" in mismatches({0: [ar], 1: [gather]})[0]
    wide = Call("allreduce_", *world, ((8,),), "torch.float32")
    assert "allreduce_[8]" in mismatches({0: [ar], 1: [wide]})[0]
    send = Call("send", *world, ((2,),), "torch.float32", peer=1)
    recv = Call("recv_", *world, ((3,),), "torch.float32", peer=0)
    problems = mismatches({0: [send], 1: [recv]})
    assert any("received as" in p for p in problems), problems
    assert any("sends 1 times" in p for p in mismatches({0: [send], 1: []})), "unmatched"
    assert any("begins with sends" in p for p in mismatches({0: [send, ar], 1: [ar]}))


def test_a_rank_that_skips_a_collective_is_caught():
    """A real gloo world in which rank 1 issues one all-reduce fewer."""
    def step(_):
        import torch
        x = torch.ones(3)
        with CollectiveLog() as log:
            dist.all_reduce(x)
            if dist.get_rank() == 0:
                dist.all_reduce(x, group=dist.new_group([0]))
            dist.all_gather_into_tensor(torch.empty(6), x)
        return log.calls

    logs = dict(enumerate(on_ranks(step, 2, None)))
    assert [c.op for c in logs[0]] == ["allreduce_", "allreduce_", "_allgather_base_"]
    assert mismatches(logs) == []  # the extra one is on rank 0's own group
    logs[1] = logs[1][1:]  # as if rank 1 had skipped the world's first all-reduce
    assert mismatches(logs)
