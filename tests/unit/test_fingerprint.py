"""Pure tests of pd_connector.core.fingerprint: the handoff's prompt fingerprint."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pd_connector.core.fingerprint import TOKENS, blocks_form, extra_keys, form_of, fingerprint, token_fold

tokens = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=300)


def test_token_fold_is_cpythons_64_bit_tuple_hash_known_answer():
    """P and D must fold alike: a Python whose tuple or int hash changed would refuse every
    handoff (loudly); this pins the values so such a change shows in CI first."""
    assert token_fold([1, 2, 3], 0, 3) == 529344067295497451
    assert token_fold(list(range(10)), 0, 10) == -2040549277248155741
    assert fingerprint([1, 2, 3], 3) == "2:t:19828adde58a0a397d3a68012ea17cb8"


@settings(max_examples=300, deadline=None)
@given(tokens, st.data())
def test_any_single_changed_token_changes_the_fingerprint(prompt, data):
    i = data.draw(st.integers(0, len(prompt) - 1), label="position")
    new = data.draw(st.integers(0, 2**31 - 1).filter(lambda t: t != prompt[i]), label="token")
    other = prompt[:i] + [new] + prompt[i + 1 :]
    assert fingerprint(prompt, len(prompt)) != fingerprint(other, len(other))


@settings(max_examples=200, deadline=None)
@given(tokens, st.data())
def test_only_the_first_length_tokens_count(prompt, data):
    length = data.draw(st.integers(1, len(prompt)), label="length")
    tail = data.draw(st.lists(st.integers(0, 10**6), max_size=5), label="tail")
    assert fingerprint(prompt, length) == fingerprint(prompt[:length] + tail, length)
    if length > 1:
        assert fingerprint(prompt, length) != fingerprint(prompt, length - 1)


def test_blocks_form_hashes_the_chain_and_folds_only_the_tail():
    prompt = list(range(100, 140))
    form = blocks_form("sha256", 16, "abcd")
    base = fingerprint(prompt, 39, form=form, chain=b"x" * 32, chain_tokens=32)
    assert base.startswith("2:b:sha256:16:abcd:") and form_of(base) == form
    # Another chain (a change in the first 32 tokens, as vLLM's block hash sees it).
    assert fingerprint(prompt, 39, form=form, chain=b"y" * 32, chain_tokens=32) != base
    # A change in the tail; a change in the chained tokens alone is the chain's to see.
    assert fingerprint(prompt[:35] + [1] + prompt[36:], 39, form=form, chain=b"x" * 32, chain_tokens=32) != base
    assert fingerprint([0] * 32 + prompt[32:], 39, form=form, chain=b"x" * 32, chain_tokens=32) == base
    # The same tokens in the other form never compare equal.
    assert fingerprint(prompt, 39) != base and form_of(fingerprint(prompt, 39)) == TOKENS


def test_extra_keys_distinguish_adapter_salt_and_multimodal_items():
    prompt = list(range(50))
    plain = fingerprint(prompt, 40)
    variants = [
        extra_keys(lora_name="sql"),
        extra_keys(lora_name="sql", lora_files="files:aa"),
        extra_keys(lora_name="sql", lora_files="files:bb"),
        extra_keys(lora_name="chat", lora_files="files:aa"),
        extra_keys(cache_salt="tenant-a"),
        extra_keys([("img-1", 3, 10)], length=40),
        extra_keys([("img-1", 4, 10)], length=40),
        extra_keys([("img-2", 3, 10)], length=40),
    ]
    digests = {fingerprint(prompt, 40, keys) for keys in variants}
    assert len(digests) == len(variants) and plain not in digests
    assert extra_keys([("img-1", 40, 10)], length=40) == ()  # placed after R: D computes it


def test_form_of_reads_only_our_fingerprints():
    assert form_of("2:t:" + "0" * 32) == TOKENS
    assert form_of("2:b:sha256_cbor:32:0a0b0c0d:" + "0" * 32) == "b:sha256_cbor:32:0a0b0c0d"
    for other in ("", "abc", "1:t:" + "0" * 32, "3:t:00", "2:"):
        assert form_of(other) == ""


def test_blocks_form_parses_back_and_other_forms_do_not():
    from pd_connector.core.fingerprint import TOKENS, blocks_form, parse_blocks_form

    assert parse_blocks_form(blocks_form("sha256", 384, "2bdd5f16")) == ("sha256", 384, "2bdd5f16")
    assert parse_blocks_form(TOKENS) is None
    assert parse_blocks_form("b:sha256:0:tag") is None and parse_blocks_form("b:sha256:x:tag") is None
