"""The training forward (all blocks at once) against dflash's served forward (one block at a time)."""

import dataclasses

import pytest
import torch

from dflash_trainer.model.drafter import DFlashDrafter

CTX_LEN = 24
ANCHORS = torch.tensor([[3, 9, 18]])  # sliding window 6 < anchor distance: the window matters


def _inputs(spec, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    context = torch.randn(1, CTX_LEN, 2 * spec.hidden_size, generator=gen)
    noise = torch.randn(1, ANCHORS.shape[1] * spec.block_size, spec.hidden_size, generator=gen)
    return context, noise, torch.ones_like(ANCHORS, dtype=torch.bool)


def _served(dflash_model, context, noise, bs: int) -> torch.Tensor:
    """What dflash computes for each block given exactly the context before its anchor."""
    outs = []
    for i, a in enumerate(ANCHORS[0].tolist()):
        with torch.no_grad():
            outs.append(
                dflash_model(
                    position_ids=torch.arange(a + bs)[None],
                    noise_embedding=noise[:, i * bs : (i + 1) * bs],
                    target_hidden=context[:, :a],
                )
            )
    return torch.cat(outs, dim=1)


def test_training_forward_equals_dflash_per_block(small_spec, tmp_path) -> None:
    # Catches: anchor's own context visible, one block seeing another, sliding layers trained as full,
    # rotary settings ignored (rope_theta 1e4, not the default), and any format/config mismatch.
    dflash_model = pytest.importorskip("dflash.model")
    from dflash_trainer.export import export_draft

    torch.manual_seed(0)
    drafter = DFlashDrafter(small_spec).eval()
    export_draft(drafter.state_dict(), small_spec, tmp_path, dtype=torch.float32)
    served = dflash_model.DFlashDraftModel.from_pretrained(str(tmp_path)).eval()
    context, noise, valid = _inputs(small_spec)
    with torch.no_grad():
        ours = drafter.forward_blocks(context, noise, ANCHORS, valid)
    torch.testing.assert_close(
        ours, _served(served, context, noise, small_spec.block_size), rtol=1e-4, atol=1e-4
    )


def test_blocks_are_isolated_and_context_is_causal_to_anchor(small_spec) -> None:
    torch.manual_seed(0)
    drafter = DFlashDrafter(small_spec).eval()
    context, noise, valid = _inputs(small_spec)
    bs = small_spec.block_size
    with torch.no_grad():
        base = drafter.forward_blocks(context, noise, ANCHORS, valid)
        other = noise.clone()
        other[:, 2 * bs :] += 1.0  # change only the last block
        changed = drafter.forward_blocks(context, other, ANCHORS, valid)
        late = context.clone()
        late[:, 9:] += 1.0  # features at and after the second anchor
        moved = drafter.forward_blocks(late, noise, ANCHORS, valid)
    assert torch.equal(base[:, : 2 * bs], changed[:, : 2 * bs])
    assert not torch.allclose(base[:, 2 * bs :], changed[:, 2 * bs :])
    assert torch.equal(base[:, : 2 * bs], moved[:, : 2 * bs])


def test_sliding_window_and_rope_theta_change_outputs(small_spec) -> None:
    context, noise, valid = _inputs(small_spec)

    def run(spec) -> torch.Tensor:
        torch.manual_seed(0)
        with torch.no_grad():
            return DFlashDrafter(spec).eval().forward_blocks(context, noise, ANCHORS, valid)

    base = run(small_spec)
    full = run(dataclasses.replace(small_spec, layer_types=["full_attention"] * 2))
    theta = run(dataclasses.replace(small_spec, rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert not torch.allclose(base, full, atol=1e-4)
    assert not torch.allclose(base, theta, atol=1e-4)


def test_gradient_checkpointing_same_values_and_grads(small_spec) -> None:
    context, noise, valid = _inputs(small_spec)
    results = []
    for flag in (False, True):
        torch.manual_seed(0)
        drafter = DFlashDrafter(small_spec, gradient_checkpointing=flag).train()
        out = drafter.forward_blocks(context, noise, ANCHORS, valid)
        out.square().sum().backward()
        results.append((out.detach(), drafter.fc.weight.grad.clone()))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])


def test_state_dict_is_the_published_format(small_spec) -> None:
    names = set(DFlashDrafter(small_spec).state_dict())
    per_layer = [
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
        "input_layernorm.weight", "post_attention_layernorm.weight",
    ]  # fmt: skip
    expected = {f"layers.{i}.{n}" for i in range(2) for n in per_layer}
    assert names == expected | {"norm.weight", "fc.weight", "hidden_norm.weight"}
