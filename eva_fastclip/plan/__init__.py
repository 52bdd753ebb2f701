"""The run plan: what a run will do, decided once before anything is built (``run_plan.make_plan``).

Batch layout (``layout.py``), precision (``precision.py``), the resolved DeepSpeed JSON
(``deepspeed_json.py``), the checks before step 1 (``preflight.py``) and the resume decision.
"""
