"""Witness process: rank `r` of real gloo worlds builds each job's SGLang model and dumps its parameters.

Run as `python tests/support/replica_witness.py SPEC.json RANK`. SPEC: {"out": DIR, "phases": [{"world": N,
"init": "tcp://...", "jobs": [{"tag", "model_path", "server_args", "env"?}]}]} (env: the environment settings the
rollout's processes were started with, set while the model is built); a rank joins the phases whose world
includes it, and the world is torn down between phases. Writes DIR/TAG/rank{r}.pt (parameters),
DIR/TAG/derived{r}.pt (non-parameter tensors SGLang derived after loading, e.g. MLA's w_kc/w_vc) and, from
rank 0, DIR/TAG/server_info.json (the resolved server args, as `/server_info` would serve them).
"""

import json
import os
import sys


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    rank = int(sys.argv[2])
    import torch

    from verl_p2p.loopback.sglang_rank import build_sglang_rank_model
    from verl_p2p.replica.rank_context import environment_set

    for phase in spec["phases"]:
        if rank >= phase["world"]:
            break
        for job in phase["jobs"]:
            out = os.path.join(spec["out"], job["tag"])
            os.makedirs(out, exist_ok=True)
            with environment_set(job.get("env", {})):  # what the rollout's process was started with
                model = build_sglang_rank_model(
                    job["model_path"], job["server_args"], rank, phase["world"], phase["init"]
                )
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
            assert all(p.device.type == "cpu" for p in params.values())
            torch.save(params, os.path.join(out, f"rank{rank}.pt"))
            derived = {  # tensors SGLang derives after loading (post_load_weights), e.g. MLA's w_kc / w_vc
                f"{mod_name}.{attr}": t.detach().clone()
                for mod_name, module in model.named_modules()
                for attr, t in vars(module).items()
                if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter)
            }
            torch.save(derived, os.path.join(out, f"derived{rank}.pt"))
            if rank == 0:
                with open(os.path.join(out, "server_info.json"), "w") as f:
                    json.dump(model.sglang_server_info, f, default=str)
            del model
        from sglang.srt.distributed import parallel_state as ps

        torch.distributed.barrier()
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()


if __name__ == "__main__":
    main()
