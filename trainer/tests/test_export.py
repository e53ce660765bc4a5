import json

import pytest
import torch
from safetensors import safe_open

from dflash_trainer.export import check_export, export_draft, load_draft
from dflash_trainer.fixtures.tiny import TINY_MASK_TOKEN_ID, tiny_token_ids
from dflash_trainer.model.drafter import DFlashDrafter, DrafterSpec


def test_config_and_weights(small_spec, tmp_path) -> None:
    drafter = DFlashDrafter(small_spec)
    export_draft(drafter.state_dict(), small_spec, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["dflash_config"] == {"mask_token_id": 511, "target_layer_ids": [1, 5]}
    assert cfg["block_size"] == 4 and cfg["num_target_layers"] == 8 and cfg["vocab_size"] == 512
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] == 10000.0
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] and cfg["sliding_window"] == 6
    assert cfg["is_causal"] is False
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert set(f.keys()) == set(drafter.state_dict())
        assert not any("embed" in k or "lm_head" in k for k in f.keys())  # noqa: SIM118 (safe_open is no dict)
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
    assert DrafterSpec.from_config_dict(cfg) == small_spec


def test_rejects_foreign_weights(small_spec, tmp_path) -> None:
    state = DFlashDrafter(small_spec).state_dict() | {"embed_tokens.weight": torch.zeros(512, 64)}
    with pytest.raises(ValueError, match="embed_tokens"):
        export_draft(state, small_spec, tmp_path)


def test_check_export(small_spec, tmp_path) -> None:
    torch.manual_seed(0)
    drafter = DFlashDrafter(small_spec)
    head = torch.nn.Linear(64, 512, bias=False)
    export_draft(drafter.state_dict(), small_spec, tmp_path / "fp32", dtype=torch.float32)
    export_draft(drafter.state_dict(), small_spec, tmp_path / "bf16")
    assert check_export(tmp_path / "fp32", drafter, lm_head=head) < 1e-5
    assert 0 < check_export(tmp_path / "bf16", drafter, lm_head=head) < 0.1
    assert drafter.fc.weight.dtype == torch.float32  # checking never converts the training model
    assert load_draft(tmp_path / "bf16").fc.weight.dtype == torch.bfloat16


def test_dflash_generate_equals_target_greedy(tiny_target, tmp_path) -> None:
    dflash_model = pytest.importorskip("dflash.model")
    from transformers import Qwen3ForCausalLM

    path = tiny_target("qwen3")
    target = Qwen3ForCausalLM.from_pretrained(str(path), local_files_only=True).eval()
    spec = DrafterSpec.from_target_config(target.config, 2, 4, TINY_MASK_TOKEN_ID)
    torch.manual_seed(0)
    export_draft(DFlashDrafter(spec).state_dict(), spec, tmp_path, dtype=torch.float32)
    draft = dflash_model.DFlashDraftModel.from_pretrained(str(tmp_path)).eval()
    prompt = tiny_token_ids(0, (1, 8))

    out = dflash_model.dflash_generate(draft, target, prompt, max_new_tokens=12, stop_token_ids=None)
    ids = prompt
    with torch.no_grad():
        for _ in range(12):
            ids = torch.cat([ids, target(ids).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(out, ids)


def test_export_untrained_is_step_zero_of_the_run(tiny_target, tmp_path, capsys) -> None:
    """`export --untrained CONFIG OUT --dtype float32`: the drafter the run starts from, for baselines."""
    from safetensors.torch import load_file
    from tiny_run import tiny_run_config

    from dflash_trainer.cli import main
    from dflash_trainer.config import load_config
    from dflash_trainer.data.synth import write_shard
    from dflash_trainer.train.loop import Run

    (tmp_path / "shards").mkdir()
    write_shard(tmp_path / "shards" / "a.arrow", [(list(range(1, 25)), [0] * 6 + [1] * 18)] * 4)
    path = tiny_run_config(tmp_path / "train.toml", tiny_target("qwen3"), tmp_path / "shards")
    code = main(["export", "--untrained", str(path), str(tmp_path / "out"), "--dtype", "float32"])
    assert code == 0 and "untrained drafter" in capsys.readouterr().out
    exported = load_file(tmp_path / "out" / "model.safetensors")
    start = Run(load_config(path)).drafter.drafter.state_dict()
    assert set(exported) == set(start)
    assert all(torch.equal(exported[k], start[k]) for k in start)  # float32: bit for bit
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float32"
