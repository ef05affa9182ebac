"""The verifier (SpecServe Alg. 2 and lossless verification): which draft tokens each request
verifies (confidence-prior elimination, elimination.py: numpy, asked by the SpecServe plan)
and whether the target accepts them (acceptance.py: greedy and speculative sampling, pure
math on one request, the one rule of both engines). Imports only the estimator and torch."""
