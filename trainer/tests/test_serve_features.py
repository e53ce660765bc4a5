"""Train what serving reads: every target_layer_ids entry, the last layer included, is the feature that dflash
0.1.0 (`extract_context_feature` over HF's output_hidden_states) feeds the drafter for that id."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3_5ForConditionalGeneration

from dflash_trainer.fixtures.tiny import TINY_KINDS, tiny_token_ids
from dflash_trainer.model.target import CAUSAL_LM_CLASSES, load_target, read_text_config


def _served_features(path, kind: str, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    dflash_model = pytest.importorskip("dflash.model")
    if kind == "qwen3_5_vl_wrapper":  # the class the published 27B checkpoints load as
        model = Qwen3_5ForConditionalGeneration.from_pretrained(str(path), local_files_only=True)
    else:
        model = CAUSAL_LM_CLASSES[read_text_config(path).model_type].from_pretrained(
            str(path), local_files_only=True
        )
    with torch.no_grad():
        hidden = model.eval()(input_ids=ids, output_hidden_states=True).hidden_states
    return dflash_model.extract_context_feature(hidden, layer_ids)


@pytest.mark.parametrize("kind", TINY_KINDS)
@pytest.mark.parametrize(("layer_ids", "full"), [([1, 4], False), ([1, 4], True), ([2, 7], False)])
def test_capture_is_what_dflash_feeds_the_drafter(tiny_target, kind: str, layer_ids, full: bool) -> None:
    """([1, 4], True): the whole target loaded for the walk, the capture still stops after layer 4;
    ([2, 7], False): 7 is the last layer, which HF (and so serving) takes after the final norm."""
    path = tiny_target(kind)
    ids = tiny_token_ids(1, (2, 12))
    captured = load_target(path, layer_ids=layer_ids, full=full).capture(ids).context
    torch.testing.assert_close(captured, _served_features(path, kind, ids, layer_ids), rtol=1e-5, atol=1e-5)


def test_full_load_runs_every_layer_only_for_the_walk(tiny_target) -> None:
    target = load_target(tiny_target("qwen3_5"), layer_ids=[1, 4], full=True)
    assert len(target.model.model.layers) == 8
    seen: list[int] = []
    for i, layer in enumerate(target.model.model.layers):
        layer.register_forward_pre_hook(lambda *_, i=i: seen.append(i))
    target.capture(torch.tensor([[1, 2, 3]]))
    assert seen == [0, 1, 2, 3, 4]  # the capture ends after the last captured layer
    seen.clear()
    with torch.no_grad():
        logits = target.model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert seen == list(range(8)) and logits.shape == (1, 3, 512)
