"""Checkpoints and resume: the sharded folder a crash cannot corrupt (``checkpoint.py``), what a resumed
run may change (``resume_config.py``), planning a resume before anything is built (``resume_plan.py``: the
checkpoint, the global batch it keeps, the keys the run changes), and the component that saves a run and
restores a resumed one (``checkpointer.py``)."""
