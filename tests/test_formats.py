"""Stanford ColBERT and PyLate checkpoints in (evaluation and init_from) and out (our ColBERT export).

Every checkpoint is written as the peer writes it (``tests/peer_layouts.py``, no ``hil`` code) from the shared tiny
BERT, and ``hil``'s scores are compared with a reference that re-does the peer's own tokenization, projection,
normalization and MaxSim from those files.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from hil.errors import MissingInputError, UserError
from hil.modeling.encoder import ColBERTEncoder
from hil.modeling.export import export_model
from hil.modeling.formats import ModelFormatError, model_layout
from hil.modeling.hil import HILEncoder
from hil.modeling.initial_weights import initial_state
from hil.modeling.loading import load_encoder

from peer_layouts import pylate_reference, stanford_reference, write_pylate, write_stanford

pytestmark = pytest.mark.integration
QUERIES = ["what is the capital of france?", "do vaccines cause autism, really"]
DOCS = ["Paris is the capital of France.", "Vaccines do not cause autism; many studies, e.g. (a), show it!",
        "short", "a much longer document about the geography of europe and its many capitals, rivers and hills"]


def ours(encoder) -> torch.Tensor:
    tokenizer = encoder.tokenizer
    with torch.no_grad():
        return encoder.score(encoder.encode(tokenizer.encode_queries(QUERIES), True),
                             encoder.encode(tokenizer.encode_documents(DOCS), False))


def assert_scores_match(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert torch.allclose(a, b, rtol=0, atol=1e-5), (a - b).abs().max()


@pytest.fixture(scope="module")
def backbone(shared_dir):
    return str(shared_dir / "models" / "bert-tiny-splade")


@pytest.mark.parametrize("metadata", [{}, {"attend_to_mask_tokens": True, "mask_punctuation": False,
                                           "query_maxlen": 8, "doc_maxlen": 16}])
def test_stanford_checkpoint_scores_as_stanford_colbert(tmp_path, backbone, metadata):
    folder = write_stanford(tmp_path / "st", backbone, metadata=metadata)
    assert model_layout(folder) == "stanford"
    encoder = load_encoder(folder)
    settings = encoder.settings()
    assert settings["query_maxlen"] == metadata.get("query_maxlen", 12)
    assert settings["doc_maxlen"] == metadata.get("doc_maxlen", 40)
    assert settings["attend_to_mask_tokens"] == metadata.get("attend_to_mask_tokens", False)
    assert settings["mask_punctuation"] == metadata.get("mask_punctuation", True)
    assert settings["query_marker"] == "[unused0]" and settings["dim"] == 24
    assert_scores_match(ours(encoder), stanford_reference(folder, QUERIES, DOCS))


def test_stanford_without_metadata_takes_stanford_defaults_and_says_so(tmp_path, backbone, caplog):
    folder = write_stanford(tmp_path / "st", backbone, with_metadata=False)
    with caplog.at_level(logging.WARNING):
        encoder = load_encoder(folder)
    assert "no artifact.metadata" in caplog.text
    assert (encoder.settings()["doc_maxlen"], encoder.settings()["query_maxlen"]) == (220, 32)


@pytest.mark.parametrize("bias,settings", [(False, {}), (True, {"attend_to_expansion_tokens": True}),
                                           (False, {"skiplist_words": [], "query_length": 10})])
def test_pylate_checkpoint_scores_as_pylate(tmp_path, backbone, bias, settings):
    folder = write_pylate(tmp_path / "pl", backbone, bias=bias, settings=settings)
    assert model_layout(folder) == "pylate"
    encoder = load_encoder(folder)
    assert encoder.settings()["query_marker"] == "[Q] " and encoder.projection_bias == bias
    assert encoder.settings()["mask_punctuation"] == bool(settings.get("skiplist_words", True))
    assert_scores_match(ours(encoder), pylate_reference(folder, QUERIES, DOCS))


def test_pylate_dense_layers_fold_into_one_projection(tmp_path, backbone):
    folder = write_pylate(tmp_path / "pl", backbone, dense=[{"out_features": 40, "bias": True}, {"bias": True}])
    assert_scores_match(ours(load_encoder(folder)), pylate_reference(folder, QUERIES, DOCS))


def _edit_json(path, **changes):
    record = json.loads(path.read_text())
    record.update(changes)
    path.write_text(json.dumps(record))


@pytest.mark.parametrize("edit,words", [
    (lambda f: _edit_json(f / "1_Dense" / "config.json", activation_function="torch.nn.modules.activation.Tanh"),
     ["1_Dense/config.json", "activation_function", "Tanh"]),
    (lambda f: _edit_json(f / "1_Dense" / "config.json", use_residual=True), ["1_Dense/config.json", "use_residual"]),
    (lambda f: _edit_json(f / "config_sentence_transformers.json", do_query_expansion=False),
     ["config_sentence_transformers.json", "do_query_expansion"]),
    (lambda f: _edit_json(f / "config_sentence_transformers.json", skiplist_words=["the"]),
     ["config_sentence_transformers.json", "skiplist_words"]),
    (lambda f: _edit_json(f / "config_sentence_transformers.json", query_prefix=""),
     ["config_sentence_transformers.json", "query_prefix"]),
    (lambda f: (f / "1_Dense" / "model.safetensors").unlink(), ["1_Dense", "no weights"]),
    (lambda f: _edit_json(f / "1_Dense" / "config.json", out_features=7), ["linear.weight is (24, 128)", "(7, 128)"]),
])
def test_pylate_what_cannot_be_represented_is_refused(tmp_path, backbone, edit, words):
    folder = write_pylate(tmp_path / "pl", backbone)
    edit(folder)
    with pytest.raises(ModelFormatError) as error:
        load_encoder(folder)
    assert all(word in str(error.value) for word in words), str(error.value)


@pytest.mark.parametrize("metadata,words", [({"similarity": "l2"}, ["artifact.metadata", "similarity", "l2"]),
                                            ({"dim": 32}, ["artifact.metadata", "dim 32", "24"])])
def test_stanford_settings_that_do_not_fit_are_refused(tmp_path, backbone, metadata, words):
    folder = write_stanford(tmp_path / "st", backbone, metadata=metadata)
    with pytest.raises(ModelFormatError) as error:
        load_encoder(folder)
    assert all(word in str(error.value) for word in words), str(error.value)


def drop_tensor(folder, key: str) -> None:
    """Rewrite ``folder``'s weights without ``key``."""
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    del state[key]
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_a_colbert_folder_whose_head_cannot_be_read_is_an_error_not_a_random_head(tmp_path, backbone):
    """``artifact.metadata`` says ColBERT, but the weights have no ``linear.weight``: never a silent random head."""
    folder = write_stanford(tmp_path / "st", backbone)
    drop_tensor(folder, "linear.weight")
    with pytest.raises(ModelFormatError, match="linear.weight"):
        load_encoder(folder)


def test_a_backbone_missing_weights_is_refused(tmp_path, backbone):
    folder = write_stanford(tmp_path / "st", backbone)
    drop_tensor(folder, "bert.encoder.layer.1.output.dense.weight")
    with pytest.raises(UserError, match="lack 1 tensors"):
        load_encoder(folder)


def test_plain_backbone_gets_a_random_head_with_a_notice(tmp_path, backbone, shared_dir, caplog):
    with caplog.at_level(logging.WARNING):
        load_encoder(backbone, dim=16)
    assert "untrained (random, dim 16)" in caplog.text
    # A sentence-transformers bi-encoder (Pooling, no ColBERT settings) is a backbone too.
    folder = tmp_path / "st-bi"
    import shutil

    shutil.copytree(shared_dir / "models" / "all-MiniLM-L6-v2", folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    assert model_layout(folder) == "sentence-transformers"
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_encoder(folder)
    assert "sentence-transformers model without a ColBERT head" in caplog.text


def test_what_is_no_model_is_one_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFormatError, match="not a model folder"):
        load_encoder(tmp_path / "empty")
    with pytest.raises(MissingInputError, match="no such model folder"):
        load_encoder(str(tmp_path / "missing" / "model"))
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelFormatError, match="not a Lightning .ckpt"):
        load_encoder(tmp_path / "notes.txt")
    (tmp_path / "broken.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(ModelFormatError, match="not a readable PyTorch checkpoint"):
        load_encoder(tmp_path / "broken.ckpt")


def test_colbert_export_is_a_stanford_checkpoint_that_reimports_identically(tmp_path, backbone):
    torch.manual_seed(3)
    encoder = ColBERTEncoder(backbone, dim=24, query_maxlen=12, doc_maxlen=40, attend_to_mask_tokens=True).eval()
    expected = ours(encoder)
    folder = export_model(encoder, tmp_path / "export")
    metadata = json.loads((folder / "artifact.metadata").read_text())
    assert metadata["attend_to_mask_tokens"] is True and metadata["doc_maxlen"] == 40
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["HF_ColBERT"]
    assert torch.equal(ours(load_encoder(folder)), expected)
    assert torch.equal(ours(load_encoder(folder, layout="stanford")), expected)
    assert_scores_match(stanford_reference(folder, QUERIES, DOCS), expected)  # read the Stanford way, by hand


def test_hil_export_keeps_its_own_layout_only(tmp_path, backbone):
    encoder = HILEncoder(backbone, dim=16, query_maxlen=12, doc_maxlen=40)
    encoder.set_idf_from_texts(DOCS)
    folder = export_model(encoder, tmp_path / "export")
    assert not (folder / "artifact.metadata").exists()
    assert json.loads((folder / "hil_config.json").read_text())["layouts"] == ["hil"]
    assert torch.equal(ours(load_encoder(folder)), ours(encoder.eval()))


def test_init_from_a_stanford_checkpoint_seeds_colbert_and_the_hil_h_head(tmp_path, backbone):
    folder = write_stanford(tmp_path / "st", backbone)
    peer = load_encoder(folder)
    colbert = ColBERTEncoder(backbone, dim=24, query_maxlen=12, doc_maxlen=40)
    state, may_stay = initial_state(colbert, str(folder))
    colbert.load_state_dict(state, strict=True)
    assert not may_stay
    assert torch.equal(colbert.linear.weight, peer.linear.weight)
    assert_scores_match(ours(colbert.eval()), ours(peer))
    hil_model = HILEncoder(backbone, dim=24, query_maxlen=12, doc_maxlen=40)
    lexical = hil_model.linear_L.weight.detach().clone()
    state, may_stay = initial_state(hil_model, str(folder))
    missing, unexpected = hil_model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) == may_stay and "linear_L.weight" in may_stay
    assert torch.equal(hil_model.linear_H.weight, peer.linear.weight)
    assert torch.equal(hil_model.linear_L.weight, lexical)
    assert torch.equal(hil_model.backbone.embeddings.word_embeddings.weight,
                       peer.backbone.embeddings.word_embeddings.weight)


def test_init_from_refuses_other_marker_tokens(tmp_path, backbone):
    folder = write_stanford(tmp_path / "st", backbone, metadata={"query_token_id": "[unused2]"})
    colbert = ColBERTEncoder(backbone, dim=24)
    with pytest.raises(ModelFormatError, match=r"model.encoder.init_args.query_marker is '\[unused0\]'"):
        initial_state(colbert, str(folder))


def test_stanford_export_keeps_every_non_default_setting(tmp_path, backbone):
    """Issue 24: a ColBERT with mask_punctuation False (and every other setting off its default) exported and read
    back through its Stanford files alone keeps each setting and its scores; the punctuation setting does move
    these documents' scores, so writing Stanford's default instead could not pass."""
    import shutil

    torch.manual_seed(5)
    settings = {"dim": 20, "query_maxlen": 10, "doc_maxlen": 30, "mask_punctuation": False,
                "attend_to_mask_tokens": True}
    encoder = ColBERTEncoder(backbone, **settings).eval()
    expected = ours(encoder)
    masked = ColBERTEncoder(backbone, **{**settings, "mask_punctuation": True}).eval()
    masked.load_state_dict(encoder.state_dict())
    assert (ours(masked) - expected).abs().max() > 1e-3, "the documents' punctuation must matter"

    folder = export_model(encoder, tmp_path / "export")
    metadata = json.loads((folder / "artifact.metadata").read_text())
    assert {key: metadata[key] for key in settings} == settings
    stanford_only = tmp_path / "stanford-only"
    shutil.copytree(folder, stanford_only)
    for ours_only in ("hil_config.json", "hil_heads.pt"):
        (stanford_only / ours_only).unlink()
    assert model_layout(stanford_only) == "stanford"
    wanted = {key: value for key, value in encoder.settings().items() if key != "backbone"}
    for reimported in (load_encoder(folder, layout="stanford"), load_encoder(stanford_only)):
        assert {key: value for key, value in reimported.settings().items() if key != "backbone"} == wanted
        assert torch.equal(ours(reimported), expected)
    assert_scores_match(stanford_reference(stanford_only, QUERIES, DOCS), expected)  # read the Stanford way, by hand
