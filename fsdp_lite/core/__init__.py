"""The core: the step (``root.py`` -> ``schedule.py``, ``unit.py`` -> ``flat_param.py``
-> ``collectives.py``), wrap-time work (``unit_init.py``, ``deferred_init.py``,
``wrap.py``), what is refused at wrap time and at the first forward (``checks.py``), and
what they share (``policies.py``, ``state.py``, ``tree.py``, ``home.py``,
``accounting.py``, ``grads.py``, ``dtensors.py``). Nothing here imports an add-on."""
