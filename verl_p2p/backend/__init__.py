"""The verl glue: what verl's checkpoint-engine machinery calls.

`plugin` registers the backend (and the replica launch hook) when verl imports its registries; `engine`
maps verl's engine hooks onto the sync; `manager` drives the whole sync from the trainer process; `guards`
and `hydra_callback` refuse configurations p2p cannot serve; `topology` and `roles` say which process is
a trainer source, a rollout leader or idle; `metrics` shapes what goes back into verl's logged metrics.
Importing this package imports nothing heavy.
"""
