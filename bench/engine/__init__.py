"""``orpheus-serve bench engine``: the vLLM engine alone, step time against streams, with one
engine or several sharing the device (the method: ``cli``'s docstring, docs/benchmarks.md).

- ``cli``: the command (``__main__.py``: ``python -m bench.engine``, also each engine's process);
- ``variants``: the variants' configuration and the engine built for each;
- ``parent``: K engine processes per variant, stepped through the levels together;
  ``channel``: the control channel between the parent and each engine process;
- ``child``: one engine's process; ``loop``: its closed loop of fixed-length requests;
  ``probes``: what it reads of itself (EngineCore CPU, GPU busy, per-phase host time);
- ``levels``: a level from its step signals, the engines' shares combined (pure);
  ``results``: the defaults and the result Structs (the JSON); ``report``: table and PNG.
"""
