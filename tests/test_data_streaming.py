"""Streaming a large dataset (`DataArguments.stream_documents`): only its first N documents are read, once."""

import json
import shutil

import pytest
from helpers import write_documents

from hf_linear_attn.configuration_linear_attention import InputError
from hf_linear_attn.training.data import (
    DataArguments,
    build_datasets,
    byte_level_tokenizer,
    check_data_arguments,
    load_documents,
)


def test_streaming_keeps_the_first_documents_and_reads_them_once(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    lines = write_documents(corpus / "docs.jsonl", count=60).read_text().splitlines()
    texts = [json.loads(line)["text"] for line in lines]
    args = DataArguments(dataset_name=str(corpus), stream_documents=40, block_size=16,
                         cache_dir=str(tmp_path / "cache"))
    documents = load_documents(args)
    assert len(documents["train"]) + len(documents["validation"]) == 40
    assert sorted([*documents["train"]["text"], *documents["validation"]["text"]]) == sorted(texts[:40])
    rows = build_datasets(args, byte_level_tokenizer())
    assert len(rows["train"]) > 0 and len(rows["validation"]) > 0

    shutil.rmtree(corpus)  # a later stage with the same arguments reads the cache and streams nothing
    again = load_documents(args)
    assert list(again["train"]["text"]) == list(documents["train"]["text"])
    assert list(again["validation"]["text"]) == list(documents["validation"]["text"])


@pytest.mark.parametrize("changes, message", [
    ({"stream_documents": 5}, "--stream_documents 5: streams --dataset_name"),
    ({"stream_documents": -1, "dataset_name": "corpus"}, "--stream_documents -1"),
], ids=["no dataset", "negative"])
def test_bad_streaming_arguments_are_refused_before_anything_is_read(changes, message):
    with pytest.raises(InputError, match=message):
        check_data_arguments(DataArguments(**changes))


def test_a_streamed_dataset_without_the_text_column_names_its_columns(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "docs.jsonl").write_text('{"body": "one"}\n{"body": "two"}\n')
    args = DataArguments(dataset_name=str(corpus), stream_documents=2, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(InputError, match=r"--text_column 'text' is not a column .*; its columns are \['body'\]"):
        load_documents(args)
