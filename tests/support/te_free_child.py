"""Child process of tests/test_te_free.py: a fresh interpreter where verl imports verl_p2p.sandbox.te_free.

Builds the tiny run's Qwen3 the way verl 0.9.1's Megatron engine does (Megatron-Bridge provider + verl's provider
overrides + the recipe's TE-free overrides), loads the HF weights through the bridge and runs verl's BSHD forward
(right-padded batch, (batch, seq) padding mask) on CPU; prints one JSON line of findings.
Usage: python te_free_child.py MODEL_DIR
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys

os.environ["VERL_USE_EXTERNAL_MODULES"] = "verl_p2p.sandbox.te_free"

import torch  # noqa: E402
import verl  # noqa: E402,F401  (imports the TE-free hook)


def main(model_dir: str) -> dict:
    out: dict = {"hook_before_bridge": "megatron.bridge" not in sys.modules}
    import megatron.core.optimizer as mcore_optimizer
    from megatron.bridge import AutoBridge
    from megatron.bridge.utils import fusions
    from megatron.core.extensions import transformer_engine as mcore_te

    out["te_importable_after"] = importlib.util.find_spec("transformer_engine") is not None
    try:
        import transformer_engine  # noqa: F401

        out["import_te_after"] = "ok"
    except ImportError:
        out["import_te_after"] = "ImportError"
    out["mcore_have_te"] = bool(mcore_te.HAVE_TE)
    out["mcore_adam"] = f"{mcore_optimizer.Adam.__module__}.{mcore_optimizer.Adam.__name__}"
    out["grad_accum_fusion_available"] = bool(fusions.can_enable_gradient_accumulation_fusion())

    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.transformer.enums import AttnBackend

    from verl_p2p.sandbox.cpu_megatron import _cuda_is_identity, free_port, init_distributed
    from verl_p2p.sandbox.te_free import REQUIRED_FALSE

    init_distributed(0, 1, free_port())
    mpu.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    bridge = AutoBridge.from_hf_pretrained(model_dir)
    provider = bridge.to_megatron_provider(load_weights=False)
    overrides = {  # verl 0.9.1 MegatronEngine._build_tf_config's provider_overrides at TP=PP=1
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "expert_model_parallel_size": 1,
        "expert_tensor_parallel_size": None,
        "virtual_pipeline_model_parallel_size": None,
        "context_parallel_size": 1,
        "sequence_parallel": False,
        "overlap_p2p_comm": False,
        "batch_p2p_comm": False,
        "variable_seq_lengths": True,
        "attention_backend": AttnBackend.flash,
        "moe_token_dispatcher_type": "alltoall",
        "moe_router_load_balancing_type": "none",
        # the recipe's override_transformer_config (te_free_overrides)
        **{name: False for name in REQUIRED_FALSE},
        "transformer_impl": "local",
        "use_cpu_initialization": True,
    }
    provider.apply_overrides_and_finalize(dtype=torch.float32, overrides=overrides)
    with _cuda_is_identity():
        model = provider.provide_distributed_model(
            wrap_with_ddp=False, use_cpu_initialization=True, mixed_precision_wrapper=None
        )
    bridge.load_hf_weights(model, model_dir)
    gpt = model[0]
    classes = {type(m).__module__ + "." + type(m).__name__ for m in gpt.modules()}
    out["core_attention"] = sorted(c for c in classes if "Attention" in c and "SelfAttention" not in c)
    out["te_modules"] = sorted(c for c in classes if "transformer_engine" in c)

    # verl's BSHD batch: right-padded, (batch, seq) bool mask True on real tokens, position ids 0..S-1.
    lengths = [9, 5]
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(10, 500, (n,), generator=gen) for n in lengths]
    width = max(lengths)
    input_ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        input_ids[i, : len(s)] = s
        mask[i, : len(s)] = True
    positions = torch.arange(width).unsqueeze(0).expand_as(input_ids)

    class _NoCudaRng:  # CPU only: megatron forks the CUDA RNG around attention dropout (p=0 here)
        def fork(self, *a, **k):
            return contextlib.nullcontext()

    tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: _NoCudaRng()
    torch.cuda.current_device = lambda: "cpu"  # CPU only: RoPE moves its frequencies to the current device
    from megatron.core.fusions import fused_softmax

    # CPU only: megatron's causal mask (the one the TE-free attention relies on) is built on "cuda"
    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool()
    gpt.eval()
    with torch.no_grad():
        logits = gpt(input_ids=input_ids, position_ids=positions, attention_mask=mask)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    diffs = []
    with torch.no_grad():
        for i, s in enumerate(seqs):
            ref = hf(input_ids=s.unsqueeze(0)).logits[0]
            got = logits[i, : len(s), : ref.shape[-1]]
            diffs.append(float((got - ref).abs().max()))
    out["max_abs_diff_vs_hf"] = max(diffs)
    out["logit_scale"] = float(logits.abs().max())

    # The conversion verl's HF checkpoint writes (AutoBridge.save_hf_weights streams the same generator; it also
    # imports ModelOpt, which the GPU stack carries): what the fresh SGLang server of the GPU run loads.
    from pathlib import Path

    from safetensors.torch import load_file

    original = load_file(str(Path(model_dir) / "model.safetensors"))
    saved = {name: t for name, t in bridge.export_hf_weights(model, cpu=True, show_progress=False)}
    out["hf_export_same_names"] = sorted(saved) == sorted(original)
    out["hf_export_bit_equal"] = all(k in saved and torch.equal(saved[k].to(v.dtype), v) for k, v in original.items())
    return out


if __name__ == "__main__":
    print("TE_FREE_RESULT " + json.dumps(main(sys.argv[1])), flush=True)
