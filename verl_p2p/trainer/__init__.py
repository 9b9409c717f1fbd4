"""The trainer side: from Megatron or FSDP parameters to writes into rollout ranks.

`export` runs the pipeline stage's Megatron-Bridge export (the in-stage TP/EP gather only), guarded by
`stage_guard` against collectives that would span stages; `senders` decides which ranks of an export group
send and which drain; `verl_engine` finds verl's Megatron engine and hooks checkpoint saves; `source` is one
trainer source's session (connect once, push every sync); `push` streams HF tensors through the replica
into transfer slots and out to the targets; `hf_specs` reads tensor names and shapes from a checkpoint.
`exports` is the source's interface to its two exports: Megatron's (`export`) and FSDP's full-tensor stream
(`fsdp_export`: verl's own `get_per_tensor_param()`, every rank its part of every target).
"""
