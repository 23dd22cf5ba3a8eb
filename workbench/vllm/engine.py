"""The vLLM sampler engine (GPU only), behind the same rows interface as the transformers engine.

Selected by `engine.name=vllm`; `play_model` and the SamplingClient run unchanged on it.
Every request sends a row's whole stream as a token prompt; vLLM's prefix cache
(`enable_prefix_caching=True`) finds the KV blocks it already holds - the system prompt, earlier
turns, the G rows of one maze - so a turn prefills only its new tokens, as our KV cache does.

A multi-turn rollout is streamed (`engine.stream_rows`, `VLLMEngine.stream`): every row's first
turn is queued (`llm_engine.add_request`), and as vLLM's engine finishes a request
(`llm_engine.step()`) that row's environment steps and its next turn is queued at once, while
vLLM's engine core (its own process) samples the other rows. No turn waits for the batch's
slowest row, and the workbench's work between turns runs beside the GPU's instead of between its
turns. A row's next request is its last one with the turn's new tokens rendered and appended
(`vllm.render.RowRequests`), not the whole stream rendered again as `LLM.enqueue` would.
`engine.stream_rows=false` runs one `LLM.generate` per turn over all live rows.

What one row sends:

    prompt   {"prompt_token_ids": the stream's tokens, each image's run of <|image_pad|> cut to
                                  one pad (vLLM's Qwen3-VL processor expands a pad to the image's
                                  token count, as the HF processor does from text),
              "multi_modal_data": {"image": [the stream's RGB images, in order]}}
    params   SamplingParams(temperature, max_tokens, logprobs=0 (the drawn token's log-prob),
                            seed (drawn from the rollout's torch.Generator), stop_token_ids
                            [<|im_end|>], logit_bias -100 on the banned vision/special tokens,
                            detokenize=False)
    adapter  LoRARequest("v{version}", version + 1, <PEFT folder of that version>)

The LLM is built with logprobs_mode="processed_logprobs", so the log-probs are those of the
distribution actually sampled from (temperature and bans applied): the rule the trainer uses.
After generation the prompt vLLM ran (expanded) must equal the stream's tokens; a mismatch (its
image processor counting a different number of image tokens than ours) raises rather than
letting the update go silently off-policy.

Prefix caching is shown, not assumed: `cache_metrics()` (logged each step as
`vllm/prefix_cache_hit_rate` through the host's speed metrics) reads vLLM's own counters. It also
gives `vllm/generate_s`, the seconds spent inside vLLM's calls since the last call: a rollout's
time minus that is the workbench's own (environment, prompts, parsing).

Tested with vLLM 0.26.0 (torch 2.11, CUDA 13) on one H200: tests/test_vllm_engine.py's real-vLLM
tests (skipped without vllm and CUDA); on the CPU the same glue runs against a recording fake
`vllm` module.
"""

from __future__ import annotations

import hashlib
import importlib
import itertools
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from workbench.deps import warn_fallback
from workbench.policy.engine import (
    Completion,
    EngineSettings,
    SamplingParams,
    StepRow,
    model_max_len,
    play_lockstep,
)
from workbench.policy.stream import ChatFormat, Stream, VisionInput, chat_format
from workbench.vllm.args import check_memory_share, checked_max_len, engine_kwargs, import_vllm
from workbench.vllm.merged import MergedLoad, push_merged
from workbench.vllm.render import RowRequests

BAN_BIAS = -100.0  # vLLM clamps logit_bias to [-100, 100]: exp(-100) is zero for sampling


def prompt_token_ids(stream: Stream) -> list[int]:
    """The stream's tokens with each image's run of image tokens cut to its first token (C-level
    searches and slices between the runs: every turn rebuilds a row's whole prompt)."""
    types_T, tokens_T = stream.mm_types_T, stream.tokens_T
    out: list[int] = []
    pos = 0
    while (start := _index(types_T, 1, pos)) < len(types_T):
        out += tokens_T[pos:start + 1]
        pos = _index(types_T, 0, start)
    return out + tokens_T[pos:]


def _index(values: list[int], value: int, start: int) -> int:
    """The first index of `value` in values[start:], or len(values) if none."""
    try:
        return values.index(value, start)
    except ValueError:
        return len(values)


def expand_image_pads(token_ids: list[int], images: tuple[VisionInput, ...], fmt: ChatFormat
                      ) -> list[int]:
    """Inverse of prompt_token_ids: each <|image_pad|> back to its image's token count (what
    vLLM's processor does with the prompt)."""
    counts = iter([image.n_patches // fmt.merge**2 for image in images])
    out: list[int] = []
    for tok in token_ids:
        out.extend([tok] * next(counts) if tok == fmt.image_pad else [tok])
    return out


def _pil(image: VisionInput) -> Any:
    from PIL import Image

    if image.image_HW3 is None:
        raise ValueError("the vLLM engine needs each image's RGB array (VisionInput.image_HW3, "
                         "which policy.encode_image keeps); this stream was built without it")
    return Image.fromarray(image.image_HW3)


def image_uuid(pil: Any) -> str:
    """A content id of a PIL image (its pixels and size): vLLM's cache key for it, so vLLM need
    not hash the pixels of every image of every prompt again each turn."""
    return hashlib.sha1(pil.tobytes() + str(pil.size).encode()).hexdigest()


def vllm_prompt(stream: Stream, pil_cache: dict[int, Any] | None = None) -> dict[str, Any]:
    """vLLM's TokensPrompt (a TypedDict: a plain dict) for one stream: its tokens, and its images
    with their content ids (`multi_modal_uuids`). `pil_cache` keeps each image's PIL copy and id
    across turns (keyed by object: an image is converted and hashed once)."""
    prompt: dict[str, Any] = {"prompt_token_ids": prompt_token_ids(stream)}
    if stream.images:
        cache = {} if pil_cache is None else pil_cache
        for image in stream.images:
            if cache.get(id(image), (None,))[0] is not image:  # kept: its id stays its own
                pil = _pil(image)
                cache[id(image)] = (image, pil, image_uuid(pil))
        prompt["multi_modal_data"] = {"image": [cache[id(image)][1] for image in stream.images]}
        prompt["multi_modal_uuids"] = {"image": [cache[id(image)][2] for image in stream.images]}
    return prompt


def sampling_params(vllm: ModuleType, params: SamplingParams, fmt: ChatFormat,
                    seed: int | None) -> Any:
    """vllm.SamplingParams for one row (temperature 0 = greedy, as in our sampler)."""
    return vllm.SamplingParams(
        temperature=max(params.temperature, 0.0),
        max_tokens=params.max_tokens,
        logprobs=0,  # 0 alternatives: only the sampled token's log-prob
        seed=seed,
        stop_token_ids=[fmt.im_end],
        logit_bias={tok: BAN_BIAS for tok in fmt.banned},
        detokenize=False,
    )


def lora_request(lora_cls: Any, version: int, folder: Path) -> Any:
    """LoRARequest for weights version `version` (vLLM's ids start at 1: id = version + 1)."""
    return lora_cls(lora_name=f"v{version}", lora_int_id=version + 1, lora_path=str(folder))


def row_seeds(rows: int, generator: torch.Generator | None) -> list[int | None]:
    """One request seed per row, drawn from the rollout's generator (None: vLLM's own RNG)."""
    if generator is None:
        return [None] * rows
    return torch.randint(0, 2**31 - 1, (rows,), generator=generator).tolist()


def output_id(request_id: str) -> str:
    """The id vLLM's outputs carry for a request that `LLM.enqueue` returned as `request_id`:
    LLM numbers its requests, and vLLM 0.26's engine makes each number unique by a '-' and 8
    random characters, which its outputs leave out again."""
    return request_id.split("-", 1)[0]


def turn_seed(base: int | None, row: int, turn: int) -> int | None:
    """The request seed of a row's turn in a streamed rollout: a function of the rollout's one
    draw (`base`), the row and the turn, so it does not depend on the order rows come back."""
    if base is None:
        return None
    digest = hashlib.blake2b(f"{base}:{row}:{turn}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & (2**31 - 1)


def token_logprob(output: Any, k: int) -> float:
    """The log-prob of a vLLM CompletionOutput's k-th sampled token (logprobs[k][token])."""
    return float(output.logprobs[k][output.token_ids[k]].logprob)


def to_completion(output: Any, fmt: ChatFormat) -> Completion:
    """Our Completion from one vLLM CompletionOutput (its token_ids and `token_logprob`s)."""
    tokens = list(output.token_ids)
    logprobs = [token_logprob(output, k) for k in range(len(tokens))]
    return Completion(tokens, logprobs, "stop" if tokens and tokens[-1] == fmt.im_end else "length")


def check_prompt(ran_ids: list[int], stream: Stream) -> None:
    """vLLM must have run exactly the stream's tokens (same image token counts)."""
    if list(ran_ids) != stream.tokens_T:
        raise RuntimeError(
            f"vLLM ran a prompt of {len(ran_ids)} tokens for a stream of {len(stream)}: its image "
            "processor counted different image tokens than ours (check the model folder's "
            "preprocessor_config.json: patch_size, merge_size, min/max pixels)")


PREFIX_QUERIES, PREFIX_HITS = "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"
"""vLLM's counters of prompt tokens looked up in, and found in, its prefix cache."""


def counter_total(metrics: list[Any], name: str) -> int:
    """The sum of vLLM counter `name` over its labels (engines) in `LLM.get_metrics()`."""
    return int(sum(m.value for m in metrics if m.name == name))


@dataclass
class VLLMRows:
    """Rows of the vLLM engine: just the live streams (vLLM's prefix cache holds the KV)."""

    engine: VLLMEngine
    streams_B: list[Stream]
    pil_cache: dict[int, Any] = field(default_factory=dict)  # id -> (VisionInput, PIL)

    def decode(self, params: SamplingParams,
               generator: torch.Generator | None = None) -> list[Completion]:
        """One reply per row."""
        return self.engine.generate(self.streams_B, params, generator, self.pil_cache)

    def advance(self, keep: list[int], streams_B: list[Stream]) -> None:
        """The kept rows' grown streams replace the batch."""
        if len(keep) != len(streams_B):
            raise ValueError(f"{len(keep)} rows kept but {len(streams_B)} streams given")
        self.streams_B = list(streams_B)


class VLLMEngine:
    """vllm.LLM over the base model; samples with the LoRA adapter of the version in use."""

    name = "vllm"
    samples_own_weights = True  # each version's adapter or merged weights: the model is free

    def __init__(self, lm: Any, settings: EngineSettings, lora_rank: int | None,
                 adapter_root: Path) -> None:
        self.vllm = import_vllm()
        if lora_rank is None:
            raise ValueError("engine.name=vllm samples LoRA adapters by version, so it "
                             "needs LoRA; full fine-tuning samples with engine.name="
                             "transformers")
        self.lora_cls = importlib.import_module("vllm.lora.request").LoRARequest
        self.fmt = chat_format(lm.processor)
        self.adapter_root = Path(adapter_root)
        self.version: int | None = None  # None: the base model, no adapter
        self.merged = settings.vllm_lora == "merged"
        self.stream_rows = settings.stream_rows  # play_rows: each row as soon as it is back
        self.gpu_share = settings.gpu_memory_utilization  # of the GPU, vLLM's whole budget
        self.merged_version: int | None = None  # the version in vLLM's weights (merged only)
        self.model: Any = None  # the peft model whose versions are merged (merged only)
        self.loading: MergedLoad | None = None  # a version arriving from another process
        self.cache_seen = (0, 0)  # prefix-cache (queries, hits) at the last cache_metrics()
        self.generate_s = 0.0  # seconds inside vLLM's calls since the last cache_metrics()
        self.closed = False  # close() stopped vLLM's engine core
        self.render_by_turn = True  # streamed rows: render each turn's new tokens (vllm_render)
        self.request_ids = itertools.count()  # streamed requests' ids: wb0, wb1, ...
        self.requests = self.requests_whole = 0  # streamed since the last cache_metrics()
        dtype = str(lm.model.dtype).removeprefix("torch.")
        length = checked_max_len(settings, dtype, model_max_len(lm.model.config))
        if torch.cuda.is_available():
            check_memory_share(settings.gpu_memory_utilization, *torch.cuda.mem_get_info())
        self.llm = self.vllm.LLM(**engine_kwargs(lm.path, settings, lora_rank, dtype, length))
        kinds = importlib.import_module("vllm.sampling_params").RequestOutputKind
        self.final_only = kinds.FINAL_ONLY
        if self.stream_rows and not hasattr(self.llm, "renderer"):
            warn_fallback("engine.stream_rows", "this vLLM has no LLM.renderer (0.26.0 has): a "
                          "rollout samples a turn at a time")
            self.stream_rows = False

    def adapter_folder(self, version: int) -> Path:
        """Where version `version`'s PEFT adapter is written."""
        return self.adapter_root / f"v{version}"

    def add_version(self, version: int, model: Any) -> None:
        """adapter: export the peft model's adapter (adapter_config.json +
        adapter_model.safetensors). merged: nothing yet; `use_version` merges the version's
        snapshot into vLLM's weights when it is first sampled."""
        if self.merged:
            self.model = model  # its frozen base weights are merged with each version's factors
            return
        model.save_pretrained(str(self.adapter_folder(version)))

    def use_version(self, version: int, tensors: dict[str, torch.Tensor] | None) -> None:
        """Sample with version `version` from now on: its adapter, or (merged) its weights,
        merged from `tensors` (the version's snapshot) if vLLM holds another version."""
        if self.merged:
            if version != self.merged_version:
                if self.model is None or not tensors:
                    raise RuntimeError(
                        f"sampler version {version} is not in vLLM (it holds version "
                        f"{self.merged_version}) and this engine has nothing to merge it from "
                        "(add_version was not called; or it is a Ray engine colocated with its "
                        "trainer, sent each version once): sample from a new client, "
                        "save_weights_and_get_sampling_client()")
                push_merged(self.llm, self.model, tensors)
                self.merged_version = version
            self.version = version
            return
        if not (self.adapter_folder(version) / "adapter_config.json").is_file():
            raise FileNotFoundError(f"no adapter for sampler version {version} in "
                                    f"{self.adapter_root} (add_version was not called)")
        self.version = version

    def load_merged(self, payload: bytes, names: list[str]) -> int:
        """One chunk of a version merged by another process on this GPU (a Ray trainer
        worker: `share`d CUDA IPC handles) -> tensors loaded; `end_merged` completes it."""
        if self.loading is None:
            self.loading = MergedLoad(self.llm)
        return self.loading.load(payload, names)

    def end_merged(self, version: int) -> int:
        """The chunks of version `version` all loaded (`load_merged`): vLLM samples it from
        now on -> tensors loaded."""
        if self.loading is None:
            raise RuntimeError(f"end_merged({version}) without a chunk loaded first")
        loading, self.loading = self.loading, None
        loaded = loading.finish()
        self.merged_version = self.version = version
        return loaded

    def drop_version(self, version: int) -> None:
        """Delete the version's folder (vLLM's LRU evicts the loaded copy: max_loras=1)."""
        shutil.rmtree(self.adapter_folder(version), ignore_errors=True)

    def close(self) -> None:
        """Stop vLLM's engine core now (its process and its GPU share), not when this process
        ends: a notebook that closes a session and opens another gets the memory back. Twice is
        fine."""
        if self.closed:
            return
        self.closed = True
        core: Any = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if not hasattr(core, "shutdown"):
            warnings.warn("this vLLM has no llm_engine.engine_core.shutdown() (0.26.0 has): "
                          "its GPU memory is freed only when this process ends", RuntimeWarning,
                          stacklevel=2)
            return
        core.shutdown()

    def cache_metrics(self) -> dict[str, float]:
        """`vllm/*`: prompt tokens looked up in the prefix cache since the last call, and the
        share found there (each turn resends the whole stream: all but its new tokens should
        hit), the seconds spent inside vLLM's calls, and the streamed requests queued and how
        many of them were rendered whole (a row's first turn; any more: a prompt that did not
        extend its row's last one, or its images evicted from vLLM's processor cache)."""
        metrics = self.llm.get_metrics()
        seen = (counter_total(metrics, PREFIX_QUERIES), counter_total(metrics, PREFIX_HITS))
        queries, hits = seen[0] - self.cache_seen[0], seen[1] - self.cache_seen[1]
        self.cache_seen = seen
        generate_s, self.generate_s = self.generate_s, 0.0
        requests, whole = self.requests, self.requests_whole
        self.requests = self.requests_whole = 0
        return {"vllm/prefix_cache_queried_tokens": float(queries),
                "vllm/prefix_cache_hit_rate": hits / queries if queries else 0.0,
                "vllm/generate_s": generate_s, "vllm/requests": float(requests),
                "vllm/requests_rendered_whole": float(whole)}

    def open(self, prompts_P: list[Stream], n: int) -> VLLMRows:
        """Rows p * n + g = prompt p (prefix caching shares its prefill among the n)."""
        return VLLMRows(self, [s for s in prompts_P for _ in range(n)])

    def play_rows(self, prompts_P: list[Stream], n: int, params: SamplingParams,
                  generator: torch.Generator | None, step_row: StepRow) -> None:
        """`Engine.play_rows`: streamed (`stream_rows`, the default) or a turn at a time."""
        if self.stream_rows:
            self.stream(prompts_P, n, params, generator, step_row)
        else:
            play_lockstep(self, prompts_P, n, params, generator, step_row)

    def stream(self, prompts_P: list[Stream], n: int, params: SamplingParams,
               generator: torch.Generator | None, step_row: StepRow) -> None:
        """Every row's first turn is queued (`llm_engine.add_request`); then, as vLLM's engine
        finishes requests (`llm_engine.step()`), each finished row goes through `step_row` at
        once and its next prompt is queued while vLLM goes on with the other rows: rendered from
        the row's last request and the turn's new tokens (`vllm.render.RowRequests`; whole with
        `render_by_turn` off). Row b's turn t is seeded by `turn_seed` (one draw from
        `generator` for the whole rollout)."""
        base = row_seeds(1, generator)[0]
        lora, pil_cache = self.lora_request(), dict[int, Any]()
        rows = RowRequests(self.llm, lambda s: vllm_prompt(s, pil_cache), self.render_by_turn)
        sent: dict[str, tuple[int, int, Stream]] = {}  # request id -> (row, turn, prompt)

        def send(row: int, turn: int, stream: Stream) -> None:
            vparams = sampling_params(self.vllm, params, self.fmt, turn_seed(base, row, turn))
            vparams.output_kind = self.final_only  # as LLM.enqueue queues: no partial outputs
            request = self.llm.llm_engine.add_request(
                f"wb{next(self.request_ids)}", rows.engine_input(row, stream), vparams,
                lora_request=lora)
            sent[output_id(request)] = (row, turn, stream)

        start, stepping = time.perf_counter(), 0.0
        try:
            for row, stream in enumerate(s for s in prompts_P for _ in range(n)):
                send(row, 0, stream)
            while sent:
                for out in self.llm.llm_engine.step():
                    if not out.finished:
                        continue
                    if out.request_id not in sent:
                        raise RuntimeError(f"vLLM returned request {out.request_id!r}, which this "
                                           f"rollout did not send (it sent {sorted(sent)[:4]}...)")
                    row, turn, stream = sent.pop(out.request_id)
                    check_prompt(out.prompt_token_ids, stream)
                    t0 = time.perf_counter()
                    grown = step_row(row, to_completion(out.outputs[0], self.fmt))
                    stepping += time.perf_counter() - t0
                    if grown is not None:
                        send(row, turn + 1, grown)
        finally:
            if sent:  # an error stopped the rollout: no request of it stays in vLLM's queue
                self.llm.llm_engine.abort_request(list(sent.keys()))
            self.generate_s += time.perf_counter() - start - stepping
            self.requests += rows.made
            self.requests_whole += rows.whole

    def lora_request(self) -> Any:
        """The LoRARequest of the version in use (None: the base, or merged weights)."""
        if self.version is None or self.merged:
            return None
        return lora_request(self.lora_cls, self.version, self.adapter_folder(self.version))

    def generate(self, streams_B: list[Stream], params: SamplingParams,
                 generator: torch.Generator | None = None,
                 pil_cache: dict[int, Any] | None = None) -> list[Completion]:
        """One reply per stream: completions_B."""
        prompts_B = [vllm_prompt(s, pil_cache) for s in streams_B]
        params_B = [sampling_params(self.vllm, params, self.fmt, seed)
                    for seed in row_seeds(len(streams_B), generator)]
        lora = self.lora_request()
        start = time.perf_counter()
        outputs_B = self.llm.generate(prompts_B, params_B, lora_request=lora, use_tqdm=False)
        self.generate_s += time.perf_counter() - start
        for out, stream in zip(outputs_B, streams_B):
            check_prompt(out.prompt_token_ids, stream)
        return [to_completion(out.outputs[0], self.fmt) for out in outputs_B]
