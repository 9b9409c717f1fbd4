"""Pure planning: no I/O, no heavy imports.

`targets` describes what a rollout rank publishes, `layout` derives a rank's parallel layout from the
server args, and `plan` assigns rollout targets to trainer sources.
"""
