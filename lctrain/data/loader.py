"""The resumable dp x cp data loader: which samples each rank reads at each step.

Global order: optimizer step s consumes the global samples [c + s G, c + (s + 1) G), G =
train.global_batch, c = where the run (re)started. DP rank r takes the contiguous slice
[r G/dp, (r + 1) G/dp) of it, cut into grad_accum micro-batches, so the union over ranks and
micro-steps is the same set for every (dp, micro_batch) split. Every rank of a TP/CP/PP group
shares its dp coordinate and so the same sequences; each cp rank then reads only its chunks.

State: the count of global samples consumed and a fingerprint of the source. The count means the
same thing for every layout, so a run resumed with another dp, tp, cp or micro-batch re-shards
the samples not yet consumed: none is lost, none is seen twice. A changed source, seq_len or seed
would change what the count points at: loading refuses it and says what changed.
"""

from __future__ import annotations

from lctrain.config import LctrainConfig
from lctrain.config.derived import load_balance_of, ulysses_degree
from lctrain.data.batch import MicroBatch, build_micro_batch
from lctrain.data.sources import build_source


class DataLoader:
    """This rank's micro-batches, step after step."""

    def __init__(self, source, seq_len: int, *, dp_rank: int, dp: int, cp_rank: int, cp: int,
                 load_balance: str, micro_batch: int, grad_accum: int, document_masking: bool,
                 seed: int, ulysses: int = 1):
        assert 0 <= dp_rank < dp and 0 <= cp_rank < cp, "rank outside its group"
        self.source, self.seq_len, self.seed = source, seq_len, seed
        self.dp_rank, self.dp, self.cp_rank, self.cp = dp_rank, dp, cp_rank, cp
        self.load_balance, self.document_masking = load_balance, document_masking
        self.ulysses = ulysses
        """cp ranks that share one balance unit (load_balance=documents)."""
        self.micro_batch, self.grad_accum = micro_batch, grad_accum
        self.consumed = 0
        """Global samples consumed by all ranks together."""

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp

    def indices(self) -> list[list[int]]:
        """Global sample indices of this rank's micro-batches in the next step."""
        start = self.consumed + self.dp_rank * self.micro_batch * self.grad_accum
        return [list(range(start + m * self.micro_batch, start + (m + 1) * self.micro_batch))
                for m in range(self.grad_accum)]

    def next_step(self) -> list[MicroBatch]:
        out = [build_micro_batch([self.source.window(i) for i in idx], self.seq_len, self.cp_rank,
                                 self.cp, self.load_balance, self.document_masking,
                                 self.ulysses)
               for idx in self.indices()]
        self.consumed += self.global_batch
        return out

    @property
    def dropped(self) -> int:
        """Documents the source skips (data.long_docs=drop)."""
        return self.source.dropped

    def _fingerprint(self) -> dict:
        return {**self.source.fingerprint(), "seq_len": self.seq_len, "seed": self.seed}

    def state_dict(self) -> dict:
        """The same on every rank: samples consumed, and what they were drawn from."""
        return {"consumed": self.consumed, "fingerprint": self._fingerprint()}

    def load_state_dict(self, state: dict, continue_data: bool = False) -> str | None:
        """Resume where `state` stopped. With `continue_data` (the next stage of
        train.stages, or an explicit checkpoint.load) a state saved at another train.seq_len
        continues at the same token, when that is a whole number of this loader's sequences;
        the note returned says so."""
        mine, theirs = self._fingerprint(), state["fingerprint"]
        if mine != theirs:
            diff = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
            tokens = int(state["consumed"]) * theirs.get("seq_len", 0)
            if continue_data and diff == ["seq_len"] and tokens % self.seq_len == 0:
                self.consumed = tokens // self.seq_len
                return (f"the data continues at token {tokens:,} (train.seq_len "
                        f"{theirs['seq_len']} -> {self.seq_len})")
            raise ValueError(
                "the data-loader state was saved for other data: "
                + "; ".join(f"{k}: saved {theirs.get(k)!r}, now {mine.get(k)!r}" for k in diff)
                + ". Restore those settings to resume, or start the data over by loading the "
                "model only")
        self.consumed = int(state["consumed"])
        return None


def build_loader(cfg: LctrainConfig, topology, rank: int, grad_accum: int) -> DataLoader:
    """This rank's loader for a validated config."""
    return DataLoader(build_source(cfg), cfg.train.seq_len,
                      dp_rank=topology.axis_rank(rank, "dp"), dp=topology.dp,
                      cp_rank=topology.axis_rank(rank, "cp"), cp=topology.cp,
                      load_balance=load_balance_of(cfg), micro_batch=cfg.train.micro_batch,
                      grad_accum=grad_accum, document_masking=cfg.data.document_masking,
                      seed=cfg.train.seed, ulysses=ulysses_degree(cfg.parallel))
