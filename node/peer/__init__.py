"""The node process: wiring, the training loop's seam, hand-over of experts, telemetry, local swarms."""
