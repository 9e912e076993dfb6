"""The benchmark's datasets: distpool's generated workloads (token ids, seeded), random prompts of a
fixed length, and ShareGPT conversations."""

from __future__ import annotations

from dataclasses import dataclass

from distpool.bench.sessions import Session, Turn
from distpool.bench.sharegpt import load_sharegpt
from distpool.serving.workloads import DEFAULT_TURNS, generate, generate_conversations

DATASETS = {
    "mixed": "prompts of 4-96 tokens, uniform (distpool run's mixed)",
    "long-tailed": "distpool run's long-tailed: lognormal around 1.5k tokens, 5% up to the context",
    "shared-prefix": "one system prompt of 1024-4096 tokens shared by all, then 64-1024 of its own",
    "multi-turn": "conversations, each turn after the previous reply (--dataset-path: ShareGPT's; "
    "else generated, 64-1024 new tokens a turn, --turns each)",
    "random": "prompts of exactly --input-len random tokens",
    "sharegpt": "the first message of each ShareGPT conversation (--dataset-path)",
}
DEFAULT_OUTPUT_LEN = 32  # tokens asked of every request of a generated dataset
DEFAULT_INPUT_LEN = 128  # random's prompt length
DEFAULT_CONTEXT_LEN = 4096  # a server that states no max_model_len


@dataclass(frozen=True)
class DatasetArgs:
    dataset: str
    num_prompts: int
    seed: int
    vocab_size: int  # token ids are drawn from [0, vocab_size)
    input_len: int | None = None
    output_len: int | None = None
    dataset_path: str | None = None
    turns: int = DEFAULT_TURNS

    def __post_init__(self) -> None:
        """Flag combinations that would be ignored are refused, with the fix."""
        if self.dataset not in DATASETS:
            raise ValueError(f"unknown --dataset {self.dataset!r}; choose one of {', '.join(DATASETS)}")
        if self.dataset == "sharegpt" and self.dataset_path is None:
            raise ValueError("--dataset sharegpt reads --dataset-path PATH (a ShareGPT JSON file); give it")
        if self.dataset_path is not None and self.dataset not in ("sharegpt", "multi-turn"):
            raise ValueError(
                f"--dataset-path is read by --dataset sharegpt or multi-turn, not {self.dataset}. "
                "Fix: drop --dataset-path, or pick one of those"
            )
        if self.input_len is not None and self.dataset != "random":
            raise ValueError(
                f"--input-len sets --dataset random's prompt length; {self.dataset} draws its own. "
                "Fix: drop --input-len, or use --dataset random"
            )


def build_sessions(args: DatasetArgs, context_len: int | None) -> list[Session]:
    """`args.num_prompts` requests in all (multi-turn: turns; fewer if a file or the context holds
    fewer), the same for the same arguments. Generated prompts are clipped to leave room for their
    output in `context_len` (the server's max_model_len; None: DEFAULT_CONTEXT_LEN)."""
    context = context_len or DEFAULT_CONTEXT_LEN
    if args.dataset_path is not None:
        multi = args.dataset == "multi-turn"
        return load_sharegpt(
            args.dataset_path, args.num_prompts, multi_turn=multi, output_len=args.output_len, seed=args.seed
        )
    output_len = args.output_len or DEFAULT_OUTPUT_LEN
    if args.dataset == "multi-turn":
        plan = generate_conversations(
            args.num_prompts,
            turns=args.turns,
            vocab_size=args.vocab_size,
            max_new_tokens=output_len,
            seed=args.seed,
            context_len=context,
        )
        return [
            Session(c.conversation_id, tuple(Turn.of_ids(m, output_len) for m in c.messages))
            for c in plan.conversations
        ]
    workload, lengths = args.dataset, {}
    if args.dataset == "random":
        input_len = args.input_len or DEFAULT_INPUT_LEN
        if input_len + output_len > context:
            raise ValueError(
                f"--input-len {input_len} and --output-len {output_len} exceed the server's context of "
                f"{context} tokens. Fix: keep their sum at most {context}"
            )
        workload, lengths = "mixed", {"min_prompt": input_len, "max_prompt": input_len}
    requests = generate(
        args.num_prompts,
        vocab_size=args.vocab_size,
        max_new_tokens=output_len,
        seed=args.seed,
        workload=workload,
        context_len=context,
        **lengths,
    )
    return [Session(r.request_id, (Turn.of_ids(r.prompt, output_len),)) for r in requests]
