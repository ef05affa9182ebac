"""The drafter of the built-in engine (the simulator drives the same rounds): draft sources
(the draft model, n-gram lookup) and the pull loop of draft rounds steered by a speculation
session (predict-execute-correct: the policy decides, rounds.py executes)."""
