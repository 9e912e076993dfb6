"""The byte-level tokenizer and the model card the front end's tests serve."""

from __future__ import annotations

import pytest

from distpool.api.engine import ModelCard
from distpool.api.request.tokenizer import ApiTokenizer, load_tokenizer
from tests.api.byte_tokenizer import EOS_ID, VOCAB_SIZE, save_byte_tokenizer


@pytest.fixture(scope="session")
def byte_tokenizer_folder(tmp_path_factory):
    return save_byte_tokenizer(tmp_path_factory.mktemp("byte_tokenizer"))


@pytest.fixture(scope="session")
def plain_tokenizer_folder(tmp_path_factory):
    """The same tokenizer without a chat template."""
    return save_byte_tokenizer(tmp_path_factory.mktemp("plain_tokenizer"), chat_template=False)


@pytest.fixture(scope="session")
def byte_tokenizer(byte_tokenizer_folder) -> ApiTokenizer:
    return load_tokenizer(str(byte_tokenizer_folder))


@pytest.fixture
def card(byte_tokenizer_folder) -> ModelCard:
    return ModelCard(
        served_name="tiny-bytes",
        context_len=64,
        vocab_size=VOCAB_SIZE,
        eos_token_ids=(EOS_ID,),
        tokenizer_folder=str(byte_tokenizer_folder),
    )
