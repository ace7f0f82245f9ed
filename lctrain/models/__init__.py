"""Models: the single-device generic decoder (decoder) and the families built on it (families:
the entry type; qwen2, qwen3, mistral; registry: every family registered, `new_model`), RoPE
frequencies with context extension (rope), Hugging Face interop (hf, hf_config). Plain code;
parallelism is applied from lctrain.parallel. Importing the package loads no torch (`lctrain
preprocess` reads config.json through hf_config)."""
