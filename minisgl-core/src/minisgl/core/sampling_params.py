"""User-facing sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Per-request sampling options (vLLM / SGLang / OpenAI names and semantics).

    temperature 0 means greedy. top_k -1 (or 0 is rejected) means no top-k cut. Penalties:
    repetition_penalty is multiplicative over prompt and output tokens (HF/CTRL style, 1.0 = off);
    frequency_penalty and presence_penalty are additive over output tokens (OpenAI style, 0 = off).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    top_logprobs: int = 0  # also report the log-probs of this many most likely tokens per step

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"{name}: {rule} (got {getattr(self, name)!r})")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not self.temperature >= 0:  # also rejects NaN
            raise bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or not (self.top_k == -1 or self.top_k >= 1):
            raise bad("top_k", "must be -1 (disabled) or an integer >= 1")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if not self.repetition_penalty > 0:
            raise bad("repetition_penalty", "must be > 0")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer or None")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative token ids")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= 20:
            raise bad("top_logprobs", "must be an integer in [0, 20]")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)
