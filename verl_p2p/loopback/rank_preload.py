"""What every loopback rank imports before it builds its model, imported once by the template the engine's ranks
are forked from (sandbox/forked.py): SGLang's loader and model code, the rank's builder, Mooncake's binding. Imports
only; each rank installs its own stand-ins, builds its model and starts its transfer engine itself.
"""

import mooncake.engine  # noqa: F401
import sglang.srt.model_loader.loader  # noqa: F401

import verl_p2p.loopback.sglang_rank  # noqa: F401
