"""Episodes and evaluation (the GRPO phases build on these)."""

from workbench.rl.evaluate import EvalResult, format_table, summarize
from workbench.rl.rollout import (
    SCRIPTED,
    Episode,
    oracle_policy,
    play_model,
    play_scripted,
    random_open_policy,
    random_policy,
    user_text,
)

__all__ = [
    "SCRIPTED", "EvalResult", "Episode", "format_table", "oracle_policy", "play_model",
    "play_scripted", "random_open_policy", "random_policy", "summarize", "user_text",
]
