"""Checkpoints and resume: the sharded folder a crash cannot corrupt (``checkpoint.py``), what a resumed
run may change (``resume_config.py``), and the component that saves and restores a run
(``checkpointer.py``)."""
