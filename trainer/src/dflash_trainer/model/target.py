"""The frozen target: load from a local checkpoint directory, capture the chosen layers' outputs."""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import (
    AutoConfig,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen3_5ForCausalLM,
    Qwen3ForCausalLM,
    Qwen3NextForCausalLM,
)
from transformers.utils import logging as hf_logging

from dflash_trainer.capture_guard import collector_paused
from dflash_trainer.data.batch import TargetBatch
from dflash_trainer.model import kernel_ops
from dflash_trainer.model.fused_projections import fused_compile_options
from dflash_trainer.model.kernels import CONV_OP, DELTA_RULE_OPS, install_device_dispatch, skip_qk_head_repeat

log = logging.getLogger("dflash_trainer.target")

# model_type of the text config -> causal LM class. The Qwen3.5/3.6 conditional-generation checkpoints
# (model_type "qwen3_5", weights under model.language_model.*) load their text config into
# Qwen3_5ForCausalLM; transformers' loader maps the prefix and skips the vision tower.
CAUSAL_LM_CLASSES: dict[str, type[PreTrainedModel]] = {
    "qwen3": Qwen3ForCausalLM,
    "qwen3_5_text": Qwen3_5ForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,
}


def read_text_config(path: str | Path) -> PreTrainedConfig:
    """The language model's config, also when it sits inside a multimodal wrapper's config."""
    cfg = AutoConfig.from_pretrained(str(path), local_files_only=True)
    text = cfg.get_text_config()
    if text.model_type not in CAUSAL_LM_CLASSES:
        raise ValueError(
            f"{path}: unsupported target model_type {text.model_type!r} (from {cfg.model_type!r})"
        )
    return text


def _truncated(cfg: PreTrainedConfig, num_layers: int) -> PreTrainedConfig:
    """Config with only the first layers: the forward then ends at the last captured layer."""
    short = copy.deepcopy(cfg)
    short.num_hidden_layers = num_layers
    if getattr(short, "layer_types", None) is not None:
        short.layer_types = list(short.layer_types[:num_layers])
    return short


def captured_batch(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    loss_mask: torch.Tensor | None,
    context: torch.Tensor,
) -> TargetBatch:
    """A capture's TargetBatch: loss_mask defaults to attention_mask, which defaults to every token."""
    if loss_mask is None:
        loss_mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask
    return TargetBatch(input_ids=input_ids, loss_mask=loss_mask.bool(), context=context)


class _StopForward(Exception):
    """Ends a capture after the last captured layer (later layers are loaded for the decode walk)."""


class TargetModel:
    """A frozen target (usually truncated after its last needed layer); forward hooks collect the features.

    The feature of layer i is what serving feeds the drafter: HF's hidden_states[i + 1], i.e. layer i's
    output, except for the target's last layer, whose entry HF takes after the final norm.
    """

    def __init__(self, model: PreTrainedModel, config: PreTrainedConfig, layer_ids: list[int]) -> None:
        self.model = model
        self.config = config
        self.layer_ids = list(layer_ids)
        self.num_layers: int = config.num_hidden_layers
        self.hidden_size: int = config.hidden_size
        self.embed_tokens: nn.Embedding = model.get_input_embeddings()
        self.lm_head: nn.Linear = model.lm_head
        self._captured: dict[int, torch.Tensor] = {}
        self._capturing = False  # hooks record only inside capture(), not in other forwards (the walk's)
        layers = model.model.layers
        # Stop after the last captured layer even when it is the last one loaded: past it the model would
        # only run its final norm (eager, in fp32), whose output capture does not read.
        self._stop_after = max(self.layer_ids)
        for i in self.layer_ids:
            layers[i].register_forward_hook(self._hook(i))

    def _hook(self, index: int):
        final_norm = self.model.model.norm if index == self.num_layers - 1 else None

        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            if not self._capturing:
                return
            out = output[0] if isinstance(output, tuple) else output
            # HF's hidden_states[index + 1]: the layer's output, after the final norm for the last layer.
            self._captured[index] = out if final_norm is None else final_norm(out)
            if index == self._stop_after:
                raise _StopForward

        return hook

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @torch.no_grad()
    def capture(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
    ) -> TargetBatch:
        """Run the (truncated) decoder stack; no LM head. loss_mask defaults to attention_mask."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        return captured_batch(
            input_ids, attention_mask, loss_mask, self._features(input_ids, attention_mask.long())
        )

    @torch.no_grad()
    def unpadded_features(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`capture(input_ids).context` for sequences without padding, with no host sync in the forward.

        For an all-ones mask, HF's mask builders return "no mask" per layer type (SDPA's is_causal, no padding
        multiply), but find that out with a host sync, and under CUDA-graph capture or tracing build the full
        masks instead. Handing the model that "no mask" mapping directly runs the same kernels as `capture`
        with none of the checks, so the forward can be captured in a CUDA graph (`GraphedForward`).
        """
        return self._features(input_ids, unpadded_masks(self.config))

    def _features(self, input_ids: torch.Tensor, masks: torch.Tensor | dict[str, None]) -> torch.Tensor:
        self._captured.clear()
        self._capturing = True
        try:
            with contextlib.suppress(_StopForward):
                self.model.model(input_ids=input_ids, attention_mask=masks, use_cache=False)
            return torch.cat([self._captured[i] for i in self.layer_ids], dim=-1)
        finally:
            self._capturing = False
            self._captured.clear()


COMPILE_SCOPES = ("layers", "mlp", "mlp-norm", "layers-opaque")
# The linear-attention kernels of the hybrid targets, by their names in transformers' modelling modules.
_KERNEL_NAMES = (*DELTA_RULE_OPS, CONV_OP)
_OPAQUE = "_dflash_opaque_to_dynamo"


def _kernels_opaque_to_dynamo() -> None:
    """The Gated DeltaNet's kernels opaque to dynamo: dynamo traced FLA's Triton kernels badly (scope
    "layers": 10 graphs, 2.3x slower). The training forward's calls go to torch custom ops (model.kernel_ops:
    one graph per layer, the casts, copies and norms around the kernels fused by inductor); any other call to
    the kernel behind torch.compiler.disable (a graph break). Outside a compiled region the same results as
    the device dispatch; idempotent (the dispatch's marks are copied onto the wrapper)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_next import modeling_qwen3_next

    install_device_dispatch()  # first, so that the wrappers wrap the dispatch
    for module in (modeling_qwen3_5, modeling_qwen3_next):
        for name in _KERNEL_NAMES:
            fn = getattr(module, name, None)
            if fn is not None and not getattr(fn, _OPAQUE, False):
                wrapper = kernel_ops.traced(module.__name__, name, fn, torch.compiler.disable(fn))
                functools.update_wrapper(wrapper, fn)  # the name and the dispatch's marks (fn's __dict__)
                setattr(wrapper, _OPAQUE, True)
                setattr(module, name, wrapper)


def compile_layers(target: TargetModel, scope: str = "layers", fuse: bool = False) -> None:
    """torch.compile the target's decoder layers at fixed shapes (eager, elementwise kernels are a quarter of
    a 27B-shaped forward; docs/journal.md). "layers": each layer's `forward` (the capture hooks stay outside,
    in the module's call); "mlp": only each layer's MLP and its two norms (no linear-attention kernels
    traced); "mlp-norm": those and the Gated DeltaNet's gated RMSNorm; "layers-opaque": each layer's forward
    with the linear-attention kernels left opaque (`_kernels_opaque_to_dynamo`); with either, the final norm
    too (capture applies it to the model's last layer). `fuse`: each layer's sibling projections in one GEMM
    (model.fused_projections). Parameter names, and with them the fast load and the decode walk, are
    unchanged."""
    if scope not in COMPILE_SCOPES:
        raise ValueError(f"compile scope {scope!r}: one of {', '.join(COMPILE_SCOPES)}")
    if scope == "layers-opaque":
        _kernels_opaque_to_dynamo()
    options = fused_compile_options(target.model) if fuse else None
    if scope in ("layers", "layers-opaque"):
        for module in _stack(target):
            module.forward = torch.compile(module.forward, dynamic=False, options=options)
        return
    for layer in target.model.model.layers:
        parts = [layer.mlp, layer.input_layernorm, layer.post_attention_layernorm]
        if scope == "mlp-norm" and hasattr(layer, "linear_attn"):
            parts.append(layer.linear_attn.norm)
        for part in parts:
            part.forward = torch.compile(part.forward, dynamic=False, options=options)


def _stack(target: TargetModel) -> list[nn.Module]:
    """What a capture runs after the embedding: the decoder layers and the final norm (which it applies to
    the model's last layer when that one is captured: an eager fp32 norm in a compiled forward otherwise)."""
    return [*target.model.model.layers, target.model.model.norm]


class CompiledCapture:
    """`target.capture` with every decoder layer compiled, FLA's kernels opaque (`compile_layers`' scope
    "layers-opaque"), for the training forward alone (train.target_compile: 41.3 ms eager against 35.4 ms on
    the 27B-shaped slice; docs/journal.md, the current figure in docs/benchmarks.md). The compiled forwards
    are swapped in for each call and out after it: the decode walk and the held-out figures run the same
    layers at shapes that change every call (a recompile each) and stay eager. dynamic=True: rows of every
    length share one graph per layer kind, with no padding to fixed shapes and no recompile per length; the
    capture hooks stay outside, in the module's call. The final norm is compiled and swapped in alike. `fuse`
    (inductor only): each layer's sibling projections in one GEMM (model.fused_projections; eager calls keep
    their own weights)."""

    def __init__(self, target: TargetModel, backend: str | Callable = "inductor", fuse: bool = True) -> None:
        _kernels_opaque_to_dynamo()
        self.target = target
        self.modules = _stack(target)
        options = fused_compile_options(target.model, backend) if fuse else None
        self.compiled = [
            torch.compile(m.forward, dynamic=True, backend=backend, options=options) for m in self.modules
        ]

    @contextlib.contextmanager
    def swapped_in(self):
        """The compiled forwards on the modules inside the block; what each module had before, after it."""
        own = [m.__dict__.get("forward") for m in self.modules]
        for module, fn in zip(self.modules, self.compiled, strict=True):
            module.forward = fn
        try:
            yield
        finally:
            for module, fn in zip(self.modules, own, strict=True):
                if fn is None:
                    del module.forward  # the class's forward again
                else:
                    module.forward = fn

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
    ) -> TargetBatch:
        with self.swapped_in():
            return self.target.capture(input_ids, attention_mask, loss_mask)


_UNMASKED_LAYER_TYPES = ("full_attention", "linear_attention")


def unpadded_masks(config: PreTrainedConfig) -> dict[str, None]:
    """The per-layer-type mask mapping HF's text models take instead of a 2D mask, all "no mask": causal
    attention through SDPA's is_causal, no padding multiply in the linear-attention layers. Only layer types
    whose mask is nothing but causality and padding (a sliding window needs its mask)."""
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    other = sorted(types.difference(_UNMASKED_LAYER_TYPES))
    if other:
        raise ValueError(
            f"layer types {other} need their attention mask; only {_UNMASKED_LAYER_TYPES} do not"
        )
    return dict.fromkeys(types)


class GraphedForward:
    """`fn` at one fixed input shape, captured once in a CUDA graph and replayed (the target's forward at the
    fixed training length without the per-kernel launch cost of eager PyTorch).

    Warm-up calls run on a side stream first (Triton autotuning, torch.compile, cuBLAS handles); the input is
    copied into a static buffer before each replay. The returned tensor is the graph's static output: the next
    call overwrites it, so use or copy it first.
    """

    def __init__(
        self,
        fn: Callable[[torch.Tensor], torch.Tensor],
        example: torch.Tensor,
        warmup: int = 3,
        pool: Any = None,
    ) -> None:
        if not example.is_cuda:
            raise ValueError(f"a CUDA graph needs a CUDA input, not {example.device}")
        self.input = example.clone()
        device = example.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn(self.input)
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        self.graph = torch.cuda.CUDAGraph()
        with collector_paused(), torch.cuda.graph(self.graph, pool=pool):
            self.output = fn(self.input)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape != self.input.shape:
            raise ValueError(f"captured for input shape {tuple(self.input.shape)}, got {tuple(x.shape)}")
        self.input.copy_(x)
        self.graph.replay()
        return self.output


def graph_features(
    target: TargetModel, example_ids: torch.Tensor, warmup: int = 3, pool: Any = None
) -> GraphedForward:
    """`target.unpadded_features` at example_ids' shape in a CUDA graph (sequences without padding)."""
    return GraphedForward(target.unpadded_features, example_ids, warmup, pool)


def bucket_length(tokens: int, bucket: int) -> int:
    """The row length a graph is captured for: `tokens` rounded up to a multiple of `bucket`."""
    return -(-tokens // bucket) * bucket


class GraphedCapture:
    """The training forward of `CompiledCapture`'s compiled layers, replayed from one CUDA graph per bucket of
    row lengths: what train.target_compile runs on CUDA. A graph has no kernel launch cost per layer (the
    compiled forward's remaining gap to the graph-captured benchmark).

    Rows without padding (batch 1, or every row full) are right-padded with token 0 to the next multiple of
    `bucket` tokens: every layer is causal (attention, the Gated DeltaNet recurrence and its causal conv), so
    the real tokens' features are those of the unpadded forward; the padded positions' are cut off. A new
    bucket is warmed up and captured once (`capture_s` adds them up); the graphs share one memory pool, safe
    because they replay one at a time and each output is copied out before the next. A batch with padding
    inside it (rows of different lengths) runs the compiled forward without a graph.
    """

    def __init__(self, compiled: CompiledCapture, bucket: int = 256, warmup: int = 2) -> None:
        if bucket < 1:
            raise ValueError(f"bucket must be at least 1 token, got {bucket}")
        self.compiled, self.bucket, self.warmup = compiled, bucket, warmup
        self.graphs: dict[tuple[int, int], GraphedForward] = {}
        self.capture_s = 0.0
        self._pool: Any = None

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
    ) -> TargetBatch:
        if not input_ids.is_cuda or (attention_mask is not None and not bool(attention_mask.all())):
            return self.compiled(input_ids, attention_mask, loss_mask)
        rows, tokens = input_ids.shape
        length = bucket_length(tokens, self.bucket)
        padded = torch.nn.functional.pad(input_ids, (0, length - tokens)) if length != tokens else input_ids
        with self.compiled.swapped_in():
            graph = self.graphs.get((rows, length))
            if graph is None:
                start = time.perf_counter()
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                graph = graph_features(self.compiled.target, padded, self.warmup, self._pool)
                self.graphs[(rows, length)] = graph
                self.capture_s += time.perf_counter() - start
                log.info("target forward: CUDA graph for %d x %d tokens captured in %.1f s (%d graphs)",
                         rows, length, time.perf_counter() - start, len(self.graphs))  # fmt: skip
            context = graph(padded)[
                :, :tokens
            ].clone()  # the graph's output is overwritten by its next replay
        return captured_batch(input_ids, attention_mask, loss_mask, context)


# Where the text model's weights sit in a checkpoint: the Qwen3.5/3.6 multimodal wrapper nests them.
_PREFIXES = ("model.language_model.", "model.")


def _text_model_name(key: str) -> str | None:
    """The causal LM's name of a checkpoint key; None for what is not the text model (vision tower, MTP)."""
    if key == "lm_head.weight":
        return key
    prefix = next((p for p in _PREFIXES if key.startswith(p)), None)
    return None if prefix is None else "model." + key[len(prefix) :]


def _files_holding(path: Path, wanted: set[str]) -> list[Path]:
    """The shard files holding any weight the truncated model needs, by the checkpoint's index when it has
    one: shards of only the vision tower or of layers after the last captured one are not read at all."""
    from dflash_trainer.model.fast_load import safetensors_files

    files = safetensors_files(path)
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return files
    weight_map = json.loads(index.read_text())["weight_map"]
    needed = {file for key, file in weight_map.items() if _text_model_name(key) in wanted}
    return [f for f in files if f.name in needed]


class NeedsConversion(ValueError):
    """The checkpoint's keys are not the model's own: only from_pretrained's converting loader places them."""


def _fast_load(
    cls: type[PreTrainedModel], path: Path, short: PreTrainedConfig, device: torch.device, dtype: torch.dtype
) -> PreTrainedModel:
    """The truncated model built on the meta device, its weights loaded by fast_load straight onto `device`.

    from_pretrained reads the 54 GB target into host memory and `.to(device)` copies it again, tensor by
    tensor (about 20 s of a restart on an H200); fast_load streams each shard file to the device in large
    pinned chunks and the parameters become views of that memory (assign=True: no second copy).
    """
    from dflash_trainer.model.fast_load import load_files

    with torch.device("meta"):
        model = cls._from_config(short, dtype=dtype, attn_implementation="sdpa")
    wanted = set(model.state_dict())
    state: dict[str, torch.Tensor] = {}
    for key, tensor in load_files(_files_holding(path, wanted), device).items():
        name = _text_model_name(key)
        if name in wanted:
            state[name] = tensor if tensor.dtype == dtype else tensor.to(dtype)
    missing = sorted(wanted - set(state))
    if missing:  # a layout transformers converts while loading (Qwen3-Next's per-expert MoE weights)
        raise NeedsConversion(f"{len(missing)} weights need transformers' conversion, e.g. {missing[0]}")
    model.load_state_dict(state, strict=True, assign=True)
    # Non-persistent buffers (rotary inverse frequencies) are not in the files: computed on the device.
    for module in model.modules():
        if any(b.is_meta for b in module.buffers(recurse=False)):
            if "RotaryEmbedding" not in type(module).__name__:
                raise NeedsConversion(f"{type(module).__name__} has buffers outside the checkpoint")
            module.to_empty(device=device, recurse=False)
            model._init_weights(module)
    return model


def load_target(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    layer_ids: list[int],
    full: bool = False,
    skip_repeat: bool = True,
) -> TargetModel:
    """Load a Qwen3 / Qwen3.5 (plain or VL wrapper) / Qwen3-Next target from safetensors + config.json.

    Frozen and in eval mode; bf16 on CUDA and fp32 elsewhere unless `dtype` says otherwise. Layers after
    max(layer_ids) are neither built nor kept unless `full` (the decode walk needs the logits); capture runs
    only up to max(layer_ids) either way. On CUDA the weights go through fast_load (see `_fast_load`);
    from_pretrained stays the reference path (CPU, and whatever fast_load cannot place).
    """
    device = torch.device(device)
    cfg = read_text_config(path)
    if not layer_ids or any(not 0 <= i < cfg.num_hidden_layers for i in layer_ids):
        raise ValueError(f"layer_ids {layer_ids} outside 0..{cfg.num_hidden_layers - 1}")
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    install_device_dispatch()
    cls = CAUSAL_LM_CLASSES[cfg.model_type]
    short = _truncated(cfg, cfg.num_hidden_layers if full else max(layer_ids) + 1)
    start = time.perf_counter()
    model = None
    if device.type == "cuda":
        try:
            model = _fast_load(cls, Path(path), short, device, dtype)
        except NeedsConversion as e:
            log.info("target %s: loading through transformers (%s)", path, e)
    if model is None:
        model = _from_pretrained(cls, Path(path), short, dtype).to(device)
    model.eval().requires_grad_(False)
    if skip_repeat:  # off only to compare with transformers' own repeat (tests, benchmarks)
        skip_qk_head_repeat(model)
    log.info("target %s: %d of %d layers on %s in %.1f s", path, short.num_hidden_layers,
             cfg.num_hidden_layers, device, time.perf_counter() - start)  # fmt: skip
    return TargetModel(model, cfg, layer_ids)


def _from_pretrained(
    cls: type[PreTrainedModel], path: Path, short: PreTrainedConfig, dtype: torch.dtype
) -> PreTrainedModel:
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the skipped later layers and vision tower are reported as unexpected
    try:
        model, info = cls.from_pretrained(
            str(path),
            config=short,
            dtype=dtype,
            local_files_only=True,
            attn_implementation="sdpa",
            output_loading_info=True,
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    if info["missing_keys"] or info["mismatched_keys"]:
        # A target with randomly initialised weights would train a useless drafter without any error.
        raise ValueError(f"{path}: missing {info['missing_keys']}, mismatched {info['mismatched_keys']}")
    # Loaded on the host, then moved: device_map would need `accelerate`, which the trainer does not pin.
    return model
