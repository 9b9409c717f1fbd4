"""CPU sandbox helpers for the demo, the benchmarks and the tests: never on the production path.

`tiny` writes tiny HF checkpoints, `cpu_megatron` builds a Megatron-Bridge model on CPU (gloo), and
`cpu_stubs` installs the import stand-ins SGLang's model classes need on a host without GPU kernels, and
`te_free` lets verl's Megatron actor run without transformer_engine (the tiny GPU run, recipes/tiny_grpo_2gpu.sh).
"""
