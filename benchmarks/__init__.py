"""Benchmarks: eva_fastclip side by side with the references' own code (docs/benchmarks.md records them).

Run from the repository root, e.g. ``python -m benchmarks.speed``; the installed package never imports
them.
"""
