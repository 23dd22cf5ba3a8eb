"""The adapter registry, on a local folder and on S3 (moto's server on loopback):

- publish copies an export with its metadata (base id and weights hash, run, step, eval results
  read from the run's eval/step_N.json) and refuses bad names and silent overwrites;
- list shows complete adapters only, promote / rollback move the serving default;
- an adapter is refused by a base with other weights, and the message names both hashes;
- `python -m workbench eval --adapter s3://.../adapters/<name>` evaluates straight from S3 and
  gives the table the local export gives.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workbench import registry, storage
from workbench.cli import main
from workbench.model import load_model, weights_hash


def test_publish_list_promote_rollback(store: storage.Store,
                                       lora_adapters: dict[str, Path]) -> None:
    for name in ("a0", "a1", "a2"):
        entry = registry.publish(store, lora_adapters[name], name)
        assert entry.base_weights_sha256 == json.loads(
            (lora_adapters[name] / "workbench_adapter.json").read_text())["base_weights_sha256"]
    files = storage.list_dir(store, "adapters/a1")
    assert {"adapter_config.json", "adapter_model.safetensors", "registry.json",
            "COMPLETE"} <= set(files)
    listed = {e.name: e for e in registry.list_adapters(store)}
    assert sorted(listed) == ["a0", "a1", "a2"]
    a1 = listed["a1"]
    assert (a1.step, a1.run) == (2, str(lora_adapters["a1"].parent.parent))
    assert a1.eval["greedy"]["solved"] == 1.0 and a1.eval["greedy"]["n_mazes"] == 4
    assert a1.lora["rank"] == 4 and not a1.default

    with pytest.raises(registry.RegistryError, match="already published"):
        registry.publish(store, lora_adapters["a0"], "a1")
    registry.publish(store, lora_adapters["a0"], "a1", overwrite=True)
    assert registry.get_adapter(store, "a1").step == 1
    with pytest.raises(registry.RegistryError, match="':'"):
        registry.publish(store, lora_adapters["a0"], "tiny:a0")
    with pytest.raises(registry.RegistryError, match="no adapter 'zz'.*published: a0, a1, a2"):
        registry.promote(store, "zz")

    with pytest.raises(registry.RegistryError, match="nothing to roll back"):
        registry.rollback(store)
    assert registry.promote(store, "a0")["default"] == "a0"
    assert registry.promote(store, "a2") | {"updated_at": 0} == {
        "default": "a2", "history": ["a0"], "updated_at": 0}
    assert [e.name for e in registry.list_adapters(store) if e.default] == ["a2"]
    assert registry.rollback(store)["default"] == "a0"
    assert registry.serving_state(store)["history"] == []


def test_torn_adapter_upload_is_not_listed(store: storage.Store,
                                           lora_adapters: dict[str, Path]) -> None:
    registry.publish(store, lora_adapters["a0"], "good")
    storage.put_file(store, "adapters/torn/adapter_config.json",
                     lora_adapters["a0"] / "adapter_config.json")
    assert registry.list_names(store) == ["good"]
    with pytest.raises(registry.RegistryError, match="no adapter 'torn'"):
        registry.promote(store, "torn")


def test_foreign_base_is_refused_naming_both_hashes(lora_adapters: dict[str, Path],
                                                    tiny_dir: Path) -> None:
    meta = registry.read_adapter_meta(lora_adapters["foreign"])
    base_hash = weights_hash(load_model(str(tiny_dir)).model)
    assert meta["base_weights_sha256"] != base_hash
    with pytest.raises(registry.ForeignBaseError) as info:
        registry.check_base(meta, base_hash, str(tiny_dir), "foreign")
    assert meta["base_weights_sha256"] in str(info.value) and base_hash in str(info.value)
    registry.check_base(registry.read_adapter_meta(lora_adapters["a0"]), base_hash, "t", "a0")


EVAL = ["env.size=5", "eval.n_mazes=3", "eval.sampled_passes=0", "generator.max_turns=3"]


def test_eval_straight_from_s3(s3_server: str, s3_bucket: str, lora_adapters: dict[str, Path],
                               tiny_dir: Path, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    store = storage.open_store(f"{s3_bucket}/wb", s3_server)
    registry.publish(store, lora_adapters["a1"], "a1")
    registry.publish(store, lora_adapters["foreign"], "foreign")
    common = [f"model.name={tiny_dir}", f"run_dir={tmp_path / 'eval'}", *EVAL,
              f"storage.endpoint_url={s3_server}"]
    main(["eval", *common, "--adapter", str(lora_adapters["a1"])])
    local_table = capsys.readouterr().out
    main(["eval", *common, "--adapter", f"{store.root}/adapters/a1"])
    s3_table = capsys.readouterr().out
    strip = lambda t: [line.split(maxsplit=1)[1] for line in t.splitlines()[1:]]  # noqa: E731
    assert strip(s3_table) == strip(local_table) and "greedy" in s3_table  # same numbers

    with pytest.raises(SystemExit) as exit_info:
        main(["eval", *common, "--adapter", f"{store.root}/adapters/foreign"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 4
    trained = registry.read_adapter_meta(lora_adapters["foreign"])["base_weights_sha256"]
    assert "cannot be loaded onto base" in err and trained in err
