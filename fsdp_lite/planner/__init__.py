"""The memory planner: ``estimate.py`` (``estimate_memory``, ``plan``) lays the units out
(``layout.py``), traces a step on fake parameters (``trace.py``, ``storage.py``) and
replays fsdp_lite's step over it (``replay.py``)."""
