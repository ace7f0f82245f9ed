"""train()'s teardown: whatever fails (a part that does not build, a step, closing the
checkpointer), every part built before the failure is closed, in the order that keeps the run's
records true (checkpointer, signal handlers, progress record, metrics logger), parts never built
are not, and the progress record ends with the phase of what happened. All cases run in one
forked rank."""

import signal
from pathlib import Path

from lctrain.rundir.rank_records import read_records
from tests.helpers import on_ranks, tiny_config

ALL = ["checkpointer", "watcher", "record", "metrics"]


class Boom(RuntimeError):
    pass


def _raise(*args, **kwargs):
    raise Boom("injected")


def _case(T, cfg, run_dir: str, fault: str) -> dict:
    """train() with `fault` injected; what was closed, in order, and how the run ended."""
    closed, saved = [], []

    def patch(owner, name, value):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def track(cls, method, part, fail=False):
        real = getattr(cls, method)

        def closing(self, *args, **kwargs):
            closed.append(part)
            real(self, *args, **kwargs)
            if fail:
                raise Boom(f"closing the {part}")
        patch(cls, method, closing)

    track(T.Checkpointer, "close", "checkpointer", fail=fault == "close")
    track(T.PreemptionWatcher, "restore", "watcher")
    track(T.progress.ProgressRecord, "close", "record")
    track(T.MetricsLogger, "close", "metrics")
    if fault in ("MetricsLogger", "Evaluator", "train_step"):
        patch(T, fault, _raise)
    handler = signal.getsignal(signal.SIGTERM)
    error = None
    try:
        T.train(cfg, run_dir)
    except Boom as e:
        error = str(e)
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)
    return {"closed": closed, "error": error, "phase": read_records(Path(run_dir))[0]["phase"],
            "handler_restored": signal.getsignal(signal.SIGTERM) is handler}


def _cases(cfg, root: str) -> dict:
    import lctrain.training.loop as T

    return {fault: _case(T, cfg, f"{root}/{fault}", fault)
            for fault in ("none", "MetricsLogger", "Evaluator", "train_step", "close")}


def test_every_part_built_is_closed_in_order_whatever_fails(tmp_path):
    cfg = tiny_config(train={"steps": 2, "global_batch": 2, "micro_batch": 1},
                      checkpoint={"every": 0})
    out = on_ranks(_cases, 1, cfg, str(tmp_path))[0]
    assert out["none"] == {"closed": ALL, "error": None, "phase": "done",
                           "handler_restored": True}
    # the metrics logger failed to build: the watcher and the record were built before it
    assert out["MetricsLogger"] == {"closed": ["watcher", "record"], "error": "injected",
                                    "phase": "failed", "handler_restored": True}
    for fault in ("Evaluator", "train_step"):
        assert out[fault] == {"closed": ALL, "error": "injected", "phase": "failed",
                              "handler_restored": True}, fault
    # the checkpointer's close raised after the last step: the rest still closed
    assert out["close"] == {"closed": ALL, "error": "closing the checkpointer", "phase": "done",
                            "handler_restored": True}
