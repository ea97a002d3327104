"""One composer's training: data, device, the composer step, outer optimizer, RDA merge, checkpoints."""
