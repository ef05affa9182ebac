"""The speculative mechanism of the built-in engine (the simulator drives the same rounds):
draft sources, draft rounds steered by a plan, lossless acceptance."""
