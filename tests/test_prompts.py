"""The shared prompt-file readers (mmrl.prompts), used by the flow and dllm plugins."""

from __future__ import annotations

import pytest

from mmrl.prompts import iter_jsonl, read_jsonl_prompts, read_prompt_file


def test_jsonl_rows_keep_their_keys_and_skip_blank_lines(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "two cats", "count": 2}\n\n{"prompt": "a dog", "solution": "1"}\n')
    assert read_jsonl_prompts(path) == [{"prompt": "two cats", "count": 2}, {"prompt": "a dog", "solution": "1"}]
    assert read_prompt_file(path) == read_jsonl_prompts(path)


def test_text_files_give_one_stripped_prompt_per_non_blank_line(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("  a cat \n\na dog\n")
    assert read_prompt_file(path) == [{"prompt": "a cat"}, {"prompt": "a dog"}]


@pytest.mark.parametrize(("text", "message"), [
    ('{"prompt": "ok"}\n{"text": "no prompt"}\n', r"p.jsonl line 2: expected a JSON object with a 'prompt' string$"),
    ('["a list"]\n', r"line 1: expected a JSON object"),
    ('{"prompt": 3}\n', r"line 1: expected a JSON object with a 'prompt' string"),
    ('{"prompt": "ok"}\n{"prompt": \n', r"p.jsonl line 2: not valid JSON \(Expecting value at column 12\)$"),
])
def test_malformed_jsonl_is_one_line_naming_file_and_line(tmp_path, text, message):
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        read_jsonl_prompts(path)
    assert "\n" not in str(info.value)


def test_a_missing_file_names_its_path(tmp_path):
    for read in (read_jsonl_prompts, read_prompt_file):
        with pytest.raises(FileNotFoundError, match="no prompt file at .*missing"):
            read(tmp_path / "missing.jsonl")
    with pytest.raises(FileNotFoundError, match="no prompt file at"):
        read_prompt_file(tmp_path / "missing.txt")


def test_iter_jsonl_is_the_one_reader_raising_the_callers_error_class(tmp_path):
    from mmrl.plugins.vlm.data import DataError, read_records

    path = tmp_path / "d.jsonl"
    path.write_text('{"a": 1}\n\n[2]\n')
    assert list(iter_jsonl(path)) == [(f"{path} line 1", {"a": 1}), (f"{path} line 3", [2])]
    path.write_text('{"a": 1}\n{"a": \n')
    with pytest.raises(DataError, match=r"d.jsonl line 2: not valid JSON \(Expecting value at column 7\)$"):
        list(iter_jsonl(path, error=DataError))
    with pytest.raises(DataError, match=r"d.jsonl line 2: not valid JSON"):  # the VLM plugin's records reader
        read_records(path)


def test_chat_template_kwargs_are_template_variables():
    from mmrl.config import ConfigError
    from mmrl.prompts import RESERVED_CHAT_TEMPLATE_KEYS, check_chat_template_kwargs

    check_chat_template_kwargs({}, "plugin.chat_template_kwargs")
    check_chat_template_kwargs({"enable_thinking": False, "chat_template": "{{ x }}"}, "plugin.chat_template_kwargs")
    for key in RESERVED_CHAT_TEMPLATE_KEYS:
        with pytest.raises(ConfigError, match=f"plugin.chat_template_kwargs.{key}.*the plugin sets those"):
            check_chat_template_kwargs({"enable_thinking": True, key: 1}, "plugin.chat_template_kwargs")
    for bad in ([("enable_thinking", False)], {1: True}, "enable_thinking"):
        with pytest.raises(ConfigError, match="a mapping of chat-template variable names"):
            check_chat_template_kwargs(bad, "plugin.chat_template_kwargs")
