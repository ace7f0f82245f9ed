"""`lctrain preprocess`: tokenize data.path with data.tokenizer into token shards at
preprocess.output (the work is `lctrain.data.preprocess`; this module never imports torch)."""

from __future__ import annotations

import sys

from lctrain.commands import CommandArgs
from lctrain.config import ConfigError
from lctrain.data.ingest import TokenizerMismatch
from lctrain.data.preprocess import preprocess, validate_preprocess


def run(args: CommandArgs) -> int:
    """Exit 2 on a config problem (raised), 1 on a data error, 0 when written."""
    cfg = args.composed.cfg
    problems = validate_preprocess(cfg)
    if problems:
        raise ConfigError(problems)
    try:
        summary = preprocess(cfg, progress=cfg.logging.progress)
    except TokenizerMismatch as e:
        raise ConfigError([str(e)]) from e
    except (ValueError, OSError) as e:  # DataError, unreadable corpus or tokenizer, no document
        message = str(e).replace("\n", " ")
        print(f"lctrain: data error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"lctrain: preprocess interrupted; {cfg.preprocess.output} was not written",
              file=sys.stderr)
        return 130
    print(summary.render())
    return 0
