"""The trained model out of a run: assembled from checkpoints or a live swarm, written as one folder, loaded,
sampled from and evaluated."""
