"""Development-only stand-ins that let SGLang 0.5.23 run on a CPU without CUDA: the
sgl_kernel ops in torch (cpu_ops/, registered by the stand-in package in cpu_shim/, which is
put on the SGLang process's PYTHONPATH, never installed), SGLang's server command line and
environment on a CPU (cpu_server.py) and the tiny test pair (tiny_pair.py). Not part of the
product: the extension (sloserve/server/) never imports this package; the launcher's CPU
branch (cli/sglang_launch.py) and the tests do."""
