"""The in-process simulator: C composers in one process, the reference every networked figure is held to."""
