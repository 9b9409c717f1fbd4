import torch

from verl_p2p.sandbox.tiny import hf_tensor_shapes, tiny_config_dict, write_tiny_checkpoint
from verl_p2p.trainer.hf_specs import hf_specs_from_checkpoint


def test_specs_match_written_checkpoint(tmp_path):
    write_tiny_checkpoint(tmp_path, "qwen3_moe", dtype=torch.bfloat16)
    specs = hf_specs_from_checkpoint(tmp_path)
    expected = dict(hf_tensor_shapes(tiny_config_dict("qwen3_moe")))
    assert {k: v[0] for k, v in specs.items()} == expected
    assert {v[1] for v in specs.values()} == {torch.bfloat16}
