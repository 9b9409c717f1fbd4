"""Which SGLang model class a rollout rank runs, and whether SGLang post-processes its weights after loading.

Some model classes derive weights from the loaded ones once loading is done (`post_load_weights`: MLA models
such as DeepSeek-V2/V3 split `kv_b_proj` into the absorbed `w_kc`/`w_vc`, others requantize or fuse). SGLang
runs that step after its own loads, and after p2p's one-sided writes only when the weight-update session
ends (`/end_weight_update`, SGLang >= 0.5.21). A rollout without sessions would keep serving the derived
weights of the old model, so such a pairing is refused (`refuse_post_load_without_sessions`), naming what
the class derives (`derived.py`: the allow-list of derivations a session end rebuilds).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from verl_p2p.errors import UnsupportedLayoutError
from verl_p2p.planning.layout import RankLayout
from verl_p2p.replica.derived import derivations_of_class
from verl_p2p.replica.rank_context import RankContext
from verl_p2p.sglang_versions import SESSIONS_SINCE as SESSIONS_RELEASE
from verl_p2p.sglang_versions import release_text

POST_LOAD = "post_load_weights"  # what SGLang's loader calls on the model after loading (hasattr check)
SESSIONS_SINCE = release_text(SESSIONS_RELEASE)  # first release with /begin_weight_update and /end_weight_update


# SGLang model classes p2p cannot plan for, with what stops it (SGLang 0.5.23 sources; the test that pins each stop
# is named, so a release that lifts one shows there).
UNSUPPORTED_CLASSES: dict[str, str] = {
    "DeepseekV4ForCausalLM": (
        "its write plan cannot be captured on the planning host's meta device: off an accelerator SGLang's rope "
        "factory builds only DeepSeek-yarn ropes and V4's sliding-window layers (compress ratio 0) have none "
        "(layers/rotary_embedding/factory.py, get_rope_cpu); its load_weights reads one-element tensors with .item() "
        "(model.hc_head_scale) and prewarms CUDA mHC kernels; and it reorders compressor.ape in place while loading "
        "and again in post_load_weights, which p2p's plan recorder does not reproduce "
        "(tests/test_replica_deepseek_v4.py)"
    ),
}


class PostLoadWithoutSessionsError(UnsupportedLayoutError):
    """The rollout has no weight-update sessions, and its model needs post-load processing after every update."""


class UnsupportedModelClassError(UnsupportedLayoutError):
    """The rollout runs a model class p2p cannot build a write plan for (`UNSUPPORTED_CLASSES`)."""


def refuse_unsupported_class(cls: type) -> None:
    """Raise UnsupportedModelClassError, before any plan or write, for a class in `UNSUPPORTED_CLASSES`."""
    why = UNSUPPORTED_CLASSES.get(cls.__name__)
    if why is not None:
        raise UnsupportedModelClassError(
            f"p2p cannot sync SGLang's {cls.__name__}: {why}; nothing was written. Fix: use verl's own weight sync "
            "for this model (actor_rollout_ref.rollout.checkpoint_engine.backend=nccl)"
        )


def model_class(hf_config: Any, server_args: Mapping[str, Any], layout: RankLayout) -> type:
    """The SGLang model class rollout rank `layout.tp_rank` runs (SGLang's own architecture resolution)."""
    from sglang.srt.model_loader.utils import get_model_architecture

    ctx = RankContext(server_args, layout, hf_config)
    with ctx:
        cls, _ = get_model_architecture(ctx.model_config)
    return cls


def post_load_hook(hf_config: Any, server_args: Mapping[str, Any], layout: RankLayout) -> str | None:
    """`Class.post_load_weights` when SGLang post-processes this model's weights after loading, else None."""
    cls = model_class(hf_config, server_args, layout)
    return f"{cls.__name__}.{POST_LOAD}" if hasattr(cls, POST_LOAD) else None


def refuse_without_sessions(
    hook: str, engine: int, server_info: Mapping[str, Any], derives: Sequence[str] = ()
) -> None:
    """Raise PostLoadWithoutSessionsError for `hook` on rollout `engine` (whose server has no sessions);
    `derives` says what the hook derives (the allow-listed derivations of its class)."""
    version = server_info.get("version") or "?"
    what = "; ".join(derives) or "tensors p2p does not know how to rebuild"
    raise PostLoadWithoutSessionsError(
        f"rollout engine {engine} runs SGLang {version} without weight-update sessions (its /begin_weight_update "
        f"answers 404, or its release predates them), so SGLang never calls {hook}() after p2p writes its "
        f"weights: the tensors that model derives after loading ({what}) would keep the old values while the "
        "rest is new; nothing was written. "
        f"Fix: run the rollout on SGLang >= {SESSIONS_SINCE} (its weight-update session runs post-load "
        "processing when the sync ends), or use verl's own weight sync for this model"
    )


def refuse_post_load_without_sessions(
    hf_config: Any, server_args: Mapping[str, Any], layout: RankLayout, engine: int
) -> None:
    """Refuse (PostLoadWithoutSessionsError) when rollout `engine`, which has no sessions, runs a model class
    that post-processes its weights after loading; return when its class has no such step."""
    cls = model_class(hf_config, server_args, layout)
    if hasattr(cls, POST_LOAD):
        derives = [d.what for d in derivations_of_class(cls)]
        refuse_without_sessions(f"{cls.__name__}.{POST_LOAD}", engine, server_args, derives)
