"""Inference engines behind one protocol.

- ``client.EngineClient``: what the rollout code calls on an engine (generate, pause, resume, abort,
  weight loading, health, load); ``launcher.EngineProcess``: how its server is started and stopped;
  ``router``: requests spread over the engines; ``fault_tolerance``: the health policy (pure).
- One folder per engine, ``embedded/`` (our CPU server), ``sglang/``, ``vllm/``, each with its
  ``client.py`` and ``launcher.py``; an engine's differences stay in its folder.
- ``engines.ENGINES``: each ``--rollout-backend``'s client and launcher, joined to its kind in
  ``config/engine_kinds.py`` (its weight routes). A new engine is a new folder, one line there and one
  kind. This package imports the configuration; the configuration imports nothing of it.

The base modules import no engine folder, and no engine folder imports another
(tests/unit/test_layers.py).
"""
