"""Context parallelism of a Gated DeltaNet layer: passing the recurrent state (parallel.linear_cp=
state) against splitting the heads (linear_cp=heads, Megatron's way), docs/parallelism.md §31.
Prints a table, or the rows as JSON.

    python bench/linear_cp.py                 # counted at 32K, 128K, 1M; timed at cp 2 (~1 min)
    python bench/linear_cp.py --no-time --json

Counted (`lctrain.planning.traffic.linear_transfers`, the formulas `lctrain plan` uses), per
linear layer, sequence and rank, forward + backward, for --model's linear layers (default
Qwen3.5-9B: 16 key heads, 32 value heads of 128) at --cp ranks (zigzag):
  state   the final states and transitions (float32) and the convolution's halo, all-gathered
          and reduce-scattered: the same at every S;
  heads   the projected Q, K, V, the decays and write strengths, and the outputs back, by
          all-to-all: (P - 1)/P of the rank's S/P tokens, growing with S;
  bytes   with each transfer's dtype (bf16, float32 where marked);
  ratio   heads / state, elements: S/P (P - 1)/P (C_c + 2 H_v + H_v d_v) over
          n (P - 1) (H_v d_k (d_k + d_v) + (k - 1) C_c), n the stretches a rank holds (zigzag: 2),
          C_c = 2 H_k d_k + H_v d_v: linear in S.
And the plan's share of attention and linear layers in a hybrid step's time and cp traffic at
128K and 1M (`lctrain plan` of --model at those lengths, cp --cp).

Timed (--no-time skips it): one layer's mixing forward + backward (`LinearCore.mix`, from the
projected Q, K, V to the rule's output) on 2 forked gloo ranks with one thread each, float32,
zigzag with packed documents, at --time-seq-len tokens, heads scaled down (4 key heads, 8 value
heads of 32: a CPU's size); the median of --repeats after a warm-up, the slowest rank's wall
time; the elements each rank sent, counted by `record_traffic`, checked to equal the formula.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from lctrain.config.compose import compose
from lctrain.planning.traffic import linear_transfers

LENGTHS = (32768, 131072, 1048576)


def layout(model: str, cp: int, seq_len: int, **model_fields):
    cfg = compose([f"model={model}", f"parallel.cp={cp}", "parallel.dp=1",
                   "parallel.load_balance=zigzag", f"train.seq_len={seq_len}",
                   "train.micro_batch=1", "train.global_batch=1", "data.source=synthetic",
                   "data.document_masking=false", f"eval.lengths=[{min(seq_len, 8192)}]"]).cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model_fields))


def counted(cfg, how: str) -> tuple[float, float]:
    """(elements, bytes) one rank sends per linear layer and sequence, forward + backward."""
    transfers = linear_transfers(cfg, how)
    return (sum(x.elements for x in transfers),
            sum(x.elements * (4 if x.float32 else 2) for x in transfers))


def counted_rows(model: str, cp: int) -> list[dict]:
    rows = []
    for s in LENGTHS:
        cfg = layout(model, cp, s)
        (state, state_bytes), (heads, heads_bytes) = counted(cfg, "state"), counted(cfg, "heads")
        rows.append({"kind": "counted", "seq_len": s, "cp": cp, "state_elements": state,
                     "heads_elements": heads, "state_bytes": state_bytes,
                     "heads_bytes": heads_bytes, "ratio": heads / state})
    return rows


def plan_shares(model: str, cp: int) -> list[dict]:
    """The plan's attention-vs-linear shares of a hybrid step (time: the layers' FLOPs at the
    plan's rates; traffic: the cp bytes of each kind of layer)."""
    from lctrain.config.model_size import attention_flops, linear_mixer_flops
    from lctrain.planning.traffic import cp_transfers, layer_windows, linear_layers

    rows = []
    for s in LENGTHS[1:]:
        cfg = layout(model, cp, s)
        m = cfg.model
        layers = range(m.n_layers)
        attention_layers = sum(layer_windows(cfg, layers).values())
        linear = linear_layers(cfg, layers)
        flops = {"attention": attention_flops(m, s) * attention_layers,
                 "linear": linear_mixer_flops(m) * linear}
        sent = {"attention": attention_layers * sum(
                    x.elements * (4 if x.float32 else 2) for x in cp_transfers(cfg, cp)),
                "linear": linear * counted(cfg, "state")[1]}
        rows.append({"kind": "plan", "seq_len": s, "cp": cp,
                     "mixing_flops_attention_share": flops["attention"] / sum(flops.values()),
                     "cp_bytes_attention_share": sent["attention"] / sum(sent.values()),
                     "attention_layers": attention_layers, "linear_layers": linear})
    return rows


def _timed_rank(inputs, doc_ids, heads, how: str, repeats: int):
    import torch.distributed as dist

    from lctrain.attention.delta_cp import StatePassing
    from lctrain.attention.delta_heads import HeadSplit
    from lctrain.comm import record_traffic
    from lctrain.layout import sequence

    qkv, weight, g, beta = inputs
    rank, world, s = dist.get_rank(), dist.get_world_size(), qkv.shape[1]
    core = (HeadSplit(dist.group.WORLD, rank, world, s, "zigzag") if how == "heads" else
            StatePassing(dist.group.WORLD, rank, world, s, "zigzag", weight.shape[-1]))
    local = [sequence.split(x, 1, rank, world, "zigzag").clone().requires_grad_()
             for x in (qkv, g, beta)]
    times, sent = [], None
    for i in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        with record_traffic() as traffic:
            out = core.mix(local[0], weight, local[1], local[2], doc_ids, heads)
            out.sum().backward()
        took = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        if i:
            times.append(float(took))
        sent = sum(traffic.elements.values())
    return statistics.median(times), sent


def timed_rows(seq_len: int, repeats: int) -> list[dict]:
    from lctrain.attention.delta_rule import LinearHeads
    from lctrain.parallel.launch import run_ranks

    heads = LinearHeads(4, 32, 8, 32)
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(1, seq_len, heads.channels, generator=gen)
    weight = torch.randn(heads.channels, 1, 4, generator=gen) / 2
    g = -torch.rand(1, seq_len, 8, generator=gen)
    beta = torch.rand(1, seq_len, 8, generator=gen)
    lengths, at, ids = [], 0, torch.empty(seq_len, dtype=torch.int64)
    while at < seq_len:  # packed documents of mixed lengths, 64 to 4096 tokens
        n = min(int(torch.randint(64, 4097, (1,), generator=gen)), seq_len - at)
        ids[at:at + n] = len(lengths)
        lengths.append(n)
        at += n
    rows = []
    for how in ("state", "heads"):
        seconds, sent = run_ranks(_timed_rank, 2, ((qkv, weight, g, beta), ids[None], heads, how,
                                                   repeats), start_method="fork", threads=1,
                                  backend="gloo", timeout_s=1200)[0]
        cfg = layout("qwen3.5-9b", 2, seq_len, linear_key_heads=4, linear_value_heads=8,
                     linear_key_dim=32, linear_value_dim=32)
        want = counted(cfg, how)[0]
        assert sent == want, (how, sent, want)
        rows.append({"kind": "timed", "how": how, "seq_len": seq_len, "cp": 2,
                     "seconds": seconds, "elements": sent, "documents": len(lengths)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3.5-9b")
    ap.add_argument("--cp", type=int, default=8)
    ap.add_argument("--time-seq-len", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = counted_rows(args.model, args.cp) + plan_shares(args.model, args.cp)
    if not args.no_time:
        rows += timed_rows(args.time_seq_len, args.repeats)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"per linear layer, sequence and rank, forward + backward ({args.model}, cp {args.cp}, "
          "zigzag)")
    print(f"{'S':>9} {'state elems':>14} {'heads elems':>16} {'state MB':>9} {'heads MB':>10} "
          f"{'ratio':>7}")
    for r in (r for r in rows if r["kind"] == "counted"):
        print(f"{r['seq_len']:>9} {r['state_elements']:>14,.0f} {r['heads_elements']:>16,.0f} "
              f"{r['state_bytes'] / 1e6:>9.1f} {r['heads_bytes'] / 1e6:>10.1f} "
              f"{r['ratio']:>7.2f}")
    print("\nthe plan's shares of a hybrid step's mixing FLOPs and cp bytes (attention layers)")
    for r in (r for r in rows if r["kind"] == "plan"):
        print(f"  S={r['seq_len']:>8}: {r['attention_layers']} attention + {r['linear_layers']} "
              f"linear layers; attention FLOPs {r['mixing_flops_attention_share']:.1%}, "
              f"attention cp bytes {r['cp_bytes_attention_share']:.1%}")
    timed = [r for r in rows if r["kind"] == "timed"]
    if timed:
        print(f"\ntimed: one layer's mix forward + backward, cp 2 gloo, S={timed[0]['seq_len']}, "
              f"{timed[0]['documents']} packed documents (median of {args.repeats})")
        for r in timed:
            print(f"  {r['how']:>5}: {r['seconds']:.3f} s, {r['elements']:,} elements sent "
                  "(= the formula)")


if __name__ == "__main__":
    main()
