"""Sibling projections in one GEMM in the target's compiled forward (model.fused_projections): the
weights keep their values and names, no second copy is kept, eager calls are unchanged, and the compiled
forward runs one matmul per group with the same features."""

import re

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

from dflash_trainer.fixtures.tiny import tiny_token_ids
from dflash_trainer.model import target as target_module
from dflash_trainer.model.fused_projections import (
    DEDUPLICATE_MATMULS,
    FusedGroup,
    Neighbours,
    fuse_group,
    fuse_projections,
)
from dflash_trainer.model.target import CompiledCapture, compile_layers, load_target

LAYER_IDS = [
    1,
    3,
    5,
]  # qwen3_5's tiny target: layers 0-5 are loaded, 3 attends, the others are Gated DeltaNets
# the projections' matmuls (not bmm: inductor lowers fp32 attention on CUDA to two of those)
_MATMUL = re.compile(r"extern_kernels\.(mm|addmm)\(")


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _fast_loaded(path) -> nn.Module:
    """The model as fast_load builds it on a GPU (each weight a view of its shard's allocation), on CPU."""
    cfg = target_module.read_text_config(path)
    short = target_module._truncated(cfg, max(LAYER_IDS) + 1)
    cls = target_module.CAUSAL_LM_CLASSES[cfg.model_type]
    model = target_module._fast_load(cls, path, short, torch.device("cpu"), torch.float32)
    return model.requires_grad_(False)


def test_fast_load_layout_fuses_by_view_and_gathers_scattered_groups_in_place(tiny_target) -> None:
    """safetensors files sort tensors by name: in_proj_a|b|qkv|z and gate|up lie back to back, q|k|v do not
    (o_proj and q_norm between): their stretch of the file's allocation is laid out again, q|k|v first, and
    every weight in it keeps its value (no second copy)."""
    model = _fast_loaded(tiny_target("qwen3_5"))
    before = _state(model)
    shard = model.model.layers[0].mlp.gate_proj.weight.untyped_storage().data_ptr()
    attention = model.model.layers[3].self_attn
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm")
    stretch = {n: getattr(attention, n).weight for n in names}
    in_file = ["k_proj", "o_proj", "q_norm", "q_proj", "v_proj"]
    assert sorted(names, key=lambda n: stretch[n].data_ptr()) == in_file
    start = stretch["k_proj"].data_ptr()
    outcome = fuse_projections(model)
    # the MLPs of layers 0-5, the Gated DeltaNets of 0, 1, 2, 4, 5; the attention of 3
    assert outcome == {"view": 6 + 5, "gathered": 1}
    assert sorted(names, key=lambda n: stretch[n].data_ptr()) == list(names)  # the group first, in its order
    assert stretch["q_proj"].data_ptr() == start  # the same stretch of the same allocation
    qkv: FusedGroup = attention.q_proj._dflash_fused
    assert qkv.weight.untyped_storage().data_ptr() == shard
    q, k, v = (getattr(attention, n).weight.shape[0] for n in names[:3])
    assert [getattr(attention, n)._dflash_rows for n in names[:3]] == [(0, q), (q, q + k), (q + k, q + k + v)]
    linear_attn = model.model.layers[0].linear_attn
    group: FusedGroup = linear_attn.in_proj_z._dflash_fused
    assert group.weight.untyped_storage().data_ptr() == shard  # a view: no new memory
    rows = {
        n: getattr(linear_attn, n)._dflash_rows
        for n in ("in_proj_a", "in_proj_b", "in_proj_qkv", "in_proj_z")
    }
    assert [rows[n] for n in sorted(rows)] == sorted(rows.values())  # memory order is name order
    for name in rows:
        lo, hi = rows[name]
        assert torch.equal(group.weight[lo:hi], getattr(linear_attn, name).weight)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    again = fuse_projections(model)  # idempotent
    assert again == {"already fused": 12}


def test_separately_allocated_weights_are_copied_once_and_keep_their_values(tiny_target) -> None:
    target = load_target(tiny_target("qwen3"), layer_ids=LAYER_IDS)  # from_pretrained: one allocation each
    ids = tiny_token_ids(0)
    expected = target.capture(ids).context
    before = _state(target.model)
    assert fuse_projections(target.model) == {"copy": 2 * (max(LAYER_IDS) + 1)}  # q|k|v and gate|up per layer
    mlp = target.model.model.layers[2].mlp
    group = mlp.gate_proj._dflash_fused
    assert (mlp.gate_proj._dflash_rows, mlp.up_proj._dflash_rows) == (
        (0, 128),
        (128, 256),
    )  # the group's order
    for lin in (mlp.gate_proj, mlp.up_proj):  # the projections' weights are now rows of the fused matrix
        assert lin.weight.untyped_storage().data_ptr() == group.weight.untyped_storage().data_ptr()
    after = target.model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)
    # outside a compiled region every projection runs its own weight: the same features, bit for bit
    torch.testing.assert_close(target.capture(ids).context, expected, rtol=0, atol=0)


def _laid_out(**sizes: int) -> tuple[nn.Module, torch.Tensor]:
    """A module whose frozen fp32 weights (`sizes` floats each) lie side by side in one allocation, in the
    order given, as fast_load lays a file out; and that allocation."""
    flat = torch.arange(float(sum(sizes.values())))
    module = nn.Module()
    for name, w in zip(sizes, flat.split(list(sizes.values())), strict=True):
        module.register_parameter(name, nn.Parameter(w, requires_grad=False))
    return module, flat


def _places(module: nn.Module, flat: torch.Tensor) -> dict[str, int]:
    """Where each weight starts in the allocation, in floats."""
    return {name: (w.data_ptr() - flat.data_ptr()) // 4 for name, w in module.named_parameters()}


def test_gather_lays_the_stretch_out_again_with_the_group_first() -> None:
    module, flat = _laid_out(a=8, between=8, b=16, after=8)
    before = _state(module)
    assert Neighbours(module).gather([module.b, module.a])  # the group's order: b first
    assert _places(module, flat) == {"b": 0, "a": 16, "between": 24, "after": 32}  # `after`: not moved
    after = module.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_gather_refuses_what_it_cannot_move_safely() -> None:
    module, flat = _laid_out(a=8, between=8, b=16)
    unchanged = _places(module, flat)
    stranger = nn.Module()  # `between` is not this model's: its bytes are someone else's
    stranger.register_parameter("a", module.a)
    stranger.register_parameter("b", module.b)
    assert not Neighbours(stranger).gather([module.a, module.b])
    pinned = Neighbours(module)
    pinned.pinned.add(id(module.between))  # a fused group's view lies over it
    assert not pinned.gather([module.a, module.b])
    assert not Neighbours(module).gather([module.a, torch.zeros(8)])  # two allocations
    twice = nn.Module()  # the first half of `between` seen twice, its second half nobody's: as many bytes
    for name, w in {"a": module.a, "b": module.b, "x": flat[8:12], "y": flat[8:12]}.items():
        twice.register_parameter(name, nn.Parameter(w, requires_grad=False))
    assert not Neighbours(twice).gather([twice.a, twice.b])
    assert _places(module, flat) == unchanged
    assert Neighbours(module).gather([module.a, module.b])  # nothing else in the way
    narrow, _ = _laid_out(a=2, n=2, b=4)
    assert not Neighbours(narrow).gather([narrow.a, narrow.b])  # b: from byte 16 to byte 8, off 16 bytes


def test_a_fused_groups_weights_are_never_moved_by_a_later_gather() -> None:
    """A group fused by view first (gate|up) lies inside the stretch of a later scattered one (k, gate, up, q,
    v in memory): moving it would leave its fused view over other weights, so the later group stays apart."""
    flat = torch.arange(5 * 4 * 8, dtype=torch.float32)
    rows = dict(zip(("k_proj", "gate_proj", "up_proj", "q_proj", "v_proj"), flat.view(5, 4, 8), strict=True))
    model = nn.Module()
    model.mlp, model.attn = nn.Module(), nn.Module()  # the MLP first: model.modules() fuses it first
    for name, w in rows.items():
        linear = nn.Linear(8, 4, bias=False)
        linear.weight = nn.Parameter(w, requires_grad=False)
        setattr(model.mlp if name in ("gate_proj", "up_proj") else model.attn, name, linear)
    outcome = fuse_projections(model)
    assert outcome == {
        "view": 1,
        "apart: the weights share memory with others (fusing would keep a second copy)": 1,
    }
    mlp: FusedGroup = model.mlp.gate_proj._dflash_fused
    assert torch.equal(mlp.weight, torch.cat([rows["gate_proj"], rows["up_proj"]]))


def _linear(out: int, bias: bool = False, dtype: torch.dtype = torch.float32) -> nn.Linear:
    return nn.Linear(8, out, bias=bias, dtype=dtype).requires_grad_(False)


def test_groups_that_cannot_share_a_gemm_stay_apart() -> None:
    assert fuse_group([_linear(4), _linear(4, dtype=torch.bfloat16)]).startswith("apart: dtypes")
    assert fuse_group([_linear(4, bias=True), _linear(4)]) == "apart: some have a bias, some not"
    assert fuse_group([_linear(4).requires_grad_(True), _linear(4)]) == "apart: trainable"
    pair = [_linear(4, bias=True), _linear(6, bias=True)]
    assert fuse_group(pair) == "copy"
    assert pair[0]._dflash_fused.bias.shape == (10,)  # the biases follow the rows


def test_deduplicate_matmuls_merges_only_identical_calls() -> None:
    graph = torch.fx.Graph()
    x, w, v = (graph.placeholder(n) for n in "xwv")
    aten = torch.ops.aten
    first = graph.call_function(aten.mm.default, (x, graph.call_function(aten.permute.default, (w, [1, 0]))))
    again = graph.call_function(aten.mm.default, (x, graph.call_function(aten.permute.default, (w, [1, 0]))))
    other = graph.call_function(aten.mm.default, (x, graph.call_function(aten.permute.default, (v, [1, 0]))))
    graph.output((first, again, other))
    DEDUPLICATE_MATMULS(graph)
    mms = [n for n in graph.nodes if n.target == aten.mm.default]
    assert len(mms) == 2
    assert list(graph.output_node().args[0]) == [first, first, other]
    assert DEDUPLICATE_MATMULS.uuid() == DEDUPLICATE_MATMULS.uuid()  # a stable key for the FX graph cache


def _compiled_run(target, fuse: bool, ids: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = CompiledCapture(target, fuse=fuse)
    try:
        features, code = run_and_get_code(lambda: compiled(ids).context)
        made = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
    finally:
        torch._dynamo.reset()
    return features, len(_MATMUL.findall("\n".join(code))), made


def test_the_trainers_compiled_forward_runs_one_matmul_per_group(tiny_target) -> None:
    """inductor on CPU, the trainer's CompiledCapture: a Gated DeltaNet layer runs 4 matmuls (5 projections in
    one, out, gate|up, down) instead of 8, an attention layer 4 instead of 7; the layers of a kind still share
    one graph (the fused rows are the same in every layer); the features are eager's."""
    ids = tiny_token_ids(0)
    target = load_target(tiny_target("qwen3_5"), layer_ids=LAYER_IDS)
    expected = target.capture(ids).context
    plain, plain_matmuls, plain_graphs = _compiled_run(target, False, ids)
    fused, fused_matmuls, fused_graphs = _compiled_run(target, True, ids)
    assert (plain_matmuls, fused_matmuls) == (5 + 3 + 4 + 3, 1 + 1 + 2 + 1 + 1 + 2)
    assert fused_graphs == plain_graphs == 2  # one per layer kind (no recompile per layer)
    torch.testing.assert_close(plain, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_compiled_capture_on_cuda_equals_capture(tiny_target) -> None:
    """The GPU path: fast_load's views fused in place, FLA's kernels, inductor's CUDA matmuls."""
    pytest.importorskip("fla")
    target = load_target(tiny_target("qwen3_5"), layer_ids=LAYER_IDS, device="cuda", dtype=torch.float32)
    ids = tiny_token_ids(0).cuda()
    expected = target.capture(ids).context
    fused, matmuls, graphs = _compiled_run(target, True, ids)
    assert graphs == 2 and matmuls == 4 + 4  # the attention's q, k, v gathered in fast_load's allocation
    torch.testing.assert_close(fused, expected, rtol=1e-4, atol=1e-4)


_CONV_CALL = re.compile(r"torch\.ops\.dflash\.causal_conv1d\.default\('[\w.]+', (\w+)")


def _conv_inputs_of_compiled_layers(target, ids: torch.Tensor) -> tuple[torch.Tensor, list[str], str]:
    """The features of the layers compiled at fixed shapes with fused projections (the CUDA-graph path), and
    the first argument of each conv call in their code. Caches off: the FX graph cache's key leaves out a
    custom op's tags, so a graph compiled before a tag changed would come back unchanged."""
    torch._dynamo.reset()
    try:
        with torch._inductor.config.patch(force_disable_caches=True):
            compile_layers(target, "layers-opaque", fuse=True)
            features, code = run_and_get_code(lambda: target.capture(ids).context)
    finally:
        torch._dynamo.reset()
    text = "\n".join(code)
    return features, _CONV_CALL.findall(text), text


def test_the_conv_reads_its_columns_of_a_padded_gemm_output_in_place(tiny_target) -> None:
    """inductor pads a matmul's output rows to 128 bytes on CUDA (comprehensive padding: the 27B shape's
    in_proj_qkv|z|b|a output, 16480 columns of bf16, is stored 16512 wide; torch 2.11 pads it, 2.13 does not).
    Under the default layout constraint for custom ops (needs_exact_strides) the conv's q|k|v columns are
    then copied out of the padded buffer, 182 us a forward (docs/journal.md). The op asks for its stride order
    only, and FLA's conv reads any strides: the columns go in as a view of the GEMM's output. Here padding is
    forced on CPU and the default set explicitly; on torch 2.11 the test fails without the op's tag (on 2.13
    the output is not padded); the features stay eager's."""
    ids = tiny_token_ids(0, (1, 64))
    target = load_target(tiny_target("qwen3_5"), layer_ids=LAYER_IDS)
    expected = target.capture(ids).context
    with (
        torch._inductor.config.patch(disable_padding_cpu=False, padding_stride_threshold=0),
        torch._functorch.config.patch(custom_op_default_layout_constraint="needs_exact_strides"),
    ):
        features, conv_inputs, code = _conv_inputs_of_compiled_layers(target, ids)
    assert len(conv_inputs) == 1  # the Gated DeltaNet layers share one graph
    assert conv_inputs[0] == "reinterpret_tensor", code  # a view, not a buffer a copy kernel filled
    torch.testing.assert_close(features, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_conv_reads_a_padded_gemm_output_in_place_on_cuda(tiny_target) -> None:
    """The same on CUDA, where inductor pads by itself (the torch and FLA of the GPU machine). The features
    are compared at inductor's defaults: forcing padding of every buffer (threshold 0) moves the tiny fp32
    layers ~0.03 from eager on CUDA whether the conv input is padded or not, fused or not, while FLA's
    conv on a strided view equals it on a contiguous copy exactly (bench/diag_padded_conv.py)."""
    pytest.importorskip("fla")
    ids = tiny_token_ids(0, (1, 64)).cuda()
    target = load_target(tiny_target("qwen3_5"), layer_ids=LAYER_IDS, device="cuda", dtype=torch.float32)
    expected = target.capture(ids).context
    with torch._inductor.config.patch(padding_stride_threshold=0):  # the tiny rows are short
        _, conv_inputs, code = _conv_inputs_of_compiled_layers(target, ids)
    assert conv_inputs == ["reinterpret_tensor"], code
    features, _, _ = _conv_inputs_of_compiled_layers(target, ids)
    torch.testing.assert_close(features, expected, rtol=1e-4, atol=1e-4)
