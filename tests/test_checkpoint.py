"""Checkpoints on gloo ranks: bitwise resume after a rank is killed mid-run and mid-save,
resharding to other layouts, damaged checkpoints, async saves, write errors, preemption
signals, non-finite steps, and loads that run no code.

References are runs that were never interrupted, on the same layout (bitwise) or on the layout
the checkpoint was saved under (approximately, for resharded loads).
"""

import dataclasses
import json
import math
import os
import pickle
import signal
import threading

import pytest
import torch

from lctrain.parallel.launch import RankFailure
from lctrain.training import checkpoint as ck
from tests.helpers import dp2_config, on_ranks, reference_model


def _train(cfg, run_dir, fault=None):
    """train() in this rank, after `fault(rank)` installed its patches (if any)."""
    import torch.distributed as dist

    import lctrain.training.loop as T

    if fault is not None:
        fault(dist.get_rank() if dist.is_initialized() else 0, T)
    return T.train(cfg, run_dir)


def _at_step(n, rank, action):
    """A fault: on `rank`, run action(T) when train_step is called for the n-th time."""
    def install(me, T):
        real, calls = T.train_step, [0]

        def step(*args, **kwargs):
            calls[0] += 1
            if me == rank and calls[0] == n:
                action(T)
            return real(*args, **kwargs)
        T.train_step = step
    return install


def _kill(_):
    os.kill(os.getpid(), signal.SIGKILL)


def _losses(history):
    return [(h["step"], h["loss"], h["grad_norm"]) for h in history]


@pytest.mark.slow  # 8 s: three runs of dp2
def test_kill_mid_run_and_mid_save_then_resume_bitwise(tmp_path):
    cfg = dp2_config(8)
    ref = on_ranks(_train, 2, cfg, str(tmp_path / "ref"))[0]
    # rank 1 dies in step 5: checkpoints 2 and 4 are complete
    run = tmp_path / "run"
    with pytest.raises(RankFailure) as failure:
        on_ranks(_train, 2, cfg, str(run), _at_step(5, 1, _kill))
    assert failure.value.rank == 1 and "SIGKILL" in str(failure.value)
    assert [p.name for p in ck.complete_checkpoints(run / "checkpoints")] == [
        "step-00000004", "step-00000002"]
    resume = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint,
                                                                     resume="auto"))
    got = on_ranks(_train, 2, resume, str(run))[0]
    assert _losses(got) == _losses(ref)[4:]  # bit for bit
    # rank 1 dies while writing the checkpoint of step 4, after its shard, before the commit
    run = tmp_path / "mid_save"

    def die_in_commit(me, T):
        real = ck.Checkpointer._commit

        def commit(self, staged, tmp, step, extra, rng):
            if me == 1 and step == 4:
                _kill(None)
            return real(self, staged, tmp, step, extra, rng)
        ck.Checkpointer._commit = commit
    with pytest.raises(RankFailure):
        on_ranks(_train, 2, cfg, str(run), die_in_commit)
    assert (run / "checkpoints" / ".step-00000004.partial").is_dir()
    assert [p.name for p in ck.complete_checkpoints(run / "checkpoints")] == ["step-00000002"]
    got = on_ranks(_train, 2, resume, str(run))[0]
    assert _losses(got) == _losses(ref)[2:]
    assert not (run / "checkpoints" / ".step-00000004.partial").exists()


RESHARD = [  # (world, parallel) to load a checkpoint saved at tp2 x cp2 x dp2 (FSDP)
    (8, {"dp": 8}),
    (8, {"cp": 4, "dp": 2, "attention": "ulysses"}),
    (4, {"cp": 2, "dp": 2, "dp_engine": "ddp"}),
]


@pytest.mark.slow
def test_a_checkpoint_loads_under_other_layouts(tmp_path):
    saved_at = {"tp": 2, "sp": True, "cp": 2, "dp": 2, "attention": "ring"}
    train = {"global_batch": 8}
    saved = dp2_config(6, parallel=saved_at, checkpoint={"every": 3}, train=train)
    ref = on_ranks(_train, 8, saved, str(tmp_path / "ref"), timeout_s=300)[0]
    step3 = tmp_path / "ref" / "checkpoints" / "step-00000003"
    for world, parallel in RESHARD:
        cfg = dp2_config(6, parallel=parallel, checkpoint={"every": 0, "load": str(step3)},
                         train=train)
        for history in on_ranks(_train, world, cfg, str(tmp_path / str(parallel)),
                                timeout_s=300):
            assert [h["step"] for h in history] == [4, 5, 6]
            for got, want in zip(history, ref[3:]):
                assert got["loss"] == pytest.approx(want["loss"], rel=2e-5), parallel
                assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), parallel
    # weights only: the same weights, but a fresh optimizer and data from the start
    cfg = dp2_config(2, parallel={"dp": 2}, train=train, checkpoint={
        "every": 0, "load": str(step3), "load_model_only": True})
    history = on_ranks(_train, 2, cfg, str(tmp_path / "weights"))[0]
    assert [h["step"] for h in history] == [1, 2] and history[0]["lr"] == ref[0]["lr"]
    assert history[0]["loss"] < ref[0]["loss"]  # trained weights, not a fresh init


@pytest.mark.slow  # 6 s
def test_damaged_checkpoints_are_skipped_or_refused(tmp_path):
    cfg = dp2_config(6)
    ref = on_ranks(_train, 2, cfg, str(tmp_path / "ref"))[0]
    run = tmp_path / "run"
    on_ranks(_train, 2, cfg, str(run))
    ck.shutil.rmtree(run / "checkpoints" / "step-00000006")
    newest = run / "checkpoints" / "step-00000004"
    shard = newest / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern, same size
    shard.write_bytes(bytes(data))
    assert any("sha256" in p for p in ck.damaged_files(newest))
    explicit = dp2_config(6, checkpoint={"every": 0, "load": str(newest)})
    with pytest.raises(RankFailure, match="cannot be used: .*sha256"):
        on_ranks(_train, 2, explicit, str(tmp_path / "explicit"))
    resume = dp2_config(6, checkpoint={"resume": "auto"})
    got = on_ranks(_train, 2, resume, str(run))[0]
    assert _losses(got) == _losses(ref)[2:]  # from step 2, the previous complete checkpoint
    shard = newest / "__0_0.distcp"  # the step-4 checkpoint written again by the resumed run
    shard.write_bytes(shard.read_bytes()[:100])  # truncated: caught by size, even unhashed
    assert "holds 100 bytes" in ck.damaged_files(newest, hashes=False)[0]


@pytest.mark.slow
def test_async_save_does_not_block_training_and_equals_a_sync_save(tmp_path):
    import torch.distributed.checkpoint as dcp

    order = []

    def gate_write(me, T):
        """The background write of step 2 waits until training has finished step 4."""
        release, real_write, real_step = threading.Event(), dcp.FileSystemWriter.write_data, \
            T.train_step
        calls = [0]

        def write_data(self, plan, planner):
            if "step-00000002" in str(self.path):
                assert release.wait(60), "training was blocked by the background write"
                order.append("write of step 2")
            return real_write(self, plan, planner)

        def step(*args, **kwargs):
            calls[0] += 1
            out = real_step(*args, **kwargs)
            order.append(f"step {calls[0]}")
            if calls[0] == 4:
                release.set()
            return out
        dcp.FileSystemWriter.write_data, T.train_step = write_data, step

    def run(cfg, run_dir, fault):
        _train(cfg, run_dir, fault)
        return order

    async_cfg = dp2_config(4, checkpoint={"async_save": True})
    seen = on_ranks(run, 2, async_cfg, str(tmp_path / "async"), gate_write)[0]
    assert seen.index("step 4") < seen.index("write of step 2")
    on_ranks(_train, 2, dp2_config(4), str(tmp_path / "sync"))
    a, s = (tmp_path / name / "checkpoints" / "step-00000004" for name in ("async", "sync"))
    assert _load_tensors(a).keys() == _load_tensors(s).keys()
    for key, value in _load_tensors(a).items():
        assert torch.equal(value, _load_tensors(s)[key]), key


def _load_tensors(path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = ck.SafeReader(path).read_metadata()
    out = {k: torch.empty(m.size, dtype=m.properties.dtype)
           for k, m in meta.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    dcp.load(out, storage_reader=ck.SafeReader(path), no_dist=True)
    return out


def test_write_errors_keep_the_previous_checkpoint(tmp_path):
    import errno

    import torch.distributed.checkpoint as dcp

    def disk_full(me, T):
        real = dcp.FileSystemWriter.write_data

        def write_data(self, plan, planner):
            if "step-00000004" in str(self.path) and me == 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(self, plan, planner)
        dcp.FileSystemWriter.write_data = write_data

    run = tmp_path / "run"
    with pytest.raises(RankFailure) as failure:
        on_ranks(_train, 2, dp2_config(6), str(run), disk_full)
    message = str(failure.value)
    assert "checkpoint of step 4 could not be written" in message
    assert "No space left on device" in message and "step-00000002 is intact" in message
    assert [p.name for p in ck.complete_checkpoints(run / "checkpoints")] == ["step-00000002"]
    assert not ck.damaged_files(run / "checkpoints" / "step-00000002")


@pytest.mark.slow
def test_preemption_signal_and_stop_file_checkpoint_and_stop(tmp_path):
    cfg = dp2_config(8, checkpoint={"every": 0})
    ref = on_ranks(_train, 2, cfg, str(tmp_path / "ref"))[0]
    for name, fault in [
        ("sigusr1", _at_step(3, 1, lambda T: os.kill(os.getpid(), signal.SIGUSR1))),
        ("stop_file", _at_step(5, 1, lambda T: (tmp_path / "stop_file" / "STOP").touch())),
    ]:
        run = tmp_path / name
        histories = on_ranks(_train, 2, cfg, str(run), fault)
        stopped = 3 if name == "sigusr1" else 5
        assert all([h["step"] for h in hist] == list(range(1, stopped + 1)) for hist in histories)
        assert [p.name for p in ck.complete_checkpoints(run / "checkpoints")] == [
            f"step-{stopped:08d}"]
        resume = dp2_config(8, checkpoint={"every": 0, "resume": "auto"})
        assert _losses(on_ranks(_train, 2, resume, str(run))[0]) == _losses(ref)[stopped:]
        assert not (run / "STOP").exists()


@pytest.mark.parametrize("parallel", [{}, pytest.param({"dp": 1, "pp": 2},
                                                      marks=pytest.mark.slow)])
def test_non_finite_steps_stop_or_are_skipped(tmp_path, parallel):
    """On every rank together: with pp=2 only the last stage computes the loss, and each
    stage holds half of the gradient norm."""
    def inf_norm(me, T):
        import lctrain.training.step as S

        real, calls = S.clip_grad_norm_, [0]

        def clip(params, max_norm, *rest):
            calls[0] += 1
            norm = real(params, max_norm, *rest)
            return torch.full_like(norm, float("inf")) if calls[0] == 3 else norm
        S.clip_grad_norm_ = clip

    stop = dp2_config(5, parallel=parallel, checkpoint={"every": 0})
    with pytest.raises(RankFailure, match="NonFiniteError: step 3: loss .* grad norm inf"):
        on_ranks(_train, 2, stop, str(tmp_path / "stop"), inf_norm)
    skip = dp2_config(5, parallel=parallel, checkpoint={"every": 0}, train={"on_nan": "skip"})
    histories = on_ranks(_train, 2, skip, str(tmp_path / "skip"), inf_norm)
    for history in histories:
        assert [h["skipped"] for h in history] == [0, 0, 1, 0, 0]
        assert history[3]["lr"] == history[2]["lr"]  # the schedule did not advance either
        assert all(math.isfinite(h["loss"]) for h in history)
    assert _losses(histories[0]) == _losses(histories[1])


def test_loading_runs_no_code_and_secrets_stay_out(tmp_path, monkeypatch):
    from lctrain.config.compose import compose
    from lctrain.config.resolved import to_yaml

    on_ranks(_train, 1, dp2_config(2, parallel={"dp": 1}), str(tmp_path / "run"))
    path = tmp_path / "run" / "checkpoints" / "step-00000002"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    (path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        ck.SafeReader(path).read_metadata()
    assert not (tmp_path / "pwned").exists()
    monkeypatch.setenv("WANDB_API_KEY", "s3cr3t-value-123")
    code = f"__import__('os').system('touch {tmp_path / 'pwned'}')"
    cfg = compose(["logging.wandb_project=${oc.env:WANDB_API_KEY}",
                   f'slurm.job_name="{code}"']).cfg
    text = to_yaml(cfg)
    assert "s3cr3t-value-123" not in text and "<WANDB_API_KEY redacted>" in text
    assert cfg.slurm.job_name == code and not (tmp_path / "pwned").exists()  # a string only
    run = tmp_path / "secret_run"
    on_ranks(_train, 1, dataclasses.replace(dp2_config(2, parallel={"dp": 1}), logging=cfg.logging),
             str(run))
    for file in [run / "config.yaml", *run.glob("checkpoints/*/config.yaml"),
                 run / "metrics.jsonl"]:
        assert "s3cr3t-value-123" not in file.read_text(), file


def test_retention_keeps_the_newest(tmp_path):
    on_ranks(_train, 1, dp2_config(7, parallel={"dp": 1}, checkpoint={"keep": 2}), str(tmp_path))
    names = [p.name for p in ck.complete_checkpoints(tmp_path / "checkpoints")]
    assert names == ["step-00000007", "step-00000006"]  # every 2 steps and after the last
    manifest = json.loads((tmp_path / "checkpoints" / names[0] / ck.MANIFEST).read_text())
    assert {".metadata", "train_state.json", "config.yaml", "rng-00000.json"} <= set(
        manifest["files"])


@pytest.mark.slow
def test_export_a_checkpoint_for_transformers(tmp_path):
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    cfg = dp2_config(2, parallel={"cp": 2, "dp": 1}, train={"global_batch": 2})
    on_ranks(_train, 2, cfg, str(tmp_path / "run"))
    step = tmp_path / "run" / "checkpoints" / "step-00000002"
    done = subprocess.run([sys.executable, "tools/export_hf.py", str(step), str(tmp_path / "hf")],
                          capture_output=True, text=True, timeout=300,
                          cwd=ck.Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    # the reference: the checkpoint's weights read straight from the shards into lctrain's model
    tensors = _load_tensors(step)
    model = reference_model(cfg)
    model.load_state_dict({k[len("model."):]: v for k, v in tensors.items()
                           if k.startswith("model.")})
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator()
                           .manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=1e-4, atol=1e-5)
