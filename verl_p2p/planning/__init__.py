"""Pure planning: no I/O, no heavy imports.

`targets` describes what a rollout rank publishes, `layout` derives a rank's parallel layout from the
server args, and `plan` assigns rollout targets to trainer sources (`fsdp`: every FSDP rank writes its part
of every target). `hf_names` lists a checkpoint's tensors
from its config, `model_cards` holds published model shapes and sync figures, and `sync_estimate` turns the
bytes of the rollout ranks' write plans into per-link bytes, a wire floor and a predicted sync time.
"""
