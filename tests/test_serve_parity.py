"""Served as trained: the endpoint's log-probs of an exported adapter's reply equal the trainer's
log-probs of the same tokens (base + adapter loaded in-process), and differ from the base's.

The transformers engine on the CPU in float32 (tiny-sft, a LoRA r4 adapter with random B), the
app in starlette's test client behind the `openai` client: at temperature 1 (sampled, seed 0)
and greedy (temperature 0: log-probs at temperature 1), the largest difference over the reply is
within 1e-4 while the base is further than 1e-2; the same check asked of the base model id (an
endpoint that ignores the adapter) fails. Each served token's `bytes` are its exact bytes;
top_logprobs is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from workbench import registry, storage
from workbench.envs import MazeConfig, eval_set
from workbench.model import LoraSettings
from workbench.serve import ServeSettings
from workbench.serve.client import first_messages
from workbench.serve.parity import check_served_logprobs

MAZE = MazeConfig(size=5, max_turns=4)
TOLERANCE = 1e-4  # float32 on the CPU: the same weights, kernels and rule on both sides


def _messages() -> list[dict[str, Any]]:
    return first_messages(MAZE, eval_set(5, 1)[0])  # a maze's first turn


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory, tiny_sft_dir: Path) -> Path:
    from conftest import export_adapter

    root = tmp_path_factory.mktemp("parity")
    return export_adapter(tiny_sft_dir, root / "run", LoraSettings(rank=4, alpha=8), 3)


@pytest.fixture(scope="module")
def openai_client(adapter: Path, tiny_sft_dir: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from starlette.testclient import TestClient

    from workbench.serve.app import build_app
    from workbench.serve.engine import open_transformers_replica

    store = storage.open_store(tmp_path_factory.mktemp("registry"))
    registry.publish(store, adapter, "trained")
    engine = open_transformers_replica(ServeSettings(model=str(tiny_sft_dir), served_name="sft",
                                                    adapters=store.root))
    with TestClient(build_app(engine)) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="-", http_client=http,
                            max_retries=0)


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_served_logprobs_are_the_trainers(openai_client: Any, adapter: Path,
                                          tiny_sft_dir: Path, temperature: float) -> None:
    check = check_served_logprobs(openai_client, "sft:trained", _messages(), str(tiny_sft_dir),
                                  adapter, temperature=temperature, max_tokens=6,
                                  tolerance=TOLERANCE)
    print(check)
    assert check.ok and check.temperature == 1.0 and check.tokens > 0
    assert check.max_diff <= TOLERANCE and check.base_diff > 1e-2


def test_an_endpoint_serving_the_base_fails_the_check(openai_client: Any, adapter: Path,
                                                      tiny_sft_dir: Path) -> None:
    check = check_served_logprobs(openai_client, "sft", _messages(), str(tiny_sft_dir), adapter,
                                  max_tokens=6, tolerance=TOLERANCE)
    print(check)
    assert not check.ok and not check.matches and check.max_diff > 1e-2


def test_served_token_bytes_are_exact(tiny) -> None:
    from workbench.serve.chat import token_bytes

    tok = tiny.processor.tokenizer
    text = "move up, then left: déjà vu ✓"
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(token_bytes(tok, i) for i in ids) == text.encode()
    assert token_bytes(tok, tok.convert_tokens_to_ids("<|im_end|>")) == b"<|im_end|>"


def test_top_logprobs_is_refused_in_one_line() -> None:
    from workbench.serve import RequestError
    from workbench.serve.chat import parse_request

    body = {"model": "sft", "messages": [{"role": "user", "content": "hi"}], "logprobs": True}
    assert parse_request(body | {"top_logprobs": 0}, 4, 8).logprobs
    with pytest.raises(RequestError, match="^top_logprobs is not supported by this server: "
                       "logprobs=true gives each sampled token's log-prob$"):
        parse_request(body | {"top_logprobs": 2}, 4, 8)


def _real_vllm() -> bool:
    try:
        import torch
        import vllm  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


# vLLM serves in bfloat16 against the float32 trainer: on the H200 the largest difference was
# 0.104 (T=1.0, 2 tokens) and 0.019 (T=0, 6 tokens), the base 2.98 and 15.05 away
VLLM_TOLERANCE = 0.25


@pytest.mark.gpu
@pytest.mark.skipif(not _real_vllm(), reason="needs vllm and a CUDA GPU")
def test_vllm_serves_as_trained(adapter: Path, tiny_sft_dir: Path, tmp_path: Path) -> None:
    """The same check through `--engine vllm`: the served log-probs (bf16) are near the
    float32 trainer's with the adapter, and far from the base's."""
    import openai

    from workbench.serve import serve, shutdown

    store = storage.open_store(tmp_path / "registry")
    registry.publish(store, adapter, "trained")
    endpoint = serve(str(tiny_sft_dir), served_name="sft", adapters=store.root, port=0,
                     address="", engine="vllm", cache_size=2, gpu_memory_utilization=0.05,
                     kv_cache_gb=0.25, cache_dir=str(tmp_path / "cache"))
    try:
        client = openai.OpenAI(base_url=endpoint.base_url, api_key="-", max_retries=0,
                               timeout=300)
        checks = [check_served_logprobs(client, "sft:trained", _messages(), str(tiny_sft_dir),
                                        adapter, temperature=t, max_tokens=6,
                                        tolerance=VLLM_TOLERANCE) for t in (1.0, 0.0)]
    finally:
        shutdown(endpoint)
    print(checks)
    assert all(c.ok for c in checks), checks
