import string

import pytest
import torch

from hil.data.tokenization import ColBERTTokenizer, MarkerTokenError


@pytest.fixture
def tok(hf_tokenizer):
    return ColBERTTokenizer(hf_tokenizer, query_maxlen=10, doc_maxlen=12)


def test_query_markers_and_mask_padding(tok, hf_tokenizer):
    batch = tok.encode_queries(["what is a cat", ""])
    cls, sep, mask = hf_tokenizer.cls_token_id, hf_tokenizer.sep_token_id, hf_tokenizer.mask_token_id
    q_marker = hf_tokenizer.convert_tokens_to_ids("[unused0]")
    body = hf_tokenizer.encode("what is a cat", add_special_tokens=False)
    expected = [cls, q_marker, *body, sep] + [mask] * (10 - len(body) - 3)
    assert batch.input_ids[0].tolist() == expected
    assert batch.input_ids.shape == (2, 10)
    n_real = len(body) + 3
    assert batch.attention_mask[0].tolist() == [1] * n_real + [0] * (10 - n_real), "[MASK] padding not attended (v1)"
    assert batch.attention_mask[1].tolist() == [1, 1, 1] + [0] * 7
    assert batch.scoring_mask.all(), "but scored"
    attending = ColBERTTokenizer(hf_tokenizer, query_maxlen=10, doc_maxlen=12, attend_to_mask_tokens=True)
    assert attending.encode_queries(["what is a cat"]).attention_mask.all()
    # A query that tokenizes to nothing is still [CLS] [Q] [SEP] + [MASK]s, not an error.
    assert batch.input_ids[1, :3].tolist() == [cls, q_marker, sep]
    assert (batch.input_ids[1, 3:] == mask).all()


def test_long_query_is_truncated_to_query_maxlen(tok, hf_tokenizer):
    batch = tok.encode_queries(["word " * 50])
    assert batch.input_ids.shape == (1, 10)
    assert batch.input_ids[0, -1].item() == hf_tokenizer.sep_token_id


def test_document_markers_truncation_padding(tok, hf_tokenizer):
    batch = tok.encode_documents(["alpha beta " * 40, "short"])
    d_marker = hf_tokenizer.convert_tokens_to_ids("[unused1]")
    assert batch.input_ids.shape == (2, 12), "truncated to doc_maxlen, padded to the longest"
    assert batch.input_ids[0, 1].item() == d_marker and batch.input_ids[0, -1].item() == hf_tokenizer.sep_token_id
    short_len = len(hf_tokenizer.encode("short", add_special_tokens=False)) + 3
    assert batch.attention_mask[1].sum().item() == short_len
    assert (batch.input_ids[1, short_len:] == hf_tokenizer.pad_token_id).all()
    assert not batch.scoring_mask[1, short_len:].any()


def test_punctuation_is_masked_from_scoring_only(tok, hf_tokenizer):
    batch = tok.encode_documents(["cats, dogs; and birds!"])
    tokens = hf_tokenizer.convert_ids_to_tokens(batch.input_ids[0].tolist())
    for token, attended, scored in zip(tokens, batch.attention_mask[0].tolist(), batch.scoring_mask[0].tolist()):
        assert attended == 1
        assert scored == (token not in set(string.punctuation))
    assert (~batch.scoring_mask[0]).sum().item() == 3


def test_empty_and_all_punctuation_documents(tok):
    batch = tok.encode_documents(["", "!!! ... ???"])
    assert batch.scoring_mask[:, :2].all(), "[CLS] and [D] stay scorable, so no document is empty"
    assert batch.scoring_mask.sum(dim=1).tolist() == [3, 3]  # [CLS] [D] [SEP]


def test_no_punctuation_masking_option(hf_tokenizer):
    tok = ColBERTTokenizer(hf_tokenizer, 8, 12, mask_punctuation=False)
    batch = tok.encode_documents(["a, b"])
    assert torch.equal(batch.scoring_mask, batch.attention_mask.bool())


def test_missing_marker_token_is_a_clear_error(hf_tokenizer):
    with pytest.raises(MarkerTokenError, match="query_marker"):
        ColBERTTokenizer(hf_tokenizer, query_marker="[no-such-token]")
