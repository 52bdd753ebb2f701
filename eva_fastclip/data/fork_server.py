"""Imported by the loaders' fork server only (the first module of its preload list, data/workers.py),
never by a rank: the server then dies with the rank that started it. Its workers die with it in turn
(``ignore_stop_signals``), so nothing of a rank is left however the rank ends. A rank must not import
this module: it would die with its launcher instead of saving (engine/preemption.py)."""

from eva_fastclip.data.workers import die_with_parent

die_with_parent()
