"""Episodes and evaluation (the GRPO phases build on these)."""

from workbench.rl.evaluate import (
    FAILURE_REASONS,
    EvalResult,
    failure_reason,
    format_table,
    summarize,
    wasted_turns,
)
from workbench.rl.rollout import Episode, play_model, play_scripted, user_text

__all__ = [
    "FAILURE_REASONS", "EvalResult", "Episode", "failure_reason", "format_table", "play_model",
    "play_scripted", "summarize", "user_text", "wasted_turns",
]
