"""Records that print: each phase's record is one short line (counts, shapes, ranges; no token
lists, no pixels), and the tables (rewards, advantages, eval results) are HTML tables in Jupyter.
Built from a real rollout of the random tiny model."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from workbench.envs import MazeConfig, eval_set
from workbench.envs.tasks import oracle_policy
from workbench.model import LoraSettings
from workbench.policy import SamplingParams
from workbench.rl import phases
from workbench.rl.rollout import play_scripted
from workbench.session import AdamParams, LossConfig, SessionSpec, create_session

SMALL = MazeConfig(size=5, max_turns=3)
LONGEST = 300  # characters: a record's repr is a line, not a dump


@pytest.fixture(scope="module")
def records(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """rollout -> score -> advantages -> datums (+1 / -1 per episode) -> forward, update ->
    evaluate, on 3 mazes x 2 samples."""
    session = create_session(SessionSpec(str(tiny_dir), LoraSettings(rank=4, alpha=8),
                                         workdir=str(tmp_path_factory.mktemp("reprs"))))
    tc = session.training_client
    sampler = tc.save_weights_and_get_sampling_client()
    batch = phases.Batch(SMALL, eval_set(5, 3), 2, SamplingParams(max_tokens=2), seed=0)
    ro = phases.rollout(sampler, batch)
    sc = phases.score(ro)
    datums = [phases.turn_datum(ep.stream, np.full(phases.replies(ep.stream), a))
              for ep, a in zip(ro.flat, [1.0, -1.0] * 3)]
    yield {"batch": batch, "ro": ro, "sc": sc, "adv": phases.advantages(sc.rewards_P_G),
           "datums": datums,
           "fb": tc.forward(datums, "ppo").result(),
           "up": phases.update(tc, datums, phases.UpdateSettings(
               "ppo", LossConfig(), AdamParams(learning_rate=1e-3))),
           "ev": phases.evaluate(sampler, replace(batch, seed=12345), "tiny")}
    session.close()


def test_rollout_and_episode_reprs(records: dict[str, Any]) -> None:
    assert repr(records["batch"]) == "Batch(MazeConfig, P=3 x G=2, temperature 1.0, seed 0)"
    window = replace(records["batch"], history_images=2)
    assert repr(window) == "Batch(MazeConfig, P=3 x G=2, temperature 1.0, seed 0, last 2 images)"
    ro = records["ro"]
    solved = sum(ep.success for ep in ro.flat)
    assert repr(ro).startswith(f"RolloutRecord(P=3 x G=2 episodes, {solved} solved, ")
    assert len(repr(ro)) <= LONGEST
    ep = ro.flat[0]
    assert ep.stream is not None and ep.stream.images  # the episode holds pixels ...
    assert repr(ep).startswith(f"Episode({'solved' if ep.success else 'failed'}, {ep.turns} "
                               "turns, reward")
    assert len(repr(ep)) < 200 and "array" not in repr(ep)  # ... its repr does not


def test_score_and_advantage_reprs_and_tables(records: dict[str, Any]) -> None:
    sc, adv = records["sc"], records["adv"]
    flat = int(np.all(sc.rewards_P_G == sc.rewards_P_G[:, :1], axis=1).sum())
    assert repr(sc).startswith("ScoreRecord(P=3 x G=2 rewards, mean ")
    assert repr(sc).endswith(f", {flat} zero-variance groups, parts env)")
    assert repr(adv).startswith(f"AdvantageRecord(grpo, P=3 x G=2, {flat} zero-variance groups")
    for record in (sc, adv):
        assert len(repr(record)) <= LONGEST
        table = record._repr_html_()
        assert "<table>" in table and table.count("<tr>") == 1 + 3  # a header, a row per maze
        assert "<th>g=1</th>" in table and "<th>p=2</th>" in table


def test_tables_of_many_mazes_stay_short() -> None:
    episodes_P_G = play_scripted(oracle_policy, SMALL, eval_set(5, 40), 2)
    sc = phases.score(phases.RolloutRecord(episodes_P_G, SamplingParams(), 0, 0.0))
    adv = phases.advantages(sc.rewards_P_G)
    assert "P=40 x G=2" in repr(sc) and len(repr(sc)) <= LONGEST
    assert adv._repr_html_().count("<tr>") == 1 + 32 + 1  # the first 32 mazes and "8 more"
    assert "... 8 more mazes" in adv._repr_html_()


def test_datum_forward_and_update_reprs(records: dict[str, Any]) -> None:
    datums, fb, up = records["datums"], records["fb"], records["up"]
    datum = datums[0]
    weighted = sum(1 for w in datum.weights_T if w)
    assert len(datum.stream) > 50  # a long stream ...
    assert repr(datum) == (f"Datum(T={len(datum.stream)}, {weighted} weighted tokens, "
                           "advantages [+1, +1])")  # ... and no token list in its repr
    assert repr(fb).startswith(f"ForwardBackwardOutput(loss {fb.loss:+.4g}, B=6 sequences, "
                               f"{fb.metrics['tokens']} tokens, kl ")
    assert len(repr(fb)) <= LONGEST and "[" not in repr(fb)  # no log-prob lists
    assert repr(up).startswith(f"UpdateRecord(6 datums, {up.metrics['tokens']} tokens, loss ")
    assert f"grad norm {up.grad_norm:.3g}" in repr(up) and len(repr(up)) <= LONGEST


def test_eval_record_repr_and_table(records: dict[str, Any]) -> None:
    ev = records["ev"]
    greedy, sampled = ev.by_mode("greedy"), ev.by_mode("sampled")
    assert repr(ev).startswith(f"EvalRecord(tiny greedy {greedy.solved:.1f}/3 solved, tiny "
                               f"sampled {sampled.solved:.1f}/3 solved (2 passes), ")
    assert len(repr(ev)) <= LONGEST
    table = ev._repr_html_()
    assert table.startswith("<table><tr><th>policy</th><th>mode</th><th>solved</th>")
    assert table.count("<tr>") == 1 + 2 and "<td>sampled</td>" in table
