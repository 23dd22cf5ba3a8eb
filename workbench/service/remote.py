"""A session server seen through the workbench's own clients: the notebook's loop (07) runs on
a server, driven by the official `tinker` SDK underneath, with its cells unchanged.

    session = connect_service("http://127.0.0.1:8100", "tml-KEY", base_model="tiny-sft")
    tc = session.training_client                      # the workbench's TrainingClient methods
    sampler = tc.save_weights_and_get_sampling_client()
    sampler.play(play_episodes, task, states, 4, params, seed).result()
    tc.forward_backward(datums, "importance_sampling", LossConfig(reduction="sequence_mean"))

Every call goes through the SDK (`service.sdk` turns streams into its types), so what this
reaches is what any SDK user reaches. The server sums each loss over the tokens (tinker's
rule); the other reductions are exact here because the four losses are linear in the
advantages (and cross_entropy in the weights): each datum's are scaled by its share of the
reduction (`losses.REDUCTION_SCALES`). An episode loop samples each live row's next reply with
one request a row (the first turn's rows of a maze in one request of n samples), seeded from the
loop's generator. Not reachable this way: truncated importance sampling (`tis_cap`), a trainer
temperature other than 1, grad_squares, exports and adapter loading.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from workbench.model.loaded import LoadedModel
from workbench.policy import SamplingParams, Stream
from workbench.policy.engine import Completion, play_lockstep
from workbench.service.sdk import completion, model_input, sdk_datum
from workbench.service.wire import ImageCache
from workbench.session.losses import REDUCTION_SCALES, LossConfig
from workbench.session.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    OptimStepOutput,
    SampleResponse,
)


def connect_service(url: str, api_key: str, base_model: str, rank: int = 0, seed: int = 0,
                    workdir: str = "runs/service-client") -> RemoteSession:
    """A LoRA training client on the server at `url` (rank 0: the server's), wrapped in the
    workbench's session interface."""
    import tinker

    client = tinker.ServiceClient(base_url=url, api_key=api_key)
    tc = client.create_lora_training_client(base_model=base_model, rank=rank,
                                            seed=seed).result()
    return RemoteSession(client, tc, Path(workdir))


@dataclass
class RemoteSession:
    """What a notebook holds of a session: its training client, folder, close()."""

    client: Any  # tinker.ServiceClient
    sdk_training: Any  # tinker.TrainingClient
    workdir: Path
    training_client: RemoteTrainingClient = field(init=False)

    def __post_init__(self) -> None:
        self.training_client = RemoteTrainingClient(self.sdk_training)

    def describe(self) -> dict[str, Any]:
        return {"backend": {"kind": "service"}, "model_id": self.sdk_training.model_id}

    def close(self) -> None:
        """Finish the calls in flight, then end the session on the server (its adapter is
        freed; saved states stay)."""
        self.training_client.pool.shutdown(wait=True)
        self.client.close("success")


class RemoteTrainingClient:
    """The workbench's TrainingClient over the SDK's: workbench records in, records out."""

    def __init__(self, sdk_training: Any) -> None:
        self.sdk = sdk_training
        self.pool = ThreadPoolExecutor(4, thread_name_prefix="workbench-remote")
        self.pngs = ImageCache()  # each image of a conversation encoded once
        self._processor: Any = None

    def get_processor(self) -> Any:
        """The policy's processor, from the folder the server names (get_info)."""
        if self._processor is None:
            from transformers import AutoProcessor

            folder = self.sdk.get_info().model_data.tokenizer_id
            self._processor = AutoProcessor.from_pretrained(folder)
        return self._processor

    def get_tokenizer(self) -> Any:
        return self.get_processor().tokenizer

    def forward(self, datums: list[Datum], loss_fn: str = "cross_entropy",
                loss_fn_config: LossConfig | None = None) -> Future:
        return self._forward(datums, loss_fn, loss_fn_config or LossConfig(), backward=False)

    def forward_backward(self, datums: list[Datum], loss_fn: str,
                         loss_fn_config: LossConfig | None = None) -> Future:
        return self._forward(datums, loss_fn, loss_fn_config or LossConfig(), backward=True)

    def _forward(self, datums: list[Datum], loss_fn: str, cfg: LossConfig,
                 backward: bool) -> Future:
        sdk_datums, config = sdk_datums_of(datums, loss_fn, cfg, self.pngs)
        call = self.sdk.forward_backward if backward else self.sdk.forward
        pending = call(sdk_datums, loss_fn, config)
        return self.pool.submit(lambda: output_of(pending.result()))

    def optim_step(self, adam: AdamParams) -> Future:
        from tinker import types

        pending = self.sdk.optim_step(types.AdamParams(
            learning_rate=adam.learning_rate, beta1=adam.beta1, beta2=adam.beta2, eps=adam.eps,
            weight_decay=adam.weight_decay, grad_clip_norm=adam.grad_clip_norm))

        def done() -> OptimStepOutput:
            metrics = pending.result().metrics or {}
            return OptimStepOutput(step=int(metrics.get("optimizer_step:max", 0)),
                                   grad_norm=float(metrics.get("grad_norm:mean", 0.0)),
                                   learning_rate=adam.learning_rate)
        return self.pool.submit(done)

    def save_state(self, name: str) -> Future:
        """A state on the server -> Future[its tinker:// path]."""
        pending = self.sdk.save_state(name)
        return self.pool.submit(lambda: pending.result().path)

    def save_weights_and_get_sampling_client(self) -> RemoteSamplingClient:
        sampler = self.sdk.save_weights_and_get_sampling_client().result()
        return RemoteSamplingClient(sampler, self)


class RemoteSamplingClient:
    """The workbench's SamplingClient over the SDK's."""

    def __init__(self, sdk_sampler: Any, trainer: RemoteTrainingClient) -> None:
        self.sdk, self.trainer = sdk_sampler, trainer

    def sample(self, prompt: Stream, num_samples: int, sampling_params: SamplingParams,
               seed: int = 0) -> Future:
        pending = self.sdk.sample(model_input(prompt, pngs=self.trainer.pngs), num_samples,
                                  sdk_params(sampling_params, seed))
        return self.trainer.pool.submit(lambda: SampleResponse(
            sequences=[completion(s) for s in pending.result().sequences]))

    def compute_logprobs(self, prompt: Stream, temperature: float = 1.0) -> Future:
        from tinker import types

        params = types.SamplingParams(max_tokens=1, temperature=temperature, seed=0)
        pending = self.sdk.sample(model_input(prompt, pngs=self.trainer.pngs), 1, params,
                                  include_prompt_logprobs=True)
        return self.trainer.pool.submit(
            lambda: [0.0] + [float(x) for x in pending.result().prompt_logprobs[1:]])

    def play(self, loop: Any, task: Any, init_states_P: list[Any], n: int,
             params: SamplingParams, seed: int) -> Future:
        """loop(...) in this process, each reply sampled on the server (`RemoteEngine`)."""
        processor = self.trainer.get_processor()
        lm = LoadedModel(model=None, processor=processor, source="service", path="")
        return self.trainer.pool.submit(loop, lm, RemoteEngine(self), task,
                                        list(init_states_P), n, params, seed)


def sdk_params(params: SamplingParams, seed: int) -> Any:
    from tinker import types

    return types.SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature,
                                seed=seed)


@dataclass
class RemoteRows:
    """Live rows of an episode loop, each sampled by a request of its own."""

    sampler: RemoteSamplingClient
    prompts_B: list[Stream]
    n: int  # samples of each prompt (the first turn's), then 1

    def decode(self, params: SamplingParams,
               generator: torch.Generator | None = None) -> list[Completion]:
        seed = int(torch.randint(2**31 - 1, (1,), generator=generator)) if generator else 0
        pending = [self.sampler.sample(p, self.n, params, seed + b)
                   for b, p in enumerate(self.prompts_B)]
        return [c for f in pending for c in f.result().sequences]

    def advance(self, keep: list[int], streams_B: list[Stream]) -> None:
        self.prompts_B, self.n = list(streams_B), 1


@dataclass
class RemoteEngine:
    """An engine whose rows are sampled on the server (the Engine protocol of policy.engine)."""

    sampler: RemoteSamplingClient
    name: str = "service"
    samples_own_weights: bool = True

    def open(self, prompts_P: list[Stream], n: int) -> RemoteRows:
        return RemoteRows(self.sampler, list(prompts_P), n)

    def play_rows(self, prompts_P: list[Stream], n: int, params: SamplingParams,
                  generator: torch.Generator | None, step_row: Any) -> None:
        play_lockstep(self, prompts_P, n, params, generator, step_row)

    def add_version(self, version: int, model: Any) -> None:
        return None

    def use_version(self, version: int, tensors: Any) -> None:
        return None

    def drop_version(self, version: int) -> None:
        return None

    def close(self) -> None:
        return None


def sdk_datums_of(datums: list[Datum], loss_fn: str, cfg: LossConfig,
                  pngs: ImageCache | None = None) -> tuple[list[Any], dict[str, float]]:
    """Workbench datums as the SDK's, the reduction folded into each datum's advantages (or
    weights) -> (datums, loss_fn_config)."""
    if cfg.tis_cap or cfg.temperature != 1.0:
        raise ValueError("a session server takes neither tis_cap nor a trainer temperature "
                         "other than 1: the tinker losses have no such knobs")
    tokens_B = [sum(1 for w in d.weights_T if w != 0) for d in datums]
    scales_B = REDUCTION_SCALES[cfg.reduction](tokens_B)
    out = [sdk_datum(d, loss_fn, scale, pngs) for d, scale in zip(datums, scales_B)]
    config = {"ppo": {"clip_low_threshold": 1.0 - cfg.clip_low,
                      "clip_high_threshold": 1.0 + cfg.clip_high},
              "cispo": {"clip_low_threshold": cfg.cispo_min,
                        "clip_high_threshold": cfg.cispo_max}}.get(loss_fn, {})
    return out, config


def output_of(out: Any) -> ForwardBackwardOutput:
    """The SDK's ForwardBackwardOutput as the workbench's."""
    m = out.metrics
    logprobs_B_T = [[0.0] + [float(x) for x in o["logprobs"].to_numpy()]
                    for o in out.loss_fn_outputs]
    metrics = {"loss": m["loss:sum"], "tokens": int(m.get("tokens:sum", 0)),
               "kl_sampler_trainer": m.get("kl_sampler_trainer:mean", 0.0),
               "clip_fraction": m.get("clip_fraction:mean", 0.0),
               "entropy": m.get("entropy:mean", 0.0)}
    return ForwardBackwardOutput(loss=m["loss:sum"], metrics=metrics, logprobs_B_T=logprobs_B_T)
