"""Worker offload: Taylor-proxy training of experts on remote workers from activation sketches."""
