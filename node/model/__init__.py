"""The MoE transformer and its parts: experts, surrogates, low-rank factors, sketches, FLOP counts."""
