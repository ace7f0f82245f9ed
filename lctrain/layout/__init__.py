"""Where the ranks, the tokens and the layers go, as pure numbers used by every layer above:
rank <-> coordinate math and named groups (topology), the context-parallel sequence split
(sequence), a packed split's causal work and travelling tokens per rank (packed), the tokens a
window layer moves between ranks (halo), and the layers of each pipeline stage and the rank that
runs it (stages). The collectives live beside it in `lctrain.comm`; a model's parameter and FLOP
counts in `lctrain.config.model_size`."""
