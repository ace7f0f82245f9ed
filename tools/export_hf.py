"""Export the weights of an lctrain checkpoint as a Hugging Face Llama directory.

    python tools/export_hf.py runs/x/checkpoints/step-00001000 exported/

One process, any saved layout and engine: the checkpoint is verified against its manifest, the
model is built from the checkpoint's config.yaml, the weights are read from the DCP shards
(resharded to one process) or from the DeepSpeed engine's ZeRO shards (consolidated) and written
as config.json + model.safetensors, which
`transformers.AutoModelForCausalLM.from_pretrained` loads.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omegaconf import OmegaConf  # noqa: E402

from lctrain.config import LctrainConfig  # noqa: E402
from lctrain.models.hf import export_hf, full_parameters  # noqa: E402
from lctrain.models.registry import new_model  # noqa: E402
from lctrain.parallel import deepspeed_engine  # noqa: E402
from lctrain.training.checkpoint import damaged_files, full_weights  # noqa: E402


def export_checkpoint(checkpoint: Path, out: Path) -> None:
    problems = damaged_files(checkpoint)
    if problems:
        raise SystemExit(f"export_hf: {checkpoint} cannot be used: {'; '.join(problems)}")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(LctrainConfig),
                                              OmegaConf.load(checkpoint / "config.yaml")))
    model = new_model(cfg.model)
    if (checkpoint / deepspeed_engine.TAG).is_dir():  # ZeRO shards, consolidated
        model.load_state_dict(deepspeed_engine.full_weights(checkpoint))
    else:
        model.load_state_dict(full_weights(checkpoint, cfg))
    export_hf(full_parameters(model), cfg.model, str(out), rank=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a step-NNNNNNNN checkpoint directory")
    parser.add_argument("out", type=Path, help="the Hugging Face directory to write")
    args = parser.parse_args()
    export_checkpoint(args.checkpoint, args.out)
    print(f"export_hf: wrote {args.out}")


if __name__ == "__main__":
    main()
