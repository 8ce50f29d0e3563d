"""The build: what wrapping does once, before any step (and what the memory planner asks
without wrapping). ``wrap.py`` picks the units (the one walk the planner shares),
``unit_init.py`` flattens a unit's parameters and prepares its buffers,
``deferred_init.py`` materializes meta-device modules, ``ownership.py`` plans whole-param
owners, ``from_torch_fsdp.py`` refuses PyTorch FSDP's names with fsdp_lite's. It sits on ``core`` (the step) and under ``fsdp.py``; what it refuses on the way
is in ``core/checks.py``, beside the first-forward checks."""
