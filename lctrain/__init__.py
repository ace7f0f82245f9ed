"""lctrain: long-context Llama pretraining with validated TP/SP/CP/PP/DP layouts."""

__version__ = "0.1.0"
