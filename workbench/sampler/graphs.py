"""Decode steps replayed as CUDA graphs over a KV pool that lives as long as the engine.

The eager sampler (`sampler.batch`) launches every kernel of a one-token step from Python: for an
8B model that is thousands of launches, and the GPU waits on Python (~77 ms a step, 5% of the
bandwidth bound). Here a step reads only fixed-address buffers, so it is captured once and
replayed:

- the KV cache is a pool of `PoolLayer`s (rows x capacity, allocated once, kept across rollouts;
  dropped rows are compacted to the front in place, so addresses never move);
- the step's inputs (token, M-RoPE position, write column, 4-D mask) are static device buffers;
- attention reads the first `window` columns, `window` = the filled length rounded up to
  `bucket`, so one graph serves `bucket` steps and the cache is never read far past its end;
- one graph per (rows, window, pool generation), captured on first use; the warm-up run of a
  capture is the real step (a step only writes column n, so running it twice is harmless).

With `fused` the step does not call the transformers model at all: `sampler.fused` runs it over
a merged, fused copy of the text weights (optionally torch.compile'd before capture), re-merged
by `GraphEngine.open` when the sampler's weights version changed. Prefill (`extend`) stays
eager: one call a turn. Sampling from the logits stays eager too (a few
kernels). Without CUDA (`use_graphs=False`) the same static step runs eagerly: that is what the
CPU tests check against the eager sampler.

    static = make_static_decode(lm.model, rows=64, capacity=2048)
    engine = GraphEngine(lm, static)       # a TransformersEngine whose rows decode by replay
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from workbench.deps import warn_fallback
from workbench.policy.engine import EngineSettings
from workbench.policy.stream import Stream
from workbench.sampler.attention import use_gqa_decode_attention
from workbench.sampler.batch import LiveBatch, extend, repeat_rows
from workbench.sampler.engine import TransformersEngine, TransformersRows
from workbench.sampler.fused import (
    compiled_layer_step,
    fuse_weights,
    fused_step,
    layer_step,
    refresh,
)
from workbench.sampler.kvcache import pool_cache


@dataclass
class StaticBuffers:
    """Fixed-address inputs of a decode step for up to R rows and C cache columns."""

    ids_R1: torch.Tensor
    pos_3R1: torch.Tensor
    index_1: torch.Tensor  # the cache column this step writes
    mask_R11C: torch.Tensor  # bool, True = attend
    generation: int  # the pool generation these were sized for
    mask_of: Any = None  # the LiveBatch mask whose columns mask_R11C holds (None: none yet)


@dataclass
class StaticDecode:
    """The pool, the step buffers and the captured graphs of one engine."""

    cache: Any  # transformers Cache of PoolLayers
    bucket: int = 256  # window granularity in cache columns
    use_graphs: bool = True  # False: run the static step eagerly (CPU)
    graphs: dict = field(default_factory=dict)  # (rows, window, generation) -> (graph, logits)
    buffers: StaticBuffers | None = None
    mempool: Any = None  # one graph memory pool shared by all captures
    captures: int = 0
    capture_seconds: float = 0.0
    error: str = ""  # why graphs were switched off, if they were
    fused: Any = None  # sampler.fused.FusedWeights: decode through merged, fused weights
    layer_step: Any = None  # fused.layer_step or its torch.compile'd form
    compile_error: str = ""  # why the compiled layer step was given up, if it was
    compiled: bool = False  # the layer step was asked to go through torch.compile

    @property
    def generation(self) -> int:
        return self.cache.layers[0].generation


def make_static_decode(model: Any, rows: int, capacity: int, bucket: int = 256,
                       use_graphs: bool | None = None, fused: bool = False,
                       compiled: bool = False) -> StaticDecode:
    """A pool for `rows` rows x `capacity` tokens (grown if a batch needs more); graphs on CUDA.
    fused: decode through a merged, fused copy of the text weights (`sampler.fused`); compiled:
    its layer step through torch.compile."""
    layers = model.config.text_config.num_hidden_layers
    capacity = -(-capacity // bucket) * bucket
    on_cuda = model.device.type == "cuda"
    return StaticDecode(cache=pool_cache(layers, rows, capacity), bucket=bucket,
                        use_graphs=on_cuda if use_graphs is None else use_graphs,
                        fused=fuse_weights(model) if fused else None,
                        layer_step=compiled_layer_step() if compiled else layer_step,
                        compiled=compiled)


def open_static(static: StaticDecode) -> LiveBatch:
    """An empty LiveBatch over the engine's pool whose decode steps go through `static_feed`."""
    for layer in static.cache.layers:
        layer.reset()
    return LiveBatch(cache=static.cache, feed=partial(static_feed, static))


def reset_graphs(static: StaticDecode) -> None:
    """Drop every captured graph and their memory pool (the next step captures afresh). The pool
    handle goes too: capturing into a pool whose graphs were freed trips an internal assert of
    PyTorch 2.11's caching allocator (seen on the H200, 2026-11-29)."""
    static.graphs.clear()
    static.mempool = None


def _buffers(static: StaticDecode, device: torch.device) -> StaticBuffers:
    first = static.cache.layers[0]
    R, C = first._k.shape[0], first._k.shape[2]
    b = static.buffers
    if b is None or b.generation != static.generation:
        reset_graphs(static)  # captured against buffers that are gone
        b = StaticBuffers(
            ids_R1=torch.zeros(R, 1, dtype=torch.long, device=device),
            pos_3R1=torch.zeros(3, R, 1, dtype=torch.long, device=device),
            index_1=torch.zeros(1, dtype=torch.long, device=device),
            mask_R11C=torch.zeros(R, 1, 1, C, dtype=torch.bool, device=device),
            generation=static.generation,
        )
        static.buffers = b
    return b


def _fused_step(static: StaticDecode, rows: int, window: int) -> torch.Tensor:
    """The step through `sampler.fused`; a compiled layer step that fails falls back to eager."""
    b = static.buffers
    assert b is not None, "static_feed fills the buffers first"
    args = (static.cache.layers, b.ids_R1[:rows], b.pos_3R1[:, :rows], b.index_1,
            b.mask_R11C[:rows, :, :, :window])
    try:
        return fused_step(static.fused, static.layer_step, *args)
    except Exception as err:  # noqa: BLE001 - compiler missing or failing: run it eagerly
        if static.layer_step is layer_step:
            raise
        static.layer_step, static.compile_error = layer_step, f"{type(err).__name__}: {err}"
        warn_fallback("engine.compile_decode", static.compile_error)
        return fused_step(static.fused, layer_step, *args)


def _step(model: Any, static: StaticDecode, rows: int, window: int) -> torch.Tensor:
    """One decode step over the static buffers: writes column index_1, returns logits (B, 1, V)."""
    if static.fused is not None:
        return _fused_step(static, rows, window)
    b = static.buffers
    assert b is not None, "static_feed fills the buffers first"
    out = model(
        input_ids=b.ids_R1[:rows],
        attention_mask=b.mask_R11C[:rows, :, :, :window],
        position_ids=b.pos_3R1[:, :rows],
        past_key_values=static.cache,
        use_cache=True,
    )
    return out.logits


def _capture(model: Any, static: StaticDecode, rows: int, window: int) -> tuple[Any, Any]:
    """Warm up (this runs the real step) and capture the step for (rows, window)."""
    start = time.perf_counter()
    if static.mempool is None:
        static.mempool = torch.cuda.graph_pool_handle()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _step(model, static, rows, window)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=static.mempool):
        logits = _step(model, static, rows, window)
    static.captures += 1
    static.capture_seconds += time.perf_counter() - start
    return graph, logits


def _run_step(model: Any, static: StaticDecode, rows: int, window: int) -> torch.Tensor:
    """Replay (capturing on first use) or, without graphs, run the static step eagerly."""
    if not static.use_graphs:
        return _step(model, static, rows, window)
    key = (rows, window, static.generation)
    if key not in static.graphs:
        try:
            static.graphs[key] = _capture(model, static, rows, window)
        except Exception as err:  # noqa: BLE001 - any capture failure: fall back, say why
            static.use_graphs, static.error = False, f"{type(err).__name__}: {err}"
            warn_fallback("engine.cuda_graphs", static.error)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return _step(model, static, rows, window)
    graph, logits = static.graphs[key]
    graph.replay()
    return logits


def static_feed(static: StaticDecode, model: Any, live: LiveBatch, tok_B: torch.Tensor,
                real_B: torch.Tensor) -> None:
    """`sampler.batch._feed` over the pool: append one token per row (holes where real_B is
    False)."""
    assert live.mask_BL is not None and live.next_pos_B is not None \
        and live.logits_BV is not None, "an empty batch: extend it first"
    B, n, device = live.rows, live.mask_BL.shape[1], model.device
    window = -(-(n + 1) // static.bucket) * static.bucket
    layers = static.cache.layers
    for layer in layers:
        layer._reserve(layer._k, B, window)  # grows only if the batch outgrew the pool
    b = _buffers(static, device)
    if b.mask_of is not live.mask_BL:  # the batch changed (open, prefill, dropped rows)
        b.mask_R11C[:B, 0, 0, :n].copy_(live.mask_BL.bool())
    live.mask_BL = torch.cat([live.mask_BL, real_B.long()[:, None]], dim=1)
    b.ids_R1[:B, 0].copy_(tok_B)
    b.pos_3R1[:, :B, 0].copy_(live.next_pos_B.view(1, B).expand(3, B))
    b.index_1.fill_(n)
    b.mask_R11C[:B, 0, 0, n].copy_(real_B)  # otherwise only the new column is sent
    b.mask_R11C[:B, 0, 0, n + 1 : window] = False
    b.mask_of = live.mask_BL
    for layer in layers:
        layer.static = (b.index_1, window)
    try:
        logits_B1V = _run_step(model, static, B, window)
    finally:
        for layer in layers:
            layer.static = None
    for layer in layers:
        layer.advance(1)
    real_dev_B = real_B.to(device)
    live.logits_BV = torch.where(real_dev_B[:, None], logits_B1V[:, -1].float(), live.logits_BV)
    live.next_pos_B = live.next_pos_B + real_B.long()
    live.consumed_B = [c + int(r) for c, r in zip(live.consumed_B, real_B.tolist())]


class GraphEngine(TransformersEngine):
    """The transformers engine with pooled KV and graph-replayed decode steps (one batch open
    at a time: a new `open` empties the pool)."""

    def __init__(self, lm: Any, static: StaticDecode) -> None:
        super().__init__(lm)
        self.static: StaticDecode | None = static
        self.version: int | None = None  # the sampler version the model holds (None: unknown)

    def use_version(self, version: int, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """The model now holds `version`: fused weights are re-merged at the next `open`."""
        self.version = version

    def open(self, prompts_P: list[Stream], n: int) -> TransformersRows:
        """Prefill each prompt once into the pool, then share its cache among its n rows."""
        assert self.static is not None, "this engine was closed"
        fused = self.static.fused
        if fused is not None and (self.version is None or fused.version != self.version):
            refresh(fused, self.lm.model, self.version)
        live = open_static(self.static)
        extend(self.lm.model, live, prompts_P, self.pad_id)
        repeat_rows(live, n)
        return TransformersRows(self, live)

    def close(self) -> None:
        """Free the pool, the fused weight copy and the captured graphs (the model is the
        session's); the engine serves no `open` after this."""
        if self.static is not None:
            reset_graphs(self.static)
            self.static = None


def graph_metrics(static: StaticDecode) -> dict[str, float]:
    """`speed/cuda_graphs`, and `speed/compile_decode` when it was asked for: 1.0 running, 0.0
    fallen back (its warning said why)."""
    out = {"speed/cuda_graphs": float(static.use_graphs)}
    if static.compiled:
        out["speed/compile_decode"] = float(not static.compile_error)
    return out


def graph_engine(lm: Any, settings: EngineSettings) -> GraphEngine:
    """Our engine over CUDA graphs with the knobs of `settings`: grouped-query decode attention,
    a KV pool of kv_rows x kv_tokens, fused and compiled decode steps."""
    if settings.gqa_decode:
        use_gqa_decode_attention(lm.model)
    static = make_static_decode(lm.model, settings.kv_rows or 64, settings.kv_tokens,
                                settings.bucket, use_graphs=True, fused=settings.fused_decode,
                                compiled=settings.compile_decode)
    return GraphEngine(lm, static)
