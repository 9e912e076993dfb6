"""What the decode worker keeps of one request, from its reservation until its result is handed out."""

from __future__ import annotations

from dataclasses import dataclass, field

from transfer import Transfer


@dataclass
class DecodeRequest:
    prompt: list[int]
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)  # generated so far (the first comes from prefill)
    held_tokens: int = 0  # of the prompt, in cached pages held here already (never transferred)
    runs: int = 0  # byte runs the transfer writes into
    landed_at: float = 0.0
    admitted_at: float = 0.0
    finished_at: float = 0.0
    transfer: Transfer | None = None
    error: str | None = None  # set when decode gave it up after receiving it
    corrupt: bool = False  # its bytes failed verification

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    def result(self) -> dict:
        """What `next_finished` hands out: {"tokens", "decode_s" (first token to last), "admit_s"
        (landed to verified and in the batch), "runs" (byte runs the transfer wrote into),
        "prefix_hit_tokens" (prompt tokens in pages held here already)}, or
        {"error", "corrupt"}."""
        if self.error is not None:
            return {"error": self.error, "corrupt": self.corrupt}
        return {
            "tokens": self.tokens,
            "decode_s": self.finished_at - self.admitted_at,
            "admit_s": self.admitted_at - self.landed_at,
            "runs": self.runs,
            "prefix_hit_tokens": self.held_tokens,
        }
