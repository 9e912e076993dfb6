"""The reference model split over TP ranks is the TP 1 model.

Each TP size runs the same scenario (`tp_ranks.serve`) in a Gloo group of ranks, each on its own
rank pool: the greedy tokens are TP 1's (or differ first at a near tie, the parity check's rule),
each rank's pool holds its shard of the TP 1 pool's bytes, and state prefilled at one TP size
decodes at the other to TP 1's tokens: what a cross-TP transfer relies on.
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from distpool.model.shard import TpUnshardable, check_tp, shard
from distpool.model_impl.errors import ImplCannotRun, TpGroupMismatch, TpSplitUneven
from distpool.model_impl.reference.model import ReferenceModel
from distpool.model_impl.reference.tensor_parallel import held_ids
from distpool.model_impl.select import build_model_impl
from distpool.serving.summary.parity import Expected, compare
from tests.model_impl.tp_ranks import (
    PROMPTS,
    SPEC,
    STEPS,
    Rows,
    Run,
    rank_main,
    resume,
    run_ranks,
    serve,
    shard_rows,
)

TP_SIZES = (2, 4)  # TP 4: KV heads and Mamba groups replicated, each norm group over two ranks
ROW_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}  # float32 caches of float64 sums taken in another order


def unshard_rows(tp: int, rows_by_rank: list[Rows]) -> Rows:
    """Rows of every rank put back at their unsharded positions (a replicated part: any rank's copy)."""
    joined: Rows = {}
    for rank, rows in enumerate(rows_by_rank):
        for key, value in rows.items():
            piece = shard(SPEC, tp, rank).tensor(key[1])
            full = joined.setdefault(key, value.new_zeros(value.shape[0], *piece.shape))
            full[:, held_ids(piece)] = value
    return joined


@pytest.fixture(scope="module")
def tp1_model() -> ReferenceModel:
    return ReferenceModel(SPEC, seed=0)


@pytest.fixture(scope="module")
def tp1(tp1_model: ReferenceModel) -> Run:
    return serve(tp1_model)


@pytest.fixture(scope="module", params=TP_SIZES, ids=[f"tp{n}" for n in TP_SIZES])
def ranks(request, tp1: Run, tmp_path_factory) -> tuple[int, list[tuple[Run, dict[str, list[int]]]]]:
    tp = request.param
    return tp, run_ranks(tp, rank_main, (tp, tp1), tmp_path_factory.mktemp(f"tp{tp}"))


def judge(tp1_model: ReferenceModel, tp1: Run, rid: str, generated: list[int]) -> str:
    """The parity check's verdict on `generated` (a prefix of TP 1's generated tokens for `rid`)."""
    reference = tp1.served[rid]

    def margin_at(step: int) -> float:
        top = tp1_model.next_token_logits(reference.tokens[: reference.generated[step]]).topk(2).values
        return float(top[0] - top[1])

    expected = Expected(tokens=reference.generated_tokens[: len(generated)], margin_at=margin_at)
    kind, note = compare(rid, generated, expected)
    assert kind in ("equal", "near_tie"), note
    return kind


def test_every_rank_generates_the_tokens_of_tp1(ranks, tp1_model: ReferenceModel, tp1: Run) -> None:
    tp, results = ranks
    runs = [run for run, _ in results]
    # the all-reduced residual stream is one tensor on every rank: so are the tokens
    assert all(run.served == runs[0].served for run in runs)
    for rid, one in runs[0].served.items():
        # the first token, two rounds of decoding, and "a"'s second turn's first token
        assert len(one.generated) == 1 + 2 * STEPS + (rid == "a")
        judge(tp1_model, tp1, rid, one.generated_tokens)


def test_each_rank_pool_holds_its_shard_of_the_tp1_bytes(ranks, tp1: Run) -> None:
    tp, results = ranks
    for rank, (run, _) in enumerate(results):
        rank_shard = shard(SPEC, tp, rank)
        for rid, rows in run.prefilled_rows.items():  # from the prompts alone: no token choice in them
            expected = shard_rows(rank_shard, tp1.prefilled_rows[rid])
            assert rows.keys() == expected.keys()
            for key, value in rows.items():
                torch.testing.assert_close(
                    value, expected[key], **ROW_TOLERANCE, msg=f"{rid} {key} rank {rank}"
                )
        # after decoding, wherever the tokens were TP 1's (a near tie would change what follows)
        same = [rid for rid, one in run.served.items() if one.tokens == tp1.served[rid].tokens]
        assert same, "no request generated TP 1's tokens"
        for rid in same:
            expected = shard_rows(rank_shard, tp1.final_rows[rid])
            for key, value in run.final_rows[rid].items():
                torch.testing.assert_close(
                    value, expected[key], **ROW_TOLERANCE, msg=f"{rid} {key} rank {rank}"
                )


def test_state_prefilled_at_tp_n_decodes_at_tp1(ranks, tp1_model: ReferenceModel, tp1: Run) -> None:
    tp, results = ranks
    runs = [run for run, _ in results]
    rows = {rid: unshard_rows(tp, [run.prefilled_rows[rid] for run in runs]) for rid in PROMPTS}
    for rid, generated in resume(tp1_model, rows, runs[0].first_tokens).items():
        judge(tp1_model, tp1, rid, generated)


def test_state_prefilled_at_tp1_decodes_at_tp_n(ranks, tp1_model: ReferenceModel, tp1: Run) -> None:
    tp, results = ranks
    for _, resumed in results:
        for rid, generated in resumed.items():
            assert len(generated) == 1 + STEPS
            judge(tp1_model, tp1, rid, generated)


@pytest.mark.parametrize("tp", [3, 8])
def test_a_tp_size_the_config_cannot_shard_is_refused_with_the_shard_rules_error(tp: int) -> None:
    with pytest.raises(TpUnshardable) as refused:
        check_tp(SPEC, tp)
    with pytest.raises(TpUnshardable) as built:
        ReferenceModel.for_rank(SPEC, tp=tp, rank=0, group=None)
    assert vars(built.value) == vars(refused.value)
    assert (built.value.architectures, built.value.valid_sizes) == ("NemotronHForCausalLM", (1, 2, 4))


def test_a_rank_without_its_group_is_refused() -> None:
    with pytest.raises(TpGroupMismatch) as refused:
        ReferenceModel.for_rank(SPEC, tp=2, rank=1, group=None)
    assert vars(refused.value) == {"tp": 2, "rank": 1, "group_size": None, "group_rank": None}
    copy = pickle.loads(pickle.dumps(refused.value))  # crosses Ray's process boundary as itself
    assert (type(copy), vars(copy), str(copy)) == (TpGroupMismatch, vars(refused.value), str(refused.value))


def test_tp1_through_every_entry_point_is_the_plain_model(tp1_model: ReferenceModel) -> None:
    prompt = PROMPTS["c"]
    expected = tp1_model.next_token_logits(prompt)
    for model in (
        ReferenceModel.for_rank(SPEC, tp=1, rank=0, group=None),
        build_model_impl(SPEC, model_impl="reference", seed=0, device="cpu"),
        build_model_impl(SPEC, model_impl="reference", seed=0, device="cpu", tp=1, rank=0, group=None),
    ):
        assert model.spec == SPEC
        assert torch.equal(model.next_token_logits(prompt), expected)  # bit for bit: one code path


def test_the_selection_builds_each_implementation_for_its_rank() -> None:
    rank_shard = shard(SPEC, 2, 1)
    cache = build_model_impl(SPEC, model_impl="synthetic", seed=0, device="cpu", tp=2, rank=1)
    assert cache.pattern.shard == rank_shard  # writes and verifies rank 1's shard, no group needed
    with pytest.raises(TpGroupMismatch) as refused:
        build_model_impl(SPEC, model_impl="reference", seed=0, device="cpu", tp=2, rank=1)
    assert (refused.value.tp, refused.value.group_size) == (2, None)
    with pytest.raises(ImplCannotRun) as refused:
        build_model_impl(SPEC, model_impl="transformers", seed=0, device="cpu", tp=2, rank=0)
    assert (refused.value.impl, refused.value.source) == ("transformers", SPEC.source)


class _GroupOf:
    """Stands in for a process group where only its size and rank are read (nothing is reduced)."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def test_a_group_that_is_not_the_tp_group_is_refused() -> None:
    for tp, group in ((2, _GroupOf(4, 1)), (2, _GroupOf(2, 0)), (1, _GroupOf(2, 1))):
        with pytest.raises(TpGroupMismatch) as refused:
            ReferenceModel.for_rank(SPEC, tp=tp, rank=tp - 1, group=group)
        facts = (refused.value.tp, refused.value.rank, refused.value.group_size, refused.value.group_rank)
        assert facts == (tp, tp - 1, group.size(), group.rank())


def test_an_mlp_width_the_ranks_cannot_split_is_refused_with_its_facts() -> None:
    spec = dataclasses.replace(SPEC, intermediate_size=66)  # the cached tensors still shard at TP 4
    with pytest.raises(TpSplitUneven) as refused:
        ReferenceModel.for_rank(spec, tp=4, rank=0, group=_GroupOf(4, 0))
    assert (refused.value.tp, refused.value.count, refused.value.unit) == (
        4,
        66,
        "MLP channels (intermediate_size)",
    )
