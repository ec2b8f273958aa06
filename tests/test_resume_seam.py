"""Unit tests: the seam of a resume (workers/engine/resume.py): text, hold-back and stop strings
across the checkpoint, and the rules that refuse a resume where it would be unsound."""
from __future__ import annotations

import pytest

from app.requests.adapters import files_fingerprint
from app.state.streams import Checkpoint
from workers.engine.resume import Seam, refusal


def char_decoder(table: dict[int, str]):
    """A decoder where token t is the text table[t] (None: an incomplete character)."""
    return lambda prompt: (lambda t: table.get(t))


TABLE = {1: "a", 2: "b", 3: "c", 4: "d", 5: "e", 6: "f", 7: "g", 8: "h", 9: None, 10: "é"}


def test_the_seam_releases_the_held_back_text_first_then_holds_back_as_vllm_does():
    # Tokens 1 2 3 decode to "abc"; vLLM released "a" (it held back 2 chars for a 3-char stop).
    seam = Seam(Checkpoint([0], [1, 2, 3], "a", "", []), ["xyz"], char_decoder(TABLE))
    assert seam.feed([4]) == ("b", None)  # "abcd": all but the last 2 characters out
    assert seam.feed([5]) == ("c", None)
    assert seam.finish() == "de" and seam.text == "abcde"


def test_a_stop_string_across_the_seam_ends_the_run_where_an_unbroken_run_ends():
    # "abc" made, "a" released; stop "cde" begins in the held-back "bc" and ends 2 tokens on.
    seam = Seam(Checkpoint([0], [1, 2, 3], "a", "", []), ["cde", "zz"], char_decoder(TABLE))
    assert seam.feed([4]) == ("b", None)  # "abcd": all but the last 2 characters out
    released, cut = seam.feed([5, 6])
    assert released == "" and cut.tokens == 2 and cut.stop == "cde" and cut.text == "ab"


def test_the_earliest_ending_stop_string_wins():
    seam = Seam(Checkpoint([0], [1], "", "", []), ["bcd", "bc"], char_decoder(TABLE))
    released, cut = seam.feed([2, 3, 4])
    assert cut.stop == "bc" and cut.tokens == 2 and cut.text == "a"


def test_stop_strings_wait_for_min_tokens_across_the_seam():
    """vLLM checks stop strings only in the text of tokens past `min_tokens` (counting every
    generated token, the checkpoint's too): "abc" made (3 tokens), min_tokens 5, stop "d" and
    "ef": the "d" of token 4 is inside min_tokens and does not stop the run; "ef", which begins
    in token 5 and ends in token 6, the first past min_tokens, does (issue 38, item 2)."""
    seam = Seam(Checkpoint([0], [1, 2, 3], "a", "", []), ["d", "ef"], char_decoder(TABLE),
                min_tokens=5)
    released, cut = seam.feed([4, 5])
    assert cut is None
    released, cut = seam.feed([6, 7])
    assert cut is not None and (cut.tokens, cut.stop, cut.text) == (3, "ef", "abcd")


def test_the_token_that_stopped_the_run_adds_no_text():
    """A run that ends on a stop token (EOS or stop_token_ids) keeps the token but not its
    text, as vLLM's detokenizer skips it, unless include_stop_str_in_output (issue 38, item
    3)."""
    seam = Seam(Checkpoint([0], [1, 2], "ab", "", []), None, char_decoder(TABLE))
    assert seam.feed([3, 4], stop_terminated=True) == ("c", None)
    assert seam.finish() == "" and seam.text == "abc" and seam.new_tokens == 2
    kept = Seam(Checkpoint([0], [1, 2], "ab", "", []), None, char_decoder(TABLE),
                include_stop=True)
    kept.feed([3, 4], stop_terminated=True)
    assert kept.finish() == "" and kept.text == "abcd"


def test_a_character_split_at_the_checkpoint_comes_out_whole():
    """The checkpoint ends inside a character (token 9 decodes to nothing on its own): the next
    token completes it, and the text is the uninterrupted run's."""
    seam = Seam(Checkpoint([0], [1, 9], "a", "", []), None, char_decoder(TABLE))
    assert seam.text == "a"
    assert seam.feed([10, 2]) == ("éb", None)


def test_a_stream_whose_text_is_not_its_tokens_decoding_is_refused():
    with pytest.raises(ValueError):
        Seam(Checkpoint([0], [1, 2], "xy", "", []), None, char_decoder(TABLE))


def test_a_split_character_in_a_real_tokenizer_decodes_as_one_uninterrupted_run():
    """With a byte-level tokenizer (tokenizers' own, trained here: no model hub), a resume
    whose checkpoint ends in the middle of a multi-byte character gives the same text as a
    decode of the whole generation."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from workers.engine.resume import fast_decoder

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["plain words only"] * 10, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    prompt = tok.encode("plain ").ids
    gen = tok.encode("words éè 中文 only").ids
    whole = tok.decode(gen)
    split = [i for i in range(1, len(gen)) if "�" in tok.decode(gen[:i])]
    assert split, "no token boundary inside a character in this sample"
    for i in split:
        step = fast_decoder(tok)(prompt)
        released = "".join(step(t) or "" for t in gen[:i])
        seam = Seam(Checkpoint(prompt, gen[:i], released, "", []), None, fast_decoder(tok))
        out, cut = seam.feed(gen[i:])
        assert cut is None and released + out + seam.finish() == whole == seam.text


def test_resume_is_refused_where_it_would_be_unsound():
    cp = Checkpoint([1] * 10, [2] * 5, "hello", "fp", [])
    ok = dict(max_tokens=20, max_model_len=64, adapter_fingerprint="fp")
    assert refusal(cp, **ok) == ""
    assert refusal(cp, **{**ok, "max_model_len": 16}) == ""  # capped by the context: resumable
    assert "LoRA adapter" in refusal(cp, **{**ok, "adapter_fingerprint": "other"})
    assert "context" in refusal(cp, **{**ok, "max_model_len": 15})
    assert "prompt" in refusal(Checkpoint(None, [2], "h", "fp", []), **ok)
    assert "max_tokens" in refusal(cp, **{**ok, "max_tokens": 4})


def test_an_adapters_fingerprint_changes_when_its_files_are_rewritten(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.safetensors").write_bytes(b"1234")
    before = files_fingerprint(str(tmp_path))
    assert before == files_fingerprint(str(tmp_path))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"12345")
    assert files_fingerprint(str(tmp_path)) != before
    assert files_fingerprint(str(tmp_path / "missing")) == ""
