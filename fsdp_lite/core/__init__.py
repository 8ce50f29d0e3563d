"""The core: the step (``root.py`` -> ``schedule.py``, ``unit.py`` -> ``flat_param.py``
-> ``collectives.py``), what is refused at wrap time and at the first forward
(``checks.py``), and what the step and the build (``fsdp_lite/build``) share
(``policies.py``, ``state.py``, ``tree.py``, ``home.py``, ``accounting.py``, ``grads.py``,
``dtensors.py``). Nothing here imports the build or an add-on."""
