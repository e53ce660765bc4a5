"""The target forward's graph helpers: the unpadded path equals `capture`, and on CUDA its replay
from a CUDA graph equals the eager forward."""

import pytest
import torch
from transformers import PretrainedConfig

from dflash_trainer.fixtures.tiny import TINY_KINDS, tiny_token_ids
from dflash_trainer.model.target import (
    COMPILE_SCOPES,
    CompiledCapture,
    GraphedCapture,
    GraphedForward,
    bucket_length,
    compile_layers,
    graph_features,
    load_target,
    unpadded_masks,
)

LAYER_IDS = [1, 3, 5]


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_unpadded_features_equal_capture(tiny_target, kind: str) -> None:
    target = load_target(tiny_target(kind), layer_ids=LAYER_IDS)
    ids = tiny_token_ids(0)
    expected = target.capture(ids).context
    torch.testing.assert_close(target.unpadded_features(ids), expected, rtol=0, atol=0)
    # a padded batch is what the mapping must not be used for: capture masks it, so the features differ
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, 12:] = False
    assert not torch.equal(target.capture(ids, mask).context[1], expected[1])


def test_unpadded_masks_refuse_a_sliding_window() -> None:
    cfg = PretrainedConfig()
    cfg.layer_types = ["full_attention", "linear_attention"]
    assert unpadded_masks(cfg) == {"full_attention": None, "linear_attention": None}
    cfg.layer_types = ["sliding_attention", "full_attention"]
    with pytest.raises(ValueError, match="sliding_attention"):
        unpadded_masks(cfg)


def test_compile_scopes_checked(tiny_target) -> None:
    target = load_target(tiny_target("qwen3_5"), layer_ids=LAYER_IDS)
    assert "mlp-norm" in COMPILE_SCOPES
    with pytest.raises(ValueError, match="compile scope"):
        compile_layers(target, "everything")


def test_compiled_layers_with_opaque_kernels_equal_eager(tiny_target) -> None:
    target = load_target(tiny_target("qwen3_5"), layer_ids=LAYER_IDS)
    ids = tiny_token_ids(0)
    expected = target.capture(ids).context
    compile_layers(target, "layers-opaque")
    torch.testing.assert_close(target.capture(ids).context, expected, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


def test_a_gated_deltanet_layer_compiles_to_one_graph_around_its_kernels(tiny_target) -> None:
    """The causal conv and the delta rule as custom ops (model.kernel_ops): no graph break at them, so a layer
    is one graph (five behind torch.compiler.disable: one more host round trip each), and the delta rule's
    q, k and v, strided views of the conv's output, are made contiguous in that graph by inductor."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, _inputs: list[torch.Tensor]):
        graphs.append(gm)
        return gm.forward

    target = load_target(tiny_target("qwen3_5"), layer_ids=LAYER_IDS)
    kinds = set(target.config.layer_types[: len(target.model.model.layers)])
    assert kinds == {"linear_attention", "full_attention"}
    try:
        torch._dynamo.reset()
        compiled = CompiledCapture(target, backend=backend)
        expected = target.capture(tiny_token_ids(0)).context
        torch.testing.assert_close(compiled(tiny_token_ids(0)).context, expected, rtol=1e-5, atol=1e-5)
        assert len(graphs) == len(kinds)  # one per layer kind: the layers of a kind share theirs
        (linear,) = (g for g in graphs if any("dflash" in str(n.target) for n in g.graph.nodes))
        nodes = {str(n.target): n for n in linear.graph.nodes if n.op == "call_function"}
        assert "dflash.causal_conv1d" in nodes
        delta_rule = nodes["dflash.chunk_gated_delta_rule"]
        assert [str(a.target) for a in delta_rule.args[1:4]] == ["contiguous"] * 3
    finally:
        torch._dynamo.reset()


def test_graphed_forward_needs_cuda() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        GraphedForward(lambda x: x * 2, torch.zeros(3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_graph_replay_equals_eager_on_cuda(tiny_target, kind: str) -> None:
    pytest.importorskip("fla")
    target = load_target(tiny_target(kind), layer_ids=LAYER_IDS, device="cuda", dtype=torch.float32)
    graphed = graph_features(target, tiny_token_ids(0).cuda())
    for seed in (1, 2):  # new inputs through the static buffer: the replay recomputes
        ids = tiny_token_ids(seed).cuda()
        torch.testing.assert_close(graphed(ids).clone(), target.capture(ids).context, rtol=1e-5, atol=1e-5)


def _compiled_capture_matches(target, backend: str, tol: float) -> None:
    """train.target_compile's forward: the same features as `capture` for rows of any length and a padded
    batch, one compile for every length (dynamic shapes), and the class's forward back on every layer after
    each call, so the walk and the held-out figures stay eager."""
    compiled = CompiledCapture(target, backend=backend)
    mask = torch.ones(2, 24, dtype=torch.bool, device=target.device)
    mask[1, 15:] = False

    def same(ids: torch.Tensor, attention: torch.Tensor | None = None) -> None:
        ids = ids.to(target.device)
        expected = target.capture(ids, attention).context
        torch.testing.assert_close(compiled(ids, attention).context, expected, rtol=tol, atol=tol)
        stack = [*target.model.model.layers, target.model.model.norm]
        assert all("forward" not in module.__dict__ for module in stack)

    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # a count over the whole process
    try:
        same(tiny_token_ids(0))
        # compiled, not eager in disguise
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs
        torch._dynamo.config.error_on_recompile = True  # another row length must not compile again
        same(tiny_token_ids(1, (2, 17)))
        torch._dynamo.config.error_on_recompile = False  # a padded batch's mask is a graph of its own
        same(tiny_token_ids(2), mask)
    finally:
        torch._dynamo.config.error_on_recompile = False
        torch._dynamo.reset()


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5", "qwen3_next"])  # the VL wrapper's layers are qwen3_5's
def test_compiled_capture_equals_capture_at_every_length_and_leaves_the_layers_eager(
    tiny_target, kind
) -> None:
    _compiled_capture_matches(load_target(tiny_target(kind), layer_ids=LAYER_IDS), "aot_eager", 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_compiled_capture_with_inductor_and_fla_on_cuda(tiny_target, kind: str) -> None:
    pytest.importorskip("fla")
    target = load_target(tiny_target(kind), layer_ids=LAYER_IDS, device="cuda", dtype=torch.float32)
    _compiled_capture_matches(target, "inductor", 1e-4)


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_right_padding_leaves_the_real_tokens_features_as_they_were(tiny_target, kind: str) -> None:
    """What GraphedCapture's buckets rely on: every layer is causal, so tokens appended after a row change
    nothing before them (attention, the Gated DeltaNet recurrence and its causal conv)."""
    target = load_target(tiny_target(kind), layer_ids=LAYER_IDS)
    ids = tiny_token_ids(3, (1, 21))
    expected = target.unpadded_features(ids)
    padded = torch.nn.functional.pad(ids, (0, bucket_length(21, 16) - 21))
    assert padded.shape == (1, 32)
    torch.testing.assert_close(target.unpadded_features(padded)[:, :21], expected, rtol=1e-5, atol=1e-5)


def test_bucket_length_rounds_up_to_the_bucket() -> None:
    assert [bucket_length(n, 256) for n in (1, 256, 257, 3072)] == [256, 256, 512, 3072]


def test_graphed_capture_off_cuda_is_the_compiled_capture(tiny_target) -> None:
    target = load_target(tiny_target("qwen3_5"), layer_ids=LAYER_IDS)
    ids = tiny_token_ids(0)
    graphed = GraphedCapture(CompiledCapture(target, backend="aot_eager"), bucket=16)
    torch.testing.assert_close(graphed(ids).context, target.capture(ids).context, rtol=1e-5, atol=1e-5)
    assert not graphed.graphs
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_graphed_capture_equals_capture_per_bucket_on_cuda(tiny_target, kind: str) -> None:
    """train.target_compile's forward on CUDA: one graph per bucket, replays equal to the eager capture at
    every length, outputs that outlive the next replay, padded batches through the compiled forward."""
    pytest.importorskip("fla")
    target = load_target(tiny_target(kind), layer_ids=LAYER_IDS, device="cuda", dtype=torch.float32)
    graphed = GraphedCapture(CompiledCapture(target), bucket=16)
    kept = []
    for seed, length in enumerate((21, 30, 9, 24)):
        ids = tiny_token_ids(seed, (1, length)).cuda()
        out = graphed(ids)
        assert out.context.shape[:2] == (1, length)
        kept.append((out.context, target.capture(ids).context))
    assert sorted(graphed.graphs) == [(1, 16), (1, 32)]
    for got, want in kept:  # each output is its own copy: later replays did not overwrite it
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    ids = tiny_token_ids(7).cuda()
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, 12:] = False
    torch.testing.assert_close(
        graphed(ids, mask).context, target.capture(ids, mask).context, rtol=1e-4, atol=1e-4
    )
    assert len(graphed.graphs) == 2  # the padded batch took no graph
    torch._dynamo.reset()
