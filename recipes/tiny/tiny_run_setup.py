"""Imported by verl in every process of the tiny GRPO run (VERL_USE_EXTERNAL_MODULES=tiny_run_setup).

- Megatron without transformer_engine where TE is missing (verl_p2p.sandbox.te_free; a no-op where TE exists).
- verl_p2p's INFO lines in the run's log: the plan, and check_weight_update_equal's verdict on the first sync
  ("compare passed on N replica(s)"), which scripts/grpo_check.py reads. verl configures the root logger at
  WARNING; the records reach its handler through propagation.
"""

import logging

from verl_p2p.sandbox import te_free

te_free.enable()
logging.getLogger("verl_p2p").setLevel(logging.INFO)
