import hashlib
import json

import pytest
import torch
from transformers import Qwen3_5ForConditionalGeneration

from dflash_trainer.fixtures.tiny import TINY_KINDS, TINY_MASK_TOKEN_ID, tiny_token_ids, write_tiny_target
from dflash_trainer.model.target import CAUSAL_LM_CLASSES, load_target, read_text_config

LAYER_IDS = [1, 3, 5]


def _reference_hidden_states(path, kind: str, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """HF's own full model; for the wrapper, the conditional-generation class the 27B checkpoints use."""
    if kind == "qwen3_5_vl_wrapper":
        model = Qwen3_5ForConditionalGeneration.from_pretrained(str(path), local_files_only=True)
    else:
        cfg = read_text_config(path)
        model = CAUSAL_LM_CLASSES[cfg.model_type].from_pretrained(str(path), local_files_only=True)
    with torch.no_grad():
        return model.eval()(input_ids=ids, output_hidden_states=True).hidden_states


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_capture_equals_layer_outputs(tiny_target, kind: str) -> None:
    path = tiny_target(kind)
    target = load_target(path, layer_ids=LAYER_IDS)
    ids = tiny_token_ids(0, (2, 20))
    batch = target.capture(ids)
    hs = _reference_hidden_states(path, kind, ids)
    # hidden_states[i + 1] is layer i's output; using hidden_states[i] (ids off by one) must not match.
    expected = torch.cat([hs[i + 1] for i in LAYER_IDS], dim=-1)
    off_by_one = torch.cat([hs[i] for i in LAYER_IDS], dim=-1)
    torch.testing.assert_close(batch.context, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(batch.context, off_by_one, atol=1e-3)
    assert batch.loss_mask.all() and torch.equal(batch.input_ids, ids)


@pytest.mark.parametrize(("layer_ids", "norms"), [(LAYER_IDS, 0), ([1, 4, 7], 1)])
def test_capture_runs_the_final_norm_only_for_the_models_last_layer(tiny_target, layer_ids, norms) -> None:
    """The forward stops after the last captured layer: the model's own final norm past it (eager, fp32,
    its output unread) never runs; capture applies the norm itself to the model's last layer (index 7)."""
    target = load_target(tiny_target("qwen3_5"), layer_ids=layer_ids)
    calls = []
    target.model.model.norm.register_forward_hook(lambda *_: calls.append(1))
    target.capture(tiny_token_ids(0, (1, 12)))
    assert len(calls) == norms


def test_frozen_truncated_and_shaped(tiny_target) -> None:
    target = load_target(tiny_target("qwen3_5"), layer_ids=LAYER_IDS)
    assert target.num_layers == 8 and target.hidden_size == 64
    assert len(target.model.model.layers) == max(LAYER_IDS) + 1  # later layers are never run
    assert not target.model.training
    assert not any(p.requires_grad for p in target.model.parameters())
    assert target.embed_tokens.weight.shape == target.lm_head.weight.shape == (512, 64)
    assert target.embed_tokens.weight.dtype == torch.float32  # CPU default


def test_loss_mask_passes_through(tiny_target) -> None:
    target = load_target(tiny_target("qwen3"), layer_ids=[2])
    ids = torch.randint(0, TINY_MASK_TOKEN_ID, (1, 10))
    loss_mask = torch.zeros(1, 10, dtype=torch.bool)
    loss_mask[0, 4:] = True
    batch = target.capture(ids, loss_mask=loss_mask)
    assert torch.equal(batch.loss_mask, loss_mask) and batch.context.shape == (1, 10, 64)


def test_rejects_layer_ids_outside_target(tiny_target) -> None:
    with pytest.raises(ValueError, match="outside"):
        load_target(tiny_target("qwen3"), layer_ids=[1, 8])


def test_tiny_target_is_deterministic_from_seed(tmp_path) -> None:
    def digest(seed: int, name: str) -> str:
        out = write_tiny_target(tmp_path / name, kind="qwen3", seed=seed)
        return hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()

    assert digest(3, "a") == digest(3, "b") != digest(4, "c")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_fla_kernels_on_cuda_match_torch_fallback_on_cpu(tiny_target, kind: str) -> None:
    pytest.importorskip("fla")
    path = tiny_target(kind)
    ids = tiny_token_ids(0, (2, 40))
    cpu = load_target(path, layer_ids=LAYER_IDS).capture(ids).context
    gpu = (
        load_target(path, device="cuda", dtype=torch.float32, layer_ids=LAYER_IDS).capture(ids.cuda()).context
    )
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=2e-3, atol=2e-3)


def test_random_target_of_a_published_shape_loads_in_its_published_layout(tmp_path):
    """`model random`: the wrapper layout (text under model.language_model), sharded with an index and a
    manifest, loadable by transformers' own multimodal class with no missing or unexpected key."""
    from transformers import Qwen3_5ForConditionalGeneration

    from dflash_trainer.cli import main
    from dflash_trainer.manifest import check_manifest
    from dflash_trainer.model.target import load_target

    out = tmp_path / "target"
    assert main(["model", "random", "--shape", "qwen3.6-mini", "--layers", "6", str(out)]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    assert any(k.startswith("model.language_model.layers.5.") for k in index["weight_map"])
    assert not any(k.startswith("model.language_model.layers.6.") for k in index["weight_map"])
    assert check_manifest(out, full=True) == []
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_5"
    assert config["text_config"]["layer_types"][:4] == ["linear_attention"] * 3 + ["full_attention"]
    _, info = Qwen3_5ForConditionalGeneration.from_pretrained(str(out), output_loading_info=True)
    assert not any(info.values()), info
    target = load_target(out, layer_ids=[1, 4])
    ctx = target.capture(torch.randint(0, 500, (1, 24))).context
    assert ctx.shape == (1, 24, 2 * 64) and torch.isfinite(ctx).all()
    # A second write into the same directory is refused, and what is there stays.
    assert main(["model", "random", "--shape", "qwen3.6-mini", str(out)]) == 1
    assert check_manifest(out, full=True) == []


def test_the_reference_shape_is_the_published_one():
    from dflash_trainer.fixtures.shapes import published_config

    text = published_config("qwen3.6-27b").text_config
    assert (text.hidden_size, text.intermediate_size, text.num_hidden_layers) == (5120, 17408, 64)
    assert (text.num_attention_heads, text.num_key_value_heads, text.head_dim) == (24, 4, 256)
    assert (text.linear_num_key_heads, text.linear_num_value_heads) == (16, 48)
    assert (text.linear_key_head_dim, text.linear_value_head_dim, text.linear_conv_kernel_dim) == (
        128,
        128,
        4,
    )
    assert text.vocab_size == 248320 and text.layer_types.count("full_attention") == 16
    assert text.layer_types[3::4] == ["full_attention"] * 16
    assert text.rope_parameters["rope_theta"] == 1e7 and text.rope_parameters["partial_rotary_factor"] == 0.25


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_fast_load_path_equals_from_pretrained(tiny_target, kind):
    """The CUDA load path (meta model + fast_load, assign) gives the reference path's model exactly; run on
    the CPU here, where fast_load reads straight into the destination."""
    from dflash_trainer.model.target import (
        CAUSAL_LM_CLASSES,
        NeedsConversion,
        _fast_load,
        _from_pretrained,
        _truncated,
    )

    path = tiny_target(kind)
    cfg = read_text_config(path)
    short = _truncated(cfg, 6)
    cls = CAUSAL_LM_CLASSES[cfg.model_type]
    if (
        kind == "qwen3_next"
    ):  # per-expert MoE weights are fused by transformers' loader: load_target falls back
        with pytest.raises(NeedsConversion, match="conversion"):
            _fast_load(cls, path, short, torch.device("cpu"), torch.float32)
        return
    fast = _fast_load(cls, path, short, torch.device("cpu"), torch.float32)
    ref = _from_pretrained(cls, path, short, torch.float32)
    fs, rs = fast.state_dict(), ref.state_dict()
    assert fs.keys() == rs.keys()
    for key in rs:
        torch.testing.assert_close(fs[key], rs[key], rtol=0, atol=0, msg=key)
    for (name, b), (_, rb) in zip(fast.named_buffers(), ref.named_buffers(), strict=True):
        torch.testing.assert_close(b, rb, rtol=0, atol=0, msg=name)
    ids = torch.randint(0, 500, (1, 20))
    torch.testing.assert_close(fast.eval()(ids).logits, ref.eval()(ids).logits)


def test_fast_load_reads_only_the_shards_the_truncated_target_needs(tmp_path):
    """On a sharded checkpoint with its index, shards holding only the vision tower or layers after the last
    captured one are not read, and the model equals transformers' own load of the same layers."""
    from dflash_trainer.fixtures.shapes import write_random_target
    from dflash_trainer.model.target import (
        CAUSAL_LM_CLASSES,
        _fast_load,
        _files_holding,
        _from_pretrained,
        _truncated,
    )

    out = write_random_target(tmp_path / "t", "qwen3.6-mini", device="cpu", progress=lambda _: None)
    cfg = read_text_config(out)
    short = _truncated(cfg, 2)
    cls = CAUSAL_LM_CLASSES[cfg.model_type]
    with torch.device("meta"):
        wanted = set(cls._from_config(short).state_dict())
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    files = {f.name for f in _files_holding(out, wanted)}
    vision_only = {
        f
        for f in set(index.values())
        if all(k.startswith("model.visual.") for k, v in index.items() if v == f)
    }
    assert vision_only and not files & vision_only
    assert len(files) < len(set(index.values()))
    fast = _fast_load(cls, out, short, torch.device("cpu"), torch.float32)
    ref = _from_pretrained(cls, out, short, torch.float32)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(fast.state_dict()[key], value, rtol=0, atol=0, msg=key)
