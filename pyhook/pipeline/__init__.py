"""The capture pipeline, one module per stage; imports run one way, top to bottom.

* :mod:`.job` -- a capture as one config (``plan()``, ``run()`` to a store, ``stream()`` to a
  trainer); the ``pyhook capture`` command parses into it and prints from it;
* :mod:`.source` -- corpus files and datasets -> tokenised, packed batches;
* :mod:`.runner` -- models and tokenizers, the forward loop;
* :mod:`.capture` -- the recorder (hooks on the chosen layers -> rows; statistics, tokens);
* sinks: :mod:`.stream` (a mixing buffer -> a trainer) and :mod:`.writer` (crash-safe shards);
* :mod:`.annotations`, :mod:`.reader`, :mod:`.dataset` -- reading a store back;
* :mod:`.verify`, :mod:`.transport` (fsspec URLs), :mod:`.format` (the bytes).

The public names are importable from :mod:`pyhook` and :mod:`pyhook.store`; the modules'
old paths (``pyhook.capture``, ``pyhook.store.writer``, ...) are these same modules. Importing
this package imports none of its stages.
"""
