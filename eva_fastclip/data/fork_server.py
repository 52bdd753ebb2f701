"""Imported by the loaders' fork server only (the first module of its preload list, data/workers.py),
never by a rank. The server then acts as the workers do: it ignores the stop signals (launch.py sends
SIGTERM to a rank's whole process tree, and the rank finishes its step and saves first), and dies with the
rank that started it, however that ends; its workers die with it in turn (``ignore_stop_signals``). A rank
must not import this module: it would ignore a stop and die with its launcher instead of saving
(reliability/preemption.py)."""

from eva_fastclip.reliability.signals import ignore_stop_signals, name_process

ignore_stop_signals()
name_process("loader-server")  # in ps and top: a server forked from its rank shows the rank's command
