"""The in-process simulator: C composers in one process, the reference every networked figure is held to."""

RUN_KINDS = ("baseline", "diloco", "parallax", "offload")
"""What a simulated run trains: the synchronous MoE, the DiLoCo reference, Parallax, Parallax with offload workers.
Here, not in ``simulator``, so that the command line names them without importing torch."""
