"""Issue 22 (7): the encoder settings have one typed home (``hil.modeling.encoder_settings``) and nothing else moved.

- the defaults are ColBERT v1's, and the paper's for ColBERT-HIL (literal values, written from the sources);
- the constructors take the fields as before (by keyword, and positionally in the old order); every tokenizer field
  reaches the tokenizer (checked on the tokens it produces);
- the LightningCLI lists every field as ``model.encoder.init_args.<field>``, in field order, type-checked;
- ``settings()`` and an export's ``hil_config.json`` hold the same keys, in the same order, with the same values as
  before the dataclass (literal dicts below); an export reloads to bit-identical scores and the same fingerprint,
  and a hand-written ``hil_config.json`` in the flat layout (also one older than ``attend_to_mask_tokens``) loads.
"""

from __future__ import annotations

import contextlib
import io
import json
import string
from dataclasses import FrozenInstanceError, fields, replace
from pathlib import Path

import docstring_parser
import pytest
import torch
import yaml

from hil.cli.train import train_main
from hil.errors import UserError
from hil.modeling.encoder import ColBERTEncoder
from hil.modeling.encoder_settings import ColBERTSettings, EncoderSettings, HILSettings
from hil.modeling.export import export_model
from hil.modeling.hil import HILEncoder
from hil.modeling.loading import load_encoder
from hil.retrieval.index import encoder_fingerprint

from conftest import random_bert

REPO = Path(__file__).resolve().parents[1]
QUERIES = ["what is a lexical head", "isotropy of token embeddings!"]
DOCS = ["A lexical head matches the same token.", "Embeddings, contextual or not, can be anisotropic.", "sleep"]

# ColBERT v1 (colbertv1 parser: --dim 128 --query_maxlen 32 --doc_maxlen 180, --mask-punctuation in its README's
# commands; [unused0] / [unused1] markers; [MASK] padding not attended; BERT init) on bert-base-uncased (HIL A.3).
COLBERT_V1 = {"backbone": "bert-base-uncased", "dim": 128, "query_maxlen": 32, "doc_maxlen": 180,
              "query_marker": "[unused0]", "doc_marker": "[unused1]", "mask_punctuation": True,
              "attend_to_mask_tokens": False, "head_init": "bert"}
HIL_PAPER = {"lexical_input": "word_embeddings", "idf_formula": "bm25", "lexical_query_tokens": "weighted",
             "zscore_std": "population", "zscore_eval": "running", "zscore_detach": [], "zscore_temperature": None,
             "zscore_momentum": 0.1, "zscore_eps": 1e-5, "idf_source": None}


def scores(encoder) -> torch.Tensor:
    encoder.eval()
    with torch.no_grad():
        return encoder.score(encoder.encode_queries(QUERIES), encoder.encode_documents(DOCS))


# -- the dataclasses ---------------------------------------------------------------------------------------------

def test_defaults_are_colbert_v1s_and_the_papers():
    assert EncoderSettings().as_settings() == COLBERT_V1
    assert list(ColBERTSettings().as_settings()) == list(COLBERT_V1)  # projection_bias recorded only when true
    assert ColBERTSettings(projection_bias=True).as_settings() == {**COLBERT_V1, "projection_bias": True}
    hil = HILSettings().as_settings()
    assert hil == {**COLBERT_V1, **HIL_PAPER} and list(hil) == [*COLBERT_V1, *HIL_PAPER]


def test_every_field_is_documented():
    """The docstrings' Attributes are the CLI's help: every field has one, and nothing else is listed."""
    shared = {f.name for f in fields(EncoderSettings)}
    for cls in (EncoderSettings, ColBERTSettings, HILSettings):
        own = {f.name for f in fields(cls)} - (shared if cls is not EncoderSettings else set())
        documented = {p.arg_name: p.description for p in docstring_parser.parse(cls.__doc__).params}
        assert set(documented) == own, cls
        assert all(len(text) > 20 for text in documented.values()), cls


@pytest.mark.parametrize("bad, field", [
    ({"head_init": "xavier"}, "head_init"), ({"dim": 0}, "dim"), ({"dim": 16.0}, "dim"), ({"dim": True}, "dim"),
    ({"query_maxlen": 3}, "query_maxlen"), ({"doc_maxlen": 2}, "doc_maxlen"), ({"query_marker": ""}, "query_marker"),
    ({"mask_punctuation": "yes"}, "mask_punctuation"), ({"attend_to_mask_tokens": 1}, "attend_to_mask_tokens"),
    ({"projection_bias": None}, "projection_bias"),
    ({"lexical_input": "tokens"}, "lexical_input"), ({"zscore_eval": "batch"}, "zscore_eval"),
    ({"zscore_detach": ["X"]}, "zscore_detach"), ({"zscore_detach": "L"}, "zscore_detach"),
    ({"zscore_temperature": 0.0}, "zscore_temperature"), ({"zscore_momentum": 0.0}, "zscore_momentum"),
    ({"zscore_momentum": 1.5}, "zscore_momentum"), ({"zscore_eps": 0.0}, "zscore_eps"),
    ({"idf_formula": "tfidf"}, "idf_formula")])
def test_a_bad_value_is_one_user_error_naming_it_before_any_backbone_loads(bad, field):
    encoder = ColBERTEncoder if field == "projection_bias" else HILEncoder
    with pytest.raises(UserError, match=field):  # "no/such/model" would be a loading error if it were reached
        encoder("no/such/model", **bad)


def test_settings_are_frozen_and_normalized():
    config = HILSettings(zscore_detach=["H", "L", "H"], zscore_temperature=2, zscore_momentum=1, zscore_eps=1)
    assert (config.zscore_detach, config.zscore_temperature, config.zscore_momentum, config.zscore_eps) == \
        (("L", "H"), 2.0, 1.0, 1.0)
    assert all(type(v) is float for v in (config.zscore_temperature, config.zscore_momentum, config.zscore_eps))
    with pytest.raises(FrozenInstanceError):
        config.dim = 64  # type: ignore[misc]


# -- the constructors ------------------------------------------------------------------------------------------

def test_constructors_take_the_fields_by_keyword_and_in_the_old_positional_order(hf_tokenizer):
    bert = random_bert()
    by_position = ColBERTEncoder("random-bert", 16, 12, 24, "[unused0]", "[unused1]", False, True, "torch", True,
                                 _loaded=(bert, hf_tokenizer))
    assert by_position.config == ColBERTSettings(backbone="random-bert", dim=16, query_maxlen=12, doc_maxlen=24,
                                                 mask_punctuation=False, attend_to_mask_tokens=True,
                                                 head_init="torch", projection_bias=True)
    assert by_position.linear.bias is not None and by_position.linear.out_features == 16
    hil = HILEncoder("random-bert", 8, 12, 24, "[unused0]", "[unused1]", True, False, "bert", "embedding_output",
                     "authors", "all", "unbiased", "per_query", ["H"], 0.5, 0.2, 1e-4, "label",
                     _loaded=(bert, hf_tokenizer))
    assert hil.config == HILSettings(backbone="random-bert", dim=8, query_maxlen=12, doc_maxlen=24,
                                     lexical_input="embedding_output", idf_formula="authors",
                                     lexical_query_tokens="all", zscore_std="unbiased", zscore_eval="per_query",
                                     zscore_detach=("H",), zscore_temperature=0.5, zscore_momentum=0.2,
                                     zscore_eps=1e-4, idf_source="label")
    assert hil.zscore["L"].momentum == 0.2 and hil.linear_L.out_features == hil.linear_H.out_features == 8
    # the attributes encoders had before ``config``, read from it
    assert (hil.dim, hil.backbone_name, hil.head_init, hil.zscore_detach, hil.zscore_eps) == (8, "random-bert",
                                                                                              "bert", ("H",), 1e-4)
    assert by_position.projection_bias is True
    with pytest.raises(TypeError):
        ColBERTEncoder("random-bert", nonsense=1, _loaded=(bert, hf_tokenizer))


def test_from_config_builds_the_same_encoder(hf_tokenizer):
    torch.manual_seed(0)
    encoder = HILEncoder("random-bert", dim=16, query_maxlen=12, doc_maxlen=24, zscore_detach=["L"],
                         _loaded=(random_bert(), hf_tokenizer))
    torch.manual_seed(0)
    again = HILEncoder.from_config(encoder.config, _loaded=(random_bert(), hf_tokenizer))
    assert again.config == encoder.config and again.settings() == encoder.settings()
    assert torch.equal(again.linear_L.weight, encoder.linear_L.weight)
    longer = ColBERTEncoder.from_config(replace(ColBERTSettings("random-bert", dim=16), query_maxlen=20),
                                        _loaded=(random_bert(), hf_tokenizer))
    assert longer.tokenizer.encode_queries(["a"]).input_ids.shape == (1, 20)
    with pytest.raises(TypeError, match="HILSettings"):
        HILEncoder.from_config(ColBERTSettings(), _loaded=(random_bert(), hf_tokenizer))


@pytest.mark.parametrize("encoder_class", [ColBERTEncoder, HILEncoder])
def test_every_tokenizer_field_reaches_the_tokenizer(encoder_class, hf_tokenizer):
    """Non-default values of every tokenizer field, checked on the tokens produced (not on what settings() says)."""
    asked = {"query_maxlen": 10, "doc_maxlen": 9, "query_marker": "[unused2]", "doc_marker": "[unused3]",
             "mask_punctuation": False, "attend_to_mask_tokens": True}
    encoder = encoder_class("random-bert", dim=8, **asked, _loaded=(random_bert(), hf_tokenizer))
    assert encoder.tokenizer.settings() == asked
    ids = hf_tokenizer.convert_tokens_to_ids
    query = encoder.tokenizer.encode_queries(["what is sleep"])
    assert query.input_ids.shape == (1, 10) and query.input_ids[0, 1] == ids("[unused2]")
    assert query.attention_mask.all()  # the [MASK] padding is attended
    doc = encoder.tokenizer.encode_documents(["a, b. c! d e f g h i j"])
    assert doc.input_ids.shape == (1, 9) and doc.input_ids[0, 1] == ids("[unused3]")
    punctuation = torch.isin(doc.input_ids[0], torch.tensor(ids(list(string.punctuation))))
    assert punctuation.any() and doc.scoring_mask[0][punctuation].all()  # punctuation still scored
    assert {k: encoder.settings()[k] for k in asked} == asked


# -- the LightningCLI ----------------------------------------------------------------------------------------------

def resolved_encoder(*args: str) -> dict:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), pytest.raises(SystemExit) as done:
        train_main(["fit", "--config", str(REPO / "configs" / "colbert.yaml"), *args, "--print_config"])
    assert done.value.code in (0, None)
    return yaml.safe_load(buffer.getvalue())["model"]["encoder"]


def test_the_cli_lists_every_field_in_order_with_its_default():
    colbert = resolved_encoder("--model.encoder.init_args.dim", "64")
    assert list(colbert["init_args"]) == [f.name for f in fields(ColBERTSettings)]
    assert colbert["init_args"] == {**COLBERT_V1, "dim": 64, "projection_bias": False}
    hil = resolved_encoder("--config", str(REPO / "configs" / "variants" / "colbert_hil_authors.yaml"),
                           "--model.encoder.init_args.zscore_detach", "[H]")
    assert list(hil["init_args"]) == [f.name for f in fields(HILSettings)]
    assert hil["init_args"] == {**COLBERT_V1, **HIL_PAPER, "query_maxlen": 300, "doc_maxlen": 300,
                                "lexical_input": "embedding_output", "idf_formula": "authors",
                                "lexical_query_tokens": "all", "zscore_std": "unbiased", "zscore_eval": "per_query",
                                "zscore_detach": ["H"]}


@pytest.mark.parametrize("option, value", [("dim", "abc"), ("head_init", "xavier"), ("zscore_std", "biased"),
                                           ("nonsense", "1")])
def test_the_cli_type_checks_every_field(option, value, capsys):
    with pytest.raises(SystemExit) as done:
        train_main(["fit", "--config", str(REPO / "configs" / "colbert.yaml"), "--model.encoder",
                    "hil.modeling.hil.HILEncoder", f"--model.encoder.init_args.{option}", value, "--print_config"])
    assert done.value.code == 2
    assert option in capsys.readouterr().err


# -- exports: the same record as before the dataclass ---------------------------------------------------------------

def exported_settings(path: Path) -> dict:
    return json.loads((path / "hil_config.json").read_text(encoding="utf-8"))["settings"]


def test_exports_hold_the_same_flat_settings_and_reload_bit_identically(tiny_model_dir, tmp_path):
    tiny = str(tiny_model_dir)
    cases = {
        "colbert": (ColBERTEncoder(tiny, dim=16, query_maxlen=12, doc_maxlen=24),
                    {"architecture": "colbert", "backbone": tiny, "dim": 16, "query_maxlen": 12, "doc_maxlen": 24,
                     "query_marker": "[unused0]", "doc_marker": "[unused1]", "mask_punctuation": True,
                     "attend_to_mask_tokens": False, "head_init": "bert"}),
        "colbert_bias": (ColBERTEncoder(tiny, dim=8, query_maxlen=10, doc_maxlen=20, mask_punctuation=False,
                                        attend_to_mask_tokens=True, head_init="torch", projection_bias=True),
                         {"architecture": "colbert", "backbone": tiny, "dim": 8, "query_maxlen": 10,
                          "doc_maxlen": 20, "query_marker": "[unused0]", "doc_marker": "[unused1]",
                          "mask_punctuation": False, "attend_to_mask_tokens": True, "head_init": "torch",
                          "projection_bias": True}),
        "hil": (HILEncoder(tiny, dim=16, query_maxlen=12, doc_maxlen=24, lexical_input="embedding_output",
                           idf_formula="authors", lexical_query_tokens="all", zscore_std="unbiased",
                           zscore_eval="per_query", zscore_detach=("H", "L"), zscore_temperature=2,
                           zscore_momentum=0.5, zscore_eps=1e-4),
                {"architecture": "hil", "backbone": tiny, "dim": 16, "query_maxlen": 12, "doc_maxlen": 24,
                 "query_marker": "[unused0]", "doc_marker": "[unused1]", "mask_punctuation": True,
                 "attend_to_mask_tokens": False, "head_init": "bert", "lexical_input": "embedding_output",
                 "idf_formula": "authors", "lexical_query_tokens": "all", "zscore_std": "unbiased",
                 "zscore_eval": "per_query", "zscore_detach": ["L", "H"], "zscore_temperature": 2.0,
                 "zscore_momentum": 0.5, "zscore_eps": 1e-4,
                 "idf_source": "five texts (5 documents; authors: ln(N / (1 + df)) over query-tokenized texts)"}),
    }
    cases["hil"][0].set_idf_from_texts(DOCS + QUERIES[:2], source="five texts")
    for name, (encoder, expected) in cases.items():
        assert list(encoder.settings().items()) == list(expected.items()), name  # keys, order and values
        export_model(encoder, tmp_path / name)
        written = exported_settings(tmp_path / name)
        assert list(written.items()) == list(expected.items()), name
        loaded = load_encoder(tmp_path / name)
        assert type(loaded) is type(encoder)
        assert loaded.settings() == {**expected, "backbone": str(tmp_path / name)}
        assert list(loaded.settings()) == list(expected)
        assert encoder_fingerprint(loaded) == encoder_fingerprint(encoder), name
        assert torch.equal(scores(loaded), scores(encoder)), name


def test_a_hand_written_flat_hil_config_loads(tiny_model_dir, tmp_path):
    """An export whose hil_config.json is written by hand in the flat layout (as every version wrote it) -- and
    one from before ``attend_to_mask_tokens`` existed, which keeps attending to the [MASK] padding."""
    torch.manual_seed(3)
    source = HILEncoder(str(tiny_model_dir), dim=8, query_maxlen=12, doc_maxlen=24)
    export_model(source, tmp_path / "model")
    flat = {"architecture": "hil", "backbone": "bert-base-uncased", "dim": 8, "query_maxlen": 12, "doc_maxlen": 24,
            "query_marker": "[unused0]", "doc_marker": "[unused1]", "mask_punctuation": True,
            "attend_to_mask_tokens": False, "head_init": "bert", "lexical_input": "word_embeddings",
            "idf_formula": "bm25", "lexical_query_tokens": "weighted", "zscore_std": "population",
            "zscore_eval": "running", "zscore_detach": ["H"], "zscore_temperature": None, "zscore_momentum": 0.1,
            "zscore_eps": 1e-5, "idf_source": None}
    heads = torch.load(tmp_path / "model" / "hil_heads.pt", weights_only=True)
    for settings, attends in ((flat, False), ({k: v for k, v in flat.items() if k != "attend_to_mask_tokens"}, True)):
        (tmp_path / "model" / "hil_config.json").write_text(json.dumps({"settings": settings}), encoding="utf-8")
        loaded = load_encoder(tmp_path / "model")
        folder = str(tmp_path / "model")
        assert loaded.settings() == {**flat, "backbone": folder, "attend_to_mask_tokens": attends}
        assert loaded.config.zscore_detach == ("H",) and loaded.tokenizer.attend_to_mask_tokens is attends
        by_hand = HILEncoder(folder, dim=8, query_maxlen=12, doc_maxlen=24, zscore_detach=["H"],
                             attend_to_mask_tokens=attends)
        by_hand.load_state_dict(heads, strict=False)
        assert torch.equal(scores(loaded), scores(by_hand))
