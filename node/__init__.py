"""The composer and worker: model, data, training loop, surrogate refresh, outer sync, checkpoints."""
