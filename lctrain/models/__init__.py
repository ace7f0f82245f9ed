"""Models: the single-device Llama (llama), RoPE frequencies with context extension (rope) and
Hugging Face interop (hf). Plain code; parallelism is applied from lctrain.parallel."""
