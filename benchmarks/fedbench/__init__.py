"""The benchmark package behind ``benchmarks/compare.py`` (and the pieces ``robustness.py`` and
``poison.py`` share).

- ``settings``: the command line, scale presets and matched budgets -> one ``settings`` dict.
- ``tasks``: the data, through the plugin's own path (``fedml_fedmitr.data.load_data``), so a
  setting gives the same clients here and through ``python -m fedml_fedmitr``.
- ``jobs``: what a child process runs (pretraining, clients, central model, one method, the
  references) and writes as a JSON record.
- ``references``: KD on real images in place of the synthetic pool, and the attention probe.
- ``schedule``: the jobs as child processes, ``--jobs`` at a time (``concurrent.futures``), each
  claimed with a ``filelock`` lock so several processes can share one cache.
- ``stats``: means over seeds and paired differences with their t interval.
- ``report``: the result JSON's rows, the markdown tables and the learning-curve plots.
- ``store``: hashing and atomic JSON files; paths written relative to the repository.

The parent side (settings, schedule, report, stats, store) never imports torch.
"""
