"""Imported by verl in every process of the tiny GRPO runs (VERL_USE_EXTERNAL_MODULES=tiny_run_setup).

- Megatron without transformer_engine where TE is missing (verl_p2p.sandbox.te_free; a no-op where TE exists).
- verl_p2p's INFO lines in the run's log: the plan, and check_weight_update_equal's verdict on the first sync
  ("compare passed on N replica(s)"), which scripts/grpo_check.py reads. verl configures the root logger at
  WARNING; the records reach its handler through propagation.
- The one-GPU pool mapping, a STAND-IN for the second GPU (VERL_P2P_ONE_GPU=1, set by tiny/tiny_args.sh's
  ONE_GPU=1): Ray is told the node has two GPUs, so verl's trainer pool and rollout pool each get one; Ray then
  hands a worker GPU id "0" or "1", and both are the one physical device. Ray sets CUDA_VISIBLE_DEVICES again
  before every task of an actor (not only at start-up), so the mapping also sits in Ray's own setter
  (`map_ray_slots`), installed by Ray's worker start-up hook (`ray_worker_setup`) before any task runs:
  verl's CheckpointEngineWorker of the rollout pool otherwise initialised CUDA under "1" while importing verl,
  and SGLang's ServerArgs in its update_weights task found no GPU (fully_async on the H200).
"""

import logging
import os

from verl_p2p.sandbox import te_free

ONE_GPU_FLAG = "VERL_P2P_ONE_GPU"


def map_onto_one_gpu(environ=os.environ) -> str | None:
    """Point the GPU slot Ray gave this process at the one device; returns what was replaced (None: untouched)."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if environ.get(ONE_GPU_FLAG) != "1" or visible in (None, "", "0"):
        return None
    environ["CUDA_VISIBLE_DEVICES"] = "0"
    return visible


def map_ray_slots(manager=None) -> bool:
    """Under the one-GPU flag, make Ray's CUDA_VISIBLE_DEVICES setter hand every GPU slot out as device "0";
    returns whether the setter is (now) mapped."""
    if os.environ.get(ONE_GPU_FLAG) != "1":
        return False
    if manager is None:
        try:
            from ray._private.accelerators.nvidia_gpu import NvidiaGPUAcceleratorManager as manager
        except ImportError:  # no Ray in this process: nothing sets the variable later
            return False
    original = manager.set_current_process_visible_accelerator_ids
    if getattr(original, "one_gpu_stand_in", False):
        return True

    def set_visible(visible_cuda_devices):
        original(["0"] if len(visible_cuda_devices) else visible_cuda_devices)

    set_visible.one_gpu_stand_in = True
    manager.set_current_process_visible_accelerator_ids = staticmethod(set_visible)
    return True


def ray_worker_setup() -> None:
    """Ray's `worker_process_setup_hook` (tiny/tiny_args.sh, ONE_GPU=1): runs in every Ray worker at start-up,
    before its first task, so Ray's setter is mapped before the actor-creation task sets "1" and the actor's
    imports touch CUDA. The mapping at `import verl` alone came too late in verl's rollout-pool worker: verl's
    `utils.device` asks torch for CUDA before verl imports this module, the CUDA runtime read "1" (no such device
    on a one-GPU host) and that process stayed without a GPU (fully_async on the H200)."""
    map_onto_one_gpu()
    map_ray_slots()


ray_worker_setup()  # also at import: verl imports this module in every process (after its own start-up)
te_free.enable()
logging.getLogger("verl_p2p").setLevel(logging.INFO)
